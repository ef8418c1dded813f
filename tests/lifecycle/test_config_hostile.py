"""Values that cannot work are refused when the config is built, each as a `ConfigError` naming
its dotted key (or the file), never later inside a save or a sync and never as another exception."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest

from lifecycle.boundary import NAME_MAX, PATH_MAX, role_problem
from lifecycle.config import (
    CONFIG_FILE_LIMIT,
    MAX_BUCKET_BYTES,
    MAX_TIMEOUT_S,
    MIN_BUCKET_BYTES,
    LifecycleConfig,
    OnDamaged,
)
from lifecycle.errors import ConfigError, EngineError

MESSAGE_LIMIT = 600
"""No error message quotes a value at length, whatever its size."""


def _error(data: object) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        LifecycleConfig.from_dict(data)  # type: ignore[arg-type]
    assert len(str(info.value)) < MESSAGE_LIMIT
    return info.value


def _yaml_error(path: Path) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        LifecycleConfig.from_yaml(path)
    assert info.value.key == str(path)
    assert str(info.value).startswith(f"{path}: ")
    return info.value


def _at(key: str, value: object) -> dict[str, Any]:
    """The nested mapping that sets the dotted `key` to `value`."""
    data: Any = value
    for part in reversed(key.split(".")):
        data = {part: data}
    return data


def _id(value: object) -> str | None:
    """A test id for a huge integer, whose digits pytest could not print."""
    return f"int{value.bit_length()}bits" if isinstance(value, int) and value.bit_length() > 64 else None


def _nested(depth: int, leaf: object = 1) -> object:
    value: object = leaf
    for i in range(depth):
        value = {"k": value} if i % 2 else [value]
    return value


# --- times and sizes ----------------------------------------------------------------------------


@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan"), 10**400, -(10**400)], ids=_id)
def test_a_timeout_that_is_not_a_finite_number_is_refused(value: float) -> None:
    err = _error({"engine": {"timeout_s": value}})
    assert err.key == "engine.timeout_s"
    assert "expected a finite number" in str(err)


def test_a_timeout_past_the_upper_bound_is_refused_and_the_bound_is_accepted() -> None:
    err = _error({"engine": {"timeout_s": MAX_TIMEOUT_S * 2}})
    assert (err.key, str(err)) == ("engine.timeout_s", f"engine.timeout_s: must be <= {MAX_TIMEOUT_S:g}, got 1209600.0")
    assert LifecycleConfig(engine={"timeout_s": MAX_TIMEOUT_S}).engine.timeout_s == MAX_TIMEOUT_S


def test_the_upper_timeout_fits_timedelta_and_threading_waits() -> None:
    import threading
    from datetime import timedelta

    assert timedelta(seconds=MAX_TIMEOUT_S) < timedelta.max
    assert MAX_TIMEOUT_S < threading.TIMEOUT_MAX


def test_the_engine_minimum_bucket_is_64_bytes_in_the_config_and_in_the_engines() -> None:
    from backends.engines.naive import NaiveEngine

    assert MIN_BUCKET_BYTES == 64
    assert _error({"engine": {"bucket_bytes": 63}}).key == "engine.bucket_bytes"
    assert LifecycleConfig(engine={"bucket_bytes": 64}).engine.bucket_bytes == 64
    with pytest.raises(EngineError, match="bucket_bytes must be in 64"):
        NaiveEngine(bucket_bytes=63)
    assert NaiveEngine(bucket_bytes=64).bucket_bytes == 64


@pytest.mark.parametrize(
    "value", [8, MIN_BUCKET_BYTES - 1, MAX_BUCKET_BYTES + 1, 2**70, 10**5000, -(10**5000)], ids=_id
)
def test_a_bucket_size_no_engine_can_use_is_refused(value: int) -> None:
    err = _error({"engine": {"bucket_bytes": value}})
    assert err.key == "engine.bucket_bytes"
    assert "must be >= 64" in str(err) or f"must be <= {MAX_BUCKET_BYTES}" in str(err)


@pytest.mark.parametrize("value", [MIN_BUCKET_BYTES, MAX_BUCKET_BYTES])
def test_the_bucket_size_bounds_are_accepted(value: int) -> None:
    assert LifecycleConfig(engine={"bucket_bytes": value}).engine.bucket_bytes == value


@pytest.mark.parametrize("value", [0, -1, -(10**5000), 10**19, 10**5000], ids=_id)
def test_keep_last_outside_one_to_the_step_limit_is_refused(value: int) -> None:
    assert _error({"checkpoint": {"keep_last": value}}).key == "checkpoint.keep_last"


def test_a_huge_integer_is_quoted_by_its_size_not_its_digits() -> None:
    err = _error({"checkpoint": {"keep_last": -(10**5000)}})
    assert str(err) == "checkpoint.keep_last: must be >= 1, got <integer of 16610 bits>"


@pytest.mark.parametrize(
    ("key", "value"),
    [("checkpoint.keep_last", True), ("engine.bucket_bytes", False), ("engine.timeout_s", True),
     ("engine.bucket_bytes", 1024.0), ("checkpoint.keep_last", "3"), ("checkpoint.fsync", 1),
     ("checkpoint.load.verify", "yes"), ("engine.verify", None)],
)
def test_a_value_of_the_wrong_type_is_refused_even_where_python_would_convert_it(key: str, value: object) -> None:
    err = _error(_at(key, value))
    assert err.key == key
    assert "expected a" in str(err)


# --- names and paths ----------------------------------------------------------------------------


@pytest.mark.parametrize("role", ["actor", "critic.v2", "_x", "..", ".", "", ".git", "-r", "a/b", "a\x00b",
                                  "a" * 128, "a" * 129, "ä", "a b", "A-9_z.1"])
def test_the_config_accepts_a_role_exactly_when_the_checkpoint_store_would(role: str) -> None:
    data = {"checkpoint": {"roles": [role]}}
    if role_problem(role) is None:
        assert LifecycleConfig.from_dict(data).checkpoint.roles == [role]
    else:
        err = _error(data)
        assert err.key == "checkpoint.roles"
        assert str(err) == f"checkpoint.roles: item 0: {role_problem(role)}"


PATH_KEYS = ["checkpoint.root", "checkpoint.pre_load.path", "resume.path", "engine.profile_dir"]


def _with_path(key: str, value: object) -> dict[str, Any]:
    data = _at(key, value)
    if key == "resume.path":
        data["resume"]["mode"] = "path"
    return data


@pytest.mark.parametrize("key", PATH_KEYS)
@pytest.mark.parametrize(
    ("value", "words"),
    [("", "empty path"), ("a\x00b", "NUL byte"), ("/ckpt/\ud800", "cannot be encoded"),
     ("/" + "a" * PATH_MAX, f"longer than {PATH_MAX}"), ("/x/" + "a" * (NAME_MAX + 1), f"longer than {NAME_MAX}")],
)
def test_a_path_that_cannot_name_a_folder_is_refused(key: str, value: str, words: str) -> None:
    err = _error(_with_path(key, value))
    assert err.key == key
    assert words in str(err)


@pytest.mark.parametrize("key", PATH_KEYS)
def test_ordinary_paths_are_accepted(key: str) -> None:
    for value in ("/ckpt", "relative/dir", "./x", "../up", "/" + "a" * NAME_MAX, "/ckpt/\udc80"):
        cfg = LifecycleConfig.from_dict(_with_path(key, value))
        assert LifecycleConfig.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize("backend", ["gloo\x00", "pkg.mod:Engine\x00", "pkg\x00.mod:Engine", "pkg.mod:Eng\nine"])
def test_an_engine_name_with_a_control_character_is_refused(backend: str) -> None:
    err = _error({"engine": {"backend": backend}})
    assert err.key == "engine.backend"
    assert "\x00" not in str(err) and "\n" not in str(err)


# --- shapes -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "key"),
    [({1: "x"}, "1"), ({None: "x"}, "None"), ({True: "x"}, "True"), ({(1, 2): "x"}, "(1, 2)"),
     ({"checkpoint": {3: 1}}, "checkpoint.3"), ({"checkpoint": {"save": {None: "hf"}}}, "checkpoint.save.None"),
     ({"engine": {b"backend": "gloo"}}, "engine.b'backend'")],
)
def test_a_key_that_is_not_a_string_is_refused_by_its_place(data: dict[Any, Any], key: str) -> None:
    err = _error(data)
    assert err.key == key
    assert "a key must be a string" in str(err)


@pytest.mark.parametrize(
    ("key", "shown"), [("", "''"), (" ", "' '"), ("a\x00b", "'a\\x00b'"), ("line\nbreak", "'line\\nbreak'")]
)
def test_an_unknown_key_is_quoted_when_it_would_not_read_as_a_key(key: str, shown: str) -> None:
    err = _error({"engine": {key: 1}})
    assert err.key == f"engine.{shown}"
    assert str(err).startswith(f"engine.{shown}: unknown key; valid keys: apply, ")


def test_a_huge_unknown_key_is_shortened() -> None:
    err = _error({"engine": {"x" * 10_000: 1}})
    assert err.key.startswith("engine.'xxx") and "..." in err.key and len(err.key) < 100


@pytest.mark.parametrize(
    ("key", "value"),
    [("checkpoint.roles", b"actor"), ("checkpoint.roles", bytearray(b"ab")), ("checkpoint.roles", {"actor"}),
     ("checkpoint.roles", {"actor": 1}), ("checkpoint.save.contents", "model"), ("checkpoint.root", b"/ckpt"),
     ("checkpoint.root", ["/ckpt"]), ("resume.mode", ["auto"]), ("engine.apply", {"atomic": True})],
)
def test_a_list_mapping_or_bytes_where_another_shape_belongs_is_refused(key: str, value: object) -> None:
    assert _error(_at(key, value)).key == key


@pytest.mark.parametrize("section", ["checkpoint", "checkpoint.load", "resume", "engine"])
@pytest.mark.parametrize("value", [["a", "b"], "text", 3, b"x"])
def test_a_section_that_is_not_a_mapping_is_refused_by_its_place(section: str, value: object) -> None:
    err = _error(_at(section, value))
    assert err.key == section


@pytest.mark.parametrize("key", ["checkpoint.root", "checkpoint.roles", "checkpoint.save.format", "engine.timeout_s"])
def test_a_value_nested_far_deeper_than_the_config_tree_is_an_error_about_its_key(key: str) -> None:
    err = _error(_at(key, _nested(sys.getrecursionlimit() * 3)))
    assert err.key == key


def test_a_section_nested_far_deeper_than_the_config_tree_is_an_unknown_key() -> None:
    err = _error({"checkpoint": {"k": _nested(sys.getrecursionlimit() * 3, leaf={})}})
    assert str(err).startswith("checkpoint.k: unknown key; valid keys: fsync, keep_last, ")
    err = _error({"checkpoint": [_nested(sys.getrecursionlimit() * 3, leaf={})]})
    assert err.key == "checkpoint"
    assert "expected a mapping for section checkpoint" in str(err)


def test_self_referencing_values_are_refused_without_recursion() -> None:
    loop: list[Any] = []
    loop.append(loop)
    table: dict[str, Any] = {}
    table["checkpoint"] = table
    assert _error({"checkpoint": {"roles": loop}}).key == "checkpoint.roles"
    assert _error(table).key == "checkpoint.checkpoint"


def test_a_huge_string_is_not_quoted_whole() -> None:
    assert _error({"engine": {"rollout_dtype": "x" * (1 << 20)}}).key == "engine.rollout_dtype"
    assert _error({"checkpoint": {"root": "x" * (1 << 20)}}).key == "checkpoint.root"


def test_a_section_changed_after_construction_is_checked_again_when_used() -> None:
    cfg = LifecycleConfig()
    cfg.engine.timeout_s = float("inf")
    with pytest.raises(ConfigError, match=r"^engine\.timeout_s: expected a finite number"):
        LifecycleConfig.coerce(cfg)
    with pytest.raises(ConfigError, match=r"^engine\.timeout_s: expected a finite number"):
        LifecycleConfig(engine=cfg.engine)


# --- resume.on_damaged --------------------------------------------------------------------------


def test_on_damaged_defaults_to_fallback_and_accepts_refuse() -> None:
    assert LifecycleConfig().resume.on_damaged is OnDamaged.FALLBACK
    cfg = LifecycleConfig.from_dict({"resume": {"on_damaged": "refuse"}})
    assert cfg.resume.on_damaged is OnDamaged.REFUSE
    assert cfg.to_dict()["resume"]["on_damaged"] == "refuse"
    assert LifecycleConfig.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize("value", ["skip", "Fallback", True, None, ["refuse"]])
def test_an_unknown_on_damaged_lists_the_two_choices(value: object) -> None:
    err = _error({"resume": {"on_damaged": value}})
    assert err.key == "resume.on_damaged"
    assert "expected one of fallback, refuse, got " in str(err)


def test_on_damaged_is_exported_and_builds_a_config() -> None:
    import lifecycle.config

    exported = {name: getattr(lifecycle.config, name) for name in lifecycle.config.__all__}  # as `import *` does
    cfg = exported["LifecycleConfig"](resume={"on_damaged": exported["OnDamaged"].REFUSE})
    assert cfg.resume.on_damaged is OnDamaged.REFUSE
    assert {"MIN_BUCKET_BYTES", "MAX_BUCKET_BYTES", "MAX_TIMEOUT_S"} <= exported.keys()


# --- YAML files ---------------------------------------------------------------------------------


def _file(tmp_path: Path, content: bytes) -> Path:
    path = tmp_path / "lifecycle.yaml"
    path.write_bytes(content)
    return path


def test_a_file_that_is_not_utf8_is_an_error_naming_the_file(tmp_path: Path) -> None:
    err = _yaml_error(_file(tmp_path, b"engine:\n  backend: gl\xffoo\n"))
    assert "not UTF-8 text: cannot decode byte 21 (0xff)" in str(err)


@pytest.mark.parametrize(
    "text", [b"[" * 10_000, b"{a: " * 10_000, b"- " * 10_000 + b"x", b"a: " + b"[" * 40 + b"]" * 40]
)
def test_yaml_nested_too_deeply_is_refused_by_the_parser_naming_the_file(tmp_path: Path, text: bytes) -> None:
    assert "not valid YAML: nested deeper than 32 levels" in str(_yaml_error(_file(tmp_path, text)))


def test_yaml_nested_as_deep_as_a_config_needs_parses(tmp_path: Path) -> None:
    path = _file(tmp_path, b"checkpoint: {save: {contents: [model]}}\n")
    assert LifecycleConfig.from_yaml(path).checkpoint.save.contents == ["model"]


@pytest.mark.parametrize(
    "text", [b"checkpoint: {keep_last: 2001-13-45}\n", b"checkpoint: {keep_last: " + b"1" * 5000 + b"}\n"]
)
def test_a_yaml_value_the_parser_cannot_build_is_an_error_naming_the_file(tmp_path: Path, text: bytes) -> None:
    assert "a value cannot be read" in str(_yaml_error(_file(tmp_path, text)))


@pytest.mark.parametrize(("text", "says"), [
    (b"resume: {mode: disable}\ncheckpoint: {keep_last: 3}\nresume: {strict: false}\n",
     "key 'resume' is given twice"),
    (b"checkpoint:\n  keep_last: 10\n  keep_last: 2\n", "key 'keep_last' is given twice"),
    (b"checkpoint: {keep_last: 010}\n", "'010' is an ambiguous integer"),
    (b"watchdog: {save_s: 1:30}\n", "'1:30' is an ambiguous integer"),
    (b"watchdog: {save_s: 1:30.5}\n", "'1:30.5' is an ambiguous number"),
], ids=["section-twice", "key-twice", "octal", "base-60", "base-60-float"])
def test_yaml_that_would_silently_mean_something_else_is_refused_naming_the_file(
    tmp_path: Path, text: bytes, says: str,
) -> None:
    """PyYAML keeps the last of a key given twice (the second `resume` dropped the first's
    `mode: disable`), reads 010 as 8 and 1:30 as 90."""
    assert says in str(_yaml_error(_file(tmp_path, text)))


def test_yaml_merge_keys_and_plain_integers_still_parse(tmp_path: Path) -> None:
    path = _file(tmp_path, b"base: &b {keep_last: 4, fsync: true}\ncheckpoint: {<<: *b, keep_last: 0x10}\n")
    from lifecycle.config_file import read_yaml

    assert read_yaml(str(path)) == {"base": {"keep_last": 4, "fsync": True}, "checkpoint": {"keep_last": 16, "fsync": True}}
    nested = _file(tmp_path, b"base: &base {keep_last: 1}\ncheckpoint: {save: &save {<<: *base, keep_last: 3}}\n"
                             b"other: {<<: *save}\n")  # a merge source with merges of its own, flattened first
    assert read_yaml(str(nested))["other"] == {"keep_last": 3}


def test_a_file_past_the_size_limit_is_refused_unread(tmp_path: Path) -> None:
    err = _yaml_error(_file(tmp_path, b"#" * (CONFIG_FILE_LIMIT + 1)))
    assert f"larger than {CONFIG_FILE_LIMIT} bytes" in str(err)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_a_fifo_at_the_path_is_refused_instead_of_blocking(tmp_path: Path) -> None:
    path = tmp_path / "lifecycle.yaml"
    os.mkfifo(path)
    assert "a FIFO, not a regular file" in str(_yaml_error(path))


def test_a_folder_at_the_path_is_refused(tmp_path: Path) -> None:
    assert "a folder, not a regular file" in str(_yaml_error(tmp_path))


def test_a_symlinked_config_file_is_read_through_its_link(tmp_path: Path) -> None:
    target = _file(tmp_path, b"engine: {timeout_s: 5}\n")
    link = tmp_path / "link.yaml"
    link.symlink_to(target)
    assert LifecycleConfig.from_yaml(link).engine.timeout_s == 5.0


def test_a_symlink_loop_is_an_error_naming_the_file(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").symlink_to(tmp_path / "b.yaml")
    (tmp_path / "b.yaml").symlink_to(tmp_path / "a.yaml")
    _yaml_error(tmp_path / "a.yaml")


@pytest.mark.parametrize("name", ["", "bad\x00name.yaml"])
def test_a_config_path_that_names_no_file_is_an_error(name: str) -> None:
    with pytest.raises(ConfigError, match="cannot read config file"):
        LifecycleConfig.from_yaml(name)


def test_a_utf8_byte_order_mark_is_accepted(tmp_path: Path) -> None:
    path = _file(tmp_path, b"\xef\xbb\xbfengine: {timeout_s: 6}\n")
    assert LifecycleConfig.from_yaml(path).engine.timeout_s == 6.0


@pytest.mark.parametrize(
    ("text", "key"),
    [(b"1: x\n", "1"), (b"null: x\n", "None"), (b"checkpoint: {root: ''}\n", "checkpoint.root"),
     (b"checkpoint: {roles: ['..']}\n", "checkpoint.roles"), (b"engine: {timeout_s: .inf}\n", "engine.timeout_s"),
     (b"engine: {timeout_s: .nan}\n", "engine.timeout_s"), (b"engine: {bucket_bytes: 8}\n", "engine.bucket_bytes"),
     (b"engine: {bucket_bytes: 0x400000000000000000}\n", "engine.bucket_bytes"),
     (b"checkpoint: {root: !!binary YWJj}\n", "checkpoint.root"),
     (b"checkpoint: &a {save: *a}\n", "checkpoint.save.save")],
)
def test_bad_values_inside_a_yaml_file_name_their_key(tmp_path: Path, text: bytes, key: str) -> None:
    with pytest.raises(ConfigError) as info:
        LifecycleConfig.from_yaml(_file(tmp_path, text))
    assert info.value.key == key


@pytest.mark.parametrize("path", [b"/x.yaml", 5], ids=["bytes", "int"])
def test_a_yaml_path_that_is_no_text_path_is_a_config_error(path: Any) -> None:
    """bytes raised a raw TypeError from deep in the reader."""
    with pytest.raises(ConfigError, match="a YAML path must be a str or os.PathLike of str"):
        LifecycleConfig.from_yaml(path)
