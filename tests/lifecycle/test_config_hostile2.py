"""More input that once got past the config as a silent wrong value or as another exception than a
`ConfigError` naming its key: YAML merge keys, a `=` key, unknown keyword arguments, OmegaConf
containers and a plugin's rules on fields of a type they cannot check.

The plugin classes live here and are selected by import path, as an uninstalled package's would be.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

import pytest

from backends.base import PLAIN_TORCH, FormatBackend, FormatCapabilities
from lifecycle.config import CheckpointConfig, EngineConfig, LifecycleConfig, SaveConfig
from lifecycle.config_file import read_yaml
from lifecycle.errors import ConfigError

HERE = __name__


def _file(tmp_path: Path, text: str) -> str:
    path = tmp_path / "lifecycle.yaml"
    path.write_text(text)
    return str(path)


def _refused(make: Any, key: str, *said: str) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        make()
    assert info.value.key == key, str(info.value)
    assert all(part in str(info.value) for part in said), str(info.value)
    assert len(str(info.value)) < 600
    return info.value


# --- YAML merge keys and the '=' key ---------------------------------------------------------------


def test_a_merge_of_two_mappings_takes_the_first_listed_mapping_s_value_for_every_key(tmp_path: Path) -> None:
    """The YAML merge-key spec: the first mapping listed wins; PyYAML 6.0.4 took the last one's
    value for keys longer than one character and the first one's for one-character keys."""
    path = _file(tmp_path, "checkpoint:\n  pre_load:\n    <<: [{path: /weights/FIRST, format: hf}, "
                           "{path: /weights/SECOND, format: hf}]\n"
                           "engine:\n  <<: [{timeout_s: 10, backend: gloo}, {timeout_s: 999, backend: naive}]\n")
    config = LifecycleConfig.from_yaml(path)
    assert config.checkpoint.pre_load.path == "/weights/FIRST"
    assert (config.engine.timeout_s, config.engine.backend) == (10.0, "gloo")
    mixed = _file(tmp_path, "c: {<<: [{x: 1, xx: 1}, {x: 2, xx: 2, y: 2}]}\n")
    assert read_yaml(mixed) == {"c": {"x": 1, "xx": 1, "y": 2}}


def test_a_key_given_beside_a_merge_wins_over_every_merged_mapping_wherever_it_is_written(tmp_path: Path) -> None:
    path = _file(tmp_path, "a: &a {x: 1, yy: 1}\nb: &b {x: 2, yy: 2, z: 2}\n"
                           "c: {yy: 3, <<: [*a, *b]}\nd: {<<: *b, x: 4, <<: *a}\n")
    data = read_yaml(path)
    assert data["c"] == {"x": 1, "yy": 3, "z": 2}  # type: ignore[index]
    assert data["d"] == {"x": 4, "yy": 2, "z": 2}  # type: ignore[index]


def test_a_merged_mapping_with_merges_of_its_own_keeps_its_own_precedence(tmp_path: Path) -> None:
    path = _file(tmp_path, "a: &a {x: 1, yy: 1}\nb: &b {<<: *a, yy: 2}\nc: {<<: [*b, {yy: 3, x: 3}]}\n"
                           "d: {<<: [*b, *b, *a]}\n")
    data = read_yaml(path)
    assert data["c"] == {"x": 1, "yy": 2}  # type: ignore[index]
    assert data["d"] == {"x": 1, "yy": 2}  # type: ignore[index]


@pytest.mark.parametrize("text", ["a: &a {<<: *a}\n", "a: {<<: [1]}\n", "a: {<<: 1}\n"],
                         ids=["self", "list-of-scalar", "scalar"])
