"""`Registry[T]` and the format registry built on it: the ways in, and what each refusal says."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import EntryPoint
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

import backends.registry as registry_module
from backends.base import (
    FORMATS, PLAIN_TORCH, FormatBackend, FormatCapabilities, backend_class, format_capabilities,
)
from backends.hf import INDEX, HFBackend
from backends.registry import Builtin, Registry
from lifecycle import Lifecycle, LifecycleConfig
from lifecycle.checkpointer import check_async
from lifecycle.errors import CheckpointError, ConfigError


class Widget:
    """The base class of the registries under test."""

    name: ClassVar[str] = "widget"


class Gear(Widget):
    pass


NOT_A_WIDGET = 3
HERE = __name__


def _registry(**builtins: Builtin) -> Registry[Widget]:
    return Registry("widget", base=Widget, group="tests.widgets", key="widgets.name", builtins=builtins)


def test_an_unknown_name_is_a_config_error_listing_the_known_ones() -> None:
    widgets = _registry(spoke=Builtin(f"{HERE}:Gear"))
    widgets.register("cog")(type("Cog", (Widget,), {}))
    with pytest.raises(ConfigError) as info:
        widgets.get("sprocket")
    assert info.value.key == "widgets.name"
    assert "unknown widget 'sprocket'; known: cog, spoke, or an import path 'pkg.module:Class'" in str(info.value)
    assert widgets.problem("sprocket", also=("auto",)) == (
        "expected one of auto, cog, spoke or an import path 'pkg.module:Class', got 'sprocket'")


def test_a_missing_dependency_names_the_package_and_the_extra_to_install() -> None:
    widgets = _registry(fast=Builtin("no_such_pkg.widgets:Fast", extra="megatron"))
    assert widgets.problem("fast") is None and widgets.names() == ["fast"]
    with pytest.raises(ConfigError) as info:
        widgets.get("fast", key="checkpoint.load.format")
    assert info.value.key == "checkpoint.load.format"
    assert "widget 'fast' needs the package 'no_such_pkg'" in str(info.value)
    assert str(info.value).endswith("install the extra: pip install 'trainer-lifecycle[megatron]'")


def test_an_import_path_selects_a_class_nobody_registered() -> None:
    widgets = _registry()
    assert widgets.problem(f"{HERE}:Gear") is None
    assert widgets.get(f"{HERE}:Gear") is Gear


@pytest.mark.parametrize(("name", "message"), [
    (f"{HERE}:NOT_A_WIDGET", f"widget '{HERE}:NOT_A_WIDGET' is 3, not a subclass of {HERE}.Widget"),
    (f"{HERE}:Missing", f"module '{HERE}' has no 'Missing'"),
    ("no_such_pkg.widgets:Fast", "needs the package 'no_such_pkg'"),
])
def test_a_bad_import_path_says_what_is_wrong(name: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        _registry().get(name)


def test_the_decorator_names_the_class_and_refuses_what_cannot_be_one() -> None:
    widgets = _registry(spoke=Builtin(f"{HERE}:Gear"))

    @widgets.register("cog")
    class Cog(Widget):
        pass

    assert widgets.get("cog") is Cog and Cog.name == "cog" and "cog" in widgets.names()
    with pytest.raises(ConfigError, match="not a subclass of"):
        widgets.register("int")(int)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="the name belongs to the built-in"):
        widgets.register("spoke")(Cog)
    for bad in ("pkg:Cog", "", "two words"):
        with pytest.raises(ConfigError, match="cannot register widget"):
            widgets.register(bad)


def test_an_entry_point_adds_a_name_and_names_its_class(monkeypatch: pytest.MonkeyPatch) -> None:
    point = EntryPoint("belt", f"{HERE}:Gear", "tests.widgets")
    monkeypatch.setattr(registry_module, "entry_points",
                        lambda group: [point] if group == "tests.widgets" else [])
    monkeypatch.setattr(Gear, "name", Gear.name)
    widgets = _registry()
    assert widgets.names() == ["belt"] and widgets.problem("belt") is None
    assert widgets.get("belt") is Gear and Gear.name == "belt"


def test_a_base_given_as_an_import_path_is_imported_when_first_needed() -> None:
    widgets: Registry[Widget] = Registry("widget", base=f"{HERE}:Widget", group="tests.widgets", key="k")
    assert widgets.get(f"{HERE}:Gear") is Gear


# --- the format registry -------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["hf", "torch_dcp", "mbridge", "dist_ckpt"])
def test_a_builtin_format_s_class_carries_the_capabilities_declared_for_it(name: str) -> None:
    cls = backend_class(name)
    assert cls.name == name and cls.capabilities is format_capabilities(name)


def test_checking_a_megatron_format_name_imports_neither_torch_nor_megatron() -> None:
    code = ("import sys; from lifecycle.config import LifecycleConfig; "
            "c = LifecycleConfig(checkpoint={'save': {'format': 'dist_ckpt'}, 'load': {'format': 'mbridge'}}); "
            "print(c.checkpoint.pre_load_format, 'torch' in sys.modules, 'megatron' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).parents[2])
    assert out.stdout.split() == ["mbridge", "False", "False"]


def test_a_missing_megatron_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    for module in ("backends.dist_ckpt", "backends.megatron"):
        monkeypatch.delitem(sys.modules, module, raising=False)
    for module in [m for m in sys.modules if m.partition(".")[0] == "megatron"] or ["megatron"]:
        monkeypatch.setitem(sys.modules, module, None)
    with pytest.raises(ConfigError) as info:
        backend_class("dist_ckpt", "checkpoint.load.format")
    assert info.value.key == "checkpoint.load.format"
    assert "format 'dist_ckpt' needs the package 'megatron." in str(info.value)
    assert "pip install 'trainer-lifecycle[megatron]'" in str(info.value)


def test_a_format_registered_by_decorator_is_usable_in_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(FORMATS, "_registered", dict(FORMATS._registered))

    @FORMATS.register("hf_twin")
    class Twin(HFBackend):
        """The hf format under another name."""

    cfg = LifecycleConfig(checkpoint={"save": {"format": "hf_twin", "max_shard_bytes": 64}})
    assert (cfg.checkpoint.save.format, cfg.checkpoint.pre_load_format) == ("hf_twin", "hf_twin")
    assert Twin(**cfg.checkpoint.save.options).max_shard_bytes == 64


def test_a_format_without_capabilities_is_refused_when_registered(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(FORMATS, "_registered", dict(FORMATS._registered))
    with pytest.raises(ConfigError, match=r"^checkpoint\.save\.format: format 'bare' \(Bare\): declares no "
                                          r"FormatCapabilities"):
        FORMATS.register("bare")(type("Bare", (FormatBackend,), {}))
    with pytest.raises(ConfigError, match=r"^checkpoint\.save\.format: .*'bare'"):
        LifecycleConfig(checkpoint={"save": {"format": "bare"}})


def test_capabilities_hold_the_model_and_only_known_contents() -> None:
    assert FormatCapabilities(family=PLAIN_TORCH, contents={"model"}).contents == frozenset({"model"})
    for contents in ({"optimizer"}, {"model", "extra"}):
        with pytest.raises(ConfigError, match="a format holds 'model'"):
            FormatCapabilities(family=PLAIN_TORCH, contents=contents)


def test_the_base_class_takes_the_model_as_it_is_and_leaves_the_methods_to_the_format() -> None:
    class Draft(FormatBackend):
        capabilities = FormatCapabilities(family=PLAIN_TORCH)

    model = torch.nn.Linear(1, 1)
    assert Draft.check_model(model, ["model"], "checkpoint.save.format") is model
    assert Draft.name == f"{__name__}:test_the_base_class_takes_the_model_as_it_is_and_leaves_the_methods_to_the_" \
                        "format.<locals>.Draft"
    with pytest.raises(NotImplementedError):
        Draft().save_model(model, Path("unused"))
    with pytest.raises(CheckpointError, match="takes no options"):
        Draft(indent=2)


def test_async_saving_is_decided_by_the_capabilities() -> None:
    class Slow(FormatBackend):
        capabilities = FormatCapabilities(family=PLAIN_TORCH)

    class Sharded(FormatBackend):
        capabilities = FormatCapabilities(family=PLAIN_TORCH, supports_async=True, collective_save=True)

    with pytest.raises(ConfigError, match="cannot write in the background"):
        check_async(Slow, world_size=1)
    check_async(Sharded, world_size=1)
    with pytest.raises(ConfigError, match="saves with collectives on every rank"):
        check_async(Sharded, world_size=2)


def test_hf_options_bound_the_shard_size() -> None:
    assert HFBackend().max_shard_bytes == 5 * 1024**3
    with pytest.raises(CheckpointError, match="max_shard_bytes must be an integer in 1..1099511627776, got 0"):
        HFBackend(max_shard_bytes=0)


def test_the_configured_shard_size_shards_the_saved_model_and_resume_reads_it(tmp_path: Path) -> None:
    config: dict[str, Any] = {"checkpoint": {"root": str(tmp_path), "save": {"max_shard_bytes": 64}}}
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    lc = Lifecycle(config, role="actor", model=model)
    lc.init_load()
    info = lc.save(1)
    assert (info.path / "model" / INDEX).is_file() and len(list((info.path / "model").glob("model-*"))) == 4
    lc.close()
    fresh = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    again = Lifecycle(config, role="actor", model=fresh)
    assert again.resume() == 1
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in model.state_dict().items())
    again.close()
