#!/usr/bin/env python3
"""Hugging Face continuous batching (``model.generate_batch``) with attn_lt against transformers' own paged attention.

A Llama-architecture model with random weights built in code (no download; ``tools/bench_generate.py``'s
construction: default 8 layers, hidden 4096, 32 query / 8 kv heads, head dim 128, intermediate 14336, vocabulary
32000), bf16, eval, on the GPU; ``--requests`` (64) prompts of random token ids, lengths uniform in
``--min-prompt``..``--max-prompt`` (128..4096, seeded: about 135k prompt tokens); for each N of ``--new-tokens``
(64) and each implementation of ``--impls`` (``paged|sdpa,paged|attn_lt``, after
``attn_lt.integrations.transformers.register()``):

    model.set_attn_implementation(impl)
    model.generate_batch(inputs=prompts, generation_config=GenerationConfig(max_new_tokens=N, do_sample=False,
                         eos_token_id=-1), continuous_batching_config=ContinuousBatchingConfig(block_size=256,
                         num_blocks=<every request's prompt + N>, max_batch_tokens=8192), record_timestamps=True)

after one short warm-up ``generate_batch`` per implementation (``--warmup-requests`` prompts cut to 512 tokens, 4 new
tokens). The same cache size and batch-token budget for every implementation, so that the scheduler makes the same
steps. EOS is disabled: every request makes N tokens.

Measured for each run:

* ``wall_s``: the whole ``generate_batch`` call (host clock; the manager, its thread and the cache included);
  ``tok_s``: generated tokens / wall_s.
* time to first token: transformers stamps each generated token when ``record_timestamps=True``; a request's TTFT
  is its first stamp minus its ``created_time`` (``add_requests``, all at the start): queueing included. Median,
  p90, min and max over the requests.
* the profile, from a second, separate run of the same work (so that the timed run has nothing wrapped): the
  registered attention function and ``model.forward`` wrapped with CUDA events on the stream they run on (the
  manager's compute stream) and a host clock: GPU ms inside attention (all layers, all steps), GPU ms of the
  forward passes, their calls, the host ms spent inside the attention function, and the fractions of that run's
  wall time (``profiled_wall_s``). (Not with ``--cuda-graphs``: events in a captured graph are not per call.)
* greedy outputs against the first implementation of ``--impls`` (``paged|sdpa``): how many requests are equal, and
  for the others the first differing position. With random weights over a 32000-token vocabulary the top two
  logits are often nearly tied, and bf16 rounding alone decides them (``--impls paged|sdpa,paged|eager,paged|attn_lt
  --quick`` shows transformers' own implementations parting as often), so most of the 64 requests part somewhere in
  64 tokens. The attention check below is the numerical evidence.
* attn_lt's device-side metadata check (``attn_lt.check_batch_errors()``) after its runs.
* before the timed runs (not timed), every attention call of a short ``generate_batch`` (8 of the prompts cut to
  3000 tokens, 4 new tokens, 1024 batch tokens: prefills in chunks after earlier ones, mixed with decode rows)
  checked against FP32 attention over each request's keys read back from the cache: attn_lt's error must be at most
  ``attn_lt.testing.tolerance()`` of torch SDPA's at bf16 (``--no-check`` skips it).

An implementation that fails (an exception, failed requests, missing results) is reported and the run goes on.

    python tools/bench_cb.py [--new-tokens 64[,256]] [--impls paged|sdpa,paged|attn_lt] [--out DIR]
                             [--requests 64] [--min-prompt 128] [--max-prompt 4096] [--max-batch-tokens 8192]
                             [--block-size 256] [--cuda-graphs] [--layers 8] [--quick]

Checked against transformers 5.17 (``generate_batch``, ``ContinuousBatchingConfig``, ``GenerationOutput``'s
``generated_tokens``/``timestamps``/``created_time``/``error``). On transformers that dropped ``paged|`` names
(5.24) use ``--impls sdpa,attn_lt``. Writes DIR/cb.json (metadata, every run with its per-request data) and prints
a short table last. Exit codes: 0 ok, 1 an implementation failed, 2 no GPU or bad arguments.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import statistics
import sys
import time
import types

TOOLS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(TOOLS)
sys.path.insert(0, REPO)
sys.path.insert(0, TOOLS)


def is_attn_lt(impl: str) -> bool:
    return impl.removeprefix("paged|").startswith("attn_lt")


def build(a):
    """The model (tools/bench_generate.py's build_model: bf16 weights made on the device)."""
    from bench_generate import build_model

    ns = types.SimpleNamespace(vocab=a.vocab, hidden=a.hidden, intermediate=a.intermediate, layers=a.layers,
                               heads=a.heads, kv_heads=a.kv_heads, head_dim=a.head_dim, prompt=a.max_prompt,
                               new=max(a.new_tokens), seed=a.seed, device=a.device)
    return build_model(ns)


def make_prompts(a) -> list[list[int]]:
    rng = random.Random(a.seed)
    lengths = [rng.randint(a.min_prompt, a.max_prompt) for _ in range(a.requests)]
    return [[rng.randrange(3, a.vocab) for _ in range(n)] for n in lengths]


def cb_config(a, prompts, new: int):
    import transformers

    # every request whole, with room above the FIFO scheduler's safety margin (no prefill is held back for blocks)
    need = sum(-(-(len(p) + new) // a.block_size) for p in prompts)
    blocks = -(-need * 5 // 4) + 2 * len(prompts)
    kw = dict(block_size=a.block_size, num_blocks=blocks, max_batch_tokens=a.max_batch_tokens)
    if a.cuda_graphs:
        kw["use_cuda_graph"] = True
    return transformers.ContinuousBatchingConfig(**kw), blocks


class Profile:
    """CUDA events (and a host clock) around every call of the attention function and of model.forward."""

    def __init__(self, cuda: bool):
        self.cuda, self.attn, self.fwd, self.attn_host_s = cuda, [], [], 0.0

    def _events(self):
        import torch

        return (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) if self.cuda else None

    def wrap(self, fn, into: list, host: bool):
        import functools

        @functools.wraps(fn)  # transformers inspects model.forward's signature (logits_to_keep)
        def timed(*args, **kwargs):
            ev = self._events()
            t = time.perf_counter()
            if ev:
                ev[0].record()
            out = fn(*args, **kwargs)
            if ev:
                ev[1].record()
                into.append(ev)
            else:
                into.append(time.perf_counter() - t)
            if host:
                self.attn_host_s += time.perf_counter() - t
            return out

        return timed

    @staticmethod
    def _ms(items) -> float:
        return sum(e[0].elapsed_time(e[1]) if isinstance(e, tuple) else e * 1e3 for e in items)

    def summary(self, wall_s: float) -> dict:
        attn, fwd = self._ms(self.attn), self._ms(self.fwd)
        return {"timer": "cuda events" if self.cuda else "host clock", "attention_ms": attn,
                "attention_calls": len(self.attn), "attention_host_ms": self.attn_host_s * 1e3, "forward_ms": fwd,
                "forward_calls": len(self.fwd), "attention_frac_of_wall": attn / (wall_s * 1e3),
                "forward_frac_of_wall": fwd / (wall_s * 1e3), "attention_frac_of_forward": attn / fwd if fwd else None}


def run_one(a, model, impl: str, prompts, new: int, profile: bool) -> dict:
    """One generate_batch; everything measured about it (or its error)."""
    import torch
    import transformers
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    row = {"impl": impl, "new_tokens": new, "requests": len(prompts), "status": "ok"}
    prof = Profile(a.device == "cuda") if profile else None
    original_fn = original_forward = None
    try:
        model.set_attn_implementation(impl)
        row["attn_implementation_set"] = model.config._attn_implementation
        gen = transformers.GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=-1, pad_token_id=0)
        cb, blocks = cb_config(a, prompts, new)
        row["num_blocks"], row["max_batch_tokens"] = blocks, a.max_batch_tokens
        if prof:  # the name the manager will call (paged| names stay themselves; 5.24 strips nothing we pass)
            called = impl
            original_fn = ALL_ATTENTION_FUNCTIONS[called]
            AttentionInterface.register(called, prof.wrap(original_fn, prof.attn, host=True))
            original_forward = model.forward
            model.forward = prof.wrap(original_forward, prof.fwd, host=False)
        if a.device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = model.generate_batch(inputs=prompts, generation_config=gen, continuous_batching_config=cb,
                                   record_timestamps=True, progress_bar=False)
        if a.device == "cuda":
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        results = list(out.values())
        row["wall_s"] = wall
        row["generated_tokens"] = sum(len(r.generated_tokens) for r in results)
        row["tok_s"] = row["generated_tokens"] / wall
        row["tokens"] = [list(r.generated_tokens) for r in results]
        row["errors"] = [r.error for r in results if r.error is not None]
        ttft = [r.timestamps[0] - r.created_time for r in results if r.timestamps]
        if ttft:
            s = sorted(ttft)
            row["ttft_s"] = {"median": statistics.median(s), "p90": s[int(0.9 * (len(s) - 1))], "min": s[0],
                             "max": s[-1]}
        if len(results) != len(prompts):
            row["status"] = f"error: {len(prompts) - len(results)} of {len(prompts)} requests missing"
        elif row["errors"]:
            row["status"] = f"error: {len(row['errors'])} requests failed: {str(row['errors'][0])[:300]}"
        elif any(len(t) != new for t in row["tokens"]):
            row["status"] = "error: some requests made fewer than N tokens"
        if prof:
            if a.device == "cuda":
                torch.cuda.synchronize()
            row["profile"] = prof.summary(wall)
        if is_attn_lt(impl) and a.device == "cuda":
            try:
                import attn_lt

                attn_lt.check_batch_errors()
                row["batch_errors"] = None
            except Exception as e:  # bad metadata seen on the device
                row["batch_errors"] = str(e)[:500]
                row["status"] = f"error: attn_lt batch metadata: {str(e)[:200]}"
    except torch.cuda.OutOfMemoryError as e:
        row["status"] = "oom: " + str(e).split("\n")[0][:300]
    except Exception as e:
        import traceback

        traceback.print_exc()
        row["status"] = f"error: {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
    finally:
        if original_fn is not None:
            AttentionInterface.register(impl, original_fn)
        if original_forward is not None:
            model.forward = original_forward
        if a.device == "cuda":
            torch.cuda.empty_cache()
    return row


def _reference_rows(q, k, v, scale):
    """FP32 causal (bottom-right) attention of one request: q (n, Hq, D), k/v (L, Hkv, D) -> (n, Hq, D)."""
    import torch

    n, Hq, D = q.shape
    L, Hkv = k.shape[:2]
    k = k.float().repeat_interleave(Hq // Hkv, 1)
    v = v.float().repeat_interleave(Hq // Hkv, 1)
    s = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    allowed = torch.arange(L, device=q.device)[None, :] <= torch.arange(n, device=q.device)[:, None] + (L - n)
    return torch.einsum("hqk,khd->qhd", s.masked_fill(~allowed, float("-inf")).softmax(-1), v)


def _torch_rows(q, k, v, scale):
    """The same with torch's SDPA in q's dtype (the precision's own error, for the tolerance)."""
    import torch

    n, L = q.shape[0], k.shape[0]
    allowed = torch.arange(L, device=q.device)[None, :] <= torch.arange(n, device=q.device)[:, None] + (L - n)
    g = q.shape[1] // k.shape[1]
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.repeat_interleave(g, 1).transpose(0, 1)[None],
        v.repeat_interleave(g, 1).transpose(0, 1)[None], attn_mask=allowed, scale=scale)
    return out[0].transpose(0, 1)


def check_attention(a, model, impl: str, prompts) -> dict:
    """Every attention call of one short generate_batch (prompts of mixed lengths, a small batch-token budget so
    that prompts are prefilled in chunks after earlier ones, and decode steps): the implementation's output rows
    of each request against FP32 attention over that request's keys read back from the cache; the error may be at
    most attn_lt.testing.tolerance() of torch's SDPA at the same precision. Not timed."""
    import torch
    import transformers
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from attn_lt.testing import rel_error, tolerance

    fn = ALL_ATTENTION_FUNCTIONS[impl]
    calls = []

    def checked(module, query, key, value, attention_mask, *args, **kwargs):
        out, weights = fn(module, query, key, value, attention_mask, *args, **kwargs)
        scale = kwargs.get("scaling") or module.scaling
        cu_q = kwargs["cu_seq_lens_q"].tolist()
        cu_k = kwargs["cu_seq_lens_k"]
        cu_k = (cu_k["full_attention"] if isinstance(cu_k, dict) else cu_k).tolist()
        cache = kwargs.get("cache")
        if cache is not None and hasattr(cache, "key_cache"):  # 5.17: the keys as the cache now holds them
            group, index = cache.layer_index_to_group_indices[module.layer_idx]
            read, write = kwargs["read_index"][group], kwargs["write_index"][group]
            slots = read if read.numel() else write
            keys, values = cache.key_cache[index][slots], cache.value_cache[index][slots]
        else:  # the layer passed them gathered (5.24)
            keys, values = key[0].transpose(0, 1), value[0].transpose(0, 1)
        q, o = query[0].transpose(0, 1), out.reshape(query.shape[2], query.shape[1], -1)
        ours, ref, torch_out = [], [], []
        for b in range(len(cu_q) - 1):
            rows, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
            if rows.stop > rows.start:
                ours.append(o[rows])
                ref.append(_reference_rows(q[rows], keys[ks], values[ks], scale))
                torch_out.append(_torch_rows(q[rows], keys[ks], values[ks], scale))
        ours, ref, torch_out = torch.cat(ours), torch.cat(ref), torch.cat(torch_out)
        err, torch_err = rel_error(ours, ref), rel_error(torch_out, ref)
        calls.append({"layer": module.layer_idx, "rows": ref.shape[0], "requests": len(cu_q) - 1,
                      "max_rows": max(cu_q[b + 1] - cu_q[b] for b in range(len(cu_q) - 1)),
                      "err": err, "torch_err": torch_err, "ok": err <= tolerance(torch_err)})
        return out, weights

    res = {"impl": impl}
    try:
        AttentionInterface.register(impl, checked)
        model.set_attn_implementation(impl)
        gen = transformers.GenerationConfig(max_new_tokens=4, do_sample=False, eos_token_id=-1, pad_token_id=0)
        cb = transformers.ContinuousBatchingConfig(block_size=a.block_size, max_batch_tokens=1024,
                                                   num_blocks=sum(-(-(len(p) + 4) // a.block_size) + 2
                                                                  for p in prompts) * 2)
        out = model.generate_batch(inputs=prompts, generation_config=gen, continuous_batching_config=cb,
                                   progress_bar=False)
        errors = [r.error for r in out.values() if r.error is not None]
        bad = [c for c in calls if not c["ok"]]
        res.update(status="ok" if calls and not bad and not errors and len(out) == len(prompts) else
                   f"error: {len(bad)} of {len(calls)} calls beyond the tolerance" + (f"; {errors[0][:200]}"
                                                                                        if errors else ""),
                   calls=len(calls), failed=len(bad), worst_ratio=max((c["err"] / tolerance(c["torch_err"])
                                                                     for c in calls), default=None),
                   max_err=max((c["err"] for c in calls), default=None),
                   max_torch_err=max((c["torch_err"] for c in calls), default=None),
                   chunked_calls=sum(c["max_rows"] > 1 and c["requests"] > 1 for c in calls), per_call=calls)
    except Exception as e:
        import traceback

        traceback.print_exc()
        res["status"] = f"error: {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
    finally:
        AttentionInterface.register(impl, fn)
        if a.device == "cuda":
            torch.cuda.empty_cache()
    return res


def compare(base: dict, other: dict) -> dict:
    """Per request: equal tokens, or the first position where they part."""
    if (base.get("status") != "ok" or other.get("status") != "ok" or "tokens" not in base or "tokens" not in other
            or len(base["tokens"]) != len(other["tokens"])):
        return {"compared": False}
    first = {}
    for i, (x, y) in enumerate(zip(base["tokens"], other["tokens"])):
        if x != y:
            first[i] = next((j for j, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
    return {"compared": True, "equal": len(base["tokens"]) - len(first), "of": len(base["tokens"]),
            "first_diff": first}


def metadata(a, argv, prompts) -> dict:
    import torch
    import transformers

    m = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
         "command": "python tools/bench_cb.py " + " ".join(argv), "torch": torch.__version__,
         "transformers": transformers.__version__, "python": sys.version.split()[0],
         "model": {k: getattr(a, k) for k in ("layers", "hidden", "heads", "kv_heads", "head_dim", "intermediate",
                                              "vocab")},
         "requests": len(prompts), "prompt_tokens": sum(map(len, prompts)),
         "prompt_lengths": [len(p) for p in prompts], "block_size": a.block_size,
         "max_batch_tokens": a.max_batch_tokens, "cuda_graphs": a.cuda_graphs, "seed": a.seed}
    if a.device == "cuda":
        m["gpu"] = torch.cuda.get_device_name()
    try:
        import attn_lt

        m["attn_lt"] = getattr(attn_lt, "__version__", "?")
    except Exception as e:
        m["attn_lt"] = f"import failed: {e}"
    return m


def table(rows: list[dict], baseline: str) -> str:
    head = (f"{'impl':<16} {'N':>4} {'wall s':>8} {'tok/s':>8} {'TTFT med s':>10} {'TTFT max s':>10} "
            f"{'attn ms':>9} {'attn/wall':>9} {'fwd ms':>9} {'equal':>7}  status")
    lines = [head, "-" * len(head)]
    for r in rows:
        p, t = r.get("profile") or {}, r.get("ttft_s") or {}
        eq = r.get("vs_baseline") or {}
        equal = f"{eq['equal']}/{eq['of']}" if eq.get("compared") else ("base" if r["impl"] == baseline else "-")

        def f(x, fmt):
            return format(x, fmt) if isinstance(x, (int, float)) else format("-", ">" + fmt.split(".")[0])

        lines.append(f"{r['impl']:<16} {r['new_tokens']:>4} {f(r.get('wall_s'), '8.2f')} {f(r.get('tok_s'), '8.1f')} "
                     f"{f(t.get('median'), '10.2f')} {f(t.get('max'), '10.2f')} {f(p.get('attention_ms'), '9.0f')} "
                     f"{f(p.get('attention_frac_of_wall'), '9.1%')} {f(p.get('forward_ms'), '9.0f')} {equal:>7}  "
                     f"{r['status'][:60]}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    from bench_generate import add_model_args

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--new-tokens", default="64", help="N, comma separated (default 64)")
    ap.add_argument("--impls", default="paged|sdpa,paged|attn_lt",
                    help="attention implementations, the first the baseline (default paged|sdpa,paged|attn_lt)")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--min-prompt", type=int, default=128)
    ap.add_argument("--max-prompt", type=int, default=4096)
    ap.add_argument("--max-batch-tokens", type=int, default=8192, help="the scheduler's tokens a step")
    ap.add_argument("--block-size", type=int, default=256, help="the paged cache's block size (transformers' 256)")
    ap.add_argument("--cuda-graphs", action="store_true", help="ContinuousBatchingConfig(use_cuda_graph=True)")
    ap.add_argument("--warmup-requests", type=int, default=8)
    ap.add_argument("--no-profile", action="store_true", help="no CUDA events around attention and forward")
    ap.add_argument("--no-check", action="store_true", help="skip the FP32 check of attn_lt's attention calls")
    add_model_args(ap)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="16 requests of 128-1024 tokens, N 16, 2 layers")
    ap.add_argument("--out", help="directory for cb.json")
    ap.add_argument("--device", default="cuda", help=argparse.SUPPRESS)  # "cpu": the script's own smoke test
    return ap


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    a = build_parser().parse_args(argv)
    try:
        a.new_tokens = [int(x) for x in a.new_tokens.split(",") if x]
    except ValueError:
        print(f"--new-tokens must be comma-separated ints, got {a.new_tokens!r}", file=sys.stderr)
        return 2
    if a.quick:
        a.requests, a.min_prompt, a.max_prompt, a.new_tokens, a.layers = 16, 128, 1024, [16], 2
    impls = [x for x in a.impls.split(",") if x]
    if not impls or not a.new_tokens or min(a.new_tokens) < 1 or not 1 <= a.min_prompt <= a.max_prompt:
        print("need at least one implementation, N >= 1 and 1 <= --min-prompt <= --max-prompt", file=sys.stderr)
        return 2

    import torch
    import transformers

    if a.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA GPU visible", file=sys.stderr)
        return 2
    transformers.logging.set_verbosity_error()
    registered = None
    if any(map(is_attn_lt, impls)):
        try:
            import attn_lt.integrations.transformers as attn_lt_hf

            names = {i.removeprefix("paged|") for i in impls if is_attn_lt(i)}
            registered = sorted(attn_lt_hf.register(n, continuous_batching=True) for n in names)
        except Exception as e:  # reported on each attn_lt row
            registered = f"error: {type(e).__name__}: {e}"
            print(f"attn_lt registration failed: {registered}", file=sys.stderr)

    prompts = make_prompts(a)
    meta = metadata(a, argv, prompts)
    meta["attn_lt_registered"] = registered
    print(f"transformers {meta['transformers']}, torch {meta['torch']}, {meta.get('gpu', a.device)}; "
          f"{len(prompts)} prompts, {meta['prompt_tokens']} tokens; impls {impls}; N {a.new_tokens}", flush=True)
    t = time.perf_counter()
    with torch.no_grad():
        model = build(a)
    print(f"model built in {time.perf_counter() - t:.1f} s", flush=True)

    rows: list[dict] = []
    res = {"meta": meta, "warmup": [], "runs": rows}

    def save():
        if a.out:
            os.makedirs(a.out, exist_ok=True)
            with open(os.path.join(a.out, "cb.json"), "w") as f:
                json.dump(res, f, indent=1)

    warm_prompts = [p[:512] for p in prompts[:a.warmup_requests]]
    for impl in impls:
        if is_attn_lt(impl) and isinstance(registered, str):
            res["warmup"].append({"impl": impl, "status": registered})
            continue
        w = run_one(a, model, impl, warm_prompts, 4, profile=False)
        w.pop("tokens", None)
        res["warmup"].append(w)
        print(f"warm-up {impl}: {w['status']} ({w.get('wall_s', float('nan')):.2f} s)", flush=True)
    if not a.no_check and a.device == "cuda":
        check_prompts = [p[:3000] for p in prompts[:8]]
        for impl in impls:
            if not is_attn_lt(impl) or isinstance(registered, str):
                continue
            c = check_attention(a, model, impl, check_prompts)
            res.setdefault("attention_check", []).append(c)
            print(f"attention check {impl}: {c['status']}; {c.get('calls')} calls ({c.get('chunked_calls')} with "
                  f"prefill chunks of several requests), error at most {c.get('max_err', float('nan')):.2e} "
                  f"(torch SDPA at the same precision {c.get('max_torch_err', float('nan')):.2e}), worst "
                  f"err / tolerance {c.get('worst_ratio', float('nan')):.2f}", flush=True)
    save()
    for new in a.new_tokens:
        base = None
        for impl in impls:
            if is_attn_lt(impl) and isinstance(registered, str):
                row = {"impl": impl, "new_tokens": new, "status": registered}
            else:
                row = run_one(a, model, impl, prompts, new, profile=False)  # the timed run: nothing wrapped
                if row["status"] == "ok" and not a.no_profile and not a.cuda_graphs:
                    prof = run_one(a, model, impl, prompts, new, profile=True)  # the profile: its own run
                    row["profile"] = dict(prof.get("profile") or {}, status=prof["status"],
                                          profiled_wall_s=prof.get("wall_s"),
                                          same_tokens=prof.get("tokens") == row.get("tokens"))
            if impl == impls[0]:
                base = row
            elif base is not None:
                row["vs_baseline"] = compare(base, row)
            rows.append(row)
            save()
            eq = row.get("vs_baseline") or {}
            print(f"{impl} N={new}: {row['status']}; wall {row.get('wall_s', float('nan')):.2f} s, "
                  f"{row.get('tok_s', float('nan')):.1f} tok/s" +
                  (f"; equal to {impls[0]}: {eq['equal']}/{eq['of']}, first differences {eq['first_diff']}"
                   if eq.get("compared") else ""), flush=True)
    save()
    print()
    print(table(rows, impls[0]))
    if a.out:
        print(f"\nwrote {os.path.join(a.out, 'cb.json')}")
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
