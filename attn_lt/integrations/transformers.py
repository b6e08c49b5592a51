"""attn_lt as an attention implementation of Hugging Face transformers (>= 4.48, 5.x).

```python
import attn_lt.integrations.transformers as attn_lt_hf

attn_lt_hf.register()                                  # once per process; name "attn_lt"
model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.bfloat16, device_map="cuda",
                                             attn_implementation="attn_lt")
# or, on a loaded model (transformers 5.x): model.set_attn_implementation("attn_lt")
```

:func:`attention_forward` has the signature of ``transformers.AttentionInterface`` functions and the semantics of
transformers' own ``sdpa`` implementation (``transformers/integrations/sdpa_attention.py``):

* query (B, Hq, Sq, D), key and value (B, Hkv, Sk, D) go to :func:`attn_lt.attention` as they are: strided views
  are read in place and grouped-query attention (Hkv < Hq) reads each kv head without copying it.
* The mask is the 4-D mask transformers builds for ``sdpa`` (:func:`register` registers sdpa's mask builder for
  this name too): bool (True = attend) or additive float (-inf or the dtype's minimum where masked), (B, 1, Sq, Sk)
  or broadcastable to (B, Hq, Sq, Sk); columns beyond Sk (older static caches) are sliced off, a float mask of a
  dtype attn_lt does not read is converted to float32. With left padding some rows have no key at all: attn_lt
  gives them zeros (SDPA's math backend gives zeros too; transformers discards those positions).
* ``attention_mask=None`` with ``is_causal`` (default ``module.is_causal``) and Sq > 1 is a plain causal mask,
  which attn_lt applies itself without reading a dense mask (its causal is bottom-right aligned; transformers
  leaves the mask out only where Sq == Sk, or on the prefill of an empty static cache, where, like its ``sdpa``,
  the keys are cut to the first Sq so that top-left and bottom-right agree). Sq == 1 (decode) sees every key.
* ``scaling`` is attn_lt's ``scale`` (None: D ** -0.5).
* Refused with ``ValueError``, as ``sdpa`` refuses or cannot do them: dropout > 0 (training), ``softcap``,
  ``output_attentions``, ``head_mask``, ``position_bias``, attention sinks (``s_aux``), packed sequences
  (``cu_seq_lens_q``), a paged cache (continuous batching), and a sliding window that no mask encodes (a window
  given with a mask is applied by the mask, as in ``sdpa``).

Returns ``(attn_output, None)``: attn_output (B, Sq, Hq, D) contiguous, in the input dtype.
"""

from __future__ import annotations

import functools
import logging

import torch

from ..api import attention

log = logging.getLogger("attn_lt")

#: The name :func:`register` uses by default: ``attn_implementation="attn_lt"``.
NAME = "attn_lt"
#: Options of :func:`attn_lt.attention` that :func:`register` can fix for every call.
OPTIONS = ("backend", "workspace_bytes", "threshold", "algo_policy")
#: Oldest transformers whose attention interface this adapter follows.
MIN_TRANSFORMERS = (4, 48)

_MASK_FLOAT_DTYPES_READ = (torch.float32,)  # besides q's own dtype (see attn_lt.attention)
#: Keyword arguments refused unless None, and what they ask for.
_REFUSED_WHEN_SET = {"softcap": "logit softcapping", "head_mask": "a head mask", "position_bias": "a position bias",
                     "s_aux": "attention sinks (s_aux)"}
#: Every keyword argument :func:`_refuse` looks at (a call without any of them and without dropout skips it).
_CHECKED = frozenset(_REFUSED_WHEN_SET) | {"output_attentions", "cache", "cu_seq_lens_q"}


def _shape(t) -> str:
    return "(" + ", ".join(str(s) for s in t.shape) + ")"


def _refuse(kwargs: dict, dropout: float) -> None:
    """ValueError for every argument this adapter cannot honour (before any GPU work)."""
    if dropout:
        raise ValueError(f"attn_lt has no attention dropout (got dropout={dropout}); it is forward-only: run the "
                         "model in eval mode (model.eval()) or with attention_dropout=0")
    if kwargs.get("output_attentions"):
        raise ValueError("attn_lt does not return attention weights (output_attentions=True): use "
                         'attn_implementation="eager" for them')
    for key, what in _REFUSED_WHEN_SET.items():
        if kwargs.get(key) is not None:
            raise ValueError(f"attn_lt does not support {what} ({key}=...); use the model's eager attention")
    cache = kwargs.get("cache")
    if cache is not None:
        raise ValueError(f"attn_lt does not support a paged cache ({type(cache).__name__}, continuous batching); "
                         "use generate() with the default dynamic cache")
    if kwargs.get("cu_seq_lens_q") is not None:  # packed sequences (continuous batching, padding-free batches)
        raise ValueError("this implementation takes padded (B, H, S, D) calls, not packed sequences (cu_seq_lens_q); "
                         "use generate() with the default dynamic cache")


