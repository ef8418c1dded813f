"""Pins the config's one validation path: defaults, the three ways in, and every error it raises."""

from __future__ import annotations

import json
from enum import Enum
from pathlib import Path
from typing import Any

import pytest

from lifecycle.boundary import role_problem
from lifecycle.config import (
    MIN_BUCKET_BYTES,
    CheckpointConfig,
    Content,
    EngineConfig,
    LifecycleConfig,
    LoadConfig,
    OnDamaged,
    PreLoadConfig,
    ResumeConfig,
    ResumeMode,
    SaveConfig,
    WatchdogConfig,
)
from lifecycle.errors import ConfigError

FORMATS = "dist_ckpt, hf, mbridge, torch_dcp"
CONTENTS = "model, hf_model, optimizer, extra"
MODES = "auto, disable, path"
BACKENDS = "auto, cuda_ipc, gloo, hccl, naive, nccl, shm"
DTYPES = "float32, float16, bfloat16"

YAML_TEXT = """\
checkpoint:
  root: /ckpt
  roles: [actor, critic]
  keep_last: 3
  fsync: true
  tracker: false
  pre_load: {format: mbridge, path: /weights}
  load: {contents: [model], verify: false}
  save: {format: dist_ckpt, contents: [model, optimizer], async: true}
resume: {mode: path, path: /ckpt/global_step_7, strict: false}
engine:
  backend: tests.backends.engines.custom_engine:OutsideEngine
  bucket_bytes: 1024
  verify: false
  apply: streamed
  timeout_s: 12
  rollout_dtype: bfloat16
  profile: true
  profile_dir: /profiles
watchdog:
  train_step_s: 30
  save_s: 600
  sync_weights_s: null
  resume_s: 900
"""


def _custom_dict() -> dict[str, Any]:
    return {
        "checkpoint": {
            "root": "/ckpt",
            "roles": ["actor", "critic"],
            "keep_last": 3,
            "fsync": True,
            "tracker": False,
            "pre_load": {"format": "mbridge", "path": "/weights"},
            "load": {"contents": ["model"], "verify": False},
            "save": {"format": "dist_ckpt", "contents": ["model", "optimizer"], "async": True},
        },
        "resume": {"mode": "path", "path": "/ckpt/global_step_7", "strict": False, "on_damaged": "fallback"},
        "engine": {
            "backend": "tests.backends.engines.custom_engine:OutsideEngine",
            "bucket_bytes": 1024,
            "verify": False,
            "apply": "streamed",
            "timeout_s": 12,
            "rollout_dtype": "bfloat16",
            "profile": True,
            "profile_dir": "/profiles",
        },
        "watchdog": {"init_load_s": None, "train_step_s": 30.0, "save_s": 600.0, "sync_weights_s": None,
                     "resume_s": 900.0, "close_s": None, "receive_weights_s": 120.0, "generate_s": None},
    }


def _error(data: dict[str, Any]) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        LifecycleConfig.from_dict(data)
    return info.value


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "lifecycle.yaml"
    path.write_text(text, encoding="utf-8")
    return path


# --- defaults and the ways in -------------------------------------------------------------------


def test_defaults_match_the_documented_values() -> None:
    cfg = LifecycleConfig()
    ckpt = cfg.checkpoint
    assert (ckpt.root, ckpt.roles, ckpt.keep_last, ckpt.tracker) == (None, [], None, True)
    assert (ckpt.pre_load.format, ckpt.pre_load.path, ckpt.pre_load_format) == (None, None, "hf")
    assert ckpt.load.format is None
    assert ckpt.load.contents == [Content.MODEL, Content.OPTIMIZER, Content.EXTRA]
    assert ckpt.save.format == "hf"
    assert ckpt.save.contents == [Content.MODEL, Content.OPTIMIZER, Content.EXTRA]
    assert ckpt.save.async_ is False
    assert (cfg.resume.mode, cfg.resume.path, cfg.resume.strict) == (ResumeMode.AUTO, None, True)
    assert cfg.resume.on_damaged is OnDamaged.FALLBACK
    eng = cfg.engine
    assert (eng.backend, eng.bucket_bytes, eng.verify, eng.timeout_s) == ("auto", 2 * 1024**3, True, 300.0)
    assert (eng.rollout_dtype, eng.profile, eng.profile_dir) == (None, False, None)


