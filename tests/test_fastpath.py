"""The compiled fast path (native/fastpath.cpp, attn_lt.fastpath) without a GPU: CPU tensors, and a launcher in
Python (ctypes) that records what the extension passes it. It runs a remembered plan for the calls of its family
(everything of api.call_signature but the key length and the K/V strides) and options over the key range it was
given, passes each call's key length and K/V strides to the launcher (which refuses what its kernel cannot read),
and declines everything else (None: the Python path takes it)."""

import ctypes
import random
import types

import pytest
import torch

import attn_lt
from attn_lt import api, config, fastpath, native

pytestmark = pytest.mark.skipif(fastpath.call is None, reason=f"fast path not built here: {fastpath.status()}")

LAUNCH = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(native.FlashArgs), ctypes.c_void_p)
OPTIONS = (False, None, "auto", None, None, None, None, "bshd", None, None)  # causal ... softcap: attention()'s defaults
CALL_DEFAULTS = dict(attn_mask=None, causal=False, scale=None, backend="auto", return_lse=False, out=None,
                     workspace_bytes=None, threshold=None, algo_policy=None, return_key_mass=False,
                     key_mass_window=None, out_layout="bshd", window=None, softcap=None, sinks=None)


class Recorder:
    """A launcher: records each call's arguments (a copy of the struct and the stream); returns ``status``."""

    def __init__(self, status=0):
        self.calls, self.status = [], status
        self.fn = LAUNCH(self._launch)
        self.address = ctypes.cast(self.fn, ctypes.c_void_p).value

    def _launch(self, args, stream):
        self.calls.append((native.FlashArgs.from_buffer_copy(args.contents), stream))
        return self.status


def randn(*shape, dtype=torch.bfloat16):
    """Random values at a 256-byte aligned address, as CUDA's caching allocator gives (the CPU's gives 64): the
    family holds the addresses' alignment."""
    n = 1
    for s in shape:
        n *= s
    buf = torch.empty(n + 256, dtype=dtype)
    at = (-buf.data_ptr() % 256) // buf.element_size()
    return buf[at:at + n].view(shape).normal_()


def qkv(B=2, Hq=8, Hkv=2, Sq=1, Sk=100, D=64, dtype=torch.bfloat16, cache=256):
    """q (B, Hq, Sq, D) as transformers holds it (a (B, Sq, Hq, D) tensor transposed), k and v views of a cache
    of ``cache`` positions (a decode loop's)."""
    q = randn(B, Sq, Hq, D, dtype=dtype).transpose(1, 2)
    kc = randn(B, Hkv, cache, D, dtype=dtype)
    vc = randn(B, Hkv, cache, D, dtype=dtype)
    return q, kc[:, :, :Sk], vc[:, :, :Sk]


def template(Sk=100):
    a = native.FlashArgs()
    a.B, a.Hq, a.Hkv, a.Sq, a.Sk, a.D, a.Dv, a.scale, a.dtype, a.splits = 2, 8, 2, 1, Sk, 64, 64, 0.125, 2, 3
    return a


@pytest.fixture
def fp():
    """The fast path cleared before and after, and a launcher remembered for ``qkv()``'s family."""
    fastpath.clear()
    rec = Recorder()

    def remember(q, k, v, options=OPTIONS, keys=(64, 4096), launcher=None, stream=0, settings=None, sinks=None):
        settings = (config.current(),) if settings is None else settings
        out_shape = (q.shape[0], q.shape[2], q.shape[1], v.shape[3])
        fastpath.remember(q, k, v, sinks, options, settings, keys, fastpath.generation(), out_shape, bytes(template()),
                          launcher or rec.address, 4096, stream, 1 << 20, 2 << 20)

    yield types.SimpleNamespace(rec=rec, remember=remember)
    fastpath.clear()


