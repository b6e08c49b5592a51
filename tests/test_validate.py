"""Input validation: wrong types, dtypes, shapes, heads, masks, strides, devices -> TypeError/ValueError that
name the shapes, raised before any GPU work (these run on CPU tensors)."""

import numpy as np
import pytest
import torch

import attn_lt
import attn_lt.api  # noqa: F401  (registers torch.ops.attn_lt.attention)
from attn_lt.validate import Case, check_tensors


def qkv(B=1, Hq=4, Hkv=2, Sq=8, Sk=16, D=64, dtype=torch.bfloat16, device="cpu"):
    return (torch.randn(B, Hq, Sq, D, dtype=dtype, device=device),
            torch.randn(B, Hkv, Sk, D, dtype=dtype, device=device),
            torch.randn(B, Hkv, Sk, D, dtype=dtype, device=device))


def test_valid_case_on_cpu_without_device_check():
    q, k, v = qkv()
    c = check_tensors(q, k, v, require_cuda=False)
    assert (c.B, c.Hq, c.Hkv, c.Sq, c.Sk, c.D, c.dtype, c.group) == (1, 4, 2, 8, 16, 64, "bf16", 2)
    assert c.scale == pytest.approx(64**-0.5)
    assert c.q_strides == (4 * 8 * 64, 8 * 64, 64, 1)


def test_cpu_tensors_rejected_naming_devices_and_shapes():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"CUDA device.*q \(1, 4, 8, 64\)"):
        attn_lt.attention(q, k, v)


@pytest.mark.parametrize("bad", ["float32", "mixed"])
def test_dtype_errors_are_type_errors(bad):
    q, k, v = qkv()
    if bad == "float32":
        q = q.float()
        with pytest.raises(TypeError, match="float32"):
            attn_lt.attention(q, k, v)
    else:
        with pytest.raises(TypeError, match="share one dtype"):
            attn_lt.attention(q, k.half(), v)


def test_non_tensor_rejected():
    _, k, v = qkv()
    with pytest.raises(TypeError, match="ndarray"):
        attn_lt.attention([1, 2], k, v)


@pytest.mark.parametrize("case,match", [
    (dict(q=(1, 4, 8)), r"4-D.*q \(1, 4, 8\)"),
    (dict(k=(1, 2, 16, 32), v=(1, 2, 16, 32)), "head dims differ"),
    (dict(k=(2, 2, 16, 64), v=(2, 2, 16, 64)), "batch sizes differ"),
    (dict(v=(1, 2, 15, 64)), "must agree in"),
    (dict(k=(1, 3, 16, 64), v=(1, 3, 16, 64)), r"Hq=4 must be a multiple of kv heads Hkv=3"),
    (dict(q=(1, 4, 0, 64)), "at least 1"),
])
def test_shape_errors_name_the_shapes(case, match):
    q, k, v = qkv()
    shapes = {"q": q, "k": k, "v": v}
    for name, shape in case.items():
        shapes[name] = torch.randn(*shape, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=match):
        attn_lt.attention(shapes["q"], shapes["k"], shapes["v"])


def test_last_dim_stride_must_be_one():
    q, k, v = qkv()
    q2 = torch.randn(1, 4, 8, 128, dtype=torch.bfloat16)[..., ::2]
    with pytest.raises(ValueError, match="stride 1"):
        attn_lt.attention(q2, k, v)


def test_overlapping_rows_rejected():
    q, k, v = qkv()
    k2 = torch.randn(1, 2, 1, 64, dtype=torch.bfloat16).expand(1, 2, 16, 64)
    with pytest.raises(ValueError, match="rows overlap"):
        attn_lt.attention(q, k2, v)


def test_bshd_transposed_view_accepted():
    q = torch.randn(2, 8, 4, 64, dtype=torch.bfloat16).transpose(1, 2)  # (B, H, S, D) view of (B, S, H, D)
    k = torch.randn(2, 16, 2, 64, dtype=torch.bfloat16).transpose(1, 2)
    c = check_tensors(q, k, k, require_cuda=False)
    assert c.q_strides == (8 * 4 * 64, 64, 4 * 64, 1)


@pytest.mark.parametrize("shape", [(8, 16), (1, 1, 8, 16), (4, 1, 16), (1, 4, 8, 1), (16,), (1, 1, 1, 16)])
def test_mask_broadcast_shapes_accepted(shape):
    q, k, v = qkv()
    c = check_tensors(q, k, v, torch.ones(shape, dtype=torch.bool), require_cuda=False)
    assert c.mask.kind == "bool" and c.mask.shape == shape
    full = torch.ones(shape, dtype=torch.bool).expand(1, 4, 8, 16)
    assert c.mask.strides == tuple(s if n > 1 else 0 for s, n in zip(full.stride(), full.shape))


