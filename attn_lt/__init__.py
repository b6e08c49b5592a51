"""attn_lt: hybrid attention for NVIDIA GPUs (cuBLASLt long path, fused tensor-core short path)."""

from .api import AttentionPlan, attention, explain, plan

__version__ = "0.1.0"
__all__ = ["attention", "plan", "AttentionPlan", "explain", "__version__"]