def test_default_lists_are_not_shared_between_instances() -> None:
    first, second = LifecycleConfig(), LifecycleConfig()
    first.checkpoint.save.contents.append(Content.HF_MODEL)
    first.checkpoint.roles.append("actor")
    assert second.checkpoint.save.contents == [Content.MODEL, Content.OPTIMIZER, Content.EXTRA]
    assert second.checkpoint.roles == []


def test_dict_yaml_and_kwargs_build_the_same_config(tmp_path: Path) -> None:
    data = _custom_dict()
    from_dict = LifecycleConfig.from_dict(data)
    from_yaml = LifecycleConfig.from_yaml(_write(tmp_path, YAML_TEXT))
    from_kwargs = LifecycleConfig(**data)
    from_sections = LifecycleConfig(
        checkpoint=CheckpointConfig(
            root="/ckpt",
            roles=["actor", "critic"],
            keep_last=3,
            fsync=True,
            tracker=False,
            pre_load=PreLoadConfig(format="mbridge", path="/weights"),
            load=LoadConfig(contents=[Content.MODEL], verify=False),
            save=SaveConfig(format="dist_ckpt", contents=["model", "optimizer"], async_=True),
        ),
        resume=ResumeConfig(mode="path", path="/ckpt/global_step_7", strict=False),
        engine=EngineConfig(**data["engine"]),
        watchdog=WatchdogConfig(train_step_s=30, save_s=600, sync_weights_s=None, resume_s=900),
    )
    assert from_dict == from_yaml == from_kwargs == from_sections


def test_strings_become_enum_members() -> None:
    cfg = LifecycleConfig.from_dict(_custom_dict())
    assert cfg.checkpoint.save.format == "dist_ckpt"
    assert cfg.checkpoint.save.contents == [Content.MODEL, Content.OPTIMIZER]
    assert all(isinstance(c, Content) for c in cfg.checkpoint.save.contents)
    assert cfg.resume.mode is ResumeMode.PATH


def test_an_integer_is_accepted_for_a_float_and_stored_as_float() -> None:
    cfg = LifecycleConfig(engine={"timeout_s": 12})
    assert cfg.engine.timeout_s == 12.0
    assert isinstance(cfg.engine.timeout_s, float)


def test_tuples_are_accepted_for_lists_and_stored_as_lists() -> None:
    cfg = LifecycleConfig(checkpoint={"roles": ("actor",), "save": {"contents": ("model",)}})
    assert cfg.checkpoint.roles == ["actor"]
    assert cfg.checkpoint.save.contents == [Content.MODEL]


def test_kwargs_accept_a_mix_of_section_instances_and_dicts() -> None:
    cfg = LifecycleConfig(
        checkpoint={"root": "/x", "save": SaveConfig(format="torch_dcp")},
        engine=EngineConfig(timeout_s=5),
    )
    assert cfg.checkpoint.root == "/x"
    assert cfg.checkpoint.save.format == "torch_dcp"
    assert cfg.engine.timeout_s == 5.0


@pytest.mark.parametrize("empty", [None, {}])
def test_from_dict_of_none_or_empty_gives_defaults(empty: dict[str, Any] | None) -> None:
    assert LifecycleConfig.from_dict(empty) == LifecycleConfig()


def test_a_section_given_as_none_takes_its_defaults(tmp_path: Path) -> None:
    cfg = LifecycleConfig.from_yaml(_write(tmp_path, "engine:\nresume:\n  mode: disable\n"))
    assert cfg == LifecycleConfig(resume={"mode": "disable"})


def test_empty_yaml_file_gives_defaults(tmp_path: Path) -> None:
    assert LifecycleConfig.from_yaml(_write(tmp_path, "# nothing set\n")) == LifecycleConfig()


def test_coerce_accepts_config_mapping_yaml_path_and_none(tmp_path: Path) -> None:
    cfg = LifecycleConfig.from_dict(_custom_dict())
    path = _write(tmp_path, YAML_TEXT)
    assert LifecycleConfig.coerce(cfg) is cfg
    assert LifecycleConfig.coerce(_custom_dict()) == cfg
    assert LifecycleConfig.coerce(path) == cfg
    assert LifecycleConfig.coerce(str(path)) == cfg
    assert LifecycleConfig.coerce(None) == LifecycleConfig()


