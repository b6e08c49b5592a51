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
    (["explain", "--backend", "wmma"], "not part of this build"),
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