def fast(q, k, v, **kw):
    a = dict(CALL_DEFAULTS, **kw)
    return fastpath.call(q, k, v, a["attn_mask"], a["causal"], a["scale"], a["backend"], a["return_lse"], a["out"],
                         a["workspace_bytes"], a["threshold"], a["algo_policy"], a["return_key_mass"],
                         a["key_mass_window"], a["out_layout"], a["window"], a["softcap"], a["sinks"])


def test_hit_launches_with_the_call_addresses_lengths_and_strides(fp):
    q, k, v = qkv()
    fp.remember(q, k, v)
    hits = fastpath.stats()["hits"]
    q2, k2, v2 = qkv(Sk=117)  # the next step: other tensors, one family, another key length
    out = attn_lt.attention(q2, k2, v2, out_layout="bshd")  # attention() offers the call to the fast path first
    assert out.shape == (2, 1, 8, 64) and out.dtype == q2.dtype and out.is_contiguous()
    assert fastpath.stats()["hits"] == hits + 1
    (a, stream), = fp.rec.calls
    assert stream is None or stream == 0
    assert (a.q, a.k, a.v, a.o) == (q2.data_ptr(), k2.data_ptr(), v2.data_ptr(), out.data_ptr())
    assert (a.lse, a.mask, a.o_part, a.lse_part) == (2 << 20, None, 1 << 20, (1 << 20) + 4096)
    assert a.Sk == 117 and (a.k_sb, a.k_sh, a.k_ss) == k2.stride()[:3] and (a.v_sb, a.v_sh, a.v_ss) == v2.stride()[:3]
    assert (a.B, a.Hq, a.Sq, a.D, a.splits) == (2, 8, 1, 64, 3)  # the rest is the remembered struct


@pytest.mark.parametrize("change", ["mask", "out", "return_lse", "return_key_mass", "causal", "scale", "backend",
                                    "workspace_bytes", "threshold", "algo_policy", "key_mass_window", "out_layout"])
def test_other_arguments_are_declined(fp, change):
    q, k, v = qkv()
    fp.remember(q, k, v)
    assert fast(q, k, v) is not None
    kw = {"mask": dict(attn_mask=torch.ones(1, 1, 1, 100, dtype=torch.bool)),
          "out": dict(out=torch.empty(2, 1, 8, 64, dtype=q.dtype)), "return_lse": dict(return_lse=True),
          "return_key_mass": dict(return_key_mass=True), "causal": dict(causal=True), "scale": dict(scale=0.1),
          "backend": dict(backend="wmma"), "workspace_bytes": dict(workspace_bytes=1 << 20),
          "threshold": dict(threshold=1024), "algo_policy": dict(algo_policy="cache"),
          "key_mass_window": dict(key_mass_window=4), "out_layout": dict(out_layout="bhsd")}[change]
    assert fast(q, k, v, **kw) is None
    assert len(fp.rec.calls) == 1


def test_equal_options_match_by_value(fp):
    q, k, v = qkv()
    fp.remember(q, k, v, options=(False, 0.125) + OPTIONS[2:])
    assert fast(q, k, v, scale=float("0.125")) is not None  # another float object, the same value
    assert fast(q, k, v, scale=0.25) is None


def test_key_range_and_v_length(fp):
    q, k, v = qkv(Sk=100)
    fp.remember(q, k, v, keys=(64, 200))
    for Sk, hit in ((63, False), (64, True), (200, True), (201, False)):
        _, k2, v2 = qkv(Sk=Sk)
        assert (fast(q, k2, v2) is not None) == hit, Sk
    _, k2, v2 = qkv(Sk=100)
    assert fast(q, k2, v2[:, :, :99]) is None  # v of another length: the Python path's validation says so
    fp.remember(q, k, v, keys=(1, float("inf")))
    _, k2, v2 = qkv(Sk=250, cache=300)
    assert fast(q, k2, v2) is not None