def test_coerce_rejects_other_types() -> None:
    with pytest.raises(ConfigError, match=r"expected a LifecycleConfig, a mapping, a YAML path or None"):
        LifecycleConfig.coerce(42)  # type: ignore[arg-type]


def test_load_format_follows_save_format_when_unset() -> None:
    cfg = LifecycleConfig(checkpoint={"save": {"format": "torch_dcp"}})
    assert cfg.checkpoint.load_format == "torch_dcp"


def test_load_format_is_load_format_when_set() -> None:
    cfg = LifecycleConfig(checkpoint={"load": {"format": "torch_dcp"}, "save": {"format": "torch_dcp"}})
    assert cfg.checkpoint.load_format == "torch_dcp"


# --- dumping ------------------------------------------------------------------------------------


def test_to_dict_then_from_dict_gives_an_equal_config() -> None:
    for cfg in (LifecycleConfig(), LifecycleConfig.from_dict(_custom_dict())):
        assert LifecycleConfig.from_dict(cfg.to_dict()) == cfg


def test_to_dict_is_plain_json_with_enum_values_as_strings() -> None:
    dumped = LifecycleConfig.from_dict(_custom_dict()).to_dict()
    assert json.loads(json.dumps(dumped)) == dumped
    expected = _custom_dict()
    expected["checkpoint"]["load"]["format"] = None
    expected["engine"]["timeout_s"] = 12.0
    assert dumped == expected
    assert type(dumped["checkpoint"]["save"]["format"]) is str


def test_async_key_round_trips_through_yaml_and_to_dict(tmp_path: Path) -> None:
    cfg = LifecycleConfig.from_yaml(_write(tmp_path, "checkpoint:\n  save:\n    async: true\n"))
    assert cfg.checkpoint.save.async_ is True
    save = cfg.to_dict()["checkpoint"]["save"]
    assert save["async"] is True
    assert "async_" not in save
    assert LifecycleConfig.from_dict(cfg.to_dict()).checkpoint.save.async_ is True


def test_async_underscore_is_not_a_dict_key() -> None:
    err = _error({"checkpoint": {"save": {"async_": True}}})
    assert err.key == "checkpoint.save.async_"
    assert "valid keys: async, contents, format" in str(err)


# --- unknown keys and non-mapping sections ------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "key", "valid"),
    [
        ({"chekpoint": {}}, "chekpoint", "checkpoint, engine, resume, watchdog"),
        ({"checkpoint": {"sav": {}}}, "checkpoint.sav", "fsync, keep_last, load, pre_load, roles, root, save, tracker"),
        ({"checkpoint": {"pre_load": {"fmt": "hf"}}}, "checkpoint.pre_load.fmt", "format, path"),
        ({"checkpoint": {"load": {"content": []}}}, "checkpoint.load.content", "contents, format, verify"),
        ({"checkpoint": {"save": {"fromat": "hf"}}}, "checkpoint.save.fromat",
         "async, contents, format, max_shard_bytes"),
        ({"checkpoint": {"save": {"format": "torch_dcp", "fromat": 1}}}, "checkpoint.save.fromat",
         "async, contents, format; format 'torch_dcp' takes no keys of its own"),
        ({"resume": {"mod": "auto"}}, "resume.mod", "mode, on_damaged, path, strict"),
        (
            {"engine": {"bucket": 1}},
            "engine.bucket",
            "apply, backend, bucket_bytes, profile, profile_dir, rollout_dtype, timeout_s, verify; "
            "backend 'auto', which picks the engine by device, takes no keys of its own",
        ),
    ],
)
def test_unknown_key_at_every_level_names_its_full_path_and_the_valid_keys(
    data: dict[str, Any], key: str, valid: str
) -> None:
    err = _error(data)
    assert err.key == key
    assert str(err) == f"{key}: unknown key; valid keys: {valid}"


@pytest.mark.parametrize(
    ("data", "section"),
    [
        ({"checkpoint": 3}, "checkpoint"),
        ({"checkpoint": {"save": ["hf"]}}, "checkpoint.save"),
        ({"checkpoint": {"pre_load": "hf"}}, "checkpoint.pre_load"),
        ({"checkpoint": {"load": True}}, "checkpoint.load"),
        ({"resume": "auto"}, "resume"),
        ({"engine": 1.5}, "engine"),
    ],
)
def test_a_section_that_is_not_a_mapping_is_an_error_naming_the_section(
    data: dict[str, Any], section: str
) -> None:
    err = _error(data)
    assert err.key == section
    assert f"expected a mapping for section {section}" in str(err)


