"""References and error measures shared by the tests, ``attn-lt demo`` and the benchmarks in tools/.

The reference computes in float32 (or float64) from the same bf16/fp16 inputs, one (batch, head) at a time so
that its memory stays bounded; PyTorch SDPA at the input precision gives the error scale the tolerance is
measured against (``ours <= 2 * torch's + floor``).
"""

from __future__ import annotations

import math

import torch

#: Rounding floor added to twice PyTorch's error (relative L2).
ERROR_FLOOR = 1e-3


def random_qkv(B: int, Hq: int, Hkv: int, Sq: int, Sk: int, D: int, dtype: torch.dtype, layout: str = "bhsd",
               device="cuda") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fresh random q (B, Hq, Sq, D), k and v (B, Hkv, Sk, D); ``layout`` "bshd": each a transposed view of a
    (B, S, H, D) tensor, as models hold them."""
    if layout == "bshd":
        return (torch.randn(B, Sq, Hq, D, dtype=dtype, device=device).transpose(1, 2),
                torch.randn(B, Sk, Hkv, D, dtype=dtype, device=device).transpose(1, 2),
                torch.randn(B, Sk, Hkv, D, dtype=dtype, device=device).transpose(1, 2))
    if layout != "bhsd":
        raise ValueError(f"layout must be 'bhsd' or 'bshd', got {layout!r}")
    return (torch.randn(B, Hq, Sq, D, dtype=dtype, device=device),
            torch.randn(B, Hkv, Sk, D, dtype=dtype, device=device),
            torch.randn(B, Hkv, Sk, D, dtype=dtype, device=device))


def causal_mask(Sq: int, Sk: int, device=None) -> torch.Tensor:
    """Bool (Sq, Sk), True where query i may see key j: j <= i + Sk - Sq (bottom-right aligned)."""
    return window_mask(Sq, Sk, (-1, 0), device=device)


def window_mask(Sq: int, Sk: int, window, causal: bool = False, device=None) -> torch.Tensor:
    """Bool (Sq, Sk), True where query i may see key j under a window ``(left, right)`` (-1: unbounded) around its
    bottom-right aligned diagonal i + Sk - Sq; ``causal`` makes the right edge 0."""
    left, right = window
    d = torch.arange(Sk, device=device)[None, :] - (torch.arange(Sq, device=device)[:, None] + (Sk - Sq))
    ok = torch.ones(Sq, Sk, dtype=torch.bool, device=device)
    if left >= 0:
        ok &= d >= -left
    if causal:
        ok &= d <= 0
    elif right >= 0:
        ok &= d <= right
    return ok


def _probabilities(q, k, attn_mask, causal, scale, dtype, rows, window, softcap, sinks):
    """Per (b, h): (b, h, P, LSE) of the query rows ``rows`` computed in ``dtype``, P (rows, Sk) and 0 where a row
    sees no key (the sink's column, which joins each row's denominator, dropped)."""
    B, Hq, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    g = Hq // Hkv
    scale = D**-0.5 if scale is None else scale
    cm = window_mask(Sq, Sk, window or (-1, -1), causal, q.device)[rows] if causal or window else None
    mask = None if attn_mask is None else attn_mask.expand(B, Hq, Sq, Sk)
    for b in range(B):
        for h in range(Hq):
            s = (q[b, h, rows].to(dtype) @ k[b, h // g].to(dtype).T) * scale
            if softcap:
                s = softcap * torch.tanh(s / softcap)
            if mask is not None:
                m = mask[b, h, rows]
                s = s.masked_fill(~m, -math.inf) if m.dtype == torch.bool else s + m.to(dtype)
            if cm is not None:
                s = s.masked_fill(~cm, -math.inf)
            if sinks is not None:  # the sink's column joins the softmax, then is dropped
                s = torch.cat([s, sinks[h].to(dtype).expand(s.shape[0], 1)], dim=1)
            l = torch.logsumexp(s, dim=-1)
            p = torch.exp(s - torch.where(torch.isinf(l), torch.zeros_like(l), l)[:, None])
            yield b, h, p[:, :Sk], l


def reference(q, k, v, attn_mask=None, causal=False, scale=None, dtype=torch.float32, rows=None, window=None,
              softcap=None, sinks=None, p_e4m3: bool = False):
    """(out, lse) of attention computed in ``dtype``; fully masked rows give 0 and -inf (with sinks: 0 and the
    sink). ``rows``: a 1-D index tensor of query rows to compute, alone (out (B, Hq, len(rows), Dv)), for shapes too
    long to check in full. ``window``, ``softcap``, ``sinks``: the attention variants as attn_lt.attention takes
    them. ``p_e4m3``: P rounded to float8 e4m3 before P V as the FP8 prefill rounds it (exp(s - row max) times 2^8),
    the precision of that path."""
    B, Hq, Sq, _ = q.shape
    rows = torch.arange(Sq, device=q.device) if rows is None else rows
    out = torch.empty(B, Hq, len(rows), v.shape[-1], dtype=dtype, device=q.device)
    lse = torch.empty(B, Hq, len(rows), dtype=dtype, device=q.device)
    g = Hq // k.shape[1]
    for b, h, p, l in _probabilities(q, k, attn_mask, causal, scale, dtype, rows, window, softcap, sinks):
        if p_e4m3:
            top = p.amax(dim=-1, keepdim=True).clamp_min(1e-300)
            p = (p / top * 256).to(torch.float8_e4m3fn).to(dtype) * (top / 256)
        out[b, h] = p @ v[b, h // g].to(dtype)
        lse[b, h] = l
    return out, lse


def key_mass_reference(q, k, attn_mask=None, causal=False, scale=None, key_mass_window=None, window=None,
                       softcap=None, sinks=None, dtype=torch.float64):
    """The attention mass per key as ``attention(..., return_key_mass=True)`` defines it, computed in ``dtype``:
    (B, Hq, Sk), the sum over the query rows (the last ``key_mass_window``) of the probabilities."""
    B, Hq, Sq, _ = q.shape
    rows = torch.arange(0 if key_mass_window is None else max(0, Sq - key_mass_window), Sq, device=q.device)
    mass = torch.empty(B, Hq, k.shape[2], dtype=dtype, device=q.device)
    for b, h, p, _ in _probabilities(q, k, attn_mask, causal, scale, dtype, rows, window, softcap, sinks):
        mass[b, h] = p.sum(dim=0)
    return mass


def sdpa(q, k, v, attn_mask=None, causal=False, scale=None, backend=None):
    """PyTorch SDPA with attn_lt's semantics (bottom-right causal, GQA); ``backend`` forces an SDPA backend."""
    import torch.nn.functional as F

    Sq, Sk = q.shape[2], k.shape[2]
    is_causal = causal and Sq == Sk and attn_mask is None
    mask = attn_mask
    if causal and not is_causal:
        cm = causal_mask(Sq, Sk, q.device)
        if mask is None:
            mask = cm
        elif mask.dtype == torch.bool:
            mask = mask & cm
        else:
            mask = mask.masked_fill(~cm, -math.inf)
    gqa = q.shape[1] != k.shape[1]
    ctx = torch.nn.attention.sdpa_kernel(backend) if backend is not None else _null()
    with ctx:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale,
                                             enable_gqa=gqa)
    return torch.nan_to_num(out, nan=0.0) if mask is not None else out  # SDPA gives NaN for fully masked rows


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def rel_error(x: torch.Tensor, ref: torch.Tensor) -> float:
    """||x - ref|| / ||ref|| in float64; inf when x has a NaN or inf where ref is finite."""
    x64, r64 = x.double(), ref.double()
    if not torch.isfinite(x64[torch.isfinite(r64)]).all():
        return math.inf
    return ((x64 - r64).norm() / r64.norm().clamp_min(1e-30)).item()


