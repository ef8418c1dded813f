"""Training extras: RNG, progress and dataloader state round trip without pickle."""

from __future__ import annotations

import json
import os
import pickle
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from lifecycle.errors import CheckpointError
from lifecycle.extra import load_extra, save_extra
from lifecycle.types import Progress
from tests.edits import edit_json, nested
from tests.guards import within

HANG_GUARD_S = 20


class StatefulLoader:
    def __init__(self) -> None:
        self.position = 0
        self.order: tuple[int, ...] = (3, 1, 2)

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position, "order": self.order, "nested": {"epoch_seed": 7}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position = state["position"]
        self.order = state["order"]


class OpaqueLoader:
    def state_dict(self) -> dict[str, Any]:
        return {"sampler": object()}


class Exploit:
    """Unpickling this creates `marker`: proof that something unpickled it."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (str(self.marker), "w"))


def draws() -> tuple[float, float, list[float]]:
    return random.random(), float(np.random.rand()), torch.rand(3).tolist()


def test_rng_states_round_trip(tmp_path: Path) -> None:
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    save_extra(tmp_path, Progress(step=4))
    expected = draws()
    draws()
    load_extra(tmp_path)
    assert draws() == expected


def test_progress_round_trips(tmp_path: Path) -> None:
    progress = Progress(step=12, epoch=2, consumed_samples=3072, weights_version=5,
                        user={"best": 0.5, "pair": (1, 2), "tags": ["a"], "inf": float("inf")})
    save_extra(tmp_path, progress)
    assert load_extra(tmp_path) == progress


def test_files_written_are_json_and_safetensors(tmp_path: Path) -> None:
    save_extra(tmp_path, Progress(step=1))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["extra.json", "rng.safetensors"]
    doc = json.loads((tmp_path / "extra.json").read_text())
    assert doc["progress"]["step"] == 1 and doc["rng"]["torch"] == ["torch_cpu"]


def test_dataloader_state_round_trips(tmp_path: Path) -> None:
    loader = StatefulLoader()
    loader.position, loader.order = 17, (2, 0, 1)
    save_extra(tmp_path, Progress(), loader)
    fresh = StatefulLoader()
    load_extra(tmp_path, fresh)
    assert (fresh.position, fresh.order) == (17, (2, 0, 1))


def test_dataloader_state_that_is_not_json_names_the_type(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="OpaqueLoader.*sampler"):
        save_extra(tmp_path, Progress(), OpaqueLoader())


def test_user_progress_that_is_not_json_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="Progress.user.*fn"):
        save_extra(tmp_path, Progress(user={"fn": print}))


@pytest.mark.parametrize("text", ["{broken", "[]", '{"format_version": 1}', "{\"format_version\": 2}"])
def test_malformed_extra_json_names_the_file(tmp_path: Path, text: str) -> None:
    save_extra(tmp_path, Progress())
    (tmp_path / "extra.json").write_text(text)
    with pytest.raises(CheckpointError, match="extra.json"):
        load_extra(tmp_path)


def test_negative_step_is_rejected(tmp_path: Path) -> None:
    save_extra(tmp_path, Progress())
    doc = json.loads((tmp_path / "extra.json").read_text())
    doc["progress"]["step"] = -1
    (tmp_path / "extra.json").write_text(json.dumps(doc))
    with pytest.raises(CheckpointError, match="extra.json.*step"):
        load_extra(tmp_path)


@pytest.mark.parametrize("name", ["state.pkl", "rng.pt"])
def test_planted_pickle_is_refused_and_never_executed(tmp_path: Path, name: str) -> None:
    live = tmp_path / "proof-the-payload-is-live"
    pickle.loads(pickle.dumps(Exploit(live)))
    assert live.exists()
    marker = tmp_path / "pwned"
    folder = tmp_path / "extra"
    save_extra(folder, Progress())
    (folder / name).write_bytes(pickle.dumps(Exploit(marker)))
    with pytest.raises(CheckpointError, match=name):
        load_extra(folder)
    assert not marker.exists()


def test_pickle_in_place_of_rng_file_is_refused_and_never_executed(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    folder = tmp_path / "extra"
    save_extra(folder, Progress())
    (folder / "rng.safetensors").write_bytes(pickle.dumps(Exploit(marker)))
    with pytest.raises(CheckpointError, match="rng.safetensors"):
        load_extra(folder)
    assert not marker.exists()


def test_rng_tensor_of_wrong_dtype_is_refused(tmp_path: Path) -> None:
    save_extra(tmp_path, Progress())
    save_file({"torch_cpu": torch.zeros(10)}, str(tmp_path / "rng.safetensors"))
    with pytest.raises(CheckpointError, match="uint8"):
        load_extra(tmp_path)


def test_bad_file_leaves_rng_untouched(tmp_path: Path) -> None:
    random.seed(5)
    save_extra(tmp_path, Progress())
    (tmp_path / "rng.safetensors").write_bytes(b"truncated")
    random.seed(9)
    before = random.getstate()
    with pytest.raises(CheckpointError):
        load_extra(tmp_path)
    assert random.getstate() == before


def test_progress_without_restoring_rng(tmp_path: Path) -> None:
    random.seed(1)
    save_extra(tmp_path, Progress(step=3))
    random.seed(2)
    before = random.getstate()
    assert load_extra(tmp_path, restore_rng=False).step == 3
    assert random.getstate() == before


def test_a_cuda_rng_state_of_another_length_is_refused_before_any_rng_is_restored(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The CUDA state was restored last and checked by nothing: a 3-byte one failed after the
    Python, numpy and CPU RNGs had moved. Run with a stand-in CUDA (16-byte Philox state)."""
    random.seed(1)
    save_extra(tmp_path, Progress())
    save_file({"torch_cpu": torch.get_rng_state(), "cuda": torch.zeros(3, dtype=torch.uint8)},
              str(tmp_path / "rng.safetensors"))
    restored: list[Any] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda *a, **k: torch.zeros(16, dtype=torch.uint8))
    monkeypatch.setattr(torch.cuda, "set_rng_state", restored.append)
    random.seed(2)
    before = random.getstate(), np.random.get_state()[1].tolist(), torch.get_rng_state()
    with pytest.raises(CheckpointError, match="'cuda' holds 3 bytes, where this device's RNG state is 16"):
        load_extra(tmp_path)
    after = random.getstate(), np.random.get_state()[1].tolist(), torch.get_rng_state()
    assert after[:2] == before[:2] and torch.equal(after[2], before[2]) and restored == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_rng_state_round_trips(tmp_path: Path) -> None:
    torch.cuda.manual_seed(11)
    save_extra(tmp_path, Progress())
    expected = torch.rand(4, device="cuda").tolist()
    torch.rand(4, device="cuda")
    load_extra(tmp_path)
    assert torch.rand(4, device="cuda").tolist() == expected


