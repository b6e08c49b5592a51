"""The long path on a decode call (B8 Hq32 Hkv8 Sq1 Sk32k D128, bench_lt's mass-decode row): host µs to issue a
call (behind a sleep kernel), its GPU time (each call queued behind a sleep kernel, events around the call only),
and where the GPU time goes (bench_lt's kernel profile); lt without and with the mass, the fused path, eager."""
import os
import statistics
import sys

import torch

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.join(os.getcwd(), "tools"))
import attn_lt  # noqa: E402
from attn_lt.testing import host_us_each  # noqa: E402
from bench_lt import eager_mass, profile_call  # noqa: E402


def gpu_ms(fn, n=50):
    """GPU time of one call: queued behind a sleep so that the host's issue time is hidden."""
    out = []
    for _ in range(n):
        torch.cuda._sleep(int(2e6))
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        out.append(s.elapsed_time(e))
    return statistics.median(out)


def main():
    B, Hq, Hkv, Sk, D = 8, 32, 8, 32768, 128
    g = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(B, Hq, 1, D, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(B, Hkv, Sk, D, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(B, Hkv, Sk, D, device="cuda", dtype=torch.bfloat16, generator=g)
    lt = attn_lt.plan(q, k, v, backend="lt").tune(q, k, v)
    ltm = attn_lt.plan(q, k, v, backend="lt", return_key_mass=True).tune(q, k, v)
    fused = attn_lt.plan(q, k, v)
    fns = {"lt": lambda: lt.run(q, k, v), "lt+mass": lambda: ltm.run(q, k, v),
           f"auto ({fused.backend})": lambda: fused.run(q, k, v),
           "attention(mass)": lambda: attn_lt.attention(q, k, v, return_key_mass=True),
           "eager mass": lambda: eager_mass(q, k, None, Hkv)}
    print(torch.cuda.get_device_name(), flush=True)
    print("explain lt+mass:", ltm.explain().plan.summary()[:200], flush=True)
    host = host_us_each(fns, calls=50, rounds=5)
    for name, fn in fns.items():
        ms = gpu_ms(fn)
        prof = profile_call(fn, None)
        print(f"{name:18s} host {host[name]:7.1f} us  gpu {1000 * ms:7.1f} us  kernels "
              f"{prof.get('kernels')} {prof.get('kernels_ms')} span {prof.get('span_ms')}", flush=True)


if __name__ == "__main__":
    main()