def tolerance(torch_error: float) -> float:
    """The error attn_lt may have where PyTorch at the same precision has ``torch_error``."""
    if not math.isfinite(torch_error):
        raise ValueError(f"PyTorch's own error is {torch_error}: no meaningful tolerance")
    return 2 * torch_error + ERROR_FLOOR


def events_ms(fn, reps: int = 20) -> float:
    """Median milliseconds of ``reps`` calls of ``fn``, each between two CUDA events (after one warm-up call; no
    L2 flush: for repeated calls of one operation, as a serving loop makes them)."""
    import statistics

    fn()
    torch.cuda.synchronize()
    return statistics.median(event_ms(fn) for _ in range(reps))


def event_ms(fn) -> float:
    """Milliseconds of one call of ``fn`` between two CUDA events on the current stream."""
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    fn()
    e.record()
    e.synchronize()
    return s.elapsed_time(e)


def host_us(fn, calls: int = 100) -> float:
    """Host microseconds to issue one call of ``fn`` (:func:`host_us_each` of it alone)."""
    return host_us_each({"fn": fn}, calls)["fn"]


def host_us_rounds(fns: dict, calls: int | dict = 100, rounds: int = 5) -> dict:
    """Host microseconds to issue one call of each function of ``fns`` (name -> function), each round's: ``rounds``
    rounds, each a batch of ``calls`` calls (or ``calls[name]``) of every function in turn (the order reversed every
    other round), each batch queued behind a ~50 ms sleep kernel so that the launches only queue and the GPU's own
    time stays out of the figure. Side by side, so that a drifting host touches every function alike. Returns name
    -> the rounds' µs a call."""
    import time

    for fn in fns.values():
        for _ in range(5):
            fn()
    torch.cuda.synchronize()
    samples: dict = {name: [] for name in fns}
    for r in range(rounds):
        for name in (list(fns) if r % 2 == 0 else list(fns)[::-1]):
            fn, n = fns[name], calls[name] if isinstance(calls, dict) else calls
            torch.cuda._sleep(int(1e8))  # the GPU busy while the host issues the calls
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            samples[name].append((time.perf_counter() - t0) / n * 1e6)
            torch.cuda.synchronize()
    return samples


