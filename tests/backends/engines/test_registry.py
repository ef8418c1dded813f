"""CheckpointEngineRegistry: names, backends from outside, missing dependencies, `auto`."""

from __future__ import annotations

import importlib
import sys
from importlib.metadata import EntryPoint

import pytest
import torch

import backends.registry as registry_module
from backends.engines import CheckpointEngine, CheckpointEngineRegistry, WeightSync
from backends.engines.options import EngineCapabilities
from backends.engines.registry import DEVICE_BACKENDS, ENGINES, ENTRY_POINT_GROUP
from backends.engines.naive import NaiveEngine
from lifecycle import Lifecycle
from lifecycle.errors import ConfigError, EngineError
from tests.backends.engines.custom_engine import OutsideEngine

BUILTIN = ["gloo", "hccl", "naive", "nccl", "shm"]


def test_every_builtin_engine_is_listed_whether_or_not_its_dependency_is_installed() -> None:
    assert set(BUILTIN) <= set(CheckpointEngineRegistry.names())


@pytest.mark.parametrize("name", ["gloo", "shm", "naive"])
def test_cpu_engines_build_with_the_given_settings(name: str) -> None:
    engine = CheckpointEngineRegistry.new(name, bucket_bytes=1 << 20, verify=False, timeout_s=5,
                                          rollout_dtype="bfloat16")
    assert isinstance(engine, CheckpointEngine) and engine.name == name
    assert (engine.bucket_bytes, engine.verify, engine.timeout_s, engine.rollout_dtype) == (
        1 << 20, False, 5.0, torch.bfloat16)


def test_hccl_imports_without_torch_npu_and_asking_for_it_names_the_package() -> None:
    module = importlib.import_module("backends.engines.hccl")
    assert "torch_npu" not in sys.modules and module.HcclEngine.name == "hccl"
    with pytest.raises(ConfigError, match=r"^engine\.backend: checkpoint engine 'hccl' needs the package torch_npu"):
        CheckpointEngineRegistry.get("hccl")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_nccl_imports_without_cuda_and_asking_for_it_names_what_is_missing() -> None:
    assert importlib.import_module("backends.engines.nccl").NcclEngine.name == "nccl"
    with pytest.raises(ConfigError, match="checkpoint engine 'nccl' needs the package torch built with CUDA"):
        CheckpointEngineRegistry.get("nccl")


@pytest.mark.parametrize(("device", "engine"), [("cpu", "gloo"), ("cuda", "nccl"), ("npu", "hccl")])
def test_auto_maps_the_device_type(device: str, engine: str) -> None:
    assert CheckpointEngineRegistry.resolve("auto", device) == engine
    assert CheckpointEngineRegistry.resolve("shm", device) == "shm"


def test_auto_on_an_unknown_device_is_a_config_error_listing_the_supported_ones() -> None:
    with pytest.raises(ConfigError) as info:
        CheckpointEngineRegistry.resolve("auto", "xpu")
    assert info.value.key == "engine.backend"
    assert "'xpu'" in str(info.value) and "cpu -> gloo, cuda -> nccl, npu -> hccl" in str(info.value)


def test_an_unknown_name_lists_the_known_ones() -> None:
    with pytest.raises(ConfigError, match="unknown checkpoint engine 'carrier_pigeon'; known: cuda_ipc, gloo, hccl, naive"):
        CheckpointEngineRegistry.get("carrier_pigeon")


def test_an_import_path_names_an_engine_from_outside_the_package() -> None:
    assert CheckpointEngineRegistry.get("tests.backends.engines.custom_engine:OutsideEngine") is OutsideEngine


@pytest.mark.parametrize(("path", "message"), [
    ("no_such_pkg.engines:Fast", "needs the package 'no_such_pkg'"),
    ("tests.backends.engines.custom_engine:Missing", "has no 'Missing'"),
    ("tests.backends.engines.custom_engine:NOT_AN_ENGINE", "not a subclass of backends.engines.base.CheckpointEngine"),
])
def test_a_bad_import_path_says_what_is_wrong(path: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        CheckpointEngineRegistry.get(path)


def test_register_adds_a_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ENGINES, "_registered", dict(ENGINES._registered))

    @CheckpointEngineRegistry.register("pigeon")
    class Pigeon(NaiveEngine):
        pass

    assert "pigeon" in CheckpointEngineRegistry.names()
    assert isinstance(CheckpointEngineRegistry.new("pigeon"), Pigeon) and Pigeon.name == "pigeon"