# Files no parser takes: a CheckpointError naming the file, never a RecursionError ----------

def edit_extra(folder: Path, edit: Any) -> Path:
    return edit_json(folder / "extra.json", edit)


@pytest.mark.parametrize("text", ["[" * 100_000 + "]" * 100_000, '{"format_version": ' + "9" * 5000 + "}",
                                  '{"format_version": 1, "x": "\udcff"}'],
                         ids=["nested-deep", "huge-integer", "not-utf8"])
def test_extra_json_no_parser_takes_names_the_file(tmp_path: Path, text: str) -> None:
    save_extra(tmp_path, Progress())
    (tmp_path / "extra.json").write_bytes(text.encode("utf-8", "surrogateescape"))
    with pytest.raises(CheckpointError, match=f"{tmp_path / 'extra.json'}: not valid JSON"):
        load_extra(tmp_path)


@pytest.mark.parametrize("plant", [lambda d: d["progress"].update(user=nested(600)),
                                   lambda d: d.update(dataloader=nested(600))], ids=["progress.user", "dataloader"])
def test_state_nested_past_the_depth_bound_names_the_file_and_key(tmp_path: Path, plant: Any) -> None:
    save_extra(tmp_path, Progress())
    path = edit_extra(tmp_path, plant)
    with pytest.raises(CheckpointError, match=rf"{path}: value at .*a\.a is nested more than 64 levels deep"):
        load_extra(tmp_path, StatefulLoader())