def test_from_dict_of_a_non_mapping_is_an_error() -> None:
    with pytest.raises(ConfigError, match=r"expected a mapping for section config, got \[1\] \(list\)"):
        LifecycleConfig.from_dict([1])  # type: ignore[arg-type]


# --- enums --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "key", "choices"),
    [
        ({"checkpoint": {"load": {"contents": ["model", "weights"]}}}, "checkpoint.load.contents", CONTENTS),
        ({"checkpoint": {"save": {"contents": ["optim"]}}}, "checkpoint.save.contents", CONTENTS),
        ({"resume": {"mode": "latest"}}, "resume.mode", MODES),
        ({"resume": {"mode": False}}, "resume.mode", MODES),
    ],
)
def test_bad_enum_value_lists_the_valid_choices(data: dict[str, Any], key: str, choices: str) -> None:
    err = _error(data)
    assert err.key == key
    assert f"expected one of {choices}, got " in str(err)


@pytest.mark.parametrize(
    ("data", "key"),
    [
        ({"checkpoint": {"pre_load": {"format": "safetensors"}}}, "checkpoint.pre_load.format"),
        ({"checkpoint": {"load": {"format": "HF"}}}, "checkpoint.load.format"),
        ({"checkpoint": {"save": {"format": "megatron"}}}, "checkpoint.save.format"),
        ({"checkpoint": {"save": {"format": "pkg.mod.Format"}}}, "checkpoint.save.format"),
    ],
)
def test_an_unknown_format_lists_the_registered_ones(data: dict[str, Any], key: str) -> None:
    err = _error(data)
    assert err.key == key
    assert f"expected one of {FORMATS} or an import path 'pkg.module:Class', got " in str(err)


@pytest.mark.parametrize("value", [1, None, ["hf"]])
def test_a_format_that_is_no_string_is_an_error(value: object) -> None:
    err = _error({"checkpoint": {"save": {"format": value}}})
    assert err.key == "checkpoint.save.format"
    assert "expected a string, got " in str(err)


def test_a_format_import_path_that_cannot_be_imported_names_the_package() -> None:
    err = _error({"checkpoint": {"save": {"format": "no_such_pkg.formats:Fast"}}})
    assert err.key == "checkpoint.save.format"
    assert "format 'no_such_pkg.formats:Fast' needs the package 'no_such_pkg'" in str(err)


def test_a_str_enum_member_given_for_a_name_is_stored_as_its_plain_value() -> None:
    class Name(str, Enum):
        TORCH_DCP = "torch_dcp"

    cfg = LifecycleConfig(checkpoint={"save": {"format": Name.TORCH_DCP}})
    assert type(cfg.checkpoint.save.format) is str and cfg.checkpoint.save.format == "torch_dcp"


def test_the_hf_shard_size_is_a_save_key_bounded_by_the_hf_options() -> None:
    cfg = LifecycleConfig(checkpoint={"save": {"max_shard_bytes": 4096}})
    assert cfg.checkpoint.save.options == {"max_shard_bytes": 4096}
    assert cfg.to_dict()["checkpoint"]["save"]["max_shard_bytes"] == 4096
    assert LifecycleConfig.from_dict(cfg.to_dict()) == cfg
    for bad, message in ((0, "must be >= 1, got 0"), ("1G", "expected an integer, got '1G' (str)"),
                         (1 << 41, "must be <= 1099511627776")):
        err = _error({"checkpoint": {"save": {"max_shard_bytes": bad}}})
        assert (err.key, message in str(err)) == ("checkpoint.save.max_shard_bytes", True), str(err)


def test_the_hf_shard_size_is_no_key_of_a_format_without_it() -> None:
    err = _error({"checkpoint": {"save": {"format": "torch_dcp", "max_shard_bytes": 4096}}})
    assert str(err) == ("checkpoint.save.max_shard_bytes: unknown key; valid keys: async, contents, format; "
                        "format 'torch_dcp' takes no keys of its own")


