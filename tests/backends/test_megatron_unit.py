"""Megatron pieces that need no process group: config JSON, CPU patches, construction checks."""

from __future__ import annotations

import json
import os
import pickle
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch
from torch import nn

from lifecycle import ConfigError, Lifecycle, State
from lifecycle.testing import InjectedFailure, MemoryCheckpointer

pytest.importorskip("megatron.core")
megatron = pytest.importorskip("backends.megatron")
megatron_files = pytest.importorskip("backends.megatron_files")


def _transformer_config() -> object:
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, use_cpu_initialization=True)


def test_transformer_config_json_drops_unserializable_attributes_for_the_write_only(tmp_path: Path) -> None:
    config = _transformer_config()
    before = dict(vars(config))
    path = megatron_files.write_transformer_config(config, tmp_path)
    written = json.loads(path.read_text())
    assert {"init_method", "output_layer_init_method", "activation_func"} <= set(written["removed"])
    assert written["config"]["hidden_size"] == 64 and written["config"]["params_dtype"] == "float32"
    assert not set(written["removed"]) & set(written["config"])
    assert vars(config) == before


def test_transformer_config_attributes_are_back_when_the_write_fails_inside_a_phase(tmp_path: Path) -> None:
    config = _transformer_config()
    before = dict(vars(config))
    seen: dict[str, bool] = {}

    def failing_write(*_: object, **__: object) -> None:
        seen["removed_during_write"] = "init_method" not in vars(config)
        raise InjectedFailure("disk full")

    class Failing(MemoryCheckpointer):
        def load_initial(self, parts: object) -> dict[str, object]:
            with mock.patch.object(Path, "write_text", failing_write):
                megatron_files.write_transformer_config(config, tmp_path)
            return {}

    lc = Lifecycle(role="actor", checkpointer=Failing())
    with pytest.raises(InjectedFailure):
        lc.init_load()
    assert lc.state is State.FAILED
    assert seen == {"removed_during_write": True}
    assert vars(config) == before
    assert callable(config.init_method)


def test_cpu_patches_hold_only_inside_the_block_and_only_without_cuda() -> None:
    synchronize, current_device, cuda = torch.cuda.synchronize, torch.cuda.current_device, nn.Module.cuda
    with pytest.raises(InjectedFailure), megatron.cpu_safe():
        if not torch.cuda.is_available():
            assert torch.cuda.current_device() == "cpu"
            assert nn.Linear(2, 2).cuda().weight.device.type == "cpu"
        raise InjectedFailure("inside a dist_checkpointing call")
    assert (torch.cuda.synchronize, torch.cuda.current_device, nn.Module.cuda) == (synchronize, current_device, cuda)


def test_hf_model_with_dist_ckpt_and_no_bridge_is_a_config_error_at_construction() -> None:
    model = megatron.MegatronModel(chunks=[nn.Linear(2, 2)])
    cfg = {"checkpoint": {"save": {"format": "dist_ckpt", "contents": ["model", "hf_model"]}}}
    with pytest.raises(ConfigError, match=r"checkpoint\.save\.contents.*bridge"):
        Lifecycle(cfg, role="actor", model=model)
    Lifecycle({"checkpoint": {"save": {"format": "dist_ckpt"}}}, role="actor", model=model)


def test_mbridge_format_without_a_bridge_or_a_megatron_model_is_a_config_error_at_construction() -> None:
    with pytest.raises(ConfigError, match=r"checkpoint\.save\.format.*bridge"):
        Lifecycle({"checkpoint": {"save": {"format": "mbridge"}}}, role="actor",
                  model=megatron.MegatronModel(chunks=[nn.Linear(2, 2)]))
    with pytest.raises(ConfigError, match=r"checkpoint\.save\.format.*Megatron format"):
        Lifecycle({"checkpoint": {"save": {"format": "dist_ckpt"}}}, role="actor", model={"not": "a model"})


def test_cpu_patches_are_not_applied_when_cuda_is_available() -> None:
    synchronize, current_device = torch.cuda.synchronize, torch.cuda.current_device
    with mock.patch("torch.cuda.is_available", return_value=True), megatron.cpu_safe():
        assert (torch.cuda.synchronize, torch.cuda.current_device) == (synchronize, current_device)