@pytest.mark.parametrize("shape", [(8, 15), (2, 4, 8, 16), (3, 8, 16), (1, 1, 1, 8, 16)])
def test_mask_bad_shape(shape):
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"attn_mask \(" + ", ".join(map(str, shape)) + r"\)"):
        check_tensors(q, k, v, torch.zeros(shape, dtype=torch.bool), require_cuda=False)


def test_mask_dtype_errors():
    q, k, v = qkv()
    with pytest.raises(TypeError, match="torch.int64"):
        check_tensors(q, k, v, torch.zeros(8, 16, dtype=torch.int64), require_cuda=False)
    with pytest.raises(TypeError, match="float16"):
        check_tensors(q, k, v, torch.zeros(8, 16, dtype=torch.float16), require_cuda=False)
    check_tensors(q, k, v, torch.zeros(8, 16, dtype=torch.float32), require_cuda=False)  # fp32 is fine


def test_option_types():
    q, k, v = qkv()
    with pytest.raises(TypeError, match="causal"):
        check_tensors(q, k, v, causal=1, require_cuda=False)
    with pytest.raises(TypeError, match="scale"):
        check_tensors(q, k, v, scale="0.1", require_cuda=False)


def test_case_str_and_contiguous():
    c = Case.contiguous(2, 32, 8, 1, 4096, 128, causal=True)
    assert str(c) == "B2 Hq32 Hkv8 (GQA x4) Sq1 Sk4096 D128 bf16 causal"
    assert c.k_strides == (8 * 4096 * 128, 4096 * 128, 128, 1)


def test_custom_op_fake_gives_shapes_and_errors_on_meta_tensors():
    """The torch.library op behind torch.compile: shapes (and validation) without any device work."""
    q = torch.empty(2, 8, 33, 64, dtype=torch.bfloat16, device="meta")
    k = torch.empty(2, 2, 97, 64, dtype=torch.bfloat16, device="meta")
    out, lse, mass = torch.ops.attn_lt.attention(q, k, k, None, True, None, "auto", None, None, None)
    assert out.shape == (2, 8, 33, 64) and out.dtype == torch.bfloat16 and lse.shape == (2, 8, 33)
    assert lse.dtype == torch.float32 and mass.shape == (0,)
    # the variants, the mass and the output layout
    out, lse, mass = torch.ops.attn_lt.attention(q, k, k, None, True, None, "auto", None, None, None, [16, 0], 30.0,
                                                 None, True, 8, "bshd")
    assert out.shape == (2, 33, 8, 64) and mass.shape == (2, 8, 97) and mass.dtype == torch.float32
    # an LSE not asked for is an empty placeholder (the call keeps its LSE-free fast route)
    out, lse, mass = torch.ops.attn_lt.attention(q, k, k, None, True, None, "auto", None, None, None, return_lse=False)
    assert out.shape == (2, 8, 33, 64) and lse.shape == (0,) and mass.shape == (0,)
    with pytest.raises(ValueError, match="softcap must be positive"):
        torch.ops.attn_lt.attention(q, k, k, None, True, None, "auto", None, None, None, None, -1.0)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        torch.ops.attn_lt.attention(q, k[:, :1].expand(2, 3, 97, 64), k[:, :1].expand(2, 3, 97, 64), None, False,
                                    None, "auto", None, None, None)


def test_attention_traces_into_its_op_with_symbolic_lengths():
    """torch.export (torch.compile's graph capture) of attention() with a window and the mass per key, the query and
    key lengths dynamic: one op, traced on fake CUDA tensors without a GPU."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.export import Dim

    class Layer(torch.nn.Module):
        def forward(self, q, k):
            return attn_lt.attention(q, k, k, causal=True, window=(64, 0), return_key_mass=True)

    with FakeTensorMode():
        q, k = (torch.empty(2, h, s, 128, dtype=torch.bfloat16, device="cuda") for h, s in ((8, 33), (2, 97)))
        program = torch.export.export(Layer(), (q, k), dynamic_shapes=({2: Dim("Sq", min=2, max=65536)},
                                                                         {2: Dim("Sk", min=2, max=65536)}))
    assert program.graph_module.code.count("attn_lt.attention") == 1


def test_custom_op_fake_reads_no_data_pointer():
    """torch.compile traces with fake and functional tensors, which have no data pointer: the fake implementation
    (validation included) must not ask for one, MLA's v-in-k layout included."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def call(q, k):
        return torch.ops.attn_lt.attention(q, k, k[..., :48], None, True, None, "auto", None, None, None)

    q, k = torch.randn(2, 8, 33, 64, dtype=torch.bfloat16), torch.randn(2, 2, 97, 64, dtype=torch.bfloat16)
    graph = make_fx(torch.func.functionalize(call), tracing_mode="fake")(q, k)
    assert "attn_lt.attention" in graph.code