def test_bad_list_item_says_which_item() -> None:
    err = _error({"checkpoint": {"load": {"contents": ["model", "weights"]}}})
    assert "item 1: expected one of" in str(err)
    assert "'weights' (str)" in str(err)


def test_enum_members_are_accepted_as_values() -> None:
    cfg = LifecycleConfig(checkpoint={"save": {"format": "torch_dcp", "contents": [Content.MODEL]}})
    assert cfg.checkpoint.save.format == "torch_dcp"
    assert cfg.checkpoint.save.contents == [Content.MODEL]


# --- types --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "key", "expected"),
    [
        ({"checkpoint": {"keep_last": "three"}}, "checkpoint.keep_last", "expected an integer, got 'three'"),
        ({"checkpoint": {"keep_last": True}}, "checkpoint.keep_last", "expected an integer, got True (bool)"),
        ({"checkpoint": {"keep_last": 2.0}}, "checkpoint.keep_last", "expected an integer, got 2.0 (float)"),
        ({"engine": {"bucket_bytes": False}}, "engine.bucket_bytes", "expected an integer, got False (bool)"),
        ({"engine": {"timeout_s": True}}, "engine.timeout_s", "expected a number, got True (bool)"),
        ({"engine": {"timeout_s": "300"}}, "engine.timeout_s", "expected a number, got '300' (str)"),
        ({"engine": {"verify": "yes"}}, "engine.verify", "expected a boolean, got 'yes' (str)"),
        ({"engine": {"apply": "lazy"}}, "engine.apply", "lazy"),
        ({"engine": {"profile": 1}}, "engine.profile", "expected a boolean, got 1 (int)"),
        ({"resume": {"strict": None}}, "resume.strict", "expected a boolean, got None (NoneType)"),
        ({"checkpoint": {"save": {"async": "no"}}}, "checkpoint.save.async", "expected a boolean, got 'no'"),
        ({"checkpoint": {"root": 3}}, "checkpoint.root", "expected a string, got 3 (int)"),
        ({"engine": {"backend": None}}, "engine.backend", "expected a string, got None (NoneType)"),
        ({"checkpoint": {"roles": "actor"}}, "checkpoint.roles", "expected a list, got 'actor' (str)"),
        ({"checkpoint": {"roles": [7]}}, "checkpoint.roles", "item 0: expected a string, got 7 (int)"),
        ({"checkpoint": {"save": {"contents": "model"}}}, "checkpoint.save.contents", "expected a list"),
        ({"checkpoint": {"load": {"contents": {"model": 1}}}}, "checkpoint.load.contents", "expected a list"),
    ],
)
def test_wrong_type_says_what_was_expected_and_what_was_got(
    data: dict[str, Any], key: str, expected: str
) -> None:
    err = _error(data)
    assert err.key == key
    assert expected in str(err)


def test_kwargs_go_through_the_same_type_checks() -> None:
    with pytest.raises(ConfigError, match=r"^engine\.bucket_bytes: expected an integer, got True \(bool\)$"):
        EngineConfig(bucket_bytes=True)


def test_a_standalone_section_reports_its_full_dotted_path() -> None:
    with pytest.raises(ConfigError) as info:
        SaveConfig(format="nope")
    assert info.value.key == "checkpoint.save.format"


def test_config_error_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        LifecycleConfig(engine={"timeout_s": -1})


# --- ranges and list rules ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "key", "message"),
    [
        ({"checkpoint": {"keep_last": 0}}, "checkpoint.keep_last", "must be >= 1, got 0"),
        ({"checkpoint": {"keep_last": -2}}, "checkpoint.keep_last", "must be >= 1, got -2"),
        ({"engine": {"bucket_bytes": 0}}, "engine.bucket_bytes", "must be >= 64, got 0"),
        ({"engine": {"bucket_bytes": -1}}, "engine.bucket_bytes", "must be >= 64, got -1"),
        ({"engine": {"bucket_bytes": 63}}, "engine.bucket_bytes", "must be >= 64, got 63"),
        ({"engine": {"timeout_s": 0}}, "engine.timeout_s", "must be > 0, got 0.0"),
        ({"engine": {"timeout_s": -1.5}}, "engine.timeout_s", "must be > 0, got -1.5"),
        ({"engine": {"timeout_s": float("nan")}}, "engine.timeout_s", "expected a finite number, got nan (float)"),
    ],
)
def test_out_of_range_number_is_an_error(data: dict[str, Any], key: str, message: str) -> None:
    err = _error(data)
    assert (err.key, str(err)) == (key, f"{key}: {message}")


