"""MLA decode (B32 Hq128 Hkv1 Sq1 D576/512, V = K[..., :512]) on the fused path, timed call by call for a few
seconds while nvidia-smi samples the SM clock, power and throttle reasons: is the H100's 64k row held by its power
limit? Prints, per key length and phase (cold after an idle pause, then hot), the calls' median time, the cache
read as % of the copy rate, and the clocks and power seen meanwhile."""
import os
import statistics
import subprocess
import sys
import threading
import time

import torch

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.join(os.getcwd(), "tools"))
import attn_lt  # noqa: E402
from bench_lt import ceilings  # noqa: E402

Q = "clocks.sm,power.draw,clocks_throttle_reasons.active,temperature.gpu"


class Sampler:
    def __init__(self):
        self.rows, self.stop = [], threading.Event()
        self.p = subprocess.Popen(["nvidia-smi", f"--query-gpu={Q}", "--format=csv,noheader,nounits", "-lms", "50"],
                                  stdout=subprocess.PIPE, text=True)
        self.t = threading.Thread(target=self._read, daemon=True)
        self.t.start()

    def _read(self):
        for line in self.p.stdout:
            self.rows.append((time.monotonic(), line.strip()))

    def window(self, t0, t1):
        out = []
        for t, line in self.rows:
            if t0 <= t <= t1:
                try:
                    c, pw, thr, temp = [x.strip() for x in line.split(",")]
                    out.append((float(c), float(pw), thr, float(temp)))
                except ValueError:
                    pass
        return out

    def close(self):
        self.p.terminate()


def main():
    ceil = ceilings()
    copy = ceil["copy_tbs"]
    print(f"{torch.cuda.get_device_name()}: copy {copy:.3f} TB/s", flush=True)
    smp = Sampler()
    time.sleep(1.0)
    for Sk in (8192, 65536):
        g = torch.Generator(device="cuda").manual_seed(Sk)
        q = torch.randn(32, 128, 1, 576, device="cuda", dtype=torch.bfloat16, generator=g)
        k = torch.randn(32, 1, Sk, 576, device="cuda", dtype=torch.bfloat16, generator=g)
        v = k[..., :512]
        p = attn_lt.plan(q, k, v, backend="wmma")
        p.run(q, k, v)
        torch.cuda.synchronize()
        cache = 32 * Sk * 576 * 2
        for phase, pause, secs in (("cold", 3.0, 1.0), ("hot", 0.0, 4.0)):
            time.sleep(pause)
            ms, t0 = [], time.monotonic()
            while time.monotonic() - t0 < secs:
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                p.run(q, k, v)
                e.record()
                e.synchronize()
                ms.append(s.elapsed_time(e))
            t1 = time.monotonic()
            w = smp.window(t0, t1)
            med = statistics.median(ms)
            first = statistics.median(ms[: max(1, len(ms) // 10)])
            last = statistics.median(ms[-max(1, len(ms) // 10):])
            clocks = sorted(c for c, *_ in w) or [0]
            power = sorted(pw for _, pw, *_ in w) or [0]
            thr = sorted({t for *_, t, _ in w})
            temps = [t for *_, t in w] or [0]
            pct = lambda x: 100 * cache / (x * 1e-3) / 1e12 / copy  # noqa: E731
            print(f"Sk {Sk:6d} {phase:4s}: {len(ms):5d} calls, median {med:.4f} ms ({pct(med):.1f} % copy), first "
                  f"10 % {first:.4f} ({pct(first):.1f}), last 10 % {last:.4f} ({pct(last):.1f}); SM clock "
                  f"{clocks[0]:.0f}-{clocks[len(clocks) // 2]:.0f}-{clocks[-1]:.0f} MHz, power {power[0]:.0f}-"
                  f"{power[len(power) // 2]:.0f}-{power[-1]:.0f} W, temp {min(temps):.0f}-{max(temps):.0f} C, "
                  f"throttle reasons {thr}", flush=True)
        del q, k, v, p
        torch.cuda.empty_cache()
    smp.close()


if __name__ == "__main__":
    main()
