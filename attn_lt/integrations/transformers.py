"""attn_lt as an attention implementation of Hugging Face transformers (>= 4.48, 5.x).

```python
import attn_lt.integrations.transformers as attn_lt_hf

attn_lt_hf.register()                                  # once per process; name "attn_lt"
model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.bfloat16, device_map="cuda",
                                             attn_implementation="attn_lt")
# or, on a loaded model (transformers 5.x): model.set_attn_implementation("attn_lt")
```

Continuous batching (``model.generate_batch(...)``, ``ContinuousBatchingManager``)::

    attn_lt_hf.register(continuous_batching=True)      # see below for what the flag does
    model.set_attn_implementation("paged|attn_lt")     # transformers <= 5.2x with "paged|" names (5.17)
    model.set_attn_implementation("attn_lt")           # transformers that dropped them (5.24)
    outputs = model.generate_batch(inputs=prompts, generation_config=GenerationConfig(max_new_tokens=64))

* transformers that name paged implementations ``paged|NAME`` (5.17: ``paged|sdpa`` in ``AttentionInterface``):
  :func:`register` also registers ``paged|<name>`` (:func:`paged_attention_forward`, no mask builder: transformers
  then builds no mask for it). Each layer writes the step's new keys and values into transformers'
  ``PagedAttentionCache`` at ``write_index`` (as its own ``cache.update`` writes them) and attends **in place in
  the cache** through a block table built on the GPU from ``read_index`` and ``cu_seq_lens_k`` (no gather of the
  batch's keys): one :class:`attn_lt.batch.BatchStep` is planned per engine step (when the layer index does not
  increase or the step's metadata tensors change) and run by every layer; no host synchronisation, so CUDA graphs
  (``ContinuousBatchingConfig(use_cuda_graph=True)``) may capture it. The cache's blocks must be a power of two
  of at least 8 tokens (transformers' default 256 is). The first call zeroes the cache once (transformers 5.17
  allocates it with ``torch.empty``; the Hopper prefill kernel reads a request's last block whole).
* transformers whose layers call ``cache.update`` themselves (5.24): the layer hands over the keys and values of
  every request already gathered from the cache; the function registered as ``<name>`` recognises the call
  (``cu_seq_lens_q`` with ``write_index``) and runs :func:`attn_lt.varlen_attention` on them (causal, bottom-right
  per request). The gather is transformers' own, as for ``sdpa``.
* ``continuous_batching=True`` (opt-in) wraps ``ContinuousBatchingManager.switch_to_cb_friendly_attn`` so that a
  model set to ``<name>`` or ``paged|<name>`` keeps attn_lt: transformers 5.24 otherwise refuses every name but
  ``paged|eager``, ``sdpa`` and flash ones ("Implementation attn_lt is not supported for continuous batching"), and
  5.17 would swap ``<name>`` for a flash implementation when one is installed. The manager then sets the form that
  version calls (``paged|<name>`` on 5.17, ``<name>`` on 5.24) and restores the original when it stops. Without
  the flag, 5.17 works with ``paged|<name>`` set explicitly.
* Sliding-window layers (gpt-oss, Gemma 2/3, Mistral), ``softcap`` and attention sinks (``s_aux``) run with
  :func:`attn_lt.attention`'s ``window``, ``softcap`` and ``sinks``. transformers keeps a sliding-window layer's
  keys in a ring of W slots a request (slot = position % W), which a block table cannot describe: on 5.17 such a
  layer lets transformers' own ``cache.update`` write the new keys and gather each request's last keys (as its
  ``paged|sdpa`` does), then runs varlen attention over them with the window; its full-attention layers attend in
  place as above. On 5.24 the layers gather their keys themselves in either case.
* Refused with ``ValueError`` before any GPU work: dropout > 0, ``output_attentions``, head dims other than 64,
  128 and 256 (or a value head dim unlike the query's), dtypes other than fp16/bf16, a non-causal layer, and
  transformers' flash-only decode fast path (a ``block_table`` argument; transformers enables it for flash
  implementations only). ``torch.compile`` of the step skips these functions (``torch.compiler.disable``).

Dense calls (``generate()``, a plain forward):

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
* The attention variants as the models pass them: ``sliding_window`` W (Mistral, Gemma 2/3, gpt-oss local layers:
  a query sees its last W positions) is attn_lt's ``window=(W - 1, W - 1)`` (the right edge is the causal one, or,
  in decode, past the last key), also where a mask encodes it, so that the key tiles outside the window are skipped
  rather than masked; ``softcap`` (Gemma 2) and ``s_aux`` (gpt-oss's sinks, one logit a query head, read as
  float32) are attn_lt's ``softcap`` and ``sinks``.
* Refused with ``ValueError``, as ``sdpa`` refuses or cannot do them: dropout > 0 (training),
  ``output_attentions``, ``head_mask``, ``position_bias``, packed sequences (``cu_seq_lens_q`` without continuous
  batching's ``write_index``) and a paged cache without continuous batching's metadata.

Returns ``(attn_output, None)``: attn_output (B, Sq, Hq, D) contiguous, in the input dtype.
"""