def test_a_merge_of_itself_or_of_no_mapping_is_an_error_naming_the_file(tmp_path: Path, text: str) -> None:
    path = _file(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        read_yaml(path)
    assert info.value.key == path


def test_an_equals_sign_key_reads_as_the_key_and_is_an_unknown_key_of_its_section(tmp_path: Path) -> None:
    """YAML 1.1 tags a plain `=` as a 'value'; safe_load reads it as the string '='."""
    path = _file(tmp_path, "checkpoint:\n  root: /ckpt\n  =: 2\n")
    assert read_yaml(path) == {"checkpoint": {"root": "/ckpt", "=": 2}}
    _refused(lambda: LifecycleConfig.from_yaml(path), "checkpoint.=", "unknown key; valid keys:")
    twice = _file(tmp_path, "checkpoint: {=: 1, '=': 2}\n")
    with pytest.raises(ConfigError, match="key '=' is given twice"):
        read_yaml(twice)


# --- keyword arguments -----------------------------------------------------------------------------


@pytest.mark.parametrize(("make", "key", "valid"), [
    (lambda: LifecycleConfig(chekpoint={}), "chekpoint", "checkpoint, engine, resume, watchdog"),
    (lambda: CheckpointConfig(rot="/x"), "checkpoint.rot", "fsync, keep_last, load, pre_load, roles, root"),
    (lambda: EngineConfig(timeout=5), "engine.timeout", "timeout_s"),
    (lambda: SaveConfig(**{"async": True}), "checkpoint.save.async", "async_, contents, format, options"),
], ids=["top", "section", "engine", "external-key-name"])
def test_an_unknown_keyword_argument_is_a_config_error_naming_the_key_and_the_valid_ones(
    make: Any, key: str, valid: str,
) -> None:
    _refused(make, key, "unknown keyword argument; valid ones:", valid)


def test_a_deprecated_keyword_argument_is_accepted_but_not_listed() -> None:
    error = _refused(lambda: CheckpointConfig(rot="/x"), "checkpoint.rot")
    assert "use_mbridge" not in str(error)
    with pytest.warns(DeprecationWarning):
        assert CheckpointConfig(use_mbridge=False).save.format == "hf"


def test_a_positional_argument_is_a_config_error_pointing_to_from_dict() -> None:
    _refused(lambda: LifecycleConfig({"checkpoint": {}}), "", "keyword arguments only", "from_dict")
    _refused(lambda: CheckpointConfig("/x"), "checkpoint", "keyword arguments only")


def test_keyword_arguments_still_build_and_copy_a_section() -> None:
    import copy
    import pickle

    config = LifecycleConfig(checkpoint={"root": "/ckpt"}, engine=EngineConfig(timeout_s=5))
    assert (config.checkpoint.root, config.engine.timeout_s) == ("/ckpt", 5.0)
    assert copy.deepcopy(config) == config
    assert pickle.loads(pickle.dumps(config)) == config


# --- OmegaConf containers --------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "key", "said"), [
    ("checkpoint: {root: '???'}", "checkpoint.root", "missing ('???'"),
    ("checkpoint: {roles: ['???']}", "checkpoint.roles", "missing ('???'"),
    ("checkpoint: {root: '${nowhere.root}'}", "checkpoint.root", "cannot resolve its interpolation"),
    ("engine: {timeout_s: '${oc.env:NO_SUCH_VAR_LIFECYCLE_TEST}'}", "engine.timeout_s",
     "cannot resolve its interpolation"),
], ids=["missing", "missing-in-list", "interpolation", "env"])
def test_an_omegaconf_config_that_cannot_resolve_is_a_config_error_naming_the_key(
    text: str, key: str, said: str,
) -> None:
    omegaconf = pytest.importorskip("omegaconf")
    config = omegaconf.OmegaConf.create(text)
    _refused(lambda: LifecycleConfig.coerce(config), key, said)
    _refused(lambda: LifecycleConfig.from_dict(config), key, said)


def test_an_omegaconf_section_inside_a_plain_dict_is_resolved_and_its_errors_name_the_key() -> None:
    omegaconf = pytest.importorskip("omegaconf")
    trainer = omegaconf.OmegaConf.create({"base": "/ckpt", "lifecycle": {"checkpoint": {"root": "${base}/run",
                                                                                        "roles": ["actor"]}}})
    config = LifecycleConfig.from_dict({"checkpoint": trainer.lifecycle.checkpoint})
    assert (config.checkpoint.root, config.checkpoint.roles) == ("/ckpt/run", ["actor"])
    assert LifecycleConfig.from_dict(trainer.lifecycle).checkpoint.root == "/ckpt/run"
    broken = omegaconf.OmegaConf.create({"lifecycle": {"checkpoint": {"keep_last": "???"}}})
    _refused(lambda: LifecycleConfig.from_dict(broken.lifecycle), "checkpoint.keep_last", "missing ('???'")