def test_range_boundaries_are_accepted() -> None:
    cfg = LifecycleConfig(checkpoint={"keep_last": 1}, engine={"bucket_bytes": MIN_BUCKET_BYTES, "timeout_s": 0.001})
    assert (cfg.checkpoint.keep_last, cfg.engine.bucket_bytes) == (1, MIN_BUCKET_BYTES)


@pytest.mark.parametrize("role", ["actor critic", "actor/critic", "", "akteur-ä", ".", "..", ".hidden", "-x",
                                  "a" * 129, "a\x00b"])
def test_role_that_is_not_a_safe_folder_name_is_an_error(role: str) -> None:
    err = _error({"checkpoint": {"roles": ["actor", role]}})
    assert err.key == "checkpoint.roles"
    assert str(err) == f"checkpoint.roles: item 1: {role_problem(role)}"


def test_roles_with_letters_digits_dots_dashes_underscores_are_accepted() -> None:
    roles = ["actor", "critic.v2", "ref-1", "reward_model", "A9", "_x", "a" * 128]
    assert LifecycleConfig(checkpoint={"roles": roles}).checkpoint.roles == roles


def test_duplicate_role_is_an_error() -> None:
    err = _error({"checkpoint": {"roles": ["actor", "critic", "actor"]}})
    assert (err.key, str(err)) == ("checkpoint.roles", "checkpoint.roles: item 2: duplicate 'actor'")


@pytest.mark.parametrize("section", ["load", "save"])
def test_empty_contents_is_an_error(section: str) -> None:
    err = _error({"checkpoint": {section: {"contents": []}}})
    assert err.key == f"checkpoint.{section}.contents"
    assert "must list at least one item" in str(err)


@pytest.mark.parametrize("section", ["load", "save"])
def test_duplicate_contents_is_an_error(section: str) -> None:
    err = _error({"checkpoint": {section: {"contents": ["model", "extra", "model"]}}})
    assert (err.key, str(err)) == (
        f"checkpoint.{section}.contents",
        f"checkpoint.{section}.contents: item 2: duplicate 'model'",
    )


# --- engine names -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "backend", ["auto", "gloo", "nccl", "hccl", "shm", "naive", "tests.backends.engines.custom_engine:OutsideEngine"]
)
def test_engine_backend_accepts_the_names_and_import_paths(backend: str) -> None:
    assert LifecycleConfig(engine={"backend": backend}).engine.backend == backend


@pytest.mark.parametrize("backend", ["pkg.mod:Engine", "_p:_E"])
def test_engine_backend_naming_a_module_that_is_not_installed_is_refused_by_the_config(backend: str) -> None:
    err = _error({"engine": {"backend": backend}})
    assert err.key == "engine.backend" and f"checkpoint engine {backend!r} needs the package" in str(err)


@pytest.mark.parametrize("backend", ["NCCL", "pkg.mod.Engine", "1pkg:Engine", "pkg:", "pkg:Eng.ine", "a b:C"])
def test_engine_backend_neither_a_name_nor_an_import_path_lists_the_names(backend: str) -> None:
    err = _error({"engine": {"backend": backend}})
    assert err.key == "engine.backend"
    assert f"expected one of {BACKENDS} or an import path 'pkg.module:Class', got {backend!r}" in str(err)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_rollout_dtype_accepts_the_three_names(dtype: str) -> None:
    assert LifecycleConfig(engine={"rollout_dtype": dtype}).engine.rollout_dtype == dtype


@pytest.mark.parametrize("dtype", ["fp16", "torch.bfloat16", "int8", ""])
def test_unknown_rollout_dtype_lists_the_three_names(dtype: str) -> None:
    err = _error({"engine": {"rollout_dtype": dtype}})
    assert err.key == "engine.rollout_dtype"
    assert str(err) == f"engine.rollout_dtype: expected one of {DTYPES}, got {dtype!r}"


# --- cross-field rules --------------------------------------------------------------------------


def test_resume_mode_path_without_a_path_names_both_keys() -> None:
    err = _error({"resume": {"mode": "path"}})
    assert err.key == "resume.path"
    assert "resume.mode" in str(err).removeprefix("resume.path:")
    assert "resume.path" in str(err).removeprefix("resume.path:")