# ---- scale, causal and the path-independent options -------------------------------------------------------------

@pytest.mark.parametrize("scale", [float("nan"), float("inf"), -float("inf"), 0, 0.0, -1, -0.125])
def test_non_finite_or_non_positive_scale_rejected(scale):
    q, k, v = qkv()
    with pytest.raises(ValueError, match="scale must be a finite number > 0"):
        check_tensors(q, k, v, scale=scale, require_cuda=False)
    with pytest.raises(ValueError, match="scale"):  # the public call too, before any device check
        attn_lt.attention(q, k, v, scale=scale)


@pytest.mark.parametrize("scale", [0.125, 1, np.float32(0.5), np.float64(2.0)], ids=repr)
def test_real_scales_accepted(scale):
    q, k, v = qkv()
    assert check_tensors(q, k, v, scale=scale, require_cuda=False).scale == float(scale)


@pytest.mark.parametrize("causal", [True, False, np.bool_(True), np.bool_(False)], ids=repr)
def test_bool_like_causal_accepted(causal):
    q, k, v = qkv()
    c = check_tensors(q, k, v, causal=causal, require_cuda=False)
    assert c.causal is bool(causal)


@pytest.mark.parametrize("causal,name", [(1, "int"), (0, "int"), ("yes", "str"), (None, "NoneType"),
                                         (1.0, "float"), (torch.tensor(True), "Tensor"), (np.int64(1), "int64")],
                         ids=lambda x: repr(x) if not isinstance(x, str) else x)
def test_other_causal_values_rejected_with_a_sentence(causal, name):
    q, k, v = qkv()
    with pytest.raises(TypeError, match=rf"causal must be a bool, got {name}\b"):
        check_tensors(q, k, v, causal=causal, require_cuda=False)


@pytest.mark.parametrize("kw,exc,match", [
    (dict(workspace_bytes=0), ValueError, "workspace_bytes must be a positive int"),
    (dict(workspace_bytes=-5), ValueError, "workspace_bytes"),
    (dict(workspace_bytes=1.5e9), TypeError, "workspace_bytes must be a positive int or None, got float"),
    (dict(workspace_bytes=True), TypeError, "got bool"),
    (dict(workspace_bytes="1GiB"), TypeError, "got str"),
    (dict(threshold=0), ValueError, "threshold must be a positive int"),
    (dict(threshold="4096"), TypeError, "threshold"),
    (dict(out_layout="bsdh"), ValueError, r"out_layout must be one of \('bhsd', 'bshd'\), got 'bsdh'"),
])
def test_check_options_whatever_the_path(kw, exc, match):
    from attn_lt.validate import check_options

    case = Case.contiguous(1, 4, 4, 8, 16, 64)
    with pytest.raises(exc, match=match):
        check_options(case, **kw)
    check_options(case, workspace_bytes=1 << 20, threshold=4096)
    check_options(case)


def test_workspace_bytes_checked_on_the_short_path_too():
    """A case the fused path takes (short keys) still has its workspace_bytes checked."""
    q, k, v = qkv(Sk=128)
    with pytest.raises(ValueError, match="workspace_bytes"):
        attn_lt.explain(q, k, v, workspace_bytes=0)


def test_output_layouts_shapes_and_strides():
    """out_layout "bshd": the output (B, Sq, Hq, Dv), whose strides over (B, Hq, Sq, Dv) the kernels are given."""
    from attn_lt.chunks import out_strides
    from attn_lt.validate import check_out, out_shape

    case = Case.contiguous(2, 8, 2, 5, 40, 64, Dv=32)
    assert out_shape(case) == (2, 8, 5, 32) and out_shape(case, "bshd") == (2, 5, 8, 32)
    assert out_strides(case) == (8 * 5 * 32, 5 * 32, 32, 1)
    bshd = torch.empty(2, 5, 8, 32)
    assert out_strides(case, "bshd") == tuple(bshd.transpose(1, 2).stride())
    q = torch.empty(2, 8, 5, 64)
    check_out(bshd, case, q, "bshd")
    check_out(torch.empty(2, 8, 5, 32), case, q)
    with pytest.raises(ValueError, match=r"out must be a contiguous \(2, 5, 8, 32\)"):
        check_out(torch.empty(2, 8, 5, 32), case, q, "bshd")
    with pytest.raises(ValueError, match="out_layout"):
        attn_lt.explain(*qkv(), out_layout="BSHD")