def test_family_is_the_plans_signature_but_the_keys(fp):
    """A call runs on a remembered plan exactly when its signature but the key length and the K/V strides
    (api.call_signature's first element) is the plan's."""
    base = qkv()
    fp.remember(*base)
    fam = api.call_signature(*base, None, 256)[0]
    q, k, v = base
    variants = {
        "same": (qkv()),
        "q (B, H, S, D)": (randn(2, 8, 1, 64), k, v),
        "B": qkv(B=3), "Hq": qkv(Hq=16), "Hkv": qkv(Hkv=4), "Sq": qkv(Sq=2), "D": qkv(D=128),
        "fp16": qkv(dtype=torch.float16),
        "k fp16": (q, k.half(), v), "v fp16": (q, k, v.half()),
        "q misaligned": (randn(2 * 8 * 64 + 8)[8:].view(2, 1, 8, 64).transpose(1, 2), k, v),
        "v is k": (q, k, k),
        "k heads of v": (q, k, randn(2, 4, 256, 64)[:, :2, :100]),
    }
    for name, (q2, k2, v2) in variants.items():
        same = api.call_signature(q2, k2, v2, None, 256)[0] == fam
        assert (fast(q2, k2, v2) is not None) == same, name
        assert same == (name in ("same", "k heads of v")), name


def test_kv_strides_are_the_launchers_to_accept(fp):
    """Each call's K/V strides (any, on random views) reach the launcher as the call's; a launcher that refuses them
    (its kernel cannot read them) sends the call to the Python path."""
    rnd = random.Random(7)
    buf = randn(1 << 16)
    q, k, v = qkv(B=2, Hkv=2, D=64)
    fp.remember(q, k, v, keys=(1, float("inf")))
    for _ in range(100):
        ks = tuple(rnd.choice((8, 16, 64, 72, 4, 12, 0)) * rnd.choice((1, 8, 64)) for _ in range(3)) + (1,)
        vs = tuple(rnd.choice((8, 64, 10)) * rnd.choice((1, 8)) for _ in range(3)) + (1,)
        k2 = buf.as_strided((2, 2, 5, 64), ks)
        v2 = buf[128:].as_strided((2, 2, 5, 64), vs)  # 256 bytes on: the family's alignment
        assert fast(q, k2, v2) is not None, (ks, vs)
        a = fp.rec.calls[-1][0]
        assert (a.Sk, a.k_sb, a.k_sh, a.k_ss, a.v_sb, a.v_sh, a.v_ss) == (5,) + ks[:3] + vs[:3]
    refusing = Recorder(status=1)  # any refusal (the launchers return ATTN_LT_ERR_STRIDES for these)
    fp.remember(q, k, v, keys=(1, float("inf")), launcher=refusing.address)
    assert fast(q, buf.as_strided((2, 2, 5, 64), (12, 4, 4, 1)), v[:, :, :5]) is None and len(refusing.calls) == 1


def test_settings_and_grad_and_clear(fp, monkeypatch):
    q, k, v = qkv()
    fp.remember(q, k, v)
    assert fast(q, k, v) is not None
    with config.override(threshold=2048):  # plans depend on the settings: new ones forget the launches
        assert fast(q, k, v) is None
        fp.remember(q, k, v)
        assert fast(q, k, v) is not None
    assert fast(q, k, v) is None
    fp.remember(q, k, v)
    monkeypatch.setenv("ATTN_LT_THRESHOLD", "2048")  # the environment read again: new settings
    assert fast(q, k, v) is None
    fp.remember(q, k, v, settings=(object(),))  # remembered under other settings than those in force
    assert fast(q, k, v) is None
    fp.remember(q, k, v)
    assert fast(q, k, v) is not None
    with torch.enable_grad():
        assert fast(q.detach().requires_grad_(), k, v) is None
        with torch.no_grad():
            assert fast(q.detach().requires_grad_(), k, v) is not None
    api.clear_plans()
    assert fastpath.stats()["entries"] == 0 and fast(q, k, v) is None