# --- a plugin's rules on fields of another type ----------------------------------------------------


class Mode(str, Enum):
    A = "a"


def _format(name: str, annotation: str, **field_args: Any) -> str:
    options = dataclass(kw_only=True)(type(f"{name}Options", (), {
        "__module__": HERE, "__annotations__": {"x": annotation}, "x": field(**field_args)}))
    cls = type(name, (FormatBackend,), {"__module__": HERE, "Options": options,
                                        "capabilities": FormatCapabilities(family=PLAIN_TORCH,
                                                                           contents=frozenset({"model"}))})
    globals()[name] = cls
    return f"{HERE}:{name}"


MISFITS: dict[str, tuple[str, str]] = {
    _format("BoundOnStr", "str", default="x", metadata={"ge": 1}): ("abc", "bounds ge, gt and le need a number"),
    _format("BoundOnList", "list[int]", default_factory=list, metadata={"le": 3}): ([1], "need a number"),
    _format("PatternOnInts", "list[int]", default_factory=list, metadata={"pattern": "[0-9]+"}):
        ([5], "pattern, choices, problem and path need a string or a list of strings"),
    _format("PathOnInt", "int", default=1, metadata={"path": True}): (3, "need a string or a list of strings"),
    _format("ChoicesOnInt", "int", default=1, metadata={"choices": ("1", "2")}): (7, "need a string"),
    _format("ProblemOnFloat", "float", default=1.0, metadata={"problem": lambda v: "no"}): (2.0, "need a string"),
    _format("UniqueOnUnhashable", "list[list[str]]", default_factory=list, metadata={"unique": True}):
        ([["a"], ["a"]], "unique needs a list of hashable items"),
    _format("UniqueOnStr", "str", default="x", metadata={"unique": True}): ("ab", "unique needs a list"),
    _format("NonEmptyOnStr", "str", default="x", metadata={"non_empty": True}): ("", "non_empty needs a list"),
}


@pytest.mark.parametrize("fmt", list(MISFITS), ids=[name.split(":")[1] for name in MISFITS])
def test_a_plugin_rule_on_a_field_of_a_type_it_cannot_check_is_refused_on_the_format_key(fmt: str) -> None:
    value, said = MISFITS[fmt]
    for keys in ({}, {"x": value}):
        _refused(lambda: LifecycleConfig.from_dict({"checkpoint": {"save": {"format": fmt, "contents": ["model"],
                                                                            **keys}}}),
                 "checkpoint.save.format", f"format '{fmt}': option 'x':", said)


FITS: dict[str, tuple[Any, Any]] = {
    _format("BoundOnOptionalFloat", "float | None", default=None, metadata={"gt": 0}): (0.5, 0.5),
    _format("PatternOnStrList", "list[str]", default_factory=list, metadata={"pattern": "[a-z]+", "unique": True}):
        (["a", "b"], ["a", "b"]),
    _format("ChoicesOnOptionalStr", "str | None", default=None, metadata={"choices": ("a",)}): ("a", "a"),
    _format("UniqueOnInts", "list[int]", default_factory=list, metadata={"unique": True, "non_empty": True}):
        ([1, 2], [1, 2]),
    _format("UniqueOnEnums", "list[Mode]", default_factory=list, metadata={"unique": True}): (["a"], [Mode.A]),
}


@pytest.mark.parametrize("fmt", list(FITS), ids=[name.split(":")[1] for name in FITS])
def test_a_plugin_rule_on_a_field_of_a_type_it_checks_is_applied(fmt: str) -> None:
    value, expected = FITS[fmt]
    config = LifecycleConfig.from_dict({"checkpoint": {"save": {"format": fmt, "contents": ["model"], "x": value}}})
    assert config.checkpoint.save.options == {"x": expected}