def host_us_each(fns: dict, calls: int | dict = 100, rounds: int = 5) -> dict:
    """The median of :func:`host_us_rounds`' rounds for each function: name -> µs a call."""
    import statistics

    return {name: round(statistics.median(v), 2) for name, v in host_us_rounds(fns, calls, rounds).items()}


#: How the timers here and in tools/ empty the L2 before a timed call. "read": a buffer larger than the L2 is read,
#: which leaves it full of clean lines that the call evicts at no cost. "write": the buffer is zeroed (triton's
#: do_bench), which leaves up to the L2's size of dirty lines whose write-back the timed call pays (docs/performance.md,
#: "The timer's L2 flush"): the flush's cost, not the call's.
L2_FLUSHES = ("read", "write")
#: The flush's buffer, MiB: several times the L2 of the GPUs attn_lt runs on (50-60 MiB).
L2_FLUSH_MIB = 256


def _check_flush(mode: str) -> None:
    if mode not in L2_FLUSHES:
        raise ValueError(f"the L2 flush must be one of {', '.join(L2_FLUSHES)}, got {mode!r}")


def l2_flusher(mode: str = "read", mib: int = L2_FLUSH_MIB):
    """A function that empties the L2 as ``mode`` (one of :data:`L2_FLUSHES`) says, through a ``mib`` MiB buffer
    taken now on the current device."""
    _check_flush(mode)
    buf = torch.zeros(mib << 20, dtype=torch.uint8, device="cuda")
    if mode == "write":
        return buf.zero_
    words, total = buf.view(torch.int64), torch.empty((), dtype=torch.int64, device="cuda")
    return lambda: torch.sum(words, dim=0, out=total)


