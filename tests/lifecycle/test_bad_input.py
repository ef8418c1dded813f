"""Bad checkpoints reach the user as a `CheckpointError` naming the file and the fault.

Everything here goes through `Lifecycle.resume()`, the user's entry point, with
`resume.on_damaged: refuse`. Two outcomes only: a step that was never committed (no manifest,
or one that does not parse) is skipped and the older step resumes; a committed step whose
files are damaged is refused loudly, the worker ends FAILED, and resume never falls back past
it to an older step or to a fresh start. (`fallback`, the default, sets a damaged step aside
instead: tests/lifecycle/test_damaged_steps.py.)
"""

from __future__ import annotations

import json
import pickle
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from lifecycle import CheckpointError, Lifecycle, State
from lifecycle.checksum import ALGORITHM, file_digest
from lifecycle.manifest import MANIFEST, check_folder
from lifecycle.store import TRACKER, CheckpointStore

ROLE = "actor"
WEIGHTS = "model/model.safetensors"
RNG = "extra/rank_0/rng.safetensors"
EXTRA_JSON = "extra/rank_0/extra.json"
OPTIM_JSON = "optimizer/optimizer.json"


class Net(nn.Module):
    def __init__(self, width: int = 6, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.body = nn.Linear(width, width, dtype=dtype)
        self.head = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def fill(model: nn.Module, step: int) -> None:
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.fill_(step * 10 + i)


def has_weights_of(model: nn.Module, step: int) -> bool:
    return all(torch.equal(p, torch.full_like(p, step * 10 + i)) for i, p in enumerate(model.parameters()))


def lifecycle_at(root: Path, model: nn.Module | None = None, verify: bool = True, **resume: Any) -> Lifecycle:
    model = Net() if model is None else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    resume = {"on_damaged": "refuse", **resume}
    cfg = {"checkpoint": {"root": str(root), "load": {"verify": verify}}, "resume": resume}
    return Lifecycle(cfg, role=ROLE, model=model, optimizer=optimizer)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """A run with two committed steps whose weights say which step they are."""
    root = tmp_path / "ckpt"
    lc = lifecycle_at(root)
    lc.init_load()
    for step in (1, 2):
        model = lc.parts.model
        fill(model, step)
        model(torch.ones(2, 6)).sum().backward()
        lc.parts.optimizer.step()
        fill(model, step)
        lc.save(step)
    lc.close()
    return root


def step_folder(root: Path, step: int = 2) -> Path:
    return root / f"global_step_{step}" / ROLE


def resign(folder: Path) -> None:
    """Re-describe every file in the manifest, as a tool rewriting the files would: only the
    parsers can catch what is wrong with them then, not the size or checksum checks."""
    path = folder / MANIFEST
    manifest = json.loads(path.read_text())
    files = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*")
                   if p.is_file() and p.name != MANIFEST)
    manifest["files"] = [{"path": rel, "size": (folder / rel).stat().st_size,
                          ALGORITHM: file_digest(folder / rel)} for rel in files]
    path.write_text(json.dumps(manifest))


def edit_manifest(folder: Path, **changes: Any) -> None:
    path = folder / MANIFEST
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def resumes_at(root: Path, step: int) -> Lifecycle:
    lc = lifecycle_at(root)
    assert lc.resume() == step
    assert lc.state is State.READY and lc.progress.step == step and has_weights_of(lc.parts.model, step)
    return lc


def refused(lc: Lifecycle, *needles: str) -> CheckpointError:
    """Resume fails with a CheckpointError naming every needle; the worker is left FAILED."""
    with pytest.raises(CheckpointError) as caught:
        lc.resume()
    message = str(caught.value)
    for needle in needles:
        assert needle in message, f"{needle!r} not in: {message}"
    assert lc.state is State.FAILED
    record = lc.history[-1]
    assert (record.trigger, record.ok) == ("resume", False) and "CheckpointError" in str(record.error)
    return caught.value


