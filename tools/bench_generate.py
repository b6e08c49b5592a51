#!/usr/bin/env python3
"""Hugging Face ``generate()`` with ``attn_implementation="attn_lt"`` against ``sdpa`` (issue 11's figures).

A Llama-architecture model with random weights, bf16 (default: 8 layers, hidden 4096, 32 query / 8 kv heads, head
dim 128, intermediate 14336, vocabulary 32000), a random prompt of ``--prompt`` tokens, ``--new`` greedy tokens
(``min_new_tokens`` so that it never stops early), with each provider in its own process (clean memory):

* ``attn_lt``: ``attn_lt.integrations.transformers.register()``, a **fresh, empty algorithm cache**
  (``ATTN_LT_CACHE_DIR`` a new temporary directory) and the policy ``--algo-policy`` (default ``tune``);
* ``sdpa``: transformers' ``sdpa`` with PyTorch's default backend choice (cuDNN on Hopper);
* ``sdpa-nocudnn``: the same after ``torch.backends.cuda.enable_cudnn_sdp(False)``;
* ``attn_lt-py``: attn_lt with its compiled fast path off (``attn_lt.fastpath``): every call takes the Python
  path (an A/B of the fast path; not in the default list).

Each process first warms torch, cuBLAS and transformers up with a short ``sdpa`` generate (never attn_lt, whose
cache stays cold), then runs ``generate()`` ``--repeat`` times (run 1 ``cold``, later ones ``warm``). A
``LogitsProcessor`` synchronises and stamps the time after every forward: prefill = start to the first stamp,
time per new token = the gaps between stamps (median, p90, worst and where), total = the whole call. ``floor`` is
the memory floor of a decode step: weights plus the K/V cache read once at the HBM bandwidth measured in the run.
Tokens and first-step logits are compared with ``sdpa``'s (random weights: near-ties may part the sequences).

The decode loop of ``generate()`` is bound by the host (Python), whose speed drifts for seconds at a time on a
shared machine; ``--interleave ROUNDS`` runs every provider in one process, in turn, ROUNDS times (a provider's
first round is its cold one; round r starts with the r-th provider), so that such spells fall on all providers
alike. Before the first round, ``sdpa`` generates a few tokens from the full prompt: the process's own first-use
costs (the caching allocator's pool for a cache of that size, libraries loaded) are paid there, by no provider's
timed run; attn_lt's plans and algorithm cache stay cold. ``--per-token CALLS`` then makes CALLS more
``generate()`` calls whose attention changes provider every token (one registered implementation that dispatches
to attn_lt's function or to sdpa's, cuDNN on or off; the order turns every cycle and every call): the finest
interleaving, each provider's steps taken between the others' within the same seconds.

    python tools/bench_generate.py [--prompt 32768[,131072]] [--new 256] [--layers 8] [--out DIR] [--quick]
                                   [--providers attn_lt,sdpa,sdpa-nocudnn] [--repeat 2] [--cache dynamic|static]
                                   [--algo-policy tune] [--timeout-s 600] [--profile N] [--interleave ROUNDS]
                                   [--per-token CALLS]

Writes DIR/results.json (metadata, one row per prompt × provider × run with every step's time) and a log per
process; prints a short table last. Exit codes: 0 ok, 1 a provider failed, 2 no GPU or bad arguments.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

TOOLS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(TOOLS)
sys.path.insert(0, REPO)
PROVIDERS = ("attn_lt", "sdpa", "sdpa-nocudnn", "attn_lt-py")


def is_attn_lt(provider: str) -> bool:
    """attn_lt, or attn_lt-py: attn_lt with its compiled fast path off (attn_lt.fastpath), every call in Python."""
    return provider.startswith("attn_lt")


def use_fastpath(provider: str) -> None:
    """The fast path on for attn_lt, off for attn_lt-py (where attn_lt is imported)."""
    if "attn_lt.fastpath" in sys.modules:
        sys.modules["attn_lt.fastpath"].set_enabled(provider != "attn_lt-py")


# ---- the worker: one provider, one prompt length, its own process ----------------------------------------------

def build_model(a):
    import torch
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.intermediate, num_hidden_layers=a.layers,
        num_attention_heads=a.heads, num_key_value_heads=a.kv_heads, head_dim=a.head_dim,
        max_position_embeddings=a.prompt + a.new + 16, rope_theta=500000.0, pad_token_id=0, bos_token_id=1,
        eos_token_id=2)
    torch.manual_seed(a.seed)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # weights made in bf16, on the GPU: fast, no fp32 copy
    try:
        with torch.device(a.device):
            model = transformers.LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(prev)
    return model.eval()


def use(model, name: str):
    if hasattr(model, "set_attn_implementation"):  # transformers 5.x
        model.set_attn_implementation(name)
    else:
        model.config._attn_implementation = name


def sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def hbm_gbs(device: str) -> float:
    """Device-to-device copy bandwidth, bytes read + written per second / 1e9."""
    import torch

    if device != "cuda":
        return float("nan")

    x = torch.empty(1 << 29, dtype=torch.uint8, device="cuda")  # 512 MiB
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(10):
        y.copy_(x)
    e.record()
    e.synchronize()
    return 2 * 10 * x.numel() / (s.elapsed_time(e) * 1e-3) / 1e9


def attn_lt_paths(a) -> dict:
    """The attn_lt path of the prefill and of a decode step (explain on meta tensors; no GPU work)."""
    import torch

    import attn_lt

    def path(Sq, Sk, causal):
        q = torch.empty(a.batch, a.heads, Sq, a.head_dim, dtype=torch.bfloat16, device="meta")
        k = torch.empty(a.batch, a.kv_heads, Sk, a.head_dim, dtype=torch.bfloat16, device="meta")
        return attn_lt.explain(q, k, k, causal=causal).decision.backend

    return {"prefill": path(a.prompt, a.prompt, True), "decode": path(1, a.prompt + a.new, False)}


def per_token_dispatch(providers: list[str], host_us: dict):
    """Register the implementation ``bench_switch`` (sdpa's mask builder, as attn_lt's ``register`` does) whose
    attention is the current provider's, and whose host microseconds a call go to ``host_us[provider]``; returns
    the function that makes a provider current."""
    import torch
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    fns = {p: sdpa_attention_forward for p in providers}
    if any(map(is_attn_lt, providers)):
        import attn_lt.integrations.transformers as attn_lt_hf

        for p in filter(is_attn_lt, providers):
            fns[p] = attn_lt_hf.make_attention_forward()
    current = [fns[providers[0]], host_us[providers[0]]]

    def forward(*args, **kwargs):
        t = time.perf_counter()
        out = current[0](*args, **kwargs)
        current[1].append((time.perf_counter() - t) * 1e6)
        return out

    AttentionInterface.register("bench_switch", forward)
    AttentionMaskInterface.register("bench_switch", ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])

    def make_current(provider: str) -> None:
        torch.backends.cuda.enable_cudnn_sdp(provider != "sdpa-nocudnn")
        use_fastpath(provider)
        current[0], current[1] = fns[provider], host_us[provider]

    return make_current


def per_token_order(providers: list[str], call: int):
    """The provider of forward j in per-token call ``call``: providers in turn, the order reversed every other
    cycle and shifted by the call, so that no provider always follows the same one."""
    n = len(providers)

    def of(j: int) -> str:
        order = providers if (j // n) % 2 == 0 else providers[::-1]
        return order[(j + call) % n]

    return of


def p90(values: list[float]) -> float:
    return sorted(values)[int(0.9 * (len(values) - 1))] if values else float("nan")


def summarise(stamps: list[float], t0: float, t1: float) -> dict:
    steps = [(b - c) * 1e3 for b, c in zip(stamps[1:], stamps[:-1])]
    med = statistics.median(steps) if steps else float("nan")
    worst = max(steps) if steps else float("nan")
    return {"prefill_ms": (stamps[0] - t0) * 1e3, "step_ms": steps, "median_ms": med, "p90_ms": p90(steps),
            "worst_ms": worst, "worst_step": steps.index(worst) + 1 if steps else None,
            "steps_over_3x_median": sum(s > 3 * med for s in steps), "decode_ms": (stamps[-1] - stamps[0]) * 1e3,
            "total_ms": (t1 - t0) * 1e3}


def worker(a) -> int:
    """One process: the model once, then ``generate()`` per entry of the schedule: ``--repeat`` runs of one
    provider, or (``--interleave``) rounds of every provider in turn, so that the host's slow spells fall on all of
    them alike. A provider's first run is ``cold``, later ones ``warm``."""
    import logging

    import torch
    import transformers

    logging.basicConfig(level=logging.WARNING)
    providers = a.providers if a.worker == "interleaved" else [a.worker]
    # round r starts with provider r (mod their number): no provider always runs right after the same one
    schedule = [p for r in range(a.repeat) for p in providers[r % len(providers):] + providers[:r % len(providers)]]
    res = {"provider": a.worker, "prompt": a.prompt, "status": "ok", "runs": []}

    def save():
        with open(a.result, "w") as f:
            json.dump(res, f)

    try:
        bw = hbm_gbs(a.device)
        model = build_model(a)
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        kv_per_token = 2 * a.layers * a.batch * a.kv_heads * a.head_dim * 2
        kv = kv_per_token * (a.prompt + a.new)
        # a decode step reads every weight but the embedding table (one row of it) and the K/V cache, once
        floor_bytes = weights - a.vocab * a.hidden * 2 + kv_per_token * (a.prompt + a.new // 2)
        res.update(weights_gib=weights / 2**30, kv_cache_gib=kv / 2**30, hbm_gbs=bw,
                   floor_ms=floor_bytes / (bw * 1e9) * 1e3)
        # memory: weights, the cache (plus one layer's copy while a dynamic cache grows), prefill activations
        act = a.batch * a.prompt * (3 * a.intermediate + 8 * a.hidden + 2 * a.heads * a.head_dim) * 2
        need = kv * (1 + 1 / a.layers) + act + (2 << 30)
        free = torch.cuda.mem_get_info()[0] if a.device == "cuda" else float("inf")
        res["estimated_need_gib"], res["free_gib"] = need / 2**30, free / 2**30
        if need > free:
            res["status"] = f"skipped: needs about {need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free"
            save()
            return 0
        gen = torch.Generator().manual_seed(a.seed + 1)
        ids = torch.randint(3, a.vocab, (a.batch, a.prompt), generator=gen).to(a.device)
        kw = dict(do_sample=False, pad_token_id=0, use_cache=True)
        if a.cache == "static":
            kw["cache_implementation"] = "static"
        # warm-up at the full prompt length: torch, cuBLAS, transformers and the caching allocator's pool for a
        # cache of this size, so that no provider's first run pays the process's own first-use costs; attn_lt's
        # algorithm cache and plans stay cold (sdpa runs it)
        use(model, "sdpa")
        with torch.no_grad():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, min_new_tokens=4, **kw)
        if any(map(is_attn_lt, providers)):
            import attn_lt.integrations.transformers as attn_lt_hf

            attn_lt_hf.register()
            res["attn_lt_paths"] = attn_lt_paths(a)
            res["algo_cache_dir"] = os.environ.get("ATTN_LT_CACHE_DIR")
            res["algo_policy"] = os.environ.get("ATTN_LT_ALGO_POLICY")

        def switch(provider: str) -> None:
            torch.backends.cuda.enable_cudnn_sdp(provider != "sdpa-nocudnn")
            use_fastpath(provider)
            use(model, "attn_lt" if is_attn_lt(provider) else "sdpa")

        class Clock(transformers.LogitsProcessor):
            """Stamps the time after every forward (synchronised); saves a partial row every few seconds, so
            that a run stopped by the parent's timeout still shows its steps."""

            def __init__(self, t0: float, run: str, provider: str):
                self.t0, self.run, self.provider = t0, run, provider
                self.stamps, self.waits, self.first, self.saved = [], [], None, time.perf_counter()

            def __call__(self, input_ids, scores):
                t = time.perf_counter()
                sync(a.device)
                now = time.perf_counter()
                self.stamps.append(now)
                self.waits.append((now - t) * 1e3)  # the GPU work left when the host reached the end of the step
                if self.first is None:
                    self.first = scores[0].float().cpu()
                if now - self.saved > 5:
                    res["runs"][-1] = dict(summarise(self.stamps, self.t0, now), run=f"{self.run} (partial)",
                                           provider=self.provider, peak_gib=None, tokens=[])
                    save()
                    self.saved = now
                return scores

        seen = set()
        for provider in schedule:
            switch(provider)
            sync(a.device)
            if a.device == "cuda":
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            clock = Clock(t0, "warm" if provider in seen else "cold", provider)
            res["runs"].append({})
            with torch.no_grad():
                out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=a.new,
                                     min_new_tokens=a.new, logits_processor=transformers.LogitsProcessorList([clock]),
                                     **kw)
            sync(a.device)
            t1 = time.perf_counter()
            row = summarise(clock.stamps, t0, t1)
            peak = torch.cuda.max_memory_allocated() / 2**30 if a.device == "cuda" else None
            row.update(run=clock.run, provider=provider, peak_gib=peak, tokens=out[0, a.prompt:].tolist())
            res["runs"][-1] = row
            if provider not in seen:
                torch.save(clock.first, logits_path(a.result, provider, a.worker))
            seen.add(provider)
            save()
            print(f"{provider} S={a.prompt} {row['run']}: prefill {row['prefill_ms']:.0f} ms, "
                  f"median {row['median_ms']:.2f} ms/token, worst {row['worst_ms']:.1f}", flush=True)
            del out
        if a.per_token:
            by = res["per_token"] = {p: [] for p in providers}
            waits = res["per_token_sync_wait_ms"] = {p: [] for p in providers}
            host = res["per_token_attention_host_us"] = {p: [] for p in providers}
            make_current = per_token_dispatch(providers, host)
            use(model, "bench_switch")

            class Flip(Clock):
                """The clock, then the next forward's provider made current (``seq``: each forward's provider)."""

                def __init__(self, t0: float, run: str, of):
                    super().__init__(t0, run, "per-token")
                    self.of, self.seq = of, [of(0)]
                    make_current(self.seq[0])

                def __call__(self, input_ids, scores):
                    scores = super().__call__(input_ids, scores)
                    self.seq.append(self.of(len(self.stamps)))
                    make_current(self.seq[-1])
                    return scores

            for call in range(a.per_token):
                sync(a.device)
                t0 = time.perf_counter()
                clock = Flip(t0, f"per-token {call + 1}", per_token_order(providers, call))
                seq = clock.seq
                res["runs"].append({"provider": "per-token"})
                with torch.no_grad():
                    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=a.new,
                                   min_new_tokens=a.new, logits_processor=transformers.LogitsProcessorList([clock]),
                                   **kw)
                sync(a.device)
                res["runs"][-1] = {"provider": "per-token", "run": clock.run}
                for j in range(1, len(clock.stamps)):  # forward j ran between stamps j - 1 and j
                    by[seq[j]].append((clock.stamps[j] - clock.stamps[j - 1]) * 1e3)
                    waits[seq[j]].append(clock.waits[j])
                save()
                print(f"per-token call {call + 1}: " + ", ".join(
                    f"{p} {statistics.median(v):.2f}" for p, v in by.items() if v) + " ms/token (median so far)",
                    flush=True)
        if a.profile:
            res["profile"] = {}
            for provider in providers:
                switch(provider)
                res["profile"][provider] = profile_generate(model, ids, a.profile, kw,
                                                            f"{a.result}.{provider}.profile.txt")
        if any(map(is_attn_lt, providers)) and res.get("algo_cache_dir"):
            d = res["algo_cache_dir"]
            res["algo_cache_files"] = {f: os.path.getsize(os.path.join(d, f)) for f in sorted(os.listdir(d))}
    except torch.cuda.OutOfMemoryError as e:
        res["status"] = "oom: " + str(e).split("\n")[0][:200]
    except Exception as e:  # recorded, reported by the parent
        import traceback

        traceback.print_exc()
        res["status"] = f"error: {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
    save()
    return 0 if res["status"] == "ok" or res["status"].startswith(("skipped", "oom")) else 1


