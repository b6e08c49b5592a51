"""The attn-lt command line without a GPU: subcommands, --json, exit codes that match what happened on disk,
argument errors as sentences, no traceback from any command, text from cache files escaped."""

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from attn_lt import cli
from attn_lt.cli import main

CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")  # what must never reach a terminal (\t and \n may)


def run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_info(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("ATTN_LT_CACHE_DIR", str(tmp_path))
    code, out, _ = run(capsys, "info", "--json")
    info = json.loads(out)
    assert code == 0 and info["workspace_budget_mib"] == 1024 and str(info["threshold"]).startswith("4096")
    assert info["cache"] == f"{tmp_path / 'algos.sqlite'} (0 entries)" and info["cache_state"] == "ok"
    assert os.listdir(tmp_path) == []  # read-only: the store is not created
    from conftest import native_unavailable_reason

    assert info["native_library"].startswith("ok" if native_unavailable_reason() is None else "unavailable")


def test_explain_text_and_json(capsys):
    code, out, _ = run(capsys, "explain", "-H", "32", "-s", "32768", "--causal")
    assert code == 0 and "backend: lt" in out and "plan:" in out
    code, out, _ = run(capsys, "explain", "--json", "-b", "8", "-H", "32", "--kv-heads", "8", "--sq", "1",
                       "--sk", "65536")
    d = json.loads(out)
    assert d["backend"] == "lt" and d["plan"]["fold_group"] is True and d["plan"]["chunks"] == 1


def test_explain_a_value_head_dim_of_its_own(capsys):
    """MLA prefill (D_qk 192, D_v 128) runs in the Hopper kernel when its row blocks do, else in the long path;
    MLA decode (576/512) only in the long path; explain says why."""
    code, out, _ = run(capsys, "explain", "-H", "128", "-s", "2048", "-d", "192", "--dv", "128", "--causal")
    assert code == 0 and "Dqk192 Dv128" in out and "backend: wmma" in out and "flash_sm90.cu" in out
    code, out, _ = run(capsys, "explain", "-H", "128", "--sq", "4", "--sk", "8192", "-d", "192", "--dv", "128")
    assert code == 0 and "backend: lt" in out and "more than 64 rows a kv head (4 here)" in out
    code, out, _ = run(capsys, "explain", "-d", "576", "--dv", "512", "--sq", "1", "--sk", "8192")
    assert code == 0 and "backend: lt" in out and "with v the first 512 columns of k's memory" in out
    code, out, _ = run(capsys, "explain", "-d", "576", "--dv", "512", "--v-in-k", "-H", "128", "--kv-heads", "1",
                       "--sq", "1", "--sk", "2048")
    assert code == 0 and "(v in k)" in out and "backend: wmma" in out and "MLA decode" in out
    code, out, _ = run(capsys, "explain", "-d", "96", "--dv", "64")
    assert code == 0 and "head dims 96/64 (q·k/v) not in (64, 128, 256, 192/128, 576/512)" in out
    code, out, _ = run(capsys, "explain", "--json", "-d", "576", "--dv", "512", "--sq", "1", "--sk", "8192")
    assert code == 0 and "Dqk576 Dv512" in json.loads(out)["case"]


def test_explain_lists_chunks(capsys):
    code, out, _ = run(capsys, "explain", "-s", "8192", "--workspace-mb", "64", "--chunks")
    assert code == 0 and out.count("entries ") > 4


def test_explain_ten_million_keys_fast(capsys):
    """Long keys are tiled; explain reads the plan's grid (shapes and counts) without listing its chunks."""
    import time

    t0 = time.perf_counter()
    code, out, _ = run(capsys, "explain", "-s", "10000000", "-H", "32", "--causal")
    elapsed = time.perf_counter() - t0
    assert code == 0 and "keys in tiles of" in out and "class qk" in out
    assert elapsed < 10  # well under a second on a workstation; generous for slow CI machines
    code, out, _ = run(capsys, "explain", "--workspace-mb", "1", "--seq", "1000000")  # a small budget: tiles too
    assert code == 0 and "keys in tiles of" in out


@pytest.mark.parametrize("argv,match", [
    (["explain", "--heads", "6", "--kv-heads", "4"], "multiple"),
    (["explain", "--backend", "wmma", "-d", "96"], "head dim 96"),
    (["explain", "--seq", "0"], "-s/--seq must be a positive integer, got '0'"),
    (["explain", "--sq", "0"], "--sq must be a positive integer, got '0'"),
    (["explain", "--sk", "0"], "--sk must be a positive integer, got '0'"),
    (["explain", "--kv-heads", "0"], "--kv-heads must be a positive integer, got '0'"),
    (["explain", "-b", "-2"], "-b/--batch must be a positive integer, got '-2'"),
    (["explain", "-d", "12.5"], "-d/--dim must be a positive integer, got '12.5'"),
    (["explain", "--dv", "0"], "--dv must be a positive integer, got '0'"),
    (["explain", "--workspace-mb", "x"], "--workspace-mb must be a positive integer, got 'x'"),
    (["explain", "--threshold", "0"], "--threshold must be a positive integer"),
    (["explain", "--dtype", "fp8"], "--dtype must be one of bf16, fp16; got 'fp8'"),
    (["explain", "--sq"], "--sq needs a value"),
    ([], "name a command: info, explain, explain-batch, demo, calibrate, cache"),
    (["cache"], "name a command: list, show, tune, clear, export, import, verify"),
    (["cache", "lisst"], "unknown command 'lisst'"),
    (["cache", "show"], "missing KEY"),
    (["calibrate", "--dims", "80"], "--dims takes 64 and/or 128 and/or 192 and/or 256"),
    (["calibrate", "--lengths", "1,x"], "--lengths takes positive integers"),
    (["cache", "verify", "--tolerance", "-1"], "--tolerance must be a number >= 0"),
    (["cache", "tune", "b=0"], "b must be a positive integer, got '0'"),
    (["cache", "tune", "b=1,h=x"], "h must be a positive integer, got 'x'"),
    (["cache", "tune", "b=1,bogus=3"], "unknown field 'bogus'"),
    (["cache", "tune", "causal=banana"], "causal takes no value, or one of"),
    (["cache", "tune", "b=1,b=2"], "b is given twice"),
    (["cache", "tune", ","], "is empty"),
], ids=lambda x: " ".join(x) if isinstance(x, list) else None)
def test_bad_arguments_exit_2_with_a_sentence(capsys, argv, match):
    code, out, err = run(capsys, *argv)
    assert code == 2 and match in err, err
    for raw in ("invalid literal", "required: cache_cmd", "invalid int value", "Traceback", "invalid choice"):
        assert raw not in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_demo_without_gpu_explains_and_prints_plan():
    r = subprocess.run([sys.executable, "-m", "attn_lt", "demo"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0
    assert "No CUDA GPU" in r.stdout and "plan:" in r.stdout and "B1 Hq16 Hkv16 Sq16384" in r.stdout
    assert "1 chunks" not in r.stdout


def test_unexpected_errors_are_one_line_and_debug_shows_the_traceback(capsys, monkeypatch):
    def boom(a):
        raise RuntimeError("the driver fell over")

    monkeypatch.setattr(cli, "cmd_info", boom)
    code, out, err = run(capsys, "info")
    assert code == 3 and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert "unexpected error: RuntimeError: the driver fell over" in err and "--debug" in err
    code, out, err = run(capsys, "--debug", "info")
    assert code == 3 and "Traceback" in err
    monkeypatch.setenv("ATTN_LT_DEBUG", "1")
    code, out, err = run(capsys, "info")
    assert code == 3 and "Traceback" in err


# ---- attn-lt cache, on a fixture cache ---------------------------------------------------------------------------

HOSTILE_TEXT = "\x1b[2J\x1b]0;pwned\x07\x9b31m"


@pytest.fixture
def fixture_cache(tmp_path, monkeypatch):
    from attn_lt.cache import AlgoCache, AlgoConfig, Entry, Env
    from attn_lt.lt.cublaslt import GemmKey

    monkeypatch.setenv("ATTN_LT_CACHE_DIR", str(tmp_path))
    c = AlgoCache(tmp_path / "algos.sqlite")
    env = Env("NVIDIA H200", "9.0", 132, 130100)
    for n in (4, 8):
        key = GemmKey("pv", "bf16", 128, n, 65536, 64, False, False, 128, 131072, 128, 8388608, 524288, 512, 256,
                      256, 256)
        c.put(env, key, Entry(AlgoConfig(21, splitk=n), 0.2, 0.3, 4096, (), "2026-11-20T23:00:00+00:00"))
    c.close()
    return tmp_path


def test_cache_list_and_show(capsys, fixture_cache):
    code, out, _ = run(capsys, "cache", "list", "--json")
    d = json.loads(out)
    assert code == 0 and len(d["entries"]) == 2 and d["entries"][0]["config"]["splitk"] in (4, 8)
    assert d["state"] == "ok" and d["skipped_rows"] == 0
    code, out, _ = run(capsys, "cache", "list")
    assert code == 0 and "2 entries" in out and "1.50x" in out
    key = d["entries"][0]["gemm"]
    code, out, _ = run(capsys, "cache", "show", key)
    assert code == 0 and "winner algo 21" in out
    code, out, _ = run(capsys, "cache", "show", key, "--json")
    assert json.loads(out)[0]["gemm"] == key
    code, _, err = run(capsys, "cache", "show", key.replace("n4", "n5"))
    assert code == 1 and "no entry" in err
    code, _, err = run(capsys, "cache", "show", "qk|nope")
    assert code == 2 and "malformed key" in err


def test_cache_export_import_clear(capsys, fixture_cache):
    dest = fixture_cache / "exported.json"
    code, out, _ = run(capsys, "cache", "export", str(dest))
    assert code == 0 and out.strip() == f"exported 2 entries to {dest}"
    code, out, _ = run(capsys, "cache", "clear")
    assert code == 0 and out.startswith(f"removed 2 entries from {fixture_cache / 'algos.sqlite'}; the file is now")
    assert "0 entries" in run(capsys, "cache", "list")[1]
    code, out, _ = run(capsys, "cache", "import", str(dest))
    assert code == 0 and "imported 2 entries" in out
    code, out, err = run(capsys, "cache", "export", "-")
    assert code == 0 and json.loads(out)["schema"] == "attn_lt.algo_cache" and "exported 2 entries" in err
    bad = fixture_cache / "bad.json"
    bad.write_text('{"schema": "attn_lt.algo_cache", "version": 99, "entries": {}}')
    code, _, err = run(capsys, "cache", "import", str(bad))
    assert code == 2 and "version 99" in err and "nothing was imported" in err
    os.mkfifo(fixture_cache / "fifo")
    code, _, err = run(capsys, "cache", "import", str(fixture_cache / "fifo"))  # refused, never hangs
    assert code == 2 and "FIFO" in err
    code, _, err = run(capsys, "cache", "export", str(fixture_cache / "fifo"))
    assert code == 2 and "FIFO" in err


def test_singular_messages(capsys, fixture_cache):
    from attn_lt.cache import AlgoCache

    c = AlgoCache(fixture_cache / "algos.sqlite")
    c.remove([(e, k) for e, k, _ in c.items()][:1])
    assert "1 entry" in run(capsys, "cache", "list")[1]
    assert run(capsys, "cache", "clear")[1].startswith("removed 1 entry from")


@pytest.mark.parametrize("how", ["dir-is-a-file", "symlink-loop", "directory"])
def test_unusable_store_no_traceback_and_commands_say_what_did_not_happen(capsys, tmp_path, monkeypatch, how):
    if how == "dir-is-a-file":
        (tmp_path / "file").write_text("x")
        monkeypatch.setenv("ATTN_LT_CACHE_DIR", str(tmp_path / "file"))
    else:
        monkeypatch.setenv("ATTN_LT_CACHE_DIR", str(tmp_path))
        if how == "symlink-loop":
            os.symlink(tmp_path / "algos.sqlite", tmp_path / "algos.sqlite")
        else:
            (tmp_path / "algos.sqlite").mkdir()
    src = tmp_path / "in.json"
    src.write_text('{"schema": "attn_lt.algo_cache", "version": 1, "entries": {}}')
    results = {}
    for argv in (["info"], ["explain", "-s", "8192"], ["cache", "list"], ["cache", "list", "--json"],
                 ["cache", "clear"], ["cache", "import", str(src)], ["cache", "export", str(tmp_path / "o.json")],
                 ["cache", "show", "role=qk"]):
        code, out, err = run(capsys, *argv)
        assert "Traceback" not in err and "Error:" not in err.split(":", 1)[0], (argv, err)
        results[" ".join(argv[:2])] = (code, out, err)
    assert results["info"][0] == 0 and "memory" in results["info"][1]
    assert results["explain -s"][0] == 0
    assert results["cache list"][0] == 0 and "memory" in results["cache list"][1]
    assert results["cache clear"][0] == 1 and "nothing was removed" in results["cache clear"][2]
    assert results["cache import"][0] == 1 and "nothing was imported" in results["cache import"][2]
    # an export that wrote nothing because the store cannot be read fails (a backup script must not take it for one)
    assert results["cache export"][0] == 1 and "nothing was exported" in results["cache export"][2]
    assert not (tmp_path / "o.json").exists()
    assert results["cache show"][0] == 1


def test_escape_sequences_from_cache_files_never_reach_the_terminal(capsys, tmp_path, monkeypatch):
    from attn_lt.cache import AlgoCache, AlgoConfig, Entry, Env

    monkeypatch.setenv("ATTN_LT_CACHE_DIR", str(tmp_path))
    c = AlgoCache(tmp_path / "algos.sqlite")
    env = Env("GPU" + HOSTILE_TEXT, "9.0", 132, 130100)
    c.put(env, {"role": "qk", "m": 1}, Entry(AlgoConfig(1), 0.1, 0.2, 0, (), "t" + HOSTILE_TEXT))
    c.close()
    bad = tmp_path / ("x" + HOSTILE_TEXT + ".json")
    bad.write_text('{"schema": "attn_lt.algo_cache", "version": 1, "entries": {"' + HOSTILE_TEXT.replace(
        "\x1b", "\\u001b").replace("\x07", "\\u0007").replace("\x9b", "\\u009b") + '": {}}}')
    for argv in (["cache", "list"], ["cache", "list", "--json"], ["cache", "show", "m=1|role=qk"], ["info"],
                 ["info", "--json"], ["explain", "-s", "8192"], ["cache", "import", str(bad)],
                 ["cache", "show", "m=1|role=" + HOSTILE_TEXT]):
        code, out, err = run(capsys, *argv)
        assert not CONTROL.search(out) and not CONTROL.search(err), (argv, out, err)
    code, out, _ = run(capsys, "cache", "show", "m=1|role=qk")
    assert code == 0 and "\\x1b[2J" in out  # shown, escaped


def test_cache_gpu_commands_check_shapes_before_needing_a_gpu(capsys, fixture_cache):
    code, _, err = run(capsys, "cache", "tune", "b=1,h=x")
    assert code == 2 and "must be a positive integer" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
@pytest.mark.parametrize("cmd", [["tune", "b=1,h=2,s=4096,d=64"], ["verify"]])
def test_cache_gpu_commands_without_gpu_exit_2(capsys, fixture_cache, cmd):
    code, _, err = run(capsys, "cache", *cmd)
    assert code == 2 and "needs a CUDA GPU" in err


def test_explain_shows_each_gemm(capsys, fixture_cache):
    code, out, _ = run(capsys, "explain", "--json", "-s", "8192")
    d = json.loads(out)
    assert code == 0 and {g["role"] for g in d["gemms"]} == {"qk", "pv"}
    assert all("class" in g and "algorithm" in g for g in d["gemms"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_calibrate_without_gpu_exits_2(capsys):
    code, _, err = run(capsys, "calibrate", "--dims", "64", "--lengths", "1024")
    assert code == 2 and "needs a CUDA GPU" in err
    code, _, err = run(capsys, "calibrate", "--dims", "80")
    assert code == 2 and "--dims" in err


def test_the_real_entry_point_never_prints_a_traceback(tmp_path):
    (tmp_path / "algos.sqlite").write_bytes(b"\x00" * 4096)
    env = dict(os.environ, ATTN_LT_CACHE_DIR=str(tmp_path))
    for argv in (["cache", "list"], ["cache"], ["explain", "--sq", "0"], ["cache", "import", "/dev/zero"], ["info"]):
        r = subprocess.run([sys.executable, "-m", "attn_lt", *argv], capture_output=True, text=True, env=env,
                           timeout=120)
        assert r.returncode in (0, 1, 2) and "Traceback" not in r.stderr, (argv, r.stderr)
    assert sorted(os.listdir(tmp_path)) == ["algos.sqlite"]  # read-only commands moved nothing
    r = subprocess.run([sys.executable, "-m", "attn_lt", "cache", "clear"], capture_output=True, text=True, env=env,
                       timeout=120)
    assert r.returncode == 0 and "moved it to algos.sqlite.bad-" in r.stderr, r.stderr  # a writing command says so
    assert list(tmp_path.glob("algos.sqlite.bad-*"))


def test_explain_batch(capsys):
    rc, out, _ = run(capsys, "explain-batch", "--requests", "64", "--max-seqlen-k", "8192", "--block-size", "16")
    assert rc == 0 and "paged batch" in out and "decode blocks" in out and "mass per key" not in out
    rc, out, _ = run(capsys, "explain-batch", "--requests", "64", "--max-seqlen-k", "8192", "--key-mass")
    assert rc == 0 and "mass per key (FP32 (Hq, total_k)" in out
    rc, out, _ = run(capsys, "explain-batch", "--requests", "64", "--max-seqlen-k", "8192", "--key-mass", "--json")
    assert rc == 0 and json.loads(out)["key_mass"].startswith("mass per key")
    rc, out, _ = run(capsys, "explain-batch", "--requests", "16", "--max-seqlen-q", "4096", "--max-seqlen-k", "16384",
                     "--json")
    d = json.loads(out)
    assert rc == 0 and d["kind"] == "varlen" and d["row_kernel"] in ("sm90", "flash")
    rc, _, err = run(capsys, "explain-batch", "--requests", "4", "--max-seqlen-k", "100", "--head-dim", "80")
    assert rc == 2 and "head dim 80" in err
    rc, out, _ = run(capsys, "explain-batch", "--requests", "64", "--heads-q", "128", "--heads-kv", "1", "--head-dim",
                     "576", "--head-dim-v", "512", "--max-seqlen-k", "8192", "--block-size", "64")
    assert rc == 0 and "MLA decode blocks" in out
    rc, out, _ = run(capsys, "explain-batch", "--requests", "64", "--max-seqlen-k", "8192", "--fp8-kv", "--json")
    assert rc == 0 and json.loads(out)["kv"].startswith("K/V: an FP8 KV cache")
    rc, out, _ = run(capsys, "explain-batch", "--requests", "8", "--heads-q", "128", "--heads-kv", "1", "--head-dim",
                     "576", "--head-dim-v", "512", "--max-seqlen-k", "8192", "--block-size", "64", "--fp8-kv", "--json")
    assert rc == 0 and json.loads(out)["kv"].startswith("K/V: an FP8 latent cache")
    rc, out, _ = run(capsys, "explain-batch", "--requests", "64", "--max-seqlen-k", "8192", "--fp8-kv",
                     "--max-seqlen-q", "8")  # 32 rows a kv head: two 16-row decode blocks on the FP8 bytes
    assert rc == 0 and "2 blocks of 16 rows a kv head" in out and "converted" not in out
    rc, out, _ = run(capsys, "explain-batch", "--requests", "64", "--max-seqlen-k", "8192", "--fp8-kv",
                     "--max-seqlen-q", "17", "--json")  # 68 rows a kv head: converted, then the 16-bit kernels
    assert rc == 0 and "converted to q's dtype first" in json.loads(out)["kv"]
    assert json.loads(out)["decode_rows"] == 16 and json.loads(out)["row_kernel"] == "sm90"
    rc, out, _ = run(capsys, "explain-batch", "--requests", "64", "--max-seqlen-k", "8192", "--max-seqlen-q", "5",
                     "--json")  # a 16-bit cache's speculative decoding: 20 rows a kv head, two decode blocks
    assert rc == 0 and json.loads(out)["decode_rows"] == 32 and json.loads(out)["row_kernel"] is None


def test_explain_the_attention_variants(capsys):
    code, out, _ = run(capsys, "explain", "-H", "64", "--kv-heads", "8", "-d", "64", "--sq", "1", "--sk", "32768",
                       "--causal", "--window", "127,0", "--sinks")
    assert code == 0 and "window(127, -1) sinks" in out and "backend: wmma" in out, out
    assert "native/flash.cu" in out, out  # the decode blocks run the variants (not the sm90 decode kernel)
    code, _, err = run(capsys, "explain", "--window", "a,b")
    assert code != 0 and "LEFT,RIGHT" in err


def test_explain_fp8(capsys):
    """--fp8 qkv: the FP8 prefill (e4m3 q, k, v); --fp8 kv: an FP8 KV cache read by the decode blocks; a head dim
    the FP8 prefill does not run is an error naming why."""
    code, out, _ = run(capsys, "explain", "-b", "2", "-H", "32", "--kv-heads", "8", "-s", "8192", "--causal",
                       "--fp8", "qkv")
    assert code == 0 and "e4m3 causal" in out and "FP8 wgmma" in out and "native/flash_sm90.cu" in out
    code, out, _ = run(capsys, "explain", "--json", "-H", "32", "--kv-heads", "8", "--sq", "1", "--sk", "8192",
                       "--fp8", "kv")
    d = json.loads(out)
    assert code == 0 and d["backend"] == "wmma" and "FP8 KV cache" in d["reasons"][0]
    code, _, err = run(capsys, "explain", "-s", "512", "-d", "96", "--fp8", "qkv")
    assert code == 2 and "head dims D = Dv 64, 128 or 256" in err
    code, out, _ = run(capsys, "explain", "-b", "4", "-H", "128", "--kv-heads", "1", "--sq", "1", "--sk", "4096", "-d",
                       "576", "--dv", "512", "--v-in-k", "--fp8", "kv")
    assert code == 0 and "FP8 latent cache" in out and "MLA decode" in out, out