def test_a_failed_launch_forgets_the_entry(fp):
    q, k, v = qkv()
    bad = Recorder(status=1)
    fp.remember(q, k, v, launcher=bad.address)
    assert fast(q, k, v) is None and len(bad.calls) == 1  # the Python path launches again and raises CudaError
    assert fastpath.stats()["entries"] == 0


def test_recent_families_are_kept(fp):
    shapes = [dict(Hq=h) for h in (8, 16, 24, 32, 40, 48, 56, 64, 72)]
    for s in shapes:
        fp.remember(*qkv(**s))
    assert fastpath.stats()["entries"] == 8
    assert fast(*qkv(**shapes[0])) is None  # the oldest went
    for s in shapes[1:]:
        assert fast(*qkv(**s)) is not None
    fp.remember(*qkv(**shapes[-1]))  # the same family again replaces its entry
    assert fastpath.stats()["entries"] == 8


def test_switch_and_bad_arguments(fp):
    q, k, v = qkv()
    fp.remember(q, k, v)
    assert fastpath.set_enabled(False) is False and fastpath.call is None
    assert fastpath.set_enabled(True) is True and fastpath.call is not None and fastpath.stats()["entries"] == 1
    assert fast(q.float().numpy(), k, v) is None and fast(q[0], k, v) is None
    with pytest.raises(TypeError):
        fastpath.remember(q, k, v, None, OPTIONS[:3], (), (1, 2), 0, (1, 1, 1, 1), b"", 1, 0, 0, 0, 0)
    assert "on" in fastpath.status()


def test_cli_info_names_the_fast_path(capsys):
    from attn_lt import cli

    cli.main(["info"])
    assert "fast_path" in capsys.readouterr().out


def test_a_bound_plan_runs_exactly_its_own_layout(fp):
    """AttentionPlan.run's handle: its tensors' family, key length and K/V strides exactly, until clear()."""
    q, k, v = qkv(Sk=100)
    bind = lambda q, k, v, address: fastpath.bind(q, k, v, fastpath.generation(), (2, 1, 8, 64), bytes(template()),
                                                  address, 4096, 0, 1 << 20, 2 << 20)
    h = bind(q, k, v, fp.rec.address)
    q2, k2, v2 = qkv(Sk=100)  # new data, the same layout
    out = fastpath.run(h, q2, k2, v2)
    assert out is not None and out.shape == (2, 1, 8, 64)
    (a, _), = fp.rec.calls
    assert (a.q, a.k, a.v, a.o, a.Sk) == (q2.data_ptr(), k2.data_ptr(), v2.data_ptr(), out.data_ptr(), 100)
    for other in (qkv(Sk=101), qkv(Sk=100, cache=300), qkv(Sk=100, Hq=16), (q2, k2, k2)):
        assert fastpath.run(h, *other) is None  # plan.run's own check then raises ValueError
    fastpath.clear()  # the scratch moved, or the plans were cleared
    assert fastpath.run(h, q2, k2, v2) is None
    bad = Recorder(status=1)
    h = bind(q, k, v, bad.address)
    assert fastpath.run(h, q2, k2, v2) is None and fastpath.run(h, q2, k2, v2) is None
    assert len(bad.calls) == 1  # a handle whose launch failed is not tried again
    assert fastpath.run(object(), q2, k2, v2) is None
    with pytest.raises(TypeError):
        fastpath.bind(q, k, v, fastpath.generation(), (2, 1, 8), bytes(template()), fp.rec.address, 4096, 0, 0, 0)
    gen = fastpath.generation()
    fastpath.clear()  # e.g. another thread grew the scratch after these addresses were read
    assert fastpath.bind(q, k, v, gen, (2, 1, 8, 64), bytes(template()), fp.rec.address, 4096, 0, 0, 0) is None


class Sub(torch.Tensor):
    """A tensor subclass: the Python path keeps its semantics (__torch_function__), the fast path leaves it."""


