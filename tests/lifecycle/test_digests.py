"""Digests travel as values: a save's writers hand theirs to the manifest, a resume hands the
manifest's to the readers (model and optimizer) and hashes only what they did not verify."""

from __future__ import annotations

import __future__
import dataclasses
import json
import types
from collections.abc import Callable
from contextvars import ContextVar
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import lifecycle.checksum as checksum
import lifecycle.manifest as manifest_module
import lifecycle.load_format as load_format
from backends.hf import HFBackend
from lifecycle import LifecycleConfig
from lifecycle.checkpointer import DiskCheckpointer
from lifecycle.checksum import ALGORITHM, file_digest
from lifecycle.errors import CheckpointError
from lifecycle.manifest import build_manifest
from lifecycle.types import Parts, Progress

WEIGHTS = "model/model.safetensors"
OPTIMIZER_TENSORS = "optimizer/optimizer.safetensors"
WRITTEN_WHILE_HASHED = {WEIGHTS, OPTIMIZER_TENSORS, "extra/rank_0/rng.safetensors"}


def config(root: Path, **checkpoint: Any) -> LifecycleConfig:
    return LifecycleConfig.from_dict({"checkpoint": {"root": str(root), **checkpoint},
                                      "resume": {"on_damaged": "refuse"}})


def parts(seed: int = 0) -> Parts:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(3, 8)).sum().backward()
    optimizer.step()
    return Parts(model=model, optimizer=optimizer)


def spy(monkeypatch: pytest.MonkeyPatch, module: Any) -> list[str]:
    """Every file `module.file_digest` hashes from now on, by its path in the role folder
    (`actor`, or `.staging-actor` before the commit)."""
    seen: list[str] = []
    real = checksum.file_digest

    def counting(path: Path, **kwargs: Any) -> str:
        names = Path(path).parts
        role = max(i for i, name in enumerate(names) if name.endswith("actor"))
        seen.append("/".join(names[role + 1:]))
        return real(path, **kwargs)

    monkeypatch.setattr(module, "file_digest", counting)
    return seen


def manifest_of(folder: Path) -> dict[str, str]:
    doc = json.loads((folder / "manifest.json").read_text())
    return {f["path"]: f[ALGORITHM] for f in doc["files"]}


@pytest.mark.parametrize("async_", [False, True])
def test_the_manifest_takes_the_digests_the_writers_returned_and_hashes_only_the_rest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, async_: bool
) -> None:
    hashed = spy(monkeypatch, manifest_module)
    ckpt = DiskCheckpointer(config(tmp_path, save={"async": async_}), role="actor")
    ckpt.save(1, parts(), Progress(step=1))
    info = ckpt.wait() if async_ else None
    folder = tmp_path / "global_step_1" / "actor"
    assert info is None or info.path == folder
    assert sorted(hashed) == ["extra/rank_0/extra.json", "optimizer/optimizer.json"]
    digests = manifest_of(folder)
    assert WRITTEN_WHILE_HASHED <= set(digests)
    assert all(digests[rel] == file_digest(folder / rel) for rel in digests)


def test_a_returned_digest_is_what_the_manifest_states_without_reading_the_file(tmp_path: Path) -> None:
    (tmp_path / "a.bin").write_bytes(b"written")
    (tmp_path / "b.bin").write_bytes(b"not hashed while written")
    built = build_manifest(tmp_path, step=1, role="actor", contents={}, parallel={}, model_config_hash=None,
                           meta={}, digests={"a.bin": "0123456789abcdef"})
    stated = {f["path"]: f[ALGORITHM] for f in built["files"]}
    assert stated == {"a.bin": "0123456789abcdef", "b.bin": file_digest(tmp_path / "b.bin")}