class Exploit:
    """Unpickling this creates `marker`: proof that something unpickled it."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (str(self.marker), "w"))


# Truncated weights -------------------------------------------------------------------------

@pytest.mark.parametrize("cut", ["empty", "length-prefix", "header", "data", "last-byte"])
def test_truncated_weights_with_a_matching_manifest_fail_in_the_safetensors_parser(root: Path, cut: str) -> None:
    path = step_folder(root) / WEIGHTS
    data = path.read_bytes()
    header_end = 8 + int.from_bytes(data[:8], "little")
    keep = {"empty": 0, "length-prefix": 5, "header": header_end // 2,
            "data": (header_end + len(data)) // 2, "last-byte": len(data) - 1}[cut]
    path.write_bytes(data[:keep])
    resign(step_folder(root))
    refused(lifecycle_at(root), str(path), "truncated")


@pytest.mark.parametrize("older_step", [True, False], ids=["older-step-on-disk", "only-step"])
def test_truncated_weights_caught_by_the_size_check_refuse_resume(root: Path, older_step: bool) -> None:
    """Not skipped for the older step, and not a silent fresh start when it is the only one."""
    if not older_step:
        shutil.rmtree(root / "global_step_1")
    path = step_folder(root) / WEIGHTS
    size = path.stat().st_size
    path.write_bytes(path.read_bytes()[:-16])
    refused(lifecycle_at(root), "cannot resume from step 2", str(path),
            f"size {size - 16} != manifest {size}")


def test_flipped_bytes_of_the_same_size_fail_the_checksum(root: Path) -> None:
    path = step_folder(root) / WEIGHTS
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF
    path.write_bytes(bytes(data))
    lc = lifecycle_at(root)
    refused(lc, "cannot resume from step 2", str(path), "checksum")
    shutil.rmtree(root / "global_step_2")
    shutil.rmtree(root / "global_step_1")
    with pytest.raises(CheckpointError, match="partly overwritten by a failed resume.*pre_load.path"):
        lc.resume()


def test_with_load_verify_off_flipped_bytes_load_but_a_truncated_file_is_still_refused(root: Path) -> None:
    path = step_folder(root) / WEIGHTS
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF
    path.write_bytes(bytes(data))
    lc = lifecycle_at(root, verify=False)
    assert lc.resume() == 2 and lc.state is State.READY
    path.write_bytes(bytes(data[:-8]))
    refused(lifecycle_at(root, verify=False), "cannot resume from step 2", str(path), "size")


@pytest.mark.parametrize("rel", [WEIGHTS, "optimizer/optimizer.safetensors", EXTRA_JSON])
def test_missing_file_of_a_committed_step_is_named(root: Path, rel: str) -> None:
    (step_folder(root) / rel).unlink()
    refused(lifecycle_at(root), str(step_folder(root) / rel), "listed in the manifest but missing")


# Never committed: skipped; a manifest that is there but unreadable: judged ----------------

def test_a_role_folder_without_a_manifest_is_skipped_for_the_older_one(root: Path) -> None:
    (step_folder(root) / MANIFEST).unlink()
    resumes_at(root, 1)


@pytest.mark.parametrize("manifest", ["{not json", '{"step": 2', "", "[]", '{"step": 2}'])
def test_a_manifest_that_does_not_parse_is_refused_not_skipped(root: Path, manifest: str) -> None:
    """A role folder appears only with its manifest (the commit renames both at once): one
    that cannot be read is damage, refused here (`refuse`) or set aside (`fallback`)."""
    (step_folder(root) / MANIFEST).write_text(manifest)
    refused(lifecycle_at(root), str(step_folder(root) / MANIFEST), "cannot resume from step 2")
    assert step_folder(root).is_dir()


def test_a_manifest_from_a_newer_format_is_refused_and_never_set_aside(root: Path) -> None:
    """Written by a newer release: resuming the older step would silently lose its progress,
    and setting it aside would hide it from that release. Refused, in both modes."""
    edit_manifest(step_folder(root), format_version=99)
    for on_damaged in ("refuse", "fallback"):
        refused(lifecycle_at(root, on_damaged=on_damaged), "format_version 99", "newer release")
    assert step_folder(root).is_dir() and not list(root.glob("*.damaged-*"))
    assert any("format_version 99" in p for p in check_folder(step_folder(root), deep=False))


def test_staging_folder_of_an_interrupted_save_is_skipped(root: Path) -> None:
    staging = root / "global_step_3" / f".staging-{ROLE}"
    shutil.copytree(step_folder(root), staging)
    (root / TRACKER).write_text("3\n")
    resumes_at(root, 2)


# Tracker -----------------------------------------------------------------------------------

@pytest.mark.parametrize("text", ["99\n", "0\n", "twelve\n", "", "-3\n", "\xff\xfe"])
def test_resume_reads_the_disk_whatever_the_tracker_says(root: Path, text: str) -> None:
    (root / TRACKER).write_text(text, encoding="latin-1")
    lc = resumes_at(root, 2)
    fill(lc.parts.model, 3)
    lc.save(3)
    assert CheckpointStore(root).read_tracker() == 3


@pytest.mark.parametrize("text", ["twelve\n", "", "-3\n", "2.5\n", "\xff\xfe"])
def test_a_tracker_that_is_not_a_step_number_is_named(root: Path, text: str) -> None:
    (root / TRACKER).write_text(text, encoding="latin-1")
    with pytest.raises(CheckpointError, match=TRACKER):
        CheckpointStore(root).read_tracker()


# Weights that do not fit the model ---------------------------------------------------------

def test_tensor_of_another_shape_is_named_with_its_file(root: Path) -> None:
    refused(lifecycle_at(root, Net(width=4), strict=False), str(step_folder(root) / WEIGHTS),
            "'body.weight' has shape [6, 6], the model expects [4, 4]")


def test_another_architecture_is_refused_by_the_model_config_hash(root: Path) -> None:
    refused(lifecycle_at(root, Net(width=4)), str(step_folder(root) / MANIFEST), "model-config hash")


def test_tensor_of_another_dtype_is_named_with_its_file(root: Path) -> None:
    path = step_folder(root) / WEIGHTS
    tensors = load_file(str(path))
    tensors["head.bias"] = tensors["head.bias"].double()
    save_file(tensors, str(path))
    resign(step_folder(root))
    refused(lifecycle_at(root), str(path),
            "'head.bias' has dtype torch.float64, the model expects torch.float32")


def test_model_of_another_dtype_is_named_with_the_tensor(root: Path) -> None:
    refused(lifecycle_at(root, Net(dtype=torch.bfloat16), strict=False), str(step_folder(root) / WEIGHTS),
            "'body.weight' has dtype torch.float32, the model expects torch.bfloat16")


# Paths that leave the checkpoint folder ----------------------------------------------------

@pytest.mark.parametrize("bad", ["../../etc/passwd", "/etc/passwd", "model/../../../outside.bin"])
def test_manifest_file_path_escaping_the_folder_is_refused(root: Path, bad: str) -> None:
    folder = step_folder(root)
    manifest = json.loads((folder / MANIFEST).read_text())
    manifest["files"].append({"path": bad, "size": 1, "xxh3_64": "0000000000000000"})
    (folder / MANIFEST).write_text(json.dumps(manifest))
    refused(lifecycle_at(root), str(folder / MANIFEST), repr(bad), "is refused")


def test_content_folder_escaping_the_folder_is_refused(root: Path) -> None:
    folder = step_folder(root)
    edit_manifest(folder, contents={"model": {"backend": "hf", "folder": "../../global_step_1/actor/model"}})
    refused(lifecycle_at(root), str(folder / MANIFEST), "escapes")


@pytest.mark.parametrize("what", ["file", "folder"])
def test_symlink_pointing_outside_is_refused(root: Path, tmp_path: Path, what: str) -> None:
    """The outside copy holds the very bytes the manifest describes: only the path gives it away."""
    folder = step_folder(root)
    outside = tmp_path / "outside"
    shutil.copytree(folder / "model", outside)
    if what == "file":
        (folder / WEIGHTS).unlink()
        (folder / WEIGHTS).symlink_to(outside / "model.safetensors")
    else:
        shutil.rmtree(folder / "model")
        (folder / "model").symlink_to(outside, target_is_directory=True)
    link = folder / (WEIGHTS if what == "file" else "model")
    refused(lifecycle_at(root), f"{link}: a symlink; a checkpoint holds regular files only")


# Pickles planted in extra/ -----------------------------------------------------------------

@pytest.fixture
def marker(tmp_path: Path) -> Path:
    live = tmp_path / "proof-the-payload-is-live"
    pickle.loads(pickle.dumps(Exploit(live)))
    assert live.exists()
    return tmp_path / "pwned"


@pytest.mark.parametrize("rel", ["extra/rank_0/rng.pt", "extra/state.pkl", "extra/rank_0/extra.pkl"])
@pytest.mark.parametrize("listed", [False, True], ids=["unlisted", "listed-in-manifest"])
def test_planted_pickle_in_extra_is_named_and_never_unpickled(
    root: Path, marker: Path, rel: str, listed: bool
) -> None:
    planted = step_folder(root) / rel
    planted.write_bytes(pickle.dumps(Exploit(marker)))
    if listed:
        resign(step_folder(root))
    refused(lifecycle_at(root), str(planted))
    assert not marker.exists()


@pytest.mark.parametrize("rel", [RNG, "optimizer/optimizer.safetensors", WEIGHTS])
def test_pickle_in_place_of_a_safetensors_file_is_never_unpickled(root: Path, marker: Path, rel: str) -> None:
    path = step_folder(root) / rel
    path.write_bytes(pickle.dumps(Exploit(marker)))
    resign(step_folder(root))
    refused(lifecycle_at(root), str(path), "truncated")
    assert not marker.exists()


# Files that parse but hold nonsense (manifest re-signed to match) ---------------------------

def set_key(doc: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, last = dotted.split(".")
    for key in parents:
        doc = doc[key]
    doc[last] = value


@pytest.mark.parametrize(("key", "value"), [
    pytest.param("rng.python.state", [1, 2, 3], id="python-state-size"),
    pytest.param("rng.python.version", -1, id="python-version"),
    pytest.param("rng.numpy.keys", [-1] * 624, id="numpy-keys-negative"),
    pytest.param("rng.numpy.keys", [2**40] * 624, id="numpy-keys-too-large"),
    pytest.param("rng.numpy.pos", 2**70, id="numpy-pos-overflow"),
    pytest.param("rng.numpy.pos", 100_000, id="numpy-pos-out-of-bounds"),
    pytest.param("rng.numpy.pos", -1, id="numpy-pos-negative"),
    pytest.param("rng.numpy.name", "PCG64", id="numpy-name"),
    pytest.param("rng.numpy.cached_gaussian", 10**400, id="numpy-gaussian-overflow"),
    pytest.param("progress.step", "seven", id="progress-step"),
    pytest.param("format_version", 2, id="format-version"),
])
def test_extra_json_with_an_impossible_value_is_named_and_restores_nothing(
    root: Path, key: str, value: Any
) -> None:
    path = step_folder(root) / EXTRA_JSON
    doc = json.loads(path.read_text())
    set_key(doc, key, value)
    path.write_text(json.dumps(doc))
    resign(step_folder(root))
    lc = lifecycle_at(root)
    random.seed(5)
    np.random.seed(5)
    torch.manual_seed(5)
    before = (random.getstate(), np.random.get_state(legacy=True)[1].copy(), torch.get_rng_state())
    refused(lc, str(path), "malformed extra state")
    assert random.getstate() == before[0]
    assert np.array_equal(np.random.get_state(legacy=True)[1], before[1])
    assert torch.equal(torch.get_rng_state(), before[2])


def test_torch_rng_state_of_the_wrong_length_is_named(root: Path) -> None:
    path = step_folder(root) / RNG
    save_file({"torch_cpu": torch.zeros(10, dtype=torch.uint8)}, str(path))
    resign(step_folder(root))
    lc = lifecycle_at(root)
    random.seed(5)
    before = random.getstate()
    refused(lc, str(path), "'torch_cpu' is not a CPU RNG state")
    assert random.getstate() == before


@pytest.mark.parametrize("state", [None, 3, "x", [1, 2]])
def test_optimizer_json_of_the_wrong_shape_is_named(root: Path, state: Any) -> None:
    path = step_folder(root) / OPTIM_JSON
    doc = json.loads(path.read_text())
    doc["optimizer"]["state"] = state
    path.write_text(json.dumps(doc))
    resign(step_folder(root))
    refused(lifecycle_at(root), str(path))


def test_optimizer_json_that_is_not_json_is_named(root: Path) -> None:
    path = step_folder(root) / OPTIM_JSON
    path.write_text("{oops")
    resign(step_folder(root))
    refused(lifecycle_at(root), str(path), "not valid JSON")


def _with_scheduler(root: Path, fmt: str) -> Lifecycle:
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2)
    cfg = {"checkpoint": {"root": str(root), "save": {"format": fmt}}, "resume": {"on_damaged": "refuse"}}
    return Lifecycle(cfg, role=ROLE, model=model, optimizer=optimizer, lr_scheduler=scheduler)


@pytest.mark.parametrize("fmt", ["hf", "torch_dcp"])
@pytest.mark.parametrize(("edit", "said"), [
    ({"optimizer": None}, "lr_scheduler holds ['optimizer'], which the running scheduler keeps out of its state"),
    ({"step_size": "x"}, "lr_scheduler.step_size: must be a finite number"),
    ({"base_lrs": [0.01, 0.02, 0.03]}, "lr_scheduler.base_lrs: must be a list of 1"),
    ({"last_epoch": float("nan")}, "lr_scheduler.last_epoch: must be a finite number"),
], ids=["optimizer", "step-size", "base-lrs", "nan-epoch"])
def test_an_lr_scheduler_state_that_does_not_fit_the_running_scheduler_is_refused_before_loading(
        tmp_path: Path, fmt: str, edit: dict[str, Any], said: str) -> None:
    lc = _with_scheduler(tmp_path, fmt)
    lc.init_load()
    lc.save(1)
    lc.close()
    path = step_folder(tmp_path, 1) / OPTIM_JSON
    doc = json.loads(path.read_text())
    doc["lr_scheduler"].update(edit)
    path.write_text(json.dumps(doc))
    resign(step_folder(tmp_path, 1))
    fresh = _with_scheduler(tmp_path, fmt)
    refused(fresh, str(path), said)
    assert fresh.parts.lr_scheduler.optimizer is fresh.parts.optimizer


class _WithExtraState(Net):
    def get_extra_state(self) -> Any:
        return {"scale": 2}

    def set_extra_state(self, state: Any) -> None:
        self.extra = state


@pytest.mark.parametrize("fmt", ["hf", "torch_dcp"])
def test_a_model_whose_state_dict_holds_extra_state_is_refused_naming_the_entry(tmp_path: Path, fmt: str) -> None:
    model = _WithExtraState()
    cfg = {"checkpoint": {"root": str(tmp_path), "save": {"format": fmt}}}
    lc = Lifecycle(cfg, role=ROLE, model=model)
    lc.init_load()
    with pytest.raises(CheckpointError, match="model entry '_extra_state' is a dict, not a tensor"):
        lc.save(1)
    assert CheckpointStore(tmp_path).newest_complete([ROLE]) is None
