"""The attn-lt command line: subcommands, --json, exit codes, errors; without a GPU."""

import json
import subprocess
import sys

import pytest
import torch

from attn_lt.cli import main


def run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_info(capsys):
    code, out, _ = run(capsys, "info", "--json")
    info = json.loads(out)
    assert code == 0 and info["threshold"] == 4096 and info["workspace_budget_mib"] == 1024
    assert info["cache"].endswith("entries)")
    assert info["native_library"].startswith("ok")


def test_explain_text_and_json(capsys):
    code, out, _ = run(capsys, "explain", "-H", "32", "-s", "32768", "--causal")
    assert code == 0 and "backend: lt" in out and "plan:" in out
    code, out, _ = run(capsys, "explain", "--json", "-b", "8", "-H", "32", "--kv-heads", "8", "--sq", "1",
                       "--sk", "65536")
    d = json.loads(out)
    assert d["backend"] == "lt" and d["plan"]["fold_group"] is True and d["plan"]["chunks"] == 1


def test_explain_lists_chunks(capsys):
    code, out, _ = run(capsys, "explain", "-s", "8192", "--workspace-mb", "64", "--chunks")
    assert code == 0 and out.count("entries ") > 4


@pytest.mark.parametrize("argv,match", [
    (["explain", "--heads", "6", "--kv-heads", "4"], "multiple"),
    (["explain", "--backend", "wmma", "-d", "96"], "head dim 96 not in"),
    (["explain", "--seq", "0"], ">= 1"),
    (["explain", "--workspace-mb", "1", "--seq", "1000000"], "too small"),
])
def test_bad_arguments_exit_2_with_message(capsys, argv, match):
    code, _, err = run(capsys, *argv)
    assert code == 2 and match in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_demo_without_gpu_explains_and_prints_plan():
    r = subprocess.run([sys.executable, "-m", "attn_lt", "demo"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0
    assert "No CUDA GPU" in r.stdout and "plan:" in r.stdout and "B1 Hq16 Hkv16 Sq16384" in r.stdout


# ---- attn-lt cache, on a fixture cache ---------------------------------------------------------------------------

@pytest.fixture
def fixture_cache(tmp_path, monkeypatch):
    from attn_lt.cache import AlgoCache, AlgoConfig, Entry, Env
    from attn_lt.lt.cublaslt import GemmKey

    monkeypatch.setenv("ATTN_LT_CACHE_DIR", str(tmp_path))
    c = AlgoCache(tmp_path / "algos.json")
    env = Env("NVIDIA H200", "9.0", 132, 130100)
    for n in (4, 8):
        key = GemmKey("pv", "bf16", 128, n, 65536, 64, False, False, 128, 131072, 128, 8388608, 524288, 512, 256,
                      256, 256)
        c.put(env, key, Entry(AlgoConfig(21, splitk=n), 0.2, 0.3, 4096, (), "2026-11-20T23:00:00+00:00"))
    return tmp_path


def test_cache_list_and_show(capsys, fixture_cache):
    code, out, _ = run(capsys, "cache", "list", "--json")
    d = json.loads(out)
    assert code == 0 and len(d["entries"]) == 2 and d["entries"][0]["config"]["splitk"] in (4, 8)
    code, out, _ = run(capsys, "cache", "list")
    assert code == 0 and "2 entries" in out and "1.50x" in out
    key = d["entries"][0]["gemm"]
    code, out, _ = run(capsys, "cache", "show", key)
    assert code == 0 and "winner algo 21" in out
    code, out, _ = run(capsys, "cache", "show", key, "--json")
    assert json.loads(out)[0]["gemm"] == key
    code, _, err = run(capsys, "cache", "show", "qk|nope")
    assert code == 1 and "no entry" in err


def test_cache_export_import_clear(capsys, fixture_cache):
    dest = fixture_cache / "exported.json"
    assert run(capsys, "cache", "export", str(dest))[0] == 0
    assert run(capsys, "cache", "clear")[0] == 0
    assert "0 entries" in run(capsys, "cache", "list")[1]
    code, out, _ = run(capsys, "cache", "import", str(dest))
    assert code == 0 and "imported 2" in out
    bad = fixture_cache / "bad.json"
    bad.write_text('{"schema": "attn_lt.algo_cache", "version": 99, "entries": {}}')
    code, _, err = run(capsys, "cache", "import", str(bad))
    assert code == 2 and "version 99" in err


def test_cache_tune_checks_shapes_before_needing_a_gpu(capsys, fixture_cache):
    code, _, err = run(capsys, "cache", "tune", "b=1,h=x")
    assert code == 2 and "must be an integer" in err
    code, _, err = run(capsys, "cache", "tune", "b=1,bogus=3")
    assert code == 2 and "unknown field" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
@pytest.mark.parametrize("cmd", [["tune", "b=1,h=2,s=4096,d=64"], ["verify"]])
def test_cache_gpu_commands_without_gpu_exit_2(capsys, fixture_cache, cmd):
    code, _, err = run(capsys, "cache", *cmd)
    assert code == 2 and "needs a CUDA GPU" in err


def test_explain_shows_each_gemm(capsys, fixture_cache):
    code, out, _ = run(capsys, "explain", "--json", "-s", "8192")
    d = json.loads(out)
    assert code == 0 and {g["gemm"].split("|")[0] for g in d["gemms"]} == {"qk", "pv"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_calibrate_without_gpu_exits_2(capsys):
    code, _, err = run(capsys, "calibrate", "--dims", "64", "--lengths", "1024")
    assert code == 2 and "needs a CUDA GPU" in err
    code, _, err = run(capsys, "calibrate", "--dims", "80")
    assert code == 2 and "--dims" in err
