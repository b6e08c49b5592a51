"""attn_lt: hybrid attention for NVIDIA GPUs (cuBLASLt long path, fused WMMA short path)."""

from .api import attention, explain

__version__ = "0.1.0"
__all__ = ["attention", "explain", "__version__"]