def logits_path(result: str, provider: str, worker: str) -> str:
    """Where a worker keeps a provider's first-step logits (one file per provider when interleaved)."""
    return result + (f".{provider}" if worker == "interleaved" else "") + ".logits0.pt"


def profile_generate(model, ids, new: int, kw: dict, path: str) -> dict:
    """One more ``generate()`` of ``new`` tokens under cProfile (host time: where a CPU-bound decode loop spends
    it); the top functions by own time go to ``path``. Returns per-token host ms of the attention function, the
    synchronisations and the whole call."""
    import cProfile
    import io
    import pstats

    import torch

    prof = cProfile.Profile()
    with torch.no_grad():
        prof.enable()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new, **kw)
        if ids.is_cuda:
            torch.cuda.synchronize()
        prof.disable()
    buf = io.StringIO()
    st = pstats.Stats(prof, stream=buf)
    st.sort_stats("tottime").print_stats(35)
    st.sort_stats("cumulative").print_stats(45)
    with open(path, "w") as f:
        f.write(buf.getvalue())
    per = {}
    for (file, _, fn), (cc, nc, tt, ct, _) in st.stats.items():
        if fn in ("attention_forward", "sdpa_attention_forward", "synchronize", "generate", "forward") or \
                fn.startswith("_scaled_dot_product") or fn in ("attention", "_execute", "run"):
            key = f"{os.path.basename(file)}:{fn}"
            per[key] = {"calls": nc, "cum_ms_per_token": ct * 1e3 / new, "own_ms_per_token": tt * 1e3 / new}
    print("profile (ms per new token):", json.dumps(per, indent=1), flush=True)
    return per