from __future__ import annotations

import functools
import logging
import weakref

import torch

from ..api import attention
from ..batch import BATCH_HEAD_DIMS

log = logging.getLogger("attn_lt")

#: The name :func:`register` uses by default: ``attn_implementation="attn_lt"``.
NAME = "attn_lt"
#: Options of :func:`attn_lt.attention` that :func:`register` can fix for every call.
OPTIONS = ("backend", "workspace_bytes", "threshold", "algo_policy")
#: Oldest transformers whose attention interface this adapter follows.
MIN_TRANSFORMERS = (4, 48)

_MASK_FLOAT_DTYPES_READ = (torch.float32,)  # besides q's own dtype (see attn_lt.attention)
#: Keyword arguments refused unless None, and what they ask for.
_REFUSED_WHEN_SET = {"head_mask": "a head mask", "position_bias": "a position bias"}
#: Every keyword argument :func:`_refuse` looks at (a call without any of them and without dropout skips it).
_CHECKED = frozenset(_REFUSED_WHEN_SET) | {"output_attentions", "cache", "cu_seq_lens_q", "write_index"}
#: The attention variants' keyword arguments (see :func:`_variants`).
_VARIANTS = frozenset({"sliding_window", "softcap", "s_aux"})


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
        raise ValueError(f"attn_lt's dense implementation got a paged cache ({type(cache).__name__}) without "
                         "continuous batching's metadata (cu_seq_lens_q, write_index); for continuous batching "
                         "register with attn_lt.integrations.transformers.register() and use 'paged|attn_lt' "
                         "(transformers 5.17) or 'attn_lt' (5.24); otherwise generate() with the default cache")
    if kwargs.get("cu_seq_lens_q") is not None:  # packed sequences (padding-free batches) outside continuous batching
        raise ValueError("this implementation takes padded (B, H, S, D) calls, not packed sequences (cu_seq_lens_q) "
                         "without continuous batching's write_index; use generate() with the default dynamic cache")


def _variants(kwargs: dict, window: int | None = None) -> dict:
    """attn_lt.attention's ``window``, ``softcap`` and ``sinks`` from transformers' ``sliding_window`` (or
    ``window``, the layer's W where the call does not pass it), ``softcap`` and ``s_aux`` (the ones given)."""
    out = {}
    given = kwargs.get("sliding_window")
    window = given if given is not None else window
    if window is not None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"sliding_window must be a positive int (keys a query sees), got {window!r}")
        out["window"] = (window - 1, window - 1)
    if kwargs.get("softcap") is not None:
        out["softcap"] = kwargs["softcap"]
    sinks = kwargs.get("s_aux")
    if sinks is not None:
        if not isinstance(sinks, torch.Tensor):
            raise TypeError(f"s_aux (attention sinks) must be a tensor of one logit a query head, got "
                            f"{type(sinks).__name__}")
        out["sinks"] = _float_sinks(sinks)
    return out


#: FP32 copies of sinks given in another dtype, by the tensor's id: (a weak reference to it, its version, the copy).
_FLOAT_SINKS: dict[int, tuple] = {}