@pytest.mark.parametrize(("edit", "needle"), [
    (lambda g: g[0].update(lr={"__float__": "nan"}), "param_groups[0].lr: must be a finite number like"),
    (lambda g: g[0].update(lr="fast"), "param_groups[0].lr: must be a finite number like"),
    (lambda g: g.append(dict(g[0])), "optimizer.param_groups must list 1 group(s)"),
], ids=["lr-nan", "lr-string", "a-group-more"])
def test_dist_ckpt_refuses_param_groups_that_do_not_fit_before_reading_any_shard(
    tmp_path: Path, edit: object, needle: str
) -> None:
    """The torch optimizer's groups are JSON next to the shards, merged into the running groups:
    checked like the other formats' before `load_sharded` runs (it would fail here: no shards)."""
    from backends import dist_ckpt
    from lifecycle.errors import CheckpointError
    from lifecycle.jsontree import encode

    optimizer = torch.optim.AdamW(nn.Linear(2, 2).parameters(), lr=0.01)
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.state_dict()["param_groups"]]
    doc = encode({"optimizer": {"kind": "torch", "state_keys": ["exp_avg"], "step": 1.0, "param_groups": groups},
                  "lr_scheduler": None}, where="optimizer.json")
    edit(doc["optimizer"]["param_groups"])  # type: ignore[operator]
    (tmp_path / "optimizer.json").write_text(json.dumps({"format_version": 1, **doc}))
    with mock.patch.object(dist_ckpt, "load_sharded", side_effect=AssertionError("read shards")), \
            pytest.raises(CheckpointError) as caught:
        dist_ckpt.DistCkptBackend().load_optimizer(optimizer, None, tmp_path, model=megatron.MegatronModel(chunks=[]))
    assert str(caught.value).startswith(f"{tmp_path / 'optimizer.json'}: does not fit the optimizer: ")
    assert needle in str(caught.value) and optimizer.param_groups[0]["lr"] == 0.01


def test_a_megatron_model_names_its_chunks_parameters_and_buffers_as_a_module_of_them_would() -> None:
    first, second = nn.BatchNorm1d(2), nn.BatchNorm1d(2)
    second.weight = first.weight  # shared by two chunks
    model, module = megatron.MegatronModel(chunks=[first, second]), nn.ModuleDict({"chunk0": first, "chunk1": second})
    for prefix in ("", "model"):
        for remove_duplicate in (True, False):
            assert ([n for n, _ in model.named_parameters(prefix, remove_duplicate=remove_duplicate)]
                    == [n for n, _ in module.named_parameters(prefix, remove_duplicate=remove_duplicate)])
            assert ([n for n, _ in model.named_buffers(prefix, remove_duplicate=remove_duplicate)]
                    == [n for n, _ in module.named_buffers(prefix, remove_duplicate=remove_duplicate)])


@pytest.mark.parametrize("raised", [TypeError("CheckpointingConfig() argument after ** must be a mapping, not list"),
                                    AttributeError("'list' object has no attribute 'get'")])
def test_a_metadata_json_of_another_shape_fails_the_load_as_a_checkpoint_error(tmp_path: Path,
                                                                              raised: Exception) -> None:
    """megatron reads metadata.json into its config class: `[]` or an unknown key raised a raw
    TypeError through every rank."""
    from lifecycle import CheckpointError

    with pytest.raises(CheckpointError, match=rf"{tmp_path}: load failed: {type(raised).__name__}"):
        with megatron.library_errors("load", tmp_path):
            raise raised


@pytest.mark.parametrize(("tp", "pp", "key"), [(0, 1, "parallel.tp"), (-1, 1, "parallel.tp"), (1, 0, "parallel.pp"),
                                               (True, 1, "parallel.tp")])
def test_a_tp_or_pp_below_one_is_a_config_error_naming_it(tp: int, pp: int, key: str) -> None:
    """tp=0 raised ZeroDivisionError, tp=-1 megatron's AssertionError."""
    with pytest.raises(ConfigError, match=rf"{key}.*must be an integer >= 1"):
        megatron.init_parallel(tp, pp)


def _dist_folder(tmp_path: Path, metadata: str | None = '{"sharded_backend": "torch_dist"}',
                 common: bytes | None = b"x") -> Path:
    folder = tmp_path / "model"
    folder.mkdir()
    if metadata is not None:
        (folder / "metadata.json").write_text(metadata)
    if common is not None:
        (folder / "common.pt").write_bytes(common)
    return folder