# ---- the parent: one process per (prompt, provider), then the table --------------------------------------------

def metadata(argv) -> dict:
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "command": "python tools/bench_generate.py " + " ".join(shlex.quote(x) for x in argv)}
    try:
        sys.path.insert(0, TOOLS)
        import bench  # the suite's metadata: GPU, driver, versions, sources' hash

        m = bench.metadata(argv)
        m.pop("command", None)
        meta.update(m)
    except Exception as e:  # never lose a run over its metadata
        meta["metadata_error"] = f"{type(e).__name__}: {e}"
        import torch

        meta["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
        meta["versions"] = {"torch": torch.__version__}
    try:
        import transformers

        meta.setdefault("versions", {})["transformers"] = transformers.__version__
    except ImportError:
        pass
    return meta


def rel_err(x, ref) -> float:
    import torch

    fin = torch.isfinite(ref) & torch.isfinite(x)
    return ((x[fin].double() - ref[fin].double()).norm() / ref[fin].double().norm()).item()


def compare(rows: list[dict], out_dir: str) -> None:
    """Tokens and first-step logits of every row against sdpa's (same prompt)."""
    import torch

    base = {r["prompt"]: r for r in rows if r["provider"] == "sdpa" and r["status"] == "ok"}
    for r in rows:
        b = base.get(r["prompt"])
        if b is None or r["status"] != "ok" or not r["runs"] or not b["runs"]:
            continue
        ta, tb = r["runs"][0].get("tokens"), b["runs"][0].get("tokens")
        if not ta or not tb:
            continue
        diff = [i for i, (x, y) in enumerate(zip(ta, tb)) if x != y]
        r["first_token_differing_from_sdpa"] = diff[0] if diff else None
        try:
            la, lb = torch.load(r["result"] + ".logits0.pt"), torch.load(b["result"] + ".logits0.pt")
            r["first_logits_rel_err_vs_sdpa"] = rel_err(la, lb)
        except OSError:
            pass


def table(rows: list[dict]) -> str:
    head = ("| prompt | provider | run | prefill s | median ms/tok | p90 | worst (step) | >3x med | total s "
            "| floor ms | tokens = sdpa | logits vs sdpa |")
    lines = [head, "|" + "---|" * 12]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['prompt']} | {r['provider']} | | {r['status']} |" + " |" * 8)
            if not r["runs"]:
                continue
        for run in r["runs"]:
            if "median_ms" not in run:
                continue
            first = run is r["runs"][0]
            d = r.get("first_token_differing_from_sdpa", "")
            same = "" if r["provider"] == "sdpa" or not first else (
                "all" if d is None else f"first {d}" if d != "" else "")
            err = r.get("first_logits_rel_err_vs_sdpa")
            lines.append(
                f"| {r['prompt']} | {r['provider']} | {run['run']} | {run['prefill_ms'] / 1e3:.2f} | "
                f"{run['median_ms']:.2f} | {run['p90_ms']:.2f} | {run['worst_ms']:.1f} ({run['worst_step']}) | "
                f"{run['steps_over_3x_median']} | {run['total_ms'] / 1e3:.2f} | {r['floor_ms']:.2f} | {same} | "
                f"{'' if err is None or not first else f'{err:.1e}'} |")
    return "\n".join(lines)


