"""Feasibility: does the long path gain from L2-resident chunks (small workspace) once host cost is gone (CUDA graph)?"""
import os, sys, statistics, torch
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.join(os.getcwd(), "tools"))
import attn_lt
from attn_lt.testing import event_ms
from bench import ceilings, warm_up

warm_up(3.0)
ceil = ceilings()
print(f"# {torch.cuda.get_device_name()} copy {ceil['copy_tbs']} TB/s", flush=True)
os.environ["ATTN_LT_KEY_TILES"] = "0"
H, S, D = int(os.environ.get("H", 16)), 16384, int(os.environ.get("D", 128))
q, k, v = (torch.randn(1, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
floor = (12 * H * S * S + 8 * H * S * D) / (ceil["copy_tbs"] * 1e9)
ref = attn_lt.attention(q, k, v, backend="lt").clone()
runs = {}
for spec in os.environ.get("CFG", "1024:2,1024:1,256:1,128:1,64:1,48:1,32:1,64:2,32:2").split(","):
    mb, lanes = (int(x) for x in spec.split(":"))
    os.environ["ATTN_LT_LANES"] = str(lanes)
    attn_lt.api.clear_plans()
    ws = mb << 20
    fn = lambda: attn_lt.attention(q, k, v, backend="lt", workspace_bytes=ws)
    fn(); torch.cuda.synchronize()
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn()
    g.replay(); torch.cuda.synchronize()
    same = torch.equal(out, ref)
    eager = statistics.median(event_ms(fn) for _ in range(5))
    graph = statistics.median(event_ms(g.replay) for _ in range(7))
    chunks = attn_lt.explain(q, k, v, backend="lt", workspace_bytes=ws)
    line = str(chunks).splitlines()
    info = next((l for l in line if "chunk" in l), "")
    print(f"ws {mb:5d} MiB lanes {lanes}: eager {eager:7.3f} ms graph {graph:7.3f} ms  graph {100*floor/graph:5.1f} % floor  same {same}  | {info.strip()[:120]}", flush=True)
    del g