def test_odd_tensors_and_options_are_left_to_the_python_path(fp):
    """Subclasses, sparse, functorch-wrapped tensors and options that are not None/bool/int/float/str are given
    back (None), never raised on or crashed on; remember takes nothing for them."""
    q, k, v = qkv()
    fp.remember(q, k, v)
    assert fast(q, k, v) is not None
    assert fast(q.as_subclass(Sub), k, v) is None and fast(q, k, v.as_subclass(Sub)) is None
    assert fast(q.to_sparse(), k, v) is None
    seen = []
    torch.func.vmap(lambda x: (seen.append(fast(x, k, v)), x)[1])(torch.stack([q, q]))  # a wrapper, no storage
    assert seen == [None]
    for bad in (torch.tensor(0.125), (0.125,), type("F", (float,), {})(0.125)):
        assert fast(q, k, v, scale=bad) is None, bad
    assert fast(q, k, v, causal=torch.tensor(False)) is None
    assert fast(q, k, v, return_lse=0) is None  # only False itself: anything else takes the Python path
    n = fastpath.stats()["entries"]
    fp.remember(q.as_subclass(Sub), k, v)  # after the Python path ran a subclass: nothing remembered, no error
    fp.remember(q, k, v, options=(False, torch.tensor(0.5)) + OPTIONS[2:])
    assert fastpath.stats()["entries"] == n
    fp.remember(q, k, v, options=(False, None, "auto", None, None, None, None, "bshd", None, None))  # equal: replaced
    assert fastpath.stats()["entries"] == n


def test_a_stale_or_missing_build_is_refused(tmp_path, monkeypatch):
    """The extension carries its sources' hash: one built from other sources is not loaded (nor a missing one)."""
    for name in ("attn_lt.h", "fastpath.cpp"):
        (tmp_path / name).write_bytes((native.SOURCE_DIR / name).read_bytes() + b"// changed\n")
    monkeypatch.setattr(native, "SOURCE_DIR", tmp_path)
    ext, why = fastpath._load()
    assert ext is None and "stale" in why and "make native" in why
    monkeypatch.setattr(fastpath, "extension_path", lambda: tmp_path / "_fastpath-none.so")
    ext, why = fastpath._load()
    assert ext is None and "not built" in why


def test_variants_window_softcap_and_sinks(fp):
    """A window (a tuple, matched by value), a softcap and sinks: a call runs on an entry remembered with the same
    window and softcap, and with sinks exactly when the entry was; the sinks' address reaches the launcher; sinks that
    are not FP32 (Hq,) on q's device are declined."""
    q, k, v = qkv()
    sinks = torch.randn(8)
    fp.remember(q, k, v, options=OPTIONS[:8] + ((128, 0), 30.0), sinks=sinks)
    assert fast(q, k, v, window=(128, 0), softcap=30.0, sinks=torch.randn(8)) is not None
    assert fp.rec.calls[-1][0].sinks is not None
    assert fast(q, k, v, window=(int("128"), 0), softcap=30.0, sinks=sinks) is not None  # equal by value
    for kw in (dict(window=(128, 0), softcap=30.0), dict(window=(64, 0), softcap=30.0, sinks=sinks),
               dict(window=[128, 0], softcap=30.0, sinks=sinks), dict(window=(128, 0), sinks=sinks),
               dict(window=(128, 0), softcap=30.0, sinks=torch.randn(8, dtype=torch.float64)),
               dict(window=(128, 0), softcap=30.0, sinks=torch.randn(4)),
               dict(window=(128, 0), softcap=30.0, sinks=torch.randn(8, 2)[:, 0])):
        assert fast(q, k, v, **kw) is None, kw
    fastpath.clear()
    fp.remember(q, k, v)
    assert fast(q, k, v, sinks=sinks) is None  # remembered without sinks
    assert fast(q, k, v) is not None and fp.rec.calls[-1][0].sinks is None