def pooled(rows: list[dict]) -> str:
    """Per prompt and provider: the median ms per token over every step of every run, and of its cold run."""
    lines = ["| prompt | provider | runs | median ms/tok, all runs | cold run |", "|---|---|---|---|---|"]
    for r in rows:
        runs = [x for x in r["runs"] if "step_ms" in x]
        if not runs:
            continue
        steps = [t for x in runs for t in x["step_ms"]]
        lines.append(f"| {r['prompt']} | {r['provider']} | {len(runs)} | {statistics.median(steps):.2f} | "
                     f"{runs[0]['median_ms']:.2f} |")
    return "\n".join(lines)


def per_token_table(rows: list[dict]) -> str:
    """Per prompt: each provider's steps of the per-token calls (median, p90, worst), against the best sdpa."""
    lines = ["| prompt | provider | steps | median ms/tok | p90 | worst | median / best sdpa | sync wait ms | "
             "attention host µs a call |", "|---|---|---|---|---|---|---|---|---|"]
    done = set()
    for r in rows:
        pt = r.get("per_token")
        if not pt or r["prompt"] in done:
            continue
        done.add(r["prompt"])
        med = {p: statistics.median(v) for p, v in pt.items() if v}
        best = min((m for p, m in med.items() if not is_attn_lt(p)), default=None)
        for p, v in pt.items():
            if not v:
                continue
            ratio = "" if best is None else f"{med[p] / best:.3f}"
            wait = r.get("per_token_sync_wait_ms", {}).get(p)
            host = r.get("per_token_attention_host_us", {}).get(p)
            lines.append(f"| {r['prompt']} | {p} | {len(v)} | {med[p]:.2f} | {p90(v):.2f} | "
                         f"{max(v):.1f} | {ratio} | {statistics.median(wait) if wait else float('nan'):.3f} | "
                         f"{statistics.median(host) if host else float('nan'):.1f} |")
    return "\n".join(lines) if len(lines) > 2 else ""


