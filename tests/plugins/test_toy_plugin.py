"""A format and an engine from another package plug in without an edit to the project.

`site/toy_checkpoints` is that package. It is reached three ways: installed (a dist-info with
entry points on sys.path), registered by decorator, and named by import path. Each way, a
YAML config selects both by name, and a `Lifecycle` saves, resumes and syncs through them.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from backends.base import FORMATS, backend_class
from backends.engines import CheckpointEngineRegistry
from backends.engines.registry import ENGINES
from lifecycle import Lifecycle, LifecycleConfig
from lifecycle.errors import ConfigError
from lifecycle.testing import MemoryRollout
from tests.plugins.distribution import install

SITE = Path(__file__).parent / "site"
ENTRY_POINTS = """\
[trainer_lifecycle.formats]
toy = toy_checkpoints.formats:ToyFormat

[trainer_lifecycle.checkpoint_engines]
toy = toy_checkpoints.engines:ToyEngine
"""
CONFIG = """\
checkpoint:
  root: {root}
  save:
    format: {format}
    contents: [model, extra]
    indent: 2
  load:
    contents: [model, extra]
engine:
  backend: {engine}
  bucket_bytes: 4096
  clone: false
"""


@pytest.fixture
def toy_site(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """`toy_checkpoints` importable, as if installed; forgotten again after the test."""
    monkeypatch.syspath_prepend(str(SITE))
    yield
    for name in [m for m in sys.modules if m.partition(".")[0] == "toy_checkpoints"]:
        del sys.modules[name]


@pytest.fixture
def installed(toy_site: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A dist-info declaring the package's entry points, found by `importlib.metadata`."""
    install(tmp_path, monkeypatch, "toy-checkpoints", ENTRY_POINTS)


@pytest.fixture
def registries(monkeypatch: pytest.MonkeyPatch) -> None:
    """Decorators register into copies, so no test leaves a name behind."""
    monkeypatch.setattr(FORMATS, "_registered", dict(FORMATS._registered))
    monkeypatch.setattr(ENGINES, "_registered", dict(ENGINES._registered))


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Linear(3, 2)


def _config(tmp_path: Path, fmt: str, engine: str) -> LifecycleConfig:
    path = tmp_path / "lifecycle.yaml"
    path.write_text(CONFIG.format(root=tmp_path / "ckpt", format=fmt, engine=engine), encoding="utf-8")
    return LifecycleConfig.from_yaml(path)


def _save_sync_resume(config: LifecycleConfig, fmt: str, engine: str) -> None:
    """Save step 1, sync it to an in-process rollout, resume it into a fresh model."""
    model = _model(seed=0)
    lc = Lifecycle(config, role="actor", model=model)
    lc.init_load()
    with lc.train_step(1), torch.no_grad():
        model.weight.add_(1.0)
    info = lc.save(1)
    assert info.backend == fmt
    assert (info.path / "model" / "weights.json").read_text(encoding="utf-8").startswith('{\n  "weight"')
    rollout = MemoryRollout()
    assert lc.sync_weights(rollout) == 1
    assert torch.equal(rollout.serve()["weight"], model.weight) and rollout.weights_version == 1
    from toy_checkpoints.engines import ToyEngine

    sender = lc.engine.engine  # type: ignore[attr-defined]
    assert isinstance(sender, ToyEngine) and (sender.name, sender.options.clone) == (engine, False)
    assert lc.history[-1].figures["backend"] == engine
    lc.close()

    fresh = _model(seed=1)
    assert not torch.equal(fresh.weight, model.weight)
    again = Lifecycle(config, role="actor", model=fresh)
    assert again.resume() == 1
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in model.state_dict().items())
    again.close()