@pytest.mark.parametrize(("metadata", "needle"), [
    ("[1]", "metadata.json: must map sharded_backend"),
    ('{"sharded_backend": "torch_dist", "sharded_backend_version": NaN}', "metadata.json: must map"),
    ('{"sharded_backend": "torch_dist", "x": 1}', "metadata.json: must map"),
    ("\xff garbage", "metadata.json: not valid JSON"),
], ids=["list", "nan-version", "unknown-key", "garbage"])
def test_a_metadata_json_megatron_cannot_use_is_refused_naming_it(tmp_path: Path, metadata: str, needle: str) -> None:
    from backends.dist_ckpt import load_sharded
    from lifecycle import CheckpointError

    with pytest.raises(CheckpointError, match=needle):
        load_sharded({}, _dist_folder(tmp_path, metadata))


def test_a_huge_metadata_json_is_refused_unread(tmp_path: Path) -> None:
    """A 1 GB sparse metadata.json took 2.4 GB of memory before megatron refused it."""
    from backends.dist_ckpt import load_sharded
    from lifecycle import CheckpointError

    folder = _dist_folder(tmp_path)
    with open(folder / "metadata.json", "r+b") as fh:
        fh.truncate(10**9)
    with pytest.raises(CheckpointError, match=r"metadata.json is larger than 65536 bytes"):
        load_sharded({}, folder)


def test_a_missing_or_special_common_pt_is_refused_naming_it(tmp_path: Path) -> None:
    """Missing, megatron-core raised AttributeError ('str' has no 'iterdir'); a FIFO blocked."""
    import os

    from backends.dist_ckpt import load_sharded
    from lifecycle import CheckpointError

    folder = _dist_folder(tmp_path, common=None)
    with pytest.raises(CheckpointError, match=rf"{folder / 'common.pt'}: file missing"):
        load_sharded({}, folder)
    os.mkfifo(folder / "common.pt")
    with pytest.raises(CheckpointError, match=r"common.pt: a FIFO, not a regular file"):
        load_sharded({}, folder)


@pytest.mark.parametrize("raised", [EOFError(), IndexError("pop from empty list"),
                                    pickle.UnpicklingError("invalid load key")])
def test_a_damaged_common_pt_fails_the_load_as_a_checkpoint_error_naming_the_folder(tmp_path: Path,
                                                                                    raised: Exception) -> None:
    from lifecycle import CheckpointError

    with pytest.raises(CheckpointError, match=rf"{tmp_path}: load failed: {type(raised).__name__}"):
        with megatron.library_errors("load", tmp_path):
            raise raised


def test_a_rank0_write_that_fails_is_a_checkpoint_error_naming_the_folder(tmp_path: Path) -> None:
    from lifecycle import CheckpointError

    def full_disk() -> None:
        raise OSError(28, "No space left on device")

    with pytest.raises(CheckpointError, match=rf"{tmp_path}: HF export failed: OSError.*No space left"):
        megatron.on_rank0(full_disk, "HF export", tmp_path)
    assert megatron.on_rank0(lambda: 5, "HF export", tmp_path) == 5


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_child_forked_during_a_dist_ckpt_save_dies_with_its_parent_and_no_other_child_does() -> None:
    """Megatron's writer processes outlived a rank killed by SIGKILL mid-save."""
    import ctypes
    import os
    import signal

    from backends.dist_ckpt import _WRITERS

    def child_death_signal() -> int:
        pid = os.fork()
        if pid == 0:
            got = ctypes.c_int(-1)
            ctypes.CDLL(None).prctl(2, ctypes.byref(got), 0, 0, 0)  # PR_GET_PDEATHSIG
            os._exit(got.value)
        return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])

    with _WRITERS.die_with_parent():
        assert child_death_signal() == signal.SIGKILL
    assert child_death_signal() == 0


@pytest.mark.parametrize("config", ['{"model_type": "no_such_model"}', '{"hidden_size": 8}', "[1, 2]", "not json",
                                    None])
def test_build_model_refuses_a_folder_without_a_config_transformers_reads_naming_it(
        tmp_path: Path, config: str | None) -> None:
    """Raw ValueError/OSError from AutoConfig before; a FIFO config.json (None here) blocked the read."""
    if config is None:
        os.mkfifo(tmp_path / "config.json")
    else:
        (tmp_path / "config.json").write_text(config)
    with pytest.raises(ConfigError, match=str(tmp_path)) as info:
        megatron.build_model(tmp_path, tp=1, pp=1)
    assert info.value.key == "hf_config"
