import torch, statistics
def t(fn, n=20):
    fn(); torch.cuda.synchronize()
    out = []
    for _ in range(n):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); fn(); e.record(); e.synchronize(); out.append(s.elapsed_time(e))
    return statistics.median(out)
N = 1 << 29  # 2 GiB of fp32
x = torch.randn(N, device="cuda"); y = torch.empty_like(x)
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
for _ in range(50): a @ a
torch.cuda.synchronize()
B = N * 4
print(torch.cuda.get_device_name())
print(f"copy (r+w)      {2*B/t(lambda: y.copy_(x))/1e9:.3f} TB/s")
print(f"memset zero_    {B/t(lambda: y.zero_())/1e9:.3f} TB/s (write)")
print(f"fill_ 1.5       {B/t(lambda: y.fill_(1.5))/1e9:.3f} TB/s (write)")
print(f"sum             {B/t(lambda: x.sum())/1e9:.3f} TB/s (read)")
h = torch.empty(N, device="cuda", dtype=torch.bfloat16)
print(f"x->bf16 (4r+2w) {6*N/t(lambda: h.copy_(x))/1e9:.3f} TB/s")
