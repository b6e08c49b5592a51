"""Algorithm choice for one GEMM: cuBLASLt's heuristic top-1 within the workspace budget.

This is the seam for the tuned split-K search and the persistent per-shape cache: ``choose`` is the one place
that fills ``gemm.algo`` and ``gemm.workspace_size``.
"""

from __future__ import annotations

from .cublaslt import CublasLtError


def choose(gemm, workspace_limit: int) -> None:
    """Set ``gemm.algo`` (and its workspace need) to the heuristic's best algorithm for ``gemm.key``."""
    results = gemm.heuristic(workspace_limit, count=1)
    if len(results) == 0:
        raise CublasLtError(f"cuBLASLt found no algorithm for {gemm.key} within {workspace_limit} bytes of "
                            "workspace")
    gemm.algo[0] = results[0]["algo"]
    gemm.workspace_size = int(results[0]["workspace_size"])
    gemm.algo_source = "heuristic"