def parent(a, argv) -> int:
    import torch

    if a.device == "cuda" and not torch.cuda.is_available():
        print("bench_generate: no CUDA GPU visible", file=sys.stderr)
        return 2
    try:
        import transformers  # noqa: F401
    except ImportError:
        print("bench_generate: needs transformers (pip install 'attn-lt[transformers]')", file=sys.stderr)
        return 2
    out_dir = a.out or tempfile.mkdtemp(prefix="bench-generate-")
    os.makedirs(out_dir, exist_ok=True)
    meta = metadata(argv)
    meta["model"] = {k: getattr(a, k) for k in ("layers", "hidden", "heads", "kv_heads", "head_dim",
                                                "intermediate", "vocab", "batch", "new", "repeat", "interleave",
                                                "per_token", "cache", "algo_policy", "seed")}
    rows = []
    t_start = time.time()
    workers = ["interleaved"] if a.interleave else a.providers
    for S in a.prompts:
        for p in workers:
            stem = os.path.join(out_dir, f"s{S}-{p}")
            cmd = [sys.executable, os.path.abspath(__file__), "--worker", p, "--result", stem + ".json",
                   "--prompt", str(S), "--providers", ",".join(a.providers),
                   "--repeat", str(a.interleave or a.repeat)] + [
                f"--{k.replace('_', '-')}={getattr(a, k)}" for k in
                ("new", "layers", "hidden", "heads", "kv_heads", "head_dim", "intermediate", "vocab", "batch",
                 "cache", "seed", "device", "profile", "per_token")]
            env = dict(os.environ)
            tmp = None
            if (is_attn_lt(p) or p == "interleaved") and any(map(is_attn_lt, a.providers)):
                tmp = tempfile.mkdtemp(prefix="attn-lt-cold-cache-")
                env["ATTN_LT_CACHE_DIR"] = tmp  # a cold algorithm cache
                env["ATTN_LT_ALGO_POLICY"] = a.algo_policy
            print(f"[{time.time() - t_start:6.0f} s] prompt {S}, {p} ...", flush=True)
            row = {"provider": p, "prompt": S, "status": "ok", "runs": [], "result": stem + ".json"}
            with open(stem + ".log", "w") as log:
                try:
                    rc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                                        timeout=a.timeout_s).returncode
                except subprocess.TimeoutExpired:
                    rc = None
            try:
                with open(stem + ".json") as f:
                    row.update(json.load(f))
            except (OSError, ValueError):
                row["status"] = "no result"
            row["result"] = stem + ".json"
            if rc is None:
                row["status"] = f"timeout after {a.timeout_s} s" + (" (partial runs kept)" if row["runs"] else "")
            elif rc != 0 and row["status"] == "ok":
                row["status"] = f"exit {rc}"
            if tmp is not None:
                row["cold_cache_dir"] = tmp
            if p == "interleaved":  # one row per provider, as the separate processes give
                for q in a.providers:
                    rows.append(dict(row, provider=q, result=f"{stem}.json.{q}",
                                     runs=[r for r in row["runs"] if r.get("provider") == q]))
                compare(rows, out_dir)
                continue
            rows.append(row)
            compare(rows, out_dir)
            with open(os.path.join(out_dir, "results.json"), "w") as f:
                json.dump({"metadata": meta, "rows": rows}, f, indent=1)
    meta["wall_s"] = time.time() - t_start
    compare(rows, out_dir)
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump({"metadata": meta, "rows": rows}, f, indent=1)
    text = table(rows) + "\n\n" + pooled(rows)
    flips = per_token_table(rows)
    if flips:
        text += "\n\nProviders changed every token (--per-token):\n\n" + flips
    with open(os.path.join(out_dir, "summary.md"), "w") as f:
        f.write(f"{meta.get('gpu', '')}; {meta.get('versions', {})}\n\n{text}\n")
    print(f"\n{meta.get('gpu', '')}, transformers {meta.get('versions', {}).get('transformers')}; model: "
          f"{a.layers} layers, hidden {a.hidden}, {a.heads}/{a.kv_heads} heads x {a.head_dim}, batch {a.batch}, "
          f"{a.new} new tokens, {a.cache} cache; {meta['wall_s']:.0f} s; files in {out_dir}")
    print(text)
    bad = [r for r in rows if not (r["status"] == "ok" or r["status"].startswith(("skipped", "oom")))]
    return 1 if bad else 0