def test_user_progress_nested_past_the_bound_or_holding_itself_is_refused_at_save(tmp_path: Path) -> None:
    loop: dict[str, Any] = {}
    loop["self"] = loop
    for user in (nested(100), loop):
        with pytest.raises(CheckpointError, match=f"{tmp_path / 'extra.json'}: value at .* nested more than 64"):
            save_extra(tmp_path, Progress(user=user))
    save_extra(tmp_path, Progress(user=nested(60)))
    assert load_extra(tmp_path).user == nested(60)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_a_fifo_in_place_of_extra_json_is_refused_without_blocking(tmp_path: Path) -> None:
    save_extra(tmp_path, Progress())
    (tmp_path / "extra.json").unlink()
    os.mkfifo(tmp_path / "extra.json")
    with pytest.raises(CheckpointError, match="extra.json"):
        within(HANG_GUARD_S, lambda: load_extra(tmp_path))


@pytest.mark.parametrize("field,value", [("version", "3"), ("version", True)])
def test_python_rng_fields_of_the_wrong_type_are_refused(tmp_path: Path, field: str, value: Any) -> None:
    save_extra(tmp_path, Progress())
    path = edit_extra(tmp_path, lambda d: d["rng"]["python"].update({field: value}))
    with pytest.raises(CheckpointError, match=f"{path}: malformed extra state.*rng.python.{field} must be"):
        load_extra(tmp_path)


@pytest.mark.parametrize("field,value", [("name", 3), ("pos", "1"), ("has_gauss", 0.5), ("cached_gaussian", "x"),
                                         ("keys", "x" * 624), ("keys", [1.5] * 624)])
def test_numpy_rng_fields_of_the_wrong_type_are_refused(tmp_path: Path, field: str, value: Any) -> None:
    save_extra(tmp_path, Progress())
    path = edit_extra(tmp_path, lambda d: d["rng"]["numpy"].update({field: value}))
    with pytest.raises(CheckpointError, match=f"{path}: malformed extra state.*rng.numpy.{field} must be"):
        load_extra(tmp_path)


class PickyLoader(StatefulLoader):
    """Refuses the state it is given the way a foreign loader would: with its own KeyError."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position = state["cursor"]


def test_a_dataloader_refusing_its_state_is_named_and_rngs_stay_untouched(tmp_path: Path) -> None:
    random.seed(5)
    save_extra(tmp_path, Progress(), StatefulLoader())
    random.seed(9)
    before = random.getstate()
    with pytest.raises(CheckpointError, match=rf"{tmp_path / 'extra.json'}: dataloader PickyLoader refused its "
                                              r"state: KeyError: 'cursor'"):
        load_extra(tmp_path, PickyLoader())
    assert random.getstate() == before


@pytest.mark.parametrize("field", [{"consumed_samples": -5}, {"epoch": 2.7}, {"epoch": "7"}, {"step": True}],
                         ids=["negative", "float", "string", "bool"])
def test_progress_a_resume_would_refuse_is_refused_on_save_before_anything_is_written(
    tmp_path: Path, field: dict[str, Any],
) -> None:
    """Before, -5 committed a step resume then refused, and 2.7 was saved as 2."""
    progress = Progress()
    for key, value in field.items():
        setattr(progress, key, value)
    with pytest.raises(CheckpointError, match=f"Progress fields must be integers >= 0.*{next(iter(field))}="):
        save_extra(tmp_path / "extra", progress)
    assert not (tmp_path / "extra").exists()