def test_a_digest_for_a_file_the_folder_does_not_hold_fails_the_commit(tmp_path: Path) -> None:
    (tmp_path / "a.bin").write_bytes(b"x")
    with pytest.raises(CheckpointError, match="digests for files it does not hold: gone.bin"):
        build_manifest(tmp_path, step=1, role="actor", contents={}, parallel={}, model_config_hash=None,
                       meta={}, digests={"gone.bin": "0" * 16})


def saved(tmp_path: Path) -> Parts:
    source = parts(seed=1)
    DiskCheckpointer(config(tmp_path), role="actor").save(1, source, Progress(step=1))
    return source


def spy_loads(monkeypatch: pytest.MonkeyPatch, verify_in_reader: bool = True, method: str = "load_model"
              ) -> list[set[str]]:
    """What each `HFBackend.load_model` (or `method`) returned; without `verify_in_reader`, a
    reader that checks nothing."""
    returned: list[set[str]] = []
    real: Callable[..., set[str]] = getattr(HFBackend, method)

    def load(self: HFBackend, *args: Any, expected: Any = None, **kwargs: Any) -> set[str]:
        returned.append(real(self, *args, expected=expected if verify_in_reader else None, **kwargs))
        return returned[-1]

    monkeypatch.setattr(HFBackend, method, load)
    return returned


def test_resume_lets_the_reader_verify_the_weights_and_hashes_only_the_other_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = saved(tmp_path)
    returned = spy_loads(monkeypatch)
    hashed_before, hashed_after = spy(monkeypatch, manifest_module), spy(monkeypatch, checksum)
    fresh = parts(seed=2)
    assert DiskCheckpointer(config(tmp_path), role="actor").resume(fresh) == Progress(step=1)
    assert returned == [{"model.safetensors"}]
    files = set(manifest_of(tmp_path / "global_step_1" / "actor"))
    assert sorted(hashed_before) == sorted(files - {WEIGHTS, OPTIMIZER_TENSORS}) and hashed_after == []
    assert all(torch.equal(a, b) for a, b in zip(source.model.parameters(), fresh.model.parameters()))


def test_weights_no_reader_verified_are_hashed_after_the_load(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    saved(tmp_path)
    returned = spy_loads(monkeypatch, verify_in_reader=False)
    hashed_before, hashed_after = spy(monkeypatch, manifest_module), spy(monkeypatch, checksum)
    assert DiskCheckpointer(config(tmp_path), role="actor").resume(parts(seed=2)) == Progress(step=1)
    assert returned == [set()] and WEIGHTS not in hashed_before and hashed_after == [WEIGHTS]


@pytest.mark.parametrize("verify_in_reader", [True, False])
def test_a_flipped_byte_in_the_weights_is_caught_whoever_checks_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, verify_in_reader: bool
) -> None:
    saved(tmp_path)
    weights = tmp_path / "global_step_1" / "actor" / WEIGHTS
    data = bytearray(weights.read_bytes())
    data[-3] ^= 0x10
    weights.write_bytes(bytes(data))
    spy_loads(monkeypatch, verify_in_reader)
    ckpt = DiskCheckpointer(config(tmp_path, load={"verify": True}), role="actor")
    with pytest.raises(CheckpointError, match="model.safetensors: checksum [0-9a-f]+ != manifest"):
        ckpt.resume(parts(seed=2))