def time_ms(fn, warmup_ms: float = 25, rep_ms: float = 200, flush: str = "read") -> float:
    """Median milliseconds of ``fn()`` between CUDA events, each call after an L2 flush (:func:`l2_flusher`): a first
    call, then the flush buffer is taken (a call that fits without it runs), five flushed calls give an estimate of a
    round, then ``warmup_ms`` of flushed calls (at least one) and as many timed ones as fit ``rep_ms`` (5 to 1000).
    The host queues them ahead of the GPU where its time a call is below the flush's and the call's."""
    _check_flush(flush)  # (before the first call)
    fn()
    torch.cuda.synchronize()
    flusher = l2_flusher(flush)
    est = sum(event_ms(lambda: (flusher(), fn())) for _ in range(5)) / 5  # flush included: what a round takes
    for _ in range(max(1, int(warmup_ms / max(est, 1e-3)))):
        flusher()
        fn()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(max(5, min(1000, int(rep_ms / max(est, 1e-3)))))]
    for s, e in events:
        flusher()
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    times = sorted(s.elapsed_time(e) for s, e in events)
    return times[len(times) // 2]


def time_turns(calls: dict, warmup_ms: float = 25, rep_ms: float = 200, turns: int = 2) -> dict:
    """Each of ``calls`` (name -> callable) timed by :func:`time_ms` in ``turns`` turns, every other turn in the
    reverse order, and its best median kept (a GPU's clocks drift with its load: timed in one order, the first of a
    run of power-bound calls comes out ahead); None for a call that ran out of memory."""
    best = dict.fromkeys(calls)
    for turn in range(turns):
        for name in list(calls)[::-1] if turn % 2 else list(calls):
            try:
                ms = time_ms(calls[name], warmup_ms, rep_ms)
            except torch.OutOfMemoryError:
                torch.cuda.empty_cache()
                continue
            best[name] = ms if best[name] is None else min(best[name], ms)
    return best


def time_interleaved(calls: dict, warmup_ms: float = 25, rep_ms: float = 200, flush_mib: int = L2_FLUSH_MIB,
                     gap_us: float = 500.0, seed: int = 0) -> dict:
    """Median milliseconds of each of ``calls`` (name -> callable), timed call by call in rounds (every call once a
    round, in an order shuffled each round), each between CUDA events after a ``gap_us`` pause of the GPU and then an
    L2 flush, so that the ratios between them share the GPU's clocks: no call always follows the same one (a
    power-bound call slows the next), and the host queues the rounds ahead of the GPU (its own time stays out).
    Rounds: ``rep_ms`` of the calls themselves (by the warm-up's times; the pauses and flushes come on top), at least
    5 and at most 1000. None for a call that ran out of memory (in its first call; the flush buffer is taken
    after)."""
    import random
    import time

    live = {}
    for name, fn in calls.items():
        try:
            fn()
            torch.cuda.synchronize()
            live[name] = fn
        except torch.OutOfMemoryError:
            torch.cuda.empty_cache()
    flush = l2_flusher("read", flush_mib)
    end = time.perf_counter() + warmup_ms / 1e3
    while live and time.perf_counter() < end:
        for fn in live.values():
            fn()
        torch.cuda.synchronize()
    round_ms = sum(event_ms(fn) for fn in live.values())
    rounds = max(5, min(1000, int(rep_ms / max(round_ms, 1e-3))))
    rng, names, pairs = random.Random(seed), list(live), []
    gap = int(gap_us * 2e3)  # GPU cycles at up to 2 GHz
    for _ in range(rounds if live else 0):
        rng.shuffle(names)
        for name in names:
            if gap:
                torch.cuda._sleep(gap)
            flush()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            live[name]()
            e.record()
            pairs.append((name, s, e))
    torch.cuda.synchronize()
    times: dict = {name: [] for name in live}
    for name, s, e in pairs:
        times[name].append(s.elapsed_time(e))
    return {name: (sorted(times[name])[len(times[name]) // 2] if name in times else None) for name in calls}


def attention_reference(q, k, v, *, attn_mask=None, causal=False, scale=None, return_lse=False,
                        dtype=torch.float64, **ignored):
    """``attn_lt.attention``'s signature and semantics in plain PyTorch, on any device and dtype, computed in
    ``dtype`` over the whole score matrix (small shapes): out (B, Hq, Sq, Dv) in q's dtype, lse float32
    (B, Hq, Sq); fully masked rows give 0 and -inf. The local attention of the CPU tests of
    ``attn_lt.distributed`` (its ``local_attention=``); options such as ``backend`` are accepted and ignored."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or q.shape[1] % k.shape[1] or k.shape[:3] != v.shape[:3]:
        raise ValueError(f"need q (B, Hq, Sq, D), k (B, Hkv, Sk, D), v (B, Hkv, Sk, Dv), Hq % Hkv == 0; got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    B, Hq, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    scale = D**-0.5 if scale is None else scale
    qg = q.to(dtype).reshape(B, Hkv, Hq // Hkv, Sq, D)
    s = (qg @ k.to(dtype)[:, :, None].transpose(-1, -2) * scale).reshape(B, Hq, Sq, Sk)
    if attn_mask is not None:
        m = attn_mask.expand(B, Hq, Sq, Sk)
        s = s.masked_fill(~m, -math.inf) if m.dtype == torch.bool else s + m.to(dtype)
    if causal:
        s = s.masked_fill(~causal_mask(Sq, Sk, q.device), -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.masked_fill(torch.isinf(lse), 0)[..., None])
    out = (p.reshape(B, Hkv, Hq // Hkv, Sq, Sk) @ v.to(dtype)[:, :, None]).reshape(B, Hq, Sq, v.shape[3])
    out, lse = out.to(q.dtype), lse.to(torch.float32)
    return (out, lse) if return_lse else out


def varlen_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, *, causal=False, scale=None, dtype=torch.float64):
    """(out, lse) of ``attn_lt.varlen_attention`` computed request by request in ``dtype`` with
    :func:`reference`: out (total_q, Hq, Dv) and lse (Hq, total_q), both in ``dtype``; a request without keys gives
    0 and -inf; rows no request owns are NaN. The offsets are read on the host (any device)."""
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    out = torch.full((q.shape[0], q.shape[1], v.shape[-1]), math.nan, dtype=dtype, device=q.device)
    lse = torch.full((q.shape[1], q.shape[0]), math.nan, dtype=dtype, device=q.device)
    for b in range(len(cq) - 1):
        q0, q1, k0, k1 = cq[b], cq[b + 1], ck[b], ck[b + 1]
        if q1 == q0:
            continue
        if k1 == k0:
            out[q0:q1], lse[:, q0:q1] = 0, -math.inf
            continue
        o, l = reference(q[q0:q1].transpose(0, 1)[None], k[k0:k1].transpose(0, 1)[None],
                         v[k0:k1].transpose(0, 1)[None], causal=causal, scale=scale, dtype=dtype)
        out[q0:q1], lse[:, q0:q1] = o[0].transpose(0, 1), l[0]
    return out, lse


def paged_gather(k_cache, v_cache, block_table, seqlens_k) -> tuple:
    """The keys of a paged cache packed request by request (host reads of the table and lengths): k, v
    (total_k, Hkv, D) and cu_seqlens_k int32 (B + 1,) on the cache's device."""
    bs = k_cache.shape[1]
    ks, vs, cu = [], [], [0]
    for row, n in zip(block_table.tolist(), seqlens_k.tolist()):
        blocks = torch.tensor(row[:-(-n // bs)], dtype=torch.long, device=k_cache.device)
        ks.append(k_cache[blocks].flatten(0, 1)[:n])
        vs.append(v_cache[blocks].flatten(0, 1)[:n])
        cu.append(cu[-1] + n)
    return torch.cat(ks), torch.cat(vs), torch.tensor(cu, dtype=torch.int32, device=k_cache.device)


def cu_seqlens(lengths, device="cuda") -> torch.Tensor:
    """The int32 (B + 1,) offsets of requests of ``lengths`` rows packed one after another, as ``cu_seqlens_q`` and
    ``cu_seqlens_k`` take them."""
    return torch.tensor([0] + torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist(), dtype=torch.int32,
                        device=device)


def varlen_key_mass_reference(q, k, cu_seqlens_q, cu_seqlens_k, *, causal=False, scale=None, key_mass_window=None,
                              window=None, softcap=None, sinks=None, dtype=torch.float64):
    """The mass per key of ``attn_lt.varlen_attention(..., return_key_mass=True)`` in ``dtype``, request by request
    with :func:`key_mass_reference`: (Hq, total_k); columns no request owns are 0. Offsets read on the host."""
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    mass = torch.zeros((q.shape[1], k.shape[0]), dtype=dtype, device=q.device)
    for b in range(len(cq) - 1):
        q0, q1, k0, k1 = cq[b], cq[b + 1], ck[b], ck[b + 1]
        if q1 > q0 and k1 > k0:
            mass[:, k0:k1] = key_mass_reference(q[q0:q1].transpose(0, 1)[None], k[k0:k1].transpose(0, 1)[None],
                                                causal=causal, scale=scale, key_mass_window=key_mass_window,
                                                window=window, softcap=softcap, sinks=sinks, dtype=dtype)[0]
    return mass


def paged_reference(q, k_cache, v_cache, block_table, seqlens_k, *, cu_seqlens_q=None, causal=True, scale=None,
                    dtype=torch.float64):
    """(out, lse) of ``attn_lt.paged_attention`` in ``dtype``: the cache gathered per request
    (:func:`paged_gather`), then :func:`varlen_reference`. q (B, Hq, D) without ``cu_seqlens_q``."""
    k, v, cu_k = paged_gather(k_cache, v_cache, block_table, seqlens_k)
    if cu_seqlens_q is None:
        cu_seqlens_q = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)
    return varlen_reference(q, k, v, cu_seqlens_q, cu_k, causal=causal, scale=scale, dtype=dtype)


def random_pages(seqlens: list[int], block_size: int, Hkv: int, D: int, dtype: torch.dtype, device="cuda",
                 spare_blocks: int = 3, generator: torch.Generator | None = None) -> tuple:
    """A random paged cache holding requests of ``seqlens`` keys: k_cache, v_cache (num_blocks, block_size, Hkv,
    D) with ``spare_blocks`` unused blocks, block_table int32 (B, max_blocks) whose ids are a random permutation
    (unused entries point at random valid blocks), seqlens_k int32 (B,)."""
    need = [-(-n // block_size) for n in seqlens]
    max_blocks = max(1, max(need))
    num = sum(need) + spare_blocks
    perm = torch.randperm(num, generator=generator).tolist()
    table = torch.randint(0, num, (len(seqlens), max_blocks), generator=generator, dtype=torch.int32)
    at = 0
    for b, n in enumerate(need):
        table[b, :n] = torch.tensor(perm[at:at + n], dtype=torch.int32)
        at += n
    k_cache = torch.randn(num, block_size, Hkv, D, dtype=dtype, device=device)
    v_cache = torch.randn(num, block_size, Hkv, D, dtype=dtype, device=device)
    return k_cache, v_cache, table.to(device), torch.tensor(seqlens, dtype=torch.int32, device=device)


def fp8_kv(x: torch.Tensor, groups: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., H, D) in float8 e4m3 the way serving engines store a KV cache and FlashAttention-3's FP8 forward
    takes its inputs: e4m3 elements and FP32 descale factors, one a head, or with ``groups`` one for each of that
    many runs of consecutive heads (a kv head's query heads: q of the FP8 prefill), the largest magnitude they
    cover mapped to e4m3's largest (448). Returns (x8, descale (groups,)); x8's values are :func:`fp8_values`."""
    H = x.shape[-2]
    groups = H if groups is None else groups
    runs = x.float().unflatten(-2, (groups, H // groups)).abs()
    amax = runs.amax(dim=tuple(d for d in range(runs.dim()) if d != runs.dim() - 3)).clamp_min(1e-12)
    descale = amax / 448.0
    return (x.float() / descale.repeat_interleave(H // groups)[:, None]).to(torch.float8_e4m3fn), descale


def fp8_values(x8: torch.Tensor, descale) -> torch.Tensor:
    """The FP32 values of x8 (..., H, D) in e4m3: elements times ``descale`` (None: 1; a number; one value; or one
    for each run of consecutive heads, :func:`fp8_kv`'s)."""
    x = x8.float()
    if descale is None:
        return x
    d = torch.as_tensor(descale, dtype=torch.float32, device=x.device)
    return x * (d.repeat_interleave(x.shape[-2] // d.numel())[:, None] if d.numel() > 1 else d.reshape(()))


def forced_flash(q, k, v, attn_mask=None, causal=False, splits: int = 1, kernel: str = "flash", window=None,
                 softcap=None, sinks=None):
    """The fused ``kernel`` forced — native/flash.cu ("flash", its keys split ``splits`` ways) or
    native/flash_sm90.cu ("sm90"; ``splits`` parts of the keys for MLA decode, else one) or its decode kernel
    ("sm90_decode", ``splits`` parts), with the attention variants ``window``, ``softcap``, ``sinks`` — for tests,
    benchmarks and sanitizer runs: returns ``(run, out, lse)``;
    ``run()`` launches without allocating.
    out, lse and the workspace are poisoned with NaN first, so that whatever the kernel leaves unwritten shows."""
    from .chunks import out_strides
    from .validate import check_tensors
    from .fused import MLA_DECODE, Program, fused_launch

    case = check_tensors(q, k, v, attn_mask, causal, window=window, softcap=softcap, sinks=sinks)
    split = kernel in ("flash", "sm90_decode") or (case.D, case.Dv) == MLA_DECODE
    launch = fused_launch(case, kernel=kernel, splits=splits if split else None)
    program = Program(case, out_strides(case), launch)
    out = torch.full((case.B, case.Hq, case.Sq, case.Dv), math.nan, dtype=q.dtype, device=q.device)
    lse = torch.full((case.B, case.Hq, case.Sq), math.nan, dtype=torch.float32, device=q.device)
    ws = torch.full((max(launch.workspace_bytes, 4) // 4,), math.nan, dtype=torch.float32, device=q.device)
    mask = 0 if attn_mask is None else attn_mask.data_ptr()

    def run():  # on the stream current at the call (a CUDA graph's capture stream, say)
        program.run(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr(),
                    torch.cuda.current_stream().cuda_stream, mask, ws.data_ptr(),
                    sinks=0 if sinks is None else sinks.data_ptr())

    return run, out, lse


def forced_flash_error(q, k, v, attn_mask=None, causal=False, splits: int = 1, kernel: str = "flash"):
    """One run of :func:`forced_flash` (synchronised) against the FP32 reference, for sanitizer scripts: returns
    ``(relative error, ok)``, ok when the error is below 2e-2 and neither the output nor the LSE holds a NaN."""
    run, out, lse = forced_flash(q, k, v, attn_mask, causal, splits, kernel)
    run()
    torch.cuda.synchronize()
    err = rel_error(out, reference(q, k, v, attn_mask, causal)[0])
    return err, bool(err < 2e-2 and not torch.isnan(lse).any() and not torch.isnan(out).any())


def scores_args(q: torch.Tensor, k: torch.Tensor, s: torch.Tensor, alpha: float):
    """The :class:`~attn_lt.native.ScoresArgs` of ``s = alpha * q @ k^T`` (native/scores_sm90.cu): q (batch, rows, D)
    and k (batch, cols, D) strided views with the last dimension contiguous, s (batch, rows, ld) FP32 whose first
    ``cols`` columns a row are the scores."""
    from . import native

    a = native.ScoresArgs()
    a.q, a.k, a.s = q.data_ptr(), k.data_ptr(), s.data_ptr()
    a.batch, a.rows, a.D = q.shape
    a.cols = k.shape[1]
    a.q_ld, a.q_bs, a.k_ld, a.k_bs = q.stride(1), q.stride(0), k.stride(1), k.stride(0)
    a.s_ld, a.s_bs = s.stride(1), s.stride(0)
    a.alpha = alpha
    a.dtype = native.DTYPE_CODES["bf16" if q.dtype == torch.bfloat16 else "fp16"]
    return a
