"""The examples' pure parts (CPU): SnapKV's choice of keys from the attention mass."""

import importlib.util
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")


def _example(name):
    path = Path(__file__).resolve().parent.parent / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_snap_indices_keep_the_window_and_the_largest_pooled_mass():
    snap = _example("snapkv_compress").snap_indices
    mass = torch.rand(2, 8, 300)
    idx, pooled = snap(mass, group=4, keep=40, window=16, kernel=5)
    assert idx.shape == (2, 2, 40)
    assert (idx[..., -16:] == torch.arange(284, 300)).all()  # the window's own keys, always kept
    assert (idx[..., :-16].diff(dim=-1) > 0).all() and (idx[..., :-16] < 284).all()
    # the chosen keys are those of the largest pooled mass of the group's summed heads
    summed = mass.view(2, 2, 4, 300).sum(2)[..., :284]
    ref = torch.nn.functional.avg_pool1d(summed, 5, stride=1, padding=2)
    assert torch.allclose(pooled, ref)
    for b in range(2):
        for h in range(2):
            chosen = ref[b, h, idx[b, h, :-16]]
            others = ref[b, h][~torch.isin(torch.arange(284), idx[b, h, :-16])]
            assert chosen.min() >= others.max()
