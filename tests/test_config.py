"""Settings: read once from the environment and checked there, reloaded on demand; test options set by override."""

import os

import pytest

from attn_lt import config


@pytest.mark.parametrize("name,value,message", [
    ("ATTN_LT_WORKSPACE_MB", "abc", "ATTN_LT_WORKSPACE_MB='abc' is not an integer"),
    ("ATTN_LT_WORKSPACE_MB", "0", "ATTN_LT_WORKSPACE_MB=0 must be between 1 and"),
    ("ATTN_LT_THRESHOLD", "1e3", "ATTN_LT_THRESHOLD='1e3' is not an integer"),
    ("ATTN_LT_TUNE_MS", "-5", "ATTN_LT_TUNE_MS=-5 must be between 1 and"),
    ("ATTN_LT_TUNE_CALL_MS", "9" * 5000, "ATTN_LT_TUNE_CALL_MS='9999"),
    ("ATTN_LT_ALGO_POLICY", "fast", "ATTN_LT_ALGO_POLICY='fast' must be one of"),
])
def test_a_bad_variable_is_named(name, value, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        config.from_environment({name: value})


def test_defaults_and_values():
    s = config.from_environment({"HOME": "/h"})
    assert (s.workspace_mb, s.threshold, s.algo_policy, s.tune_ms, s.tune_call_ms, s.lib) == \
        (1024, None, "tune", 200, 10000, None)
    assert str(s.cache_dir).endswith(os.path.join(".cache", "attn_lt"))
    s = config.from_environment({"ATTN_LT_WORKSPACE_MB": " 64 ", "ATTN_LT_THRESHOLD": "2048",
                                 "ATTN_LT_CACHE_DIR": "/x/y", "XDG_CACHE_HOME": "/ignored"})
    assert (s.workspace_mb, s.threshold, str(s.cache_dir)) == (64, 2048, "/x/y")
    assert str(config.from_environment({"XDG_CACHE_HOME": "/xdg"}).cache_dir) == "/xdg/attn_lt"


def test_read_once_until_reload(monkeypatch):
    before = config.current()
    os.environ["ATTN_LT_WORKSPACE_MB"] = "7"  # behind attn_lt's back: not read again on its own
    try:
        assert config.current() is before and config.workspace_bytes() == before.workspace_mb << 20
        config.reload()
        assert config.workspace_bytes() == 7 << 20
    finally:
        del os.environ["ATTN_LT_WORKSPACE_MB"]
        config.reload()
    assert config.current().workspace_mb == 1024


def test_reload_drops_attention_plans(monkeypatch):
    from attn_lt import api

    dropped = []
    monkeypatch.setattr(api, "_plans", type("P", (dict,), {"clear": lambda self: dropped.append(1)})())
    config.current()  # the settings plans are made under
    config.reload()
    assert dropped


def test_override_sets_test_options_and_restores():
    before = config.current()
    with config.override(lanes=1, softmax="row", key_tiles=False, qk="native") as s:
        assert config.current() is s and (s.lanes, s.softmax, s.key_tiles, s.qk) == (1, "row", False, "native")
        assert s.workspace_mb == before.workspace_mb
    assert config.current() is before
    for bad in ({"lanes": 3}, {"softmax": "fast"}, {"qk": "x"}, {"key_tiles": 1}, {"algo_policy": "x"}):
        with pytest.raises(ValueError, match="must be"):
            with config.override(**bad):
                pass
    assert config.current() is before


def test_overrides_left_out_of_order_keep_the_later_one():
    before = config.current()
    a, b = config.override(lanes=1), config.override(softmax="row")
    a.__enter__()
    inner = b.__enter__()
    a.__exit__(None, None, None)  # another thread's block ends first: it does not undo the later one
    assert config.current() is inner
    b.__exit__(None, None, None)
    assert config.current().lanes == 1  # what b found on entry
    config.reload()
    assert config.current().lanes == before.lanes


def test_a_tuning_budget_keeps_the_plans(monkeypatch):
    from attn_lt import api

    dropped = []
    monkeypatch.setattr(api, "_plans", type("P", (dict,), {"clear": lambda self: dropped.append(1)})())
    assert config.tune_call_ms() == 10000
    with config.tuning_budget(60000):
        assert config.tune_call_ms() == 60000
        with config.tuning_budget(0):
            assert config.tune_call_ms() == 0
    assert config.tune_call_ms() == 10000 and not dropped
    with pytest.raises(ValueError, match="tuning budget"):
        with config.tuning_budget(-1):
            pass


def test_settings_compare_by_identity():
    a, b = config.from_environment({}), config.from_environment({})
    assert a != b and a == a and hash(a) == hash(a) and len({a, b}) == 2


def test_commands_name_a_bad_variable(capsys, monkeypatch):
    from attn_lt import cli

    for argv in (["info"], ["explain", "-s", "1024"]):
        monkeypatch.setenv("ATTN_LT_TUNE_MS", "soon")
        assert cli.main(argv) == 2
        err = capsys.readouterr().err
        assert "ATTN_LT_TUNE_MS='soon' is not an integer" in err and "Traceback" not in err


def test_a_foreign_library_is_named_not_loaded(capsys, monkeypatch):
    import _ctypes

    from attn_lt import cli, native

    monkeypatch.setenv("ATTN_LT_LIB", _ctypes.__file__)  # a shared library, not attn_lt's
    native.load.cache_clear()
    try:
        assert cli.main(["info"]) == 0
        assert "is not an attn_lt library" in capsys.readouterr().out
        with pytest.raises(native.NativeLibraryError, match="not an attn_lt library"):
            native.load()
    finally:
        native.load.cache_clear()
