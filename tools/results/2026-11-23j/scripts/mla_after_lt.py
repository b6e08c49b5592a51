"""Does the provider that follows the long path (lt, 3.1 ms calls that draw less power) run the MLA decode faster?
bench_lt times lt, wmma and auto in bench.round_order; over three rounds wmma follows lt twice and auto never. Here
the same rotation, nine rounds, and the same again with lt's calls replaced by an idle pause of the same length."""
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.join(os.getcwd(), "tools"))
import attn_lt  # noqa: E402
from bench import Timer, round_order  # noqa: E402


def main():
    Sk = 65536
    g = torch.Generator(device="cuda").manual_seed(Sk)
    q = torch.randn(32, 128, 1, 576, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(32, 1, Sk, 576, device="cuda", dtype=torch.bfloat16, generator=g)
    v = k[..., :512]
    plans = {"lt": attn_lt.plan(q, k, v, backend="lt"), "wmma": attn_lt.plan(q, k, v, backend="wmma"),
             "auto": attn_lt.plan(q, k, v, backend="auto")}
    for p in plans.values():
        p.tune(q, k, v)
        for _ in range(3):
            p.run(q, k, v)
    torch.cuda.synchronize()
    timer = Timer(100, 3)  # bench_lt --quick's
    for mode in ("lt", "idle", "lt"):
        per = {n: [] for n in plans}
        follows = {n: [] for n in plans}
        prev = None
        for r in range(9):
            for n in round_order(list(plans), r):
                if n == "lt" and mode == "idle":
                    t0 = time.perf_counter()
                    time.sleep(0.1)  # about as long as lt's round
                    per[n].append((time.perf_counter() - t0) * 1e3)
                else:
                    s = timer.samples(lambda p=plans[n]: p.run(q, k, v))
                    per[n].append(statistics.median(s))
                follows[n].append(prev)
                prev = n
        print(f"rotation with {mode}: " + ", ".join(
            f"{n} {statistics.median(per[n]):.4f} ms (after lt: "
            f"{statistics.median([m for m, f in zip(per[n], follows[n]) if f == 'lt'] or [float('nan')]):.4f}, "
            f"otherwise {statistics.median([m for m, f in zip(per[n], follows[n]) if f != 'lt'] or [float('nan')]):.4f})"
            for n in ("wmma", "auto")), flush=True)


if __name__ == "__main__":
    main()
