#!/usr/bin/env python3
"""attn_lt inside Hugging Face transformers: greedy generate() with attn_implementation="attn_lt", then the same
with "sdpa", and what each produced.

    python examples/transformers_generate.py                          # a small random Llama built here (no download)
    python examples/transformers_generate.py --model PATH_OR_NAME [--prompt TEXT] [--new 32]   # any causal LM you have

Needs a CUDA GPU and transformers (pip install 'attn-lt[transformers]'). Exit codes: 0 ok, 2 no GPU or no
transformers.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def small_llama():
    """A 2-layer Llama with random weights: GQA (8 query / 2 kv heads), head dim 128, bf16, on the GPU."""
    import torch
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=1000, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                                   num_attention_heads=8, num_key_value_heads=2, head_dim=128,
                                   max_position_embeddings=8192, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).to("cuda", torch.bfloat16).eval()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="a local path or hub name of a causal LM (default: a small random Llama)")
    ap.add_argument("--prompt", default="The quick brown fox", help="text, with --model")
    ap.add_argument("--new", type=int, default=32, help="new tokens (default 32)")
    a = ap.parse_args(argv)
    try:
        import torch
        import transformers
    except ImportError as e:
        print(f"hf_example: {e}; pip install 'attn-lt[transformers]'", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("hf_example: attn_lt runs on an NVIDIA GPU, and none is visible", file=sys.stderr)
        return 2

    import attn_lt.integrations.transformers as attn_lt_hf

    attn_lt_hf.register()  # attn_implementation="attn_lt" from here on

    if a.model:
        dtype_kw = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
        tok = transformers.AutoTokenizer.from_pretrained(a.model)
        model = transformers.AutoModelForCausalLM.from_pretrained(
            a.model, attn_implementation="attn_lt", **{dtype_kw: torch.bfloat16}).to("cuda").eval()
        inputs = tok(a.prompt, return_tensors="pt").to("cuda")
        decode = (lambda ids: tok.decode(ids, skip_special_tokens=True))
    else:
        tok, model = None, small_llama()
        ids = torch.randint(3, model.config.vocab_size, (1, 64), generator=torch.Generator().manual_seed(1))
        inputs = {"input_ids": ids.cuda(), "attention_mask": torch.ones_like(ids).cuda()}
        decode = (lambda ids: " ".join(str(int(t)) for t in ids))

    n = inputs["input_ids"].shape[1]
    results = {}
    for name in ("attn_lt", "sdpa"):
        if hasattr(model, "set_attn_implementation"):  # transformers 5.x
            model.set_attn_implementation(name)
        else:
            model.config._attn_implementation = name
        torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=a.new, do_sample=False,
                                 pad_token_id=model.config.pad_token_id or 0)
        torch.cuda.synchronize()
        results[name] = (out[0, n:], time.perf_counter() - t)
    for name, (ids, s) in results.items():
        print(f"{name:8s} {s * 1e3:8.1f} ms  {decode(ids)!r}")
    same = torch.equal(results["attn_lt"][0], results["sdpa"][0])
    print("same tokens as sdpa" if same else
          "the tokens part from sdpa's (bf16 rounding decides near-ties; random weights have many)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