@pytest.mark.parametrize("mode", ["auto", "disable"])
def test_resume_path_without_mode_path_names_both_keys(mode: str) -> None:
    err = _error({"resume": {"mode": mode, "path": "/ckpt/global_step_3"}})
    assert err.key == "resume.path"
    message = str(err).removeprefix("resume.path:")
    assert "resume.path is set" in message
    assert f"resume.mode is {mode!r}" in message


def test_resume_mode_path_with_a_path_is_accepted() -> None:
    cfg = LifecycleConfig(resume={"mode": "path", "path": "/ckpt/global_step_3"})
    assert cfg.resume.path == "/ckpt/global_step_3"


def test_profile_without_profile_dir_names_both_keys() -> None:
    err = _error({"engine": {"profile": True}})
    assert err.key == "engine.profile_dir"
    assert str(err) == "engine.profile_dir: profile is true but profile_dir is not set"


def test_profile_dir_without_profile_is_accepted() -> None:
    assert LifecycleConfig(engine={"profile_dir": "/p"}).engine.profile is False


def test_hf_model_in_load_contents_is_an_error() -> None:
    err = _error({"checkpoint": {"load": {"contents": ["hf_model", "optimizer"]}}})
    assert err.key == "checkpoint.load.contents"
    assert "hf_model is an export" in str(err)
    assert "'model'" in str(err)


def test_hf_model_in_save_contents_is_accepted() -> None:
    cfg = LifecycleConfig(checkpoint={"save": {"contents": ["model", "hf_model"]}})
    assert Content.HF_MODEL in cfg.checkpoint.save.contents


@pytest.mark.parametrize(
    ("pre_load", "save"),
    [("hf", "mbridge"), ("torch_dcp", "dist_ckpt"), ("mbridge", "hf"), ("dist_ckpt", "torch_dcp")],
)
def test_pre_load_and_save_from_different_model_families_name_both_keys(pre_load: str, save: str) -> None:
    err = _error({"checkpoint": {"pre_load": {"format": pre_load}, "save": {"format": save}}})
    assert err.key == "checkpoint.pre_load.format"
    message = str(err).removeprefix("checkpoint.pre_load.format:")
    assert f"checkpoint.pre_load.format {pre_load!r}" in message
    assert f"checkpoint.save.format {save!r}" in message
    assert "Megatron" in message and "plain-torch" in message


@pytest.mark.parametrize(
    ("pre_load", "load", "save"),
    [("hf", "dist_ckpt", "hf"), ("mbridge", "torch_dcp", "dist_ckpt"), ("mbridge", "hf", "mbridge")],
)
def test_load_and_save_from_different_model_families_name_both_keys(
    pre_load: str, load: str, save: str
) -> None:
    data = {"pre_load": {"format": pre_load}, "load": {"format": load}, "save": {"format": save}}
    err = _error({"checkpoint": data})
    assert err.key == "checkpoint.load.format"
    message = str(err).removeprefix("checkpoint.load.format:")
    assert f"checkpoint.load.format {load!r}" in message
    assert f"checkpoint.save.format {save!r}" in message
    assert "model family" in message


@pytest.mark.parametrize(
    ("pre_load", "load", "save"),
    [
        ("mbridge", None, "dist_ckpt"),
        ("dist_ckpt", "mbridge", "mbridge"),
        ("mbridge", "dist_ckpt", "dist_ckpt"),
        ("hf", None, "torch_dcp"),
        ("torch_dcp", "hf", "hf"),
        ("hf", "torch_dcp", "torch_dcp"),
        ("mbridge", "dist_ckpt", "mbridge"),
        ("hf", "hf", "torch_dcp"),
    ],
)
def test_formats_of_one_family_are_accepted_together(
    pre_load: str, load: str | None, save: str
) -> None:
    data = {"pre_load": {"format": pre_load}, "load": {"format": load}, "save": {"format": save}}
    cfg = LifecycleConfig(checkpoint=data)
    assert cfg.checkpoint.load_format == (load or save)


@pytest.mark.parametrize(("save", "pre_load"), [("hf", "hf"), ("torch_dcp", "hf"), ("mbridge", "mbridge"),
                                              ("dist_ckpt", "mbridge")])