def attention_forward(module: torch.nn.Module | None, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      is_causal: bool | None = None, *, attn_lt_options: dict | None = None,
                      **kwargs) -> tuple[torch.Tensor, None]:
    """A ``transformers.AttentionInterface`` function running :func:`attn_lt.attention`.

    Args:
        module: the calling attention layer (its ``is_causal`` is the default of ``is_causal``), or None.
        query: (B, Hq, Sq, D) fp16/bf16 on a CUDA device.
        key, value: (B, Hkv, Sk, D), Hq % Hkv == 0 (not repeated: attn_lt reads each kv head in place).
        attention_mask: None, or 4-D bool (True = attend) or additive float, (B or 1, 1 or Hq, Sq, >= Sk).
        dropout: must be 0 (attn_lt has no dropout).
        scaling: the softmax scale; None for D ** -0.5.
        is_causal: None for ``module.is_causal`` (True when absent); applies only without a mask and for Sq > 1.
        attn_lt_options: options passed on to :func:`attn_lt.attention` (see :data:`OPTIONS`).
        **kwargs: the rest of transformers' attention kwargs; ``sliding_window``, ``softcap``,
            ``output_attentions``, ``head_mask``, ``position_bias``, ``s_aux`` and ``cache`` are checked (see the
            module docstring), the others (positions, cache positions) are not needed.

    Returns:
        ``(attn_output, None)``: attn_output (B, Sq, Hq, Dv) contiguous (Dv = value's head dim), query's dtype.

    Raises:
        ValueError: an unsupported feature, or a mask that is not 4-D; attn_lt's own TypeError/ValueError for bad
            shapes or dtypes, all before GPU work.
    """
    if dropout or not _CHECKED.isdisjoint(kwargs):  # one set operation on a decode step's hot path
        _refuse(kwargs, dropout)
    mask = attention_mask
    causal = False
    if mask is not None:
        Sk = key.shape[2]
        if mask.dim() != 4:
            raise ValueError(f"attn_lt expects the 4-D attention mask transformers builds for sdpa, (B, 1, Sq, Sk) "
                             f"with Sq={query.shape[2]}, Sk={Sk}; got {_shape(mask)} (query {_shape(query)}, key "
                             f"{_shape(key)})")
        if mask.shape[-1] > Sk:  # masks sized for a longer (static) cache: transformers' sdpa slices them too
            mask = mask[..., :Sk]
        if mask.is_floating_point() and mask.dtype != query.dtype and mask.dtype not in _MASK_FLOAT_DTYPES_READ:
            mask = mask.to(torch.float32)  # exact for fp16/bf16 masks; attn_lt reads fp32 or q's dtype
    else:
        Sq, Sk = query.shape[2], key.shape[2]
        window = kwargs.get("sliding_window")
        if window is not None and Sk > window:
            raise ValueError(f"a sliding window of {window} keys with no attention mask over Sk={Sk} keys: attn_lt "
                             "applies windows only through the mask; register the adapter with attn_lt."
                             "integrations.transformers.register() so that transformers builds it")
        if Sq > 1:  # decode (Sq 1) sees every key
            causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
            if causal and Sk > Sq:
                # transformers leaves the mask out with Sk > Sq > 1 only for the prefill of an empty static cache,
                # whose keys past Sq are empty slots; its sdpa cuts them off (top-left causal), which we do by a
                # view as well.
                key, value = key[:, :, :Sq], value[:, :, :Sq]
    # (B, Sq, Hq, Dv) as transformers wants it, written so by the kernel: no transpose and no copy after the call
    out = attention(query, key, value, attn_mask=mask, causal=causal, scale=scaling, out_layout="bshd",
                    **(attn_lt_options or {}))
    return out, None


def make_attention_forward(**options):
    """``attention_forward`` with options of :func:`attn_lt.attention` fixed (``backend``, ``workspace_bytes``,
    ``threshold``, ``algo_policy``); without options, ``attention_forward`` itself."""
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise TypeError(f"unknown attn_lt option(s) {unknown}; allowed: {list(OPTIONS)}")
    if not options:
        return attention_forward
    fn = functools.partial(attention_forward, attn_lt_options=dict(options))
    functools.update_wrapper(fn, attention_forward)
    return fn


def _transformers_version() -> tuple[int, int]:
    try:
        import transformers
    except ImportError as e:
        raise ImportError("attn_lt.integrations.transformers needs Hugging Face transformers >= 4.48: "
                          "pip install 'attn-lt[transformers]'") from e
    parts = transformers.__version__.split(".")
    version = (int(parts[0]), int("".join(c for c in parts[1] if c.isdigit()) or 0))
    if version < MIN_TRANSFORMERS:
        raise ImportError(f"attn_lt.integrations.transformers needs transformers >= 4.48, found "
                          f"{transformers.__version__}")
    return version


def register(name: str = NAME, **options) -> str:
    """Register attn_lt with transformers under ``name``; then ``attn_implementation=name`` selects it.

    Registers :func:`attention_forward` (with ``options`` fixed, see :func:`make_attention_forward`) in
    ``transformers.AttentionInterface`` and, where transformers has one (>= 4.53), sdpa's mask builder in
    ``AttentionMaskInterface`` under the same name, so that masks are built exactly as for ``sdpa``: no mask at all
    for plain causal attention without padding (attn_lt applies causality itself), a 4-D bool mask otherwise.
    Older transformers build a dense additive mask for every implementation but ``sdpa``; it is read as given.

    Returns the name. Raises ImportError without transformers >= 4.48, TypeError for an unknown option.
    """
    if not isinstance(name, str) or not name or name in ("eager", "sdpa") or "/" in name:
        raise ValueError(f"name must be a new implementation name without '/' (not eager or sdpa), got {name!r}")
    fn = make_attention_forward(**options)
    _transformers_version()
    try:
        from transformers import AttentionInterface
    except ImportError:  # transformers 4.48-4.50: a plain dict
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        ALL_ATTENTION_FUNCTIONS[name] = fn
    else:
        AttentionInterface.register(name, fn)
    try:
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    except ImportError:  # before 4.53 every model builds its own 4-D mask
        pass
    else:
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    log.info("registered attn_lt as transformers attention implementation %r%s", name,
             f" with {options}" if options else "")
    return name