def test_an_entry_point_adds_a_name(monkeypatch: pytest.MonkeyPatch) -> None:
    point = EntryPoint("outside", "tests.backends.engines.custom_engine:OutsideEngine", ENTRY_POINT_GROUP)
    scans: list[str] = []
    monkeypatch.setattr(OutsideEngine, "name", OutsideEngine.name)

    def entry_points(group: str) -> list[EntryPoint]:
        scans.append(group)
        return [point] if group == ENTRY_POINT_GROUP else []

    monkeypatch.setattr(registry_module, "entry_points", entry_points)
    assert "outside" in CheckpointEngineRegistry.names()
    scans.clear()
    assert CheckpointEngineRegistry.get("outside") is OutsideEngine and OutsideEngine.name == "outside"
    assert len(scans) == 1
    with pytest.raises(ConfigError, match="unknown checkpoint engine 'smoke_signal'; known: .*outside"):
        CheckpointEngineRegistry.get("smoke_signal")
    assert len(scans) == 2


def test_lifecycle_builds_its_engine_from_config_with_auto_picking_gloo_for_a_cpu_model() -> None:
    lc = Lifecycle({"engine": {"bucket_bytes": 1 << 16, "timeout_s": 7, "profile": True, "profile_dir": "/p"}},
                   model=torch.nn.Linear(2, 2))
    syncer = lc.engine
    assert isinstance(syncer, WeightSync) and syncer.engine.name == "gloo"
    assert (syncer.engine.bucket_bytes, syncer.engine.timeout_s, syncer.profile_dir) == (1 << 16, 7.0, "/p")


def test_a_lifecycle_with_an_engine_that_cannot_run_here_is_refused_when_built_naming_the_package() -> None:
    with pytest.raises(ConfigError, match="torch_npu"):
        Lifecycle({"engine": {"backend": "hccl"}}, model=torch.nn.Linear(2, 2))


def test_a_registered_engine_is_selected_by_name_in_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ENGINES, "_registered", dict(ENGINES._registered))

    @CheckpointEngineRegistry.register("courier")
    class Courier(NaiveEngine):
        pass

    lc = Lifecycle({"engine": {"backend": "courier", "bucket_bytes": 4096}}, model=torch.nn.Linear(2, 2))
    assert isinstance(lc.engine.engine, Courier) and lc.engine.engine.bucket_bytes == 4096


def test_a_builtin_name_cannot_be_taken_by_another_class() -> None:
    with pytest.raises(ConfigError, match="'gloo': the name belongs to the built-in backends.engines.gloo:GlooEngine"):
        CheckpointEngineRegistry.register("gloo")(OutsideEngine)


def test_each_auto_pick_serves_the_device_it_is_picked_for() -> None:
    for device, name in DEVICE_BACKENDS.items():
        capabilities = ENGINES.get(name).capabilities
        assert capabilities.devices is not None and device in capabilities.devices


def test_the_naive_engine_declares_it_runs_in_one_process() -> None:
    assert NaiveEngine.capabilities == EngineCapabilities(in_process=True)
    assert not ENGINES.get("gloo").capabilities.in_process


def test_engine_options_are_checked_when_an_engine_is_built() -> None:
    with pytest.raises(EngineError, match=r"^gloo engine: bucket_bytes must be in 64\.\.1099511627776 \(64 B\.\.1 TiB"):
        CheckpointEngineRegistry.new("gloo", bucket_bytes=8)
    with pytest.raises(EngineError, match="naive engine: .*unexpected keyword argument 'flavour'"):
        CheckpointEngineRegistry.new("naive", flavour=1)
    engine = CheckpointEngineRegistry.new("naive", rollout_dtype=torch.float16)
    assert (engine.rollout_dtype, engine.options.rollout_dtype) == (torch.float16, "float16")


def test_no_engine_instance_attribute_hides_a_method_of_its_class() -> None:
    """An attribute set in `__init__` under a method's name turns every call of that method into a
    call of the attribute (cuda_ipc's list of exported handles once hid the shared-slot engines'
    method that opens the sender's regions, so no receiver could start)."""
    from backends.engines.cuda_ipc import CudaIpcEngine  # builds without CUDA; refuses only in prepare()
    from backends.engines.gloo import GlooEngine
    from backends.engines.naive import NaiveEngine
    from backends.engines.nccl import NcclEngine
    from backends.engines.shm import ShmEngine

    for engine_class in (GlooEngine, ShmEngine, CudaIpcEngine, NcclEngine, NaiveEngine):
        engine = engine_class(bucket_bytes=4096)
        hidden = [attr for attr in vars(engine) if callable(getattr(engine_class, attr, None))]
        assert hidden == [], (engine_class.__name__, hidden)