def test_unset_pre_load_format_follows_the_save_format_family(save: str, pre_load: str) -> None:
    cfg = LifecycleConfig(checkpoint={"save": {"format": save}})
    assert cfg.checkpoint.pre_load_format == pre_load


# --- YAML files ---------------------------------------------------------------------------------


def test_missing_yaml_file_is_an_error_naming_the_file(tmp_path: Path) -> None:
    path = tmp_path / "absent.yaml"
    with pytest.raises(ConfigError) as info:
        LifecycleConfig.from_yaml(path)
    assert info.value.key == str(path)
    assert "cannot read config file" in str(info.value)


def test_bad_yaml_is_an_error_naming_the_file(tmp_path: Path) -> None:
    path = _write(tmp_path, "checkpoint: [unclosed\n")
    with pytest.raises(ConfigError) as info:
        LifecycleConfig.from_yaml(path)
    assert info.value.key == str(path)
    assert "not valid YAML" in str(info.value)


@pytest.mark.parametrize("text", ["- checkpoint\n- engine\n", "just a string\n", "42\n"])
def test_yaml_whose_top_level_is_not_a_mapping_is_an_error_naming_the_file(
    tmp_path: Path, text: str
) -> None:
    path = _write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        LifecycleConfig.from_yaml(path)
    assert info.value.key == str(path)
    assert "the top level must be a mapping of sections" in str(info.value)


def test_errors_inside_a_yaml_file_carry_the_full_dotted_key(tmp_path: Path) -> None:
    path = _write(tmp_path, "checkpoint:\n  save:\n    format: safetensors\n")
    with pytest.raises(ConfigError) as info:
        LifecycleConfig.from_yaml(path)
    assert info.value.key == "checkpoint.save.format"
    assert FORMATS in str(info.value)


@pytest.mark.parametrize(
    ("flags", "expected"),
    [({"use_mbridge": True}, "mbridge"), ({"use_dist_checkpointing": True}, "dist_ckpt"),
     ({"use_dist_checkpointing": True, "use_mbridge": True}, "dist_ckpt")],
)
def test_legacy_flags_translate_to_the_format_keys_with_a_deprecation_warning_naming_them(
    flags: dict[str, bool], expected: str
) -> None:
    with pytest.warns(DeprecationWarning) as caught:
        cfg = LifecycleConfig.from_dict({"checkpoint": flags})
    message = str(caught[0].message)
    assert "checkpoint.save.format" in message and "checkpoint.pre_load.format" in message
    assert all(f"checkpoint.{flag}" in message for flag in flags)
    assert cfg.checkpoint.save.format == expected
    assert cfg.checkpoint.pre_load_format == expected
    assert cfg.checkpoint.load_format == expected
    assert LifecycleConfig.from_dict(cfg.to_dict()) == cfg


def test_a_false_legacy_flag_changes_nothing_but_still_warns() -> None:
    with pytest.warns(DeprecationWarning, match="use_mbridge=False"):
        cfg = LifecycleConfig.from_dict({"checkpoint": {"use_mbridge": False}})
    assert cfg.checkpoint.save.format == "hf"


def test_a_legacy_flag_contradicting_an_explicit_format_names_both_keys() -> None:
    with pytest.raises(ConfigError, match=r"checkpoint\.save\.format 'mbridge'.*use_dist_checkpointing"):
        LifecycleConfig.from_dict({"checkpoint": {"use_dist_checkpointing": True, "save": {"format": "mbridge"}}})


def test_content_names_come_from_one_enum_for_the_config_the_content_table_and_the_formats() -> None:
    from backends.base import MODEL_CONTENTS
    from lifecycle.config import Content as ConfigContent
    from lifecycle.contents import CONTENTS
    from lifecycle.types import Content

    assert ConfigContent is Content
    assert list(CONTENTS) == [c.value for c in Content] and all(type(name) is str for name in CONTENTS)
    assert MODEL_CONTENTS == {c.value for c in Content} - {Content.EXTRA.value}


def test_format_options_are_checked_against_the_format_a_deprecated_flag_selects() -> None:
    with pytest.raises(ConfigError, match=r"^checkpoint\.save\.max_shard_bytes: unknown key.*'mbridge' takes no keys"):
        LifecycleConfig.from_dict({"checkpoint": {"save": {"max_shard_bytes": 1}, "use_mbridge": True}})