def add_model_args(ap: argparse.ArgumentParser) -> None:
    """The random-weight model's shape options (build_model's arguments), for this script and tools/bench_cb.py."""
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--intermediate", type=int, default=14336)
    ap.add_argument("--vocab", type=int, default=32000)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt", default="32768", help="prompt length(s), comma separated (default 32768)")
    ap.add_argument("--new", type=int, default=256, help="new tokens (default 256)")
    add_model_args(ap)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--providers", default=",".join(PROVIDERS[:3]),
                    help="comma separated: " + ", ".join(PROVIDERS) + f" (default {','.join(PROVIDERS[:3])})")
    ap.add_argument("--repeat", type=int, default=2, help="generate() calls per process: 1 cold, then warm")
    ap.add_argument("--interleave", type=int, default=0, metavar="ROUNDS",
                    help="one process, ROUNDS rounds of every provider in turn (the host's slow spells fall on all "
                         "alike); a provider's first round is cold")
    ap.add_argument("--per-token", type=int, default=0, metavar="CALLS",
                    help="with --interleave: CALLS more generate() calls whose provider changes every token")
    ap.add_argument("--cache", choices=("dynamic", "static"), default="dynamic", help="transformers' KV cache")
    ap.add_argument("--algo-policy", default="tune", choices=("tune", "cache", "heuristic"),
                    help="attn_lt's ATTN_LT_ALGO_POLICY for its run (default tune)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout-s", type=int, default=600, help="per process (default 600)")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="after the timed runs, one generate() of N tokens under cProfile (host time per function "
                         "to <out>/s<prompt>-<provider>.json.profile.txt)")
    ap.add_argument("--out", help="directory for results.json, summary.md and the logs")
    ap.add_argument("--quick", action="store_true", help="prompt 8192, 32 new tokens, 2 layers, one repeat")
    ap.add_argument("--device", default="cuda", help=argparse.SUPPRESS)  # "cpu": the script's own smoke test
    ap.add_argument("--worker", choices=PROVIDERS + ("interleaved",), help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    return ap


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    a = build_parser().parse_args(argv)
    if a.quick:
        a.prompt, a.new, a.layers, a.repeat = "8192", 32, 2, 1
    try:
        a.prompts = [int(x) for x in str(a.prompt).split(",") if x.strip()]
    except ValueError:
        print(f"bench_generate: --prompt must be integers, got {a.prompt!r}", file=sys.stderr)
        return 2
    a.providers = [p.strip() for p in a.providers.split(",") if p.strip()]
    bad = [p for p in a.providers if p not in PROVIDERS]
    if a.per_token and not a.interleave and not a.worker:
        print("bench_generate: --per-token needs --interleave (every provider in one process)", file=sys.stderr)
        return 2
    if bad or not a.prompts or min(a.prompts) < 1 or a.new < 2 or a.repeat < 1 or a.per_token < 0:
        print(f"bench_generate: bad arguments (providers {bad}, prompts {a.prompts}, new {a.new})", file=sys.stderr)
        return 2
    if a.worker:
        a.prompt = a.prompts[0]
        return worker(a)
    return parent(a, argv)


if __name__ == "__main__":
    sys.exit(main())