def test_a_format_and_an_engine_installed_by_entry_point_save_resume_and_sync_by_name(
    installed: None, tmp_path: Path
) -> None:
    assert "toy" in FORMATS.names() and "toy" in CheckpointEngineRegistry.names()
    config = _config(tmp_path, "toy", "toy")
    assert (config.checkpoint.save.format, config.checkpoint.save.options) == ("toy", {"indent": 2})
    assert (config.engine.backend, config.engine.options) == ("toy", {"clone": False})
    _save_sync_resume(config, "toy", "toy")
    manifest = json.loads(next((tmp_path / "ckpt").glob("global_step_1/actor/manifest.json")).read_text())
    assert manifest["contents"]["model"]["backend"] == "toy"


def test_a_format_and_an_engine_registered_by_decorator_save_resume_and_sync_by_name(
    toy_site: None, registries: None, tmp_path: Path
) -> None:
    from toy_checkpoints.engines import ToyEngine
    from toy_checkpoints.formats import ToyFormat

    @FORMATS.register("toy_registered")
    class RegisteredFormat(ToyFormat):
        """The toy format under a name of its own."""

    @CheckpointEngineRegistry.register("toy_registered")
    class RegisteredEngine(ToyEngine):
        """The toy engine under a name of its own."""

    assert "toy_registered" in FORMATS.names() and "toy_registered" in CheckpointEngineRegistry.names()
    _save_sync_resume(_config(tmp_path, "toy_registered", "toy_registered"), "toy_registered", "toy_registered")


def test_a_format_and_an_engine_named_by_import_path_save_resume_and_sync(toy_site: None, tmp_path: Path) -> None:
    fmt, engine = "toy_checkpoints.formats:ToyFormat", "toy_checkpoints.engines:ToyEngine"
    config = _config(tmp_path, fmt, engine)
    assert backend_class(fmt).name == fmt
    model = _model(seed=0)
    lc = Lifecycle(config, role="actor", model=model)
    lc.init_load()
    info = lc.save(1)
    assert info.backend == fmt and lc.sync_weights(MemoryRollout()) == 1
    lc.close()
    again = Lifecycle(config, role="actor", model=_model(seed=1))
    assert again.resume() == 1 and torch.equal(again.parts.model.weight, model.weight)
    again.close()


@pytest.mark.parametrize(("section", "key", "message"), [
    ({"save": {"contents": ["model", "optimizer"]}}, "checkpoint.save.contents",
     "format 'toy' cannot hold optimizer; it holds model (and extra)"),
    ({"save": {"indent": 9}}, "checkpoint.save.indent", "must be <= 8, got 9"),
    ({"save": {"max_shard_bytes": 1}}, "checkpoint.save.max_shard_bytes",
     "unknown key; valid keys: async, contents, format, indent"),
    ({"pre_load": {"format": "mbridge"}}, "checkpoint.pre_load.format",
     "'mbridge' is a Megatron format but checkpoint.save.format 'toy' is a plain-torch format"),
])
def test_a_plugin_format_is_checked_like_a_builtin(
    installed: None, section: dict[str, Any], key: str, message: str
) -> None:
    checkpoint = {**section, "save": {"format": "toy", "contents": ["model"], **section.get("save", {})}}
    with pytest.raises(ConfigError) as info:
        LifecycleConfig(checkpoint=checkpoint)
    assert info.value.key == key and message in str(info.value)


def test_a_plugin_engine_s_own_keys_need_it_named(installed: None) -> None:
    assert LifecycleConfig(engine={"backend": "toy", "clone": False}).engine.options == {"clone": False}
    with pytest.raises(ConfigError, match=r"^engine\.clone: unknown key; valid keys: apply, backend, bucket_bytes"):
        LifecycleConfig(engine={"clone": False})
    with pytest.raises(ConfigError, match=r"^engine\.clone: expected a boolean, got 'no' \(str\)$"):
        LifecycleConfig(engine={"backend": "toy", "clone": "no"})


def test_without_the_dist_info_the_names_are_unknown_and_listed(toy_site: None) -> None:
    with pytest.raises(ConfigError) as info:
        LifecycleConfig(checkpoint={"save": {"format": "toy"}})
    assert info.value.key == "checkpoint.save.format"
    assert "expected one of dist_ckpt, hf, mbridge, torch_dcp or an import path" in str(info.value)
