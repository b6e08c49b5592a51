#!/usr/bin/env python3
"""SnapKV-style KV-cache compression with transformers and attn_lt's attention mass per key.

The prefill runs every layer's attention through attn_lt with ``return_key_mass=True, key_mass_window=W``: the
output comes from the fused kernel, and the mass of the last W query rows (SnapKV's observation window) from a pass
over those rows alone. Each kv head then keeps the keys of the largest pooled mass (SnapKV: summed over the query
heads of the group, average-pooled over neighbouring keys) plus the window itself; ``generate``-style greedy
decoding goes on from the compressed cache at the original positions. The script reports the memory kept, the
time of a decode step on the full and on the compressed cache, and checks that the kept keys equal those an eager
FP64 reference (softmax of the same layer's q kᵀ) chooses on the same inputs.

    python examples/snapkv_compress.py [--prompt 16384] [--keep 2048] [--window 64] [--kernel 7] [--new 32]
                                       [--layers 8] [--hidden 4096] [--heads 32] [--kv-heads 8]

A Llama-architecture model with random weights (bf16, no download). Needs a CUDA GPU and transformers. Exit codes:
0 ok, 1 a kept-key set differs from the reference's beyond a tie, 2 no GPU or no transformers.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

NAME = "attn_lt_snapkv"


def snap_indices(mass, group: int, keep: int, window: int, kernel: int):
    """The key indices a kv head keeps, (B, Hkv, keep) sorted: the ``keep - window`` keys before the window of the
    largest mass (``mass`` (B, Hq, Sk) of the window's rows, summed over the ``group`` query heads of each kv head,
    average-pooled over ``kernel`` neighbouring keys), then the window's own ``window`` keys."""
    import torch
    import torch.nn.functional as F

    B, Hq, Sk = mass.shape
    m = mass.view(B, Hq // group, group, Sk).sum(2)[..., :Sk - window]
    pooled = F.avg_pool1d(m, kernel, stride=1, padding=kernel // 2)
    top = pooled.topk(keep - window, dim=-1).indices.sort(dim=-1).values
    tail = torch.arange(Sk - window, Sk, device=mass.device).expand(B, Hq // group, window)
    return torch.cat([top, tail], dim=-1), pooled


def random_llama(a):
    import torch
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=32000, hidden_size=a.hidden, intermediate_size=a.hidden * 7 // 2,
                                   num_hidden_layers=a.layers, num_attention_heads=a.heads,
                                   num_key_value_heads=a.kv_heads, head_dim=a.hidden // a.heads,
                                   max_position_embeddings=a.prompt + a.new + 16, rope_theta=500000.0,
                                   pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            return transformers.LlamaForCausalLM(cfg).eval()
    finally:
        torch.set_default_dtype(prev)


def cache_layers(cache):
    """[(keys, values)] of a DynamicCache, and a function that replaces layer i's."""
    if hasattr(cache, "layers"):  # transformers >= 4.56
        def put(i, k, v):
            cache.layers[i].keys, cache.layers[i].values = k, v
        return [(layer.keys, layer.values) for layer in cache.layers], put

    def put_lists(i, k, v):
        cache.key_cache[i], cache.value_cache[i] = k, v
    return list(zip(cache.key_cache, cache.value_cache)), put_lists


def greedy(model, cache, first, position: int, steps: int):
    """``steps`` greedy tokens from ``first`` (B, 1) on ``cache`` at RoPE positions from ``position`` (the
    compressed cache keeps the original positions of its keys); returns (tokens, median ms a step)."""
    import torch

    tok, toks, times = first, [], []
    length = cache.get_seq_length()
    for step in range(steps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        out = model(input_ids=tok, past_key_values=cache, use_cache=True,
                    position_ids=torch.tensor([[position + step]], device="cuda"),
                    cache_position=torch.tensor([length + step], device="cuda"))
        e.record()
        tok = out.logits[:, -1:].argmax(-1)
        toks.append(int(tok))
        e.synchronize()
        times.append(s.elapsed_time(e))
    return toks, statistics.median(times[2:] or times)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompt", type=int, default=16384)
    ap.add_argument("--keep", type=int, default=2048, help="keys a kv head keeps, the window's included")
    ap.add_argument("--window", type=int, default=64, help="SnapKV's observation window (query rows)")
    ap.add_argument("--kernel", type=int, default=7, help="pooling width over neighbouring keys")
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    a = ap.parse_args(argv)
    try:
        import torch
        import transformers  # noqa: F401
        from transformers import AttentionInterface
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    except ImportError as e:
        print(f"snapkv_compress: {e}; pip install 'attn-lt[transformers]'", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("snapkv_compress: attn_lt runs on an NVIDIA GPU, and none is visible", file=sys.stderr)
        return 2
    if not a.window < a.keep < a.prompt:
        ap.error("need window < keep < prompt")

    import attn_lt
    import attn_lt.integrations.transformers as attn_lt_hf

    attn_lt_hf.register()
    masses, captured = {}, {}

    def prefill_forward(module, query, key, value, attention_mask, scaling=None, **kwargs):
        """The prefill's attention with the window's mass kept per layer (no padding: transformers passes no
        mask); decode steps as attn_lt's transformers function runs them."""
        if query.shape[2] == 1 or attention_mask is not None:
            return attn_lt_hf.attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
        out, mass = attn_lt.attention(query, key, value, causal=True, scale=scaling, out_layout="bshd",
                                      return_key_mass=True, key_mass_window=a.window)
        masses[module.layer_idx] = mass
        captured[module.layer_idx] = (query[:, :, -a.window:].clone(), key.clone(), scaling)
        return out, None

    AttentionInterface.register(NAME, prefill_forward)
    AttentionMaskInterface.register(NAME, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    model = random_llama(a)
    model.set_attn_implementation(NAME)
    group = a.heads // a.kv_heads
    ids = torch.randint(3, 32000, (1, a.prompt), device="cuda", generator=torch.Generator("cuda").manual_seed(1))

    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
        full = out.past_key_values
        first = out.logits[:, -1:].argmax(-1)
        # the same prefill's cache, compressed: each layer keeps its kv heads' chosen keys
        small = transformers.DynamicCache()
        model(input_ids=ids, use_cache=True, past_key_values=small)
        layers, put = cache_layers(small)
        ties = bad = 0
        for i, (k, v) in enumerate(layers):
            idx, pooled = snap_indices(masses[i], group, a.keep, a.window, a.kernel)
            gather = idx[..., None].expand(-1, -1, -1, k.shape[-1])
            put(i, k.gather(2, gather), v.gather(2, gather))
            # the eager FP64 reference: softmax(q kᵀ) of the window's rows (bottom-right causal), summed
            q_w, k_all, scale = captured[i]
            s = (q_w.double() @ k_all.double().repeat_interleave(group, 1).transpose(-1, -2)) * scale
            Sk = k_all.shape[2]
            rows = torch.arange(Sk - a.window, Sk, device="cuda")[:, None]
            s = s.masked_fill(torch.arange(Sk, device="cuda")[None, :] > rows, float("-inf"))
            ref_idx, ref_pooled = snap_indices(s.softmax(-1).sum(2), group, a.keep, a.window, a.kernel)
            for h in range(a.kv_heads):
                if torch.equal(idx[0, h], ref_idx[0, h]):
                    continue
                # a differing choice is a tie when the reference's pooled masses of the swapped keys agree with
                # its boundary value to FP32 rounding of the sums
                swapped = torch.tensor(sorted(set(idx[0, h].tolist()) ^ set(ref_idx[0, h].tolist())),
                                       device="cuda")
                edge = ref_pooled[0, h].topk(a.keep - a.window).values[-1]
                gap = (ref_pooled[0, h, swapped] - edge).abs().max() / edge
                ties += bool(gap < 1e-4)
                bad += not bool(gap < 1e-4)
        full_bytes = sum(k.numel() * k.element_size() * 2 for k, _ in cache_layers(full)[0])
        small_bytes = sum(k.numel() * k.element_size() * 2 for k, _ in cache_layers(small)[0])
        model.set_attn_implementation("attn_lt")
        toks_full, ms_full = greedy(model, full, first, a.prompt, a.new)
        toks_small, ms_small = greedy(model, small, first, a.prompt, a.new)

    heads = a.layers * a.kv_heads
    print(f"{torch.cuda.get_device_name()}: random Llama, {a.layers} layers, {a.heads}/{a.kv_heads} heads, prompt "
          f"{a.prompt}, keep {a.keep} keys a kv head (window {a.window}, pooling {a.kernel})")
    print(f"kept-key sets equal to the eager FP64 reference's: {heads - ties - bad} of {heads} kv heads"
          f"{f', {ties} differing only at a tie' if ties else ''}{f', {bad} DIFFERENT' if bad else ''}")
    print(f"KV cache: {full_bytes / 2**20:.0f} MiB -> {small_bytes / 2**20:.0f} MiB "
          f"({small_bytes / full_bytes:.1%} kept)")
    print(f"decode step (median of {a.new}): full cache {ms_full:.3f} ms, compressed {ms_small:.3f} ms "
          f"({ms_full / ms_small:.2f}x)")
    same = next((i for i, (x, y) in enumerate(zip(toks_full, toks_small)) if x != y), len(toks_full))
    print(f"greedy tokens equal to the full cache's for the first {same} of {a.new} (random weights)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