def test_resume_reads_the_hf_optimizer_tensors_once_and_still_refuses_a_flipped_byte(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = saved(tmp_path)
    returned = spy_loads(monkeypatch, method="load_optimizer")
    hashed_before, hashed_after = spy(monkeypatch, manifest_module), spy(monkeypatch, checksum)
    fresh = parts(seed=2)
    assert DiskCheckpointer(config(tmp_path), role="actor").resume(fresh) == Progress(step=1)
    assert returned == [{"optimizer.safetensors"}]
    assert OPTIMIZER_TENSORS not in hashed_before + hashed_after
    assert torch.equal(fresh.optimizer.state_dict()["state"][0]["exp_avg"],
                       source.optimizer.state_dict()["state"][0]["exp_avg"])
    tensors = tmp_path / "global_step_1" / "actor" / OPTIMIZER_TENSORS
    data = bytearray(tensors.read_bytes())
    data[-3] ^= 0x10
    tensors.write_bytes(bytes(data))
    damaged = parts(seed=2)
    untouched = damaged.optimizer.state_dict()["state"][0]["exp_avg"].clone()
    with pytest.raises(CheckpointError, match="optimizer.safetensors: checksum [0-9a-f]+ != manifest"):
        DiskCheckpointer(config(tmp_path), role="actor").resume(damaged)
    assert torch.equal(damaged.optimizer.state_dict()["state"][0]["exp_avg"], untouched)


def test_a_format_that_does_not_verify_as_it_reads_has_its_weights_checked_before_the_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """So a damaged step never overwrites the model."""
    saved(tmp_path)
    real = load_format.format_capabilities
    monkeypatch.setattr(load_format, "format_capabilities",
                        lambda name, key: dataclasses.replace(real(name, key), verifies_reads=False))
    hashed_before, hashed_after = spy(monkeypatch, manifest_module), spy(monkeypatch, checksum)
    returned = spy_loads(monkeypatch)
    assert DiskCheckpointer(config(tmp_path), role="actor").resume(parts(seed=2)) == Progress(step=1)
    assert WEIGHTS in hashed_before and hashed_after == [] and returned == [set()]
    weights = tmp_path / "global_step_1" / "actor" / WEIGHTS
    data = bytearray(weights.read_bytes())
    data[-3] ^= 0x10
    weights.write_bytes(bytes(data))
    fresh = parts(seed=2)
    untouched = {k: v.clone() for k, v in fresh.model.state_dict().items()}
    with pytest.raises(CheckpointError, match="model.safetensors: checksum [0-9a-f]+ != manifest"):
        DiskCheckpointer(config(tmp_path), role="actor").resume(fresh)
    assert len(returned) == 1 and all(torch.equal(untouched[k], v) for k, v in fresh.model.state_dict().items())


def test_checksum_keeps_no_state_between_calls() -> None:
    """Only constants, functions, classes and modules at module level: no cache, no context variable."""
    immutable = (str, int, float, bool, tuple, frozenset, bytes, type(None), type(__future__.annotations))
    state = {name: value for name, value in vars(checksum).items()
             if not name.startswith("__") and not isinstance(value, (types.ModuleType, types.FunctionType, type))
             and not isinstance(value, immutable) and not callable(value)}
    assert state == {}
    assert not any(isinstance(value, ContextVar) for value in vars(checksum).values())
    for removed in ("remember", "known_digest", "expecting", "expected_digest", "mark_verified"):
        assert not hasattr(checksum, removed)


@pytest.mark.parametrize("digest", ["e3b0c44298fc1c149afbf4c8996fb924", "0123456789ABCDEF", "012345", 17])
def test_a_returned_digest_of_another_algorithm_or_shape_fails_the_commit(tmp_path: Path, digest: Any) -> None:
    (tmp_path / "a.bin").write_bytes(b"x")
    with pytest.raises(CheckpointError, match=r"digests that are not xxh3_64-tree-4MiB digests .* for: a\.bin"):
        build_manifest(tmp_path, step=1, role="actor", contents={}, parallel={}, model_config_hash=None,
                       meta={}, digests={"a.bin": digest})


def test_loads_build_the_saved_format_with_its_configured_options_and_others_with_defaults() -> None:
    config = LifecycleConfig.from_dict({"checkpoint": {"save": {"format": "hf", "max_shard_bytes": 4096}}})
    assert load_format.build_format(config, "hf").options.max_shard_bytes == 4096
    default = LifecycleConfig.from_dict({"checkpoint": {"save": {"format": "torch_dcp"}}})
    assert load_format.build_format(default, "hf").options.max_shard_bytes == HFBackend().options.max_shard_bytes
