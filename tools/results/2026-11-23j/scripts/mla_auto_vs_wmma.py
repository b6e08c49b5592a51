"""bench_lt reads the H100's MLA decode at 64k keys ~10 % slower through attention()'s plan (backend auto, which
runs the fused kernel) than through a plan of backend wmma: the same kernel. Is it the plan or the order? Two wmma
plans and one auto plan, timed as bench_lt times (bench.Timer: L2 flush, CUDA events), in rounds whose order
rotates; per round and provider the median ms."""
import os
import statistics
import sys

import torch

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.join(os.getcwd(), "tools"))
import attn_lt  # noqa: E402
from bench import Timer, round_order  # noqa: E402


def main():
    for Sk in (65536, 8192):
        g = torch.Generator(device="cuda").manual_seed(Sk)
        q = torch.randn(32, 128, 1, 576, device="cuda", dtype=torch.bfloat16, generator=g)
        k = torch.randn(32, 1, Sk, 576, device="cuda", dtype=torch.bfloat16, generator=g)
        v = k[..., :512]
        plans = {"wmma-1": attn_lt.plan(q, k, v, backend="wmma"), "auto": attn_lt.plan(q, k, v, backend="auto"),
                 "wmma-2": attn_lt.plan(q, k, v, backend="wmma")}
        for p in plans.values():
            p.tune(q, k, v)
            for _ in range(3):
                p.run(q, k, v)
        torch.cuda.synchronize()
        print(f"Sk {Sk}: backends {[p.backend for p in plans.values()]}, fast paths bound "
              f"{[p._fast is not None for p in plans.values()]}, fused {[str(p.fused) for p in plans.values()][:1]}",
              flush=True)
        timer = Timer(300, 3)
        per = {n: [] for n in plans}
        for r in range(9):
            order = round_order(list(plans), r)
            row = []
            for n in order:
                s = timer.samples(lambda p=plans[n]: p.run(q, k, v))
                per[n].append(statistics.median(s))
                row.append(f"{n} {statistics.median(s):.4f}")
            print(f"  round {r}: " + ", ".join(row), flush=True)
        print("  medians: " + ", ".join(f"{n} {statistics.median(v):.4f} ms" for n, v in per.items()), flush=True)
        # the same, calls of attention() itself
        a = statistics.median(timer.samples(lambda: attn_lt.attention(q, k, v)))
        print(f"  attention(): {a:.4f} ms", flush=True)
        del q, k, v, plans
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
