"""attn_lt: hybrid attention for NVIDIA GPUs (cuBLASLt long path, fused tensor-core short path).

The public names load on first use, so that ``import attn_lt`` (and the ``attn-lt`` command's argument parsing)
costs no ``import torch``.
"""

__version__ = "0.1.0"
__all__ = ["attention", "plan", "AttentionPlan", "explain", "varlen_attention", "paged_attention", "explain_batch",
           "check_batch_errors", "BatchStep", "__version__"]

_API_NAMES = frozenset(("attention", "plan", "AttentionPlan", "explain"))
_BATCH_NAMES = frozenset(("varlen_attention", "paged_attention", "explain_batch", "check_batch_errors", "BatchStep"))
_SUBMODULES = frozenset(("api", "backends", "batch", "cache", "calibrate", "cli", "config", "device", "distributed",
                         "fastpath", "integrations", "lt", "maintenance", "merge", "native", "chunks", "select",
                         "testing", "validate", "fused"))


def __getattr__(name: str):
    import importlib

    if name in _API_NAMES:
        api = importlib.import_module(".api", __name__)
        globals().update({n: getattr(api, n) for n in _API_NAMES})
        return globals()[name]
    if name in _BATCH_NAMES:
        batch = importlib.import_module(".batch", __name__)
        globals().update({n: getattr(batch, n) for n in _BATCH_NAMES})
        return globals()[name]
    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'attn_lt' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | _API_NAMES | _BATCH_NAMES)