def _float_sinks(sinks: torch.Tensor) -> torch.Tensor:
    """``s_aux`` as attn_lt reads sinks: FP32, contiguous (Hq,). A parameter in the model's dtype is converted once
    and the copy reused while the parameter is unchanged (its version), not on every layer's call."""
    if sinks.dtype == torch.float32 and sinks.dim() == 1 and sinks.is_contiguous():
        return sinks.detach()
    if torch.compiler.is_compiling():  # a conversion in the compiled graph (the cache below is the eager path's)
        return sinks.detach().reshape(-1).float().contiguous()
    hit = _FLOAT_SINKS.get(id(sinks))  # the caller's object (a parameter: the same one every call)
    if hit is not None and hit[0]() is sinks and hit[1] == sinks._version:
        return hit[2]
    copy = sinks.detach().reshape(-1).float().contiguous()
    if len(_FLOAT_SINKS) >= 1024:  # models come and go: forget the old ones
        _FLOAT_SINKS.clear()
    _FLOAT_SINKS[id(sinks)] = (weakref.ref(sinks), sinks._version, copy)
    return copy


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
            module docstring), the others (positions, cache positions) are not needed. A continuous-batching call
            (``cu_seq_lens_q`` with ``write_index``, transformers 5.24) goes to
            :func:`paged_attention_forward`'s path instead (packed (1, H, T, D) tensors, output (1, T, Hq, D)).

    Returns:
        ``(attn_output, None)``: attn_output (B, Sq, Hq, Dv) contiguous (Dv = value's head dim), query's dtype.

    Raises:
        ValueError: an unsupported feature, or a mask that is not 4-D; attn_lt's own TypeError/ValueError for bad
            shapes or dtypes, all before GPU work.
    """
    if dropout or not _CHECKED.isdisjoint(kwargs):  # one set operation on a decode step's hot path
        if is_continuous_batching_call(kwargs):  # transformers 5.24: the same name serves continuous batching
            return _continuous_batching_forward(module, query, key, value, dropout, scaling, is_causal, kwargs)
        _refuse(kwargs, dropout)
    variants = _variants(kwargs) if not _VARIANTS.isdisjoint(kwargs) else {}
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
        if Sq > 1:  # decode (Sq 1) sees every key (the window aside)
            causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
            if causal and Sk > Sq:
                # transformers leaves the mask out with Sk > Sq > 1 only for the prefill of an empty static cache,
                # whose keys past Sq are empty slots; its sdpa cuts them off (top-left causal), which we do by a
                # view as well.
                key, value = key[:, :, :Sq], value[:, :, :Sq]
    # (B, Sq, Hq, Dv) as transformers wants it, written so by the kernel: no transpose and no copy after the call
    out = attention(query, key, value, attn_mask=mask, causal=causal, scale=scaling, out_layout="bshd",
                    **variants, **(attn_lt_options or {}))
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


# ---- continuous batching ------------------------------------------------------------------------------------------

#: The dtypes continuous batching runs (the batch kernels'; head dims: attn_lt.batch.BATCH_HEAD_DIMS, MLA aside).
_CB_DTYPES = (torch.float16, torch.bfloat16)
#: BatchSteps (one a capacity) a cache group keeps before dropping the least recently used, unless a CUDA graph was
#: captured over one of its plans: a graph keeps pointers into its step's buffers, so then none is ever dropped.
MAX_STEPS = 32
#: Smallest capacities a step is made for (requests; keys are at least one block): fewer distinct steps.
_MIN_REQUESTS = 8


def is_continuous_batching_call(kwargs: dict) -> bool:
    """Whether an attention call comes from transformers' continuous batching: packed queries (``cu_seq_lens_q``)
    with the paged cache's write indices (``write_index``), which padding-free training batches do not have."""
    return kwargs.get("cu_seq_lens_q") is not None and kwargs.get("write_index") is not None


def _pow2(n: int, floor: int) -> int:
    return max(floor, 1 << max(0, int(n) - 1).bit_length())


def _layer_entry(x, what: str, layer_type: str = "full_attention"):
    """The ``layer_type`` entry of a per-layer-type dict (transformers' hybrid models), or x itself."""
    if isinstance(x, dict):
        if layer_type not in x:
            raise ValueError(f"continuous batching's {what} has no {layer_type!r} entry (it has {sorted(x)})")
        return x[layer_type]
    return x


def _host_int(kwargs: dict, names: tuple[str, ...], layer_type: str = "full_attention") -> int:
    for n in names:  # transformers 5.17: max_seqlen_q/k; 5.24: max_length_q/k
        if kwargs.get(n) is not None:
            return int(_layer_entry(kwargs[n], n, layer_type))
    raise ValueError(f"continuous batching's call lacks {' or '.join(names)} (the step's host-side capacity)")


def block_table_from_slots(slots: torch.Tensor, cu_seqlens_k: torch.Tensor, block_size: int,
                           max_seqlen_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The block table and key lengths of a continuous-batching step, on the device, from transformers' metadata.

    ``slots``: the cache rows transformers reads (``read_index[group]``, int64): request b's key j is row
    ``slots[cu_seqlens_k[b] + j]`` = ``block * block_size + j % block_size`` for the request's ``j // block_size``-th
    block (transformers 5.17 ``FullAttentionCacheAllocator.get_read_indices``: whole blocks in the request's order,
    then the partial last one), so its block j is ``slots[cu_seqlens_k[b] + j * block_size] // block_size``.
    ``cu_seqlens_k``: (B + 1,) offsets; ``max_seqlen_k``: a host int >= every request's keys.

    Returns ``(block_table, seqlens_k)``: int32 (B, ceil(max_seqlen_k / block_size)) and int32 (B,). Columns past
    a request's keys, and requests without keys (the padding sequences of CUDA-graph batches, whose offsets
    plateau; their slots are transformers' trash rows), hold block 0 and are never read. Tensor operations only:
    no host synchronisation (shapes come from host ints), so CUDA graphs can capture it.
    """
    B = cu_seqlens_k.shape[0] - 1
    width = max(1, -(-int(max_seqlen_k) // block_size))
    cu = cu_seqlens_k.to(torch.int64)
    seqlens = cu[1:] - cu[:-1]
    first_keys = torch.arange(width, dtype=torch.int64, device=cu.device) * block_size  # block j's first key
    if slots.numel() == 0:
        table = torch.zeros(B, width, dtype=torch.int32, device=cu.device)
    else:
        at = (cu[:-1, None] + first_keys).clamp_(0, slots.numel() - 1)
        blocks = torch.div(slots[at], block_size, rounding_mode="floor")
        table = torch.where(first_keys < seqlens[:, None], blocks, torch.zeros_like(blocks)).to(torch.int32)
    return table, seqlens.to(torch.int32)


def _make_step(max_requests: int, heads_q: int, heads_kv: int, head_dim: int, **kw):
    """A :class:`attn_lt.batch.BatchStep` (looked up at call time; the CPU tests replace this function)."""
    from ..batch import BatchStep

    return BatchStep(max_requests, heads_q, heads_kv, head_dim, **kw)


def _varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, **kw):
    """:func:`attn_lt.varlen_attention` (looked up at call time; the CPU tests replace this function)."""
    from ..batch import varlen_attention

    return varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, **kw)


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class StepPlanner:
    """The BatchSteps of one cache group: plans one when an engine step starts, hands it to each layer.

    A new engine step is recognised when the layer index does not increase (the first layer after the last), when
    the metadata tensors are other objects than the last call's, or when the step's host sizes change. The layer
    index is the signal that holds with CUDA graphs: transformers keeps its metadata in static tensors updated in
    place, and captures a graph by running an eager forward and then the captured one over the very same tensor
    objects, so neither data pointers nor object identity tell two steps apart there, while the layer index going
    back to the first layer does. (transformers 5.17 slices new views of its static tensors for every step, so
    object identity also changes between eager steps: an extra trigger, for callers whose steps do not start at
    the first layer.) Planning copies the step's metadata into the step's own buffers on the current stream (no
    sync), so a graph captured over a forward re-plans on every replay.

    Steps are made for capacities rounded up to powers of two (requests >= 8, query rows, keys >= one block) and
    kept: a captured graph points into its step's buffers.
    """

    def __init__(self, make_step=None, max_steps: int = MAX_STEPS):
        self._make = make_step  # None: the module's _make_step at call time
        self._steps: dict = {}  # capacity -> step; least recently used first
        self._max_steps = max_steps
        self._pinned = False  # a plan was captured in a CUDA graph: drop no step any more
        self._step = None
        self._last_layer = None
        self._last_objects: tuple = ()
        self._last_sizes: tuple = ()
        self.plans = 0  # steps planned (for tests and benchmarks)

    def step(self, layer_idx: int, cu_seqlens_q, cu_seqlens_k, slots, max_seqlen_q: int, max_seqlen_k: int, *,
             heads_q: int, heads_kv: int, head_dim: int, block_size: int, dtype, device):
        """The planned step for this layer's call (planning a new one when an engine step starts)."""
        objects = (cu_seqlens_q, cu_seqlens_k, slots)
        sizes = (cu_seqlens_q.shape[0], cu_seqlens_k.shape[0], slots.shape[0], int(max_seqlen_q),
                 int(max_seqlen_k), heads_q, heads_kv, head_dim, block_size, dtype, device)
        if (self._step is None or self._last_layer is None or layer_idx <= self._last_layer
                or sizes != self._last_sizes or any(a is not b for a, b in zip(objects, self._last_objects))):
            self._step = None  # a failed plan leaves nothing half planned
            self._step = self._plan(cu_seqlens_q, cu_seqlens_k, slots, int(max_seqlen_q), int(max_seqlen_k),
                                    heads_q, heads_kv, head_dim, block_size, dtype, device)
            self._last_objects, self._last_sizes = objects, sizes
        self._last_layer = layer_idx
        return self._step

    def _plan(self, cu_q, cu_k, slots, max_q, max_k, Hq, Hkv, D, block_size, dtype, device):
        B = cu_q.shape[0] - 1
        if B < 1 or cu_k.shape[0] != B + 1:
            raise ValueError(f"continuous batching's cu_seq_lens_q {tuple(cu_q.shape)} and cu_seq_lens_k "
                             f"{tuple(cu_k.shape)} must both hold B + 1 >= 2 offsets")
        table, seqlens = block_table_from_slots(slots, cu_k, block_size, max_k)
        capacity = (_pow2(B, _MIN_REQUESTS), 1 if max_q <= 1 else _pow2(max_q, 1), _pow2(max_k, block_size))
        key = (capacity, Hq, Hkv, D, block_size, dtype, device)
        if _capturing():
            self._pinned = True
        step = self._steps.pop(key, None)
        if step is None:
            make = self._make or _make_step
            step = make(capacity[0], Hq, Hkv, D, max_seqlen_q=capacity[1], max_seqlen_k=capacity[2],
                        block_size=block_size, dtype=dtype, device=device, causal=True)
            while not self._pinned and len(self._steps) >= self._max_steps:
                self._steps.pop(next(iter(self._steps)))
        self._steps[key] = step  # most recently used last
        step.plan(cu_q if cu_q.dtype == torch.int32 else cu_q.to(torch.int32), seqlens, table)
        self.plans += 1
        return step


#: The attribute of a paged cache holding attn_lt's {group index: StepPlanner}: tied to the cache's lifetime (a
#: finished generate_batch frees its steps with its cache) and to its identity.
PLANNERS_ATTR = "_attn_lt_planners"


def _planners(cache) -> dict:
    """attn_lt's {group index: StepPlanner} of a paged cache; the first sight of the cache, before attn_lt writes to
    it, zeroes it once: transformers 5.17 allocates it with torch.empty, and the Hopper prefill kernel reads a
    request's last block whole (masking the slots past its keys), which must hold finite values."""
    planners = getattr(cache, PLANNERS_ATTR, None)
    if planners is None:
        if _capturing():  # a zeroing captured would be replayed every step
            raise RuntimeError("attn_lt met this paged cache first inside a CUDA graph capture: it zeroes a new cache "
                               "and makes its steps' buffers on the first eager forward (transformers runs one before "
                               "it captures); run the model eagerly once first")
        for t in (*cache.key_cache, *cache.value_cache):
            t.zero_()
        planners = {}
        setattr(cache, PLANNERS_ATTR, planners)
    return planners


def _planner_for(cache, group: int) -> StepPlanner:
    planners = _planners(cache)
    planner = planners.get(group)
    if planner is None:
        planner = planners[group] = StepPlanner()
    return planner


def _refuse_continuous_batching(module, query, key, value, dropout, is_causal, kwargs: dict) -> None:
    """ValueError / TypeError for what attn_lt's continuous batching cannot do, before any GPU work."""
    def no(what: str):
        raise ValueError(f"attn_lt's continuous batching does not support {what}")

    if dropout:
        no(f"attention dropout (dropout={dropout}): run the model in eval mode (model.eval())")
    if kwargs.get("output_attentions"):
        no("output_attentions=True (it returns no attention weights): use 'paged|eager'")
    for name, what in _REFUSED_WHEN_SET.items():
        if kwargs.get(name) is not None:
            no(f"{what} ({name}=...): use the model's eager attention ('paged|eager')")
    if getattr(module, "sinks", None) is not None and kwargs.get("s_aux") is None:
        no("a layer's attention sinks that the call does not pass (s_aux): use 'paged|eager'")
    if is_causal is False or getattr(module, "is_causal", True) is False:
        no("non-causal layers")
    if kwargs.get("block_table") is not None:
        no("transformers' decode fast path (a block_table argument, which transformers enables for flash "
           "implementations only): set ContinuousBatchingConfig(max_blocks_per_request=0)")
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4 or query.shape[0] != 1 or key.shape[0] != 1:
        raise ValueError(f"continuous batching passes packed (1, heads, tokens, head_dim) tensors; got query "
                         f"{_shape(query)}, key {_shape(key)}, value {_shape(value)}")
    D = query.shape[-1]
    if D not in BATCH_HEAD_DIMS:
        no(f"head dim {D} (it runs {', '.join(map(str, BATCH_HEAD_DIMS))})")
    if key.shape[-1] != D or value.shape[-1] != D:
        no(f"head dims query {D}, key {key.shape[-1]}, value {value.shape[-1]} (all must be equal)")
    if query.dtype not in _CB_DTYPES or key.dtype != query.dtype or value.dtype != query.dtype:
        raise TypeError(f"attn_lt's continuous batching runs torch.float16 and torch.bfloat16; got query "
                        f"{query.dtype}, key {key.dtype}, value {value.dtype}")
    if query.shape[1] % key.shape[1] or value.shape[1] != key.shape[1]:
        raise ValueError(f"query heads {query.shape[1]} must be a multiple of kv heads {key.shape[1]} (value "
                         f"{value.shape[1]})")


def _layer_window(module, kwargs: dict) -> int | None:
    """The layer's sliding window W as transformers gives it (the call's ``sliding_window``, else the layer's)."""
    window = kwargs.get("sliding_window")
    return window if window is not None else getattr(module, "sliding_window", None)


def _paged_forward(module, query, key, value, scale, cache, kwargs: dict) -> torch.Tensor:
    """transformers 5.17's PagedAttentionCache: write the step's keys and values, attend in place in the cache (a
    full-attention layer) or over the keys transformers gathers from its ring (a sliding-window layer)."""
    layer = getattr(module, "layer_idx", None)
    if layer is None:
        raise ValueError("continuous batching needs the attention layer's layer_idx")
    ring = cache.sliding_windows.get(layer, 1)  # 1: a full-attention layer
    if ring != 1:
        return _ring_forward(module, query, key, value, scale, cache, layer, ring, kwargs)
    group, index_in_group = cache.layer_index_to_group_indices[layer]
    bs = int(cache.block_size)
    if bs < 8 or bs & (bs - 1):
        raise ValueError(f"the paged cache has blocks of {bs} tokens; attn_lt reads blocks of a power of two >= 8 "
                         "tokens: ContinuousBatchingConfig(block_size=...) (transformers' default is 256)")
    k_rows, v_rows = cache.key_cache[index_in_group], cache.value_cache[index_in_group]
    T, Hq, Hkv, D = query.shape[2], query.shape[1], key.shape[1], query.shape[3]
    if (tuple(k_rows.shape[1:]) != (Hkv, D) or tuple(v_rows.shape[1:]) != (Hkv, D) or k_rows.shape[0] % bs
            or k_rows.dtype != key.dtype or v_rows.dtype != value.dtype):
        raise ValueError(f"the paged cache's layer tensors {_shape(k_rows)} {k_rows.dtype} do not hold keys "
                         f"(rows, {Hkv}, {D}) {key.dtype} in blocks of {bs}")
    cu_q = kwargs["cu_seq_lens_q"]
    cu_k = _layer_entry(kwargs.get("cu_seq_lens_k"), "cu_seq_lens_k")
    if cu_k is None:
        raise ValueError("continuous batching's call lacks cu_seq_lens_k")
    max_q = _host_int(kwargs, ("max_seqlen_q", "max_length_q"))
    max_k = _host_int(kwargs, ("max_seqlen_k", "max_length_k"))
    write, read = kwargs["write_index"][group], kwargs["read_index"][group]
    if write.shape[0] != T:
        raise ValueError(f"write_index holds {write.shape[0]} rows for {T} new tokens")
    planner = _planner_for(cache, group)  # (zeroes a new cache first)
    # The step's new keys and values go where transformers' own PagedAttentionCache.update writes them.
    k_rows.index_copy_(0, write, key[0].transpose(0, 1))
    v_rows.index_copy_(0, write, value[0].transpose(0, 1))
    # No cache read this step (transformers then passes an empty read_index): every request is new and its keys are
    # its new rows, written at write_index in the same order (cu_seq_lens_k == cu_seq_lens_q).
    slots = read if read.numel() else write
    step = planner.step(layer, cu_q, cu_k, slots, max_q, max_k, heads_q=Hq, heads_kv=Hkv, head_dim=D,
                        block_size=bs, dtype=query.dtype, device=query.device)
    return step.run(query[0].transpose(0, 1), k_rows.view(-1, bs, Hkv, D), v_rows.view(-1, bs, Hkv, D),
                    scale=scale, **_variants(kwargs, _layer_window(module, kwargs)))


def _ring_forward(module, query, key, value, scale, cache, layer: int, ring: int, kwargs: dict) -> torch.Tensor:
    """A sliding-window layer of transformers 5.17: its cache group keeps each request's last ``ring`` keys in a
    ring (a key at position i in slot i % ring), which a block table cannot describe. transformers' own
    ``cache.update`` writes the new keys and gathers each request's keys in order (the cached ones read before the
    new ones overwrite them), as for its own paged implementations; varlen attention runs over them with the
    window."""
    window = _layer_window(module, kwargs)
    window = ring if window is None else window
    if window > ring:
        raise ValueError(f"the layer's sliding_window {window} is wider than its paged cache's ring of {ring} keys")
    _planners(cache)  # (zeroes a new cache before anything is written to it)
    keys, values = cache.update(key_states=key, value_states=value, layer_idx=layer,
                                read_index=kwargs["read_index"], write_index=kwargs["write_index"])
    return _varlen_over(query, keys, values, scale, kwargs, window, "sliding_attention")


def _gathered_forward(module, query, key, value, scale, kwargs: dict) -> torch.Tensor:
    """The layer gathered every request's keys (transformers 5.24's cache.update, which also picked the layer
    type's entries of the metadata): varlen attention over them."""
    return _varlen_over(query, key[0].transpose(0, 1), value[0].transpose(0, 1), scale, kwargs,
                        _layer_window(module, kwargs))


def _varlen_over(query, keys, values, scale, kwargs: dict, window: int | None,
                 layer_type: str = "full_attention") -> torch.Tensor:
    """Varlen attention of the step's packed queries (1, Hq, T, D) over each request's gathered keys and values
    (total_k, Hkv, D), causal within each request, with the ``layer_type`` entries of the metadata."""
    cu_k = _layer_entry(kwargs.get("cu_seq_lens_k"), "cu_seq_lens_k", layer_type)
    if cu_k is None:
        raise ValueError("continuous batching's call lacks cu_seq_lens_k")
    max_q = _host_int(kwargs, ("max_length_q", "max_seqlen_q"))
    max_k = _host_int(kwargs, ("max_length_k", "max_seqlen_k"), layer_type)
    return _varlen_attention(query[0].transpose(0, 1), keys, values, kwargs["cu_seq_lens_q"].to(torch.int32),
                             cu_k.to(torch.int32), max_seqlen_q=max(1, max_q), max_seqlen_k=max(1, max_k),
                             causal=True, scale=scale, **_variants(kwargs, window))


@torch.compiler.disable  # host-side step state and native launches: not for dynamo to trace
def _continuous_batching_forward(module, query, key, value, dropout, scaling, is_causal, kwargs: dict):
    _refuse_continuous_batching(module, query, key, value, dropout, is_causal, kwargs)
    scale = scaling if scaling is not None else getattr(module, "scaling", None)
    cache = kwargs.get("cache")
    if cache is not None and hasattr(cache, "key_cache") and hasattr(cache, "layer_index_to_group_indices"):
        out = _paged_forward(module, query, key, value, scale, cache, kwargs)
    else:
        out = _gathered_forward(module, query, key, value, scale, kwargs)
    return out.unsqueeze(0), None


def paged_attention_forward(module: torch.nn.Module | None, query: torch.Tensor, key: torch.Tensor,
                            value: torch.Tensor, attention_mask: torch.Tensor | None = None, dropout: float = 0.0,
                            scaling: float | None = None, is_causal: bool | None = None,
                            **kwargs) -> tuple[torch.Tensor, None]:
    """The ``paged|<name>`` implementation (transformers 5.17's continuous batching).

    Args:
        module: the attention layer (its ``layer_idx``; ``scaling`` when ``scaling`` is None).
        query: (1, Hq, T, D), the step's T packed query rows (fp16/bf16, D 64, 128 or 256).
        key, value: (1, Hkv, T, D), the step's new keys and values.
        attention_mask: ignored (transformers builds none for this name; continuous batching's mask is causal
            within each request, which attn_lt applies from the lengths).
        **kwargs: continuous batching's metadata: ``cache`` (``PagedAttentionCache``), ``cu_seq_lens_q``,
            ``cu_seq_lens_k``, ``max_seqlen_q``, ``max_seqlen_k``, ``read_index``, ``write_index``; refused
            features as in the module docstring.

    Returns ``(attn_output, None)``, attn_output (1, T, Hq, D); rows of padding tokens (no request's) are
    unspecified.
    """
    if not is_continuous_batching_call(kwargs):
        raise ValueError("'paged|attn_lt' was called without continuous batching's metadata (cu_seq_lens_q, "
                         "write_index, a paged cache): it serves generate_batch() and ContinuousBatchingManager; "
                         "use 'attn_lt' for a standard forward")
    return _continuous_batching_forward(module, query, key, value, dropout, scaling, is_causal, kwargs)


def _paged_prefix_convention() -> bool:
    """Whether this transformers names paged implementations ``paged|NAME`` (5.17: ``paged|sdpa`` is registered;
    5.24 keeps only ``paged|eager`` and calls ``NAME`` itself)."""
    try:
        from transformers import AttentionInterface
    except ImportError:
        return False
    return "paged|sdpa" in getattr(AttentionInterface, "_global_mapping", {})


def _allow_in_continuous_batching(name: str) -> bool:
    """Make ``ContinuousBatchingManager`` keep ``name`` / ``paged|name`` (see the module docstring). Returns False
    where transformers has no continuous batching."""
    try:
        from transformers.generation.continuous_batching.continuous_api import ContinuousBatchingManager
    except ImportError:
        return False
    current = ContinuousBatchingManager.switch_to_cb_friendly_attn
    names = getattr(current, "_attn_lt_names", None)
    if names is not None:  # already wrapped
        names.add(name)
        return True
    original = current

    @functools.wraps(original)
    def switch_to_cb_friendly_attn(self, model, *args, **kwargs):
        impl = model.config._attn_implementation
        base = impl.removeprefix("paged|") if isinstance(impl, str) else impl
        if base not in switch_to_cb_friendly_attn._attn_lt_names:
            return original(self, model, *args, **kwargs)
        target = f"paged|{base}" if _paged_prefix_convention() else base
        if target != impl:
            model.set_attn_implementation(target)
            self._original_attn_impl = impl  # restored by the manager's stop()
        return None

    switch_to_cb_friendly_attn._attn_lt_names = {name}
    ContinuousBatchingManager.switch_to_cb_friendly_attn = switch_to_cb_friendly_attn
    return True


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


def register(name: str = NAME, *, continuous_batching: bool = False, **options) -> str:
    """Register attn_lt with transformers under ``name``; then ``attn_implementation=name`` selects it.

    Registers :func:`attention_forward` (with ``options`` fixed, see :func:`make_attention_forward`) in
    ``transformers.AttentionInterface`` and, where transformers has one (>= 4.53), sdpa's mask builder in
    ``AttentionMaskInterface`` under the same name, so that masks are built exactly as for ``sdpa``: no mask at all
    for plain causal attention without padding (attn_lt applies causality itself), a 4-D bool mask otherwise.
    Older transformers build a dense additive mask for every implementation but ``sdpa``; it is read as given.

    Where transformers names paged implementations ``paged|NAME`` (5.17), also registers ``paged|<name>``
    (:func:`paged_attention_forward`; ``options`` do not apply to it) for continuous batching. On 5.24 ``<name>``
    itself serves continuous batching. ``continuous_batching=True`` lets transformers' ``ContinuousBatchingManager``
    keep this implementation (5.24 refuses unknown names without it; see the module docstring).

    Returns the name. Raises ImportError without transformers >= 4.48, TypeError for an unknown option.
    """
    if (not isinstance(name, str) or not name or name in ("eager", "sdpa") or "/" in name or "|" in name):
        raise ValueError(f"name must be a new implementation name without '/' or '|' (not eager or sdpa), got "
                         f"{name!r}")
    fn = make_attention_forward(**options)
    _transformers_version()
    try:
        from transformers import AttentionInterface
    except ImportError:  # transformers 4.48-4.50: a plain dict
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        ALL_ATTENTION_FUNCTIONS[name] = fn
    else:
        AttentionInterface.register(name, fn)
        if _paged_prefix_convention():  # no mask builder for it: transformers then builds no mask
            AttentionInterface.register(f"paged|{name}", paged_attention_forward)
    try:
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    except ImportError:  # before 4.53 every model builds its own 4-D mask
        pass
    else:
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    if continuous_batching and not _allow_in_continuous_batching(name):
        log.warning("this transformers has no ContinuousBatchingManager: continuous_batching=True does nothing")
    log.info("registered attn_lt as transformers attention implementation %r%s", name,
             f" with {options}" if options else "")
    return name
