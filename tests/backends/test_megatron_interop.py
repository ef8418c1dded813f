"""Megatron backends against the real libraries, two gloo ranks on CPU (MEGATRON_ON_CPU.md).

(a) an HF checkpoint written by `transformers` goes in through mbridge at TP=2, out, back in at
TP=1 and out again, and `transformers` reads the result with the original logits; (b) a dist
checkpoint written by plain megatron-core at TP=2 loads at TP=1; (c) save -> SIGKILL -> resume
restores weights, optimizer and step through each Megatron backend, at another TP.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.disk import small_tmpfs
from tests.backends.dist_util import run_ranks
from tests.backends.megatron_util import hf_tensors, make_hf_checkpoint, same_tensors, train_steps, weights_and_moments

pytest.importorskip("megatron.core")
pytest.importorskip("mbridge")
pytestmark = pytest.mark.transformers


def _fresh_parallel() -> None:
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()


def _lifecycle(model: Any, root: Path, fmt: str, resume: dict[str, Any] | None = None, **checkpoint: Any) -> Any:
    from lifecycle import Lifecycle

    cfg = {"checkpoint": {"root": str(root), "save": {"format": fmt, "contents": ["model", "hf_model", "extra"]},
                          "load": {"contents": ["model", "extra"]}, **checkpoint}, "resume": resume or {}}
    return Lifecycle(cfg, role="actor", model=model)


def _hf_in_tp2_out_tp1_out(rank: int, world_size: int, tmp: Path) -> dict[str, Any]:
    from backends.megatron import build_model

    lc = _lifecycle(build_model(tmp / "hf", tp=2), tmp / "run1", "mbridge", pre_load={"path": str(tmp / "hf")})
    lc.init_load()
    first = lc.save(1)
    lc.close()
    _fresh_parallel()
    lc = _lifecycle(build_model(tmp / "hf", tp=1), tmp / "run2", "mbridge", resume={"mode": "path",
                    "path": str(first.path)})
    lc.resume()
    second = lc.save(2)
    lc.close()
    _fresh_parallel()
    staged = build_model(tmp / "hf", pp=2)
    _lifecycle(staged, tmp / "run3", "mbridge", resume={"mode": "path", "path": str(second.path)}).resume()
    at_pp2 = same_tensors(hf_tensors(tmp / "hf"), staged.state_dict())
    return {"first": str(first.path), "second": str(second.path), "pp2_differ": at_pp2}


def test_hf_written_by_transformers_round_trips_through_mbridge_tp2_tp1_pp2_with_identical_logits(
    tmp_path: Path,
) -> None:
    import transformers

    make_hf_checkpoint(tmp_path / "hf")
    results = run_ranks(_hf_in_tp2_out_tp1_out, tmp_path, timeout_s=150)
    assert [r["pp2_differ"] for r in results] == [[], []]
    result = results[0]
    first, second = Path(result["first"]), Path(result["second"])
    manifest = json.loads((first / "manifest.json").read_text())
    assert manifest["contents"]["hf_model"]["folder"] == manifest["contents"]["model"]["folder"] == "model"
    assert not (first / "hf_model").exists()
    original = hf_tensors(tmp_path / "hf")
    assert same_tensors(original, hf_tensors(first / "model")) == []
    assert same_tensors(original, hf_tensors(second / "model")) == []
    tokens = torch.tensor([[1, 5, 9, 200, 17, 3]])
    with torch.no_grad():
        want = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"))(tokens).logits
        got = transformers.AutoModelForCausalLM.from_pretrained(str(second / "model"))(tokens).logits
    assert torch.equal(want, got)
    config = json.loads((second / "model" / "transformer_config.json").read_text())
    assert config["config"]["tensor_model_parallel_size"] == 1
    assert "activation_func" in config["removed"] and "activation_func" not in config["config"]


def _plain_megatron_tp2_then_dist_ckpt_tp1(rank: int, world_size: int, tmp: Path) -> bool:
    from megatron.core import dist_checkpointing

    from backends.megatron import build_model

    model = build_model(tmp / "hf", tp=2)
    model.bridge.load_weights(model.chunks, str(tmp / "hf"))
    folder = tmp / "megatron_lm"
    if rank == 0:
        folder.mkdir()
    torch.distributed.barrier()
    with mock.patch("torch.cuda.synchronize"), mock.patch("torch.cuda.current_device", return_value="cpu"):
        dist_checkpointing.save({"model": model.chunks[0].sharded_state_dict()}, str(folder))
    _fresh_parallel()
    fresh = build_model(tmp / "hf", tp=1)
    lc = _lifecycle(fresh, tmp / "run", "dist_ckpt", pre_load={"format": "dist_ckpt", "path": str(folder)})
    lc.init_load()
    loaded = fresh.state_dict()
    bare = _bare_gpt_model_saves_and_resumes(fresh, tmp)
    other = _other_architecture_is_refused(folder, tmp)
    return {"same": same_tensors(hf_tensors(tmp / "hf"), loaded) == [], "bare": bare, "other": other}


def _bare_gpt_model_saves_and_resumes(source: Any, tmp: Path) -> bool:
    """A GPTModel built outside this library (no bridge) through the dist_ckpt lifecycle."""
    gpt = source.chunks[0]
    lc = _lifecycle(gpt, tmp / "bare", "dist_ckpt", load={"contents": ["model"]}, save={"format": "dist_ckpt"})
    lc.init_load()
    lc.save(3)
    saved = {k: v.clone() for k, v in gpt.state_dict().items() if isinstance(v, torch.Tensor)}
    with torch.no_grad():
        for p in gpt.parameters():
            p.zero_()
    again = _lifecycle(gpt, tmp / "bare", "dist_ckpt", load={"contents": ["model"]}, save={"format": "dist_ckpt"})
    step = again.resume()
    restored = gpt.state_dict()
    return step == 3 and all(torch.equal(restored[k], v) for k, v in saved.items())


def _other_architecture_is_refused(folder: Path, tmp: Path) -> str:
    """Another hidden size: a CheckpointError naming the folder, not DCP's raw exception."""
    import transformers

    from backends.dist_ckpt import DistCkptBackend
    from backends.megatron import build_model
    from lifecycle.errors import CheckpointError

    config = transformers.AutoConfig.from_pretrained(str(tmp / "hf"))
    config.intermediate_size = 96
    model = build_model(config, tp=1)
    try:
        DistCkptBackend().load_model(model, folder)
    except CheckpointError as exc:
        return str(exc)
    return "loaded"


def test_dist_checkpoint_written_by_plain_megatron_core_at_tp2_loads_at_tp1_with_identical_weights(
    tmp_path: Path,
) -> None:
    make_hf_checkpoint(tmp_path / "hf")
    for result in run_ranks(_plain_megatron_tp2_then_dist_ckpt_tp1, tmp_path, timeout_s=150):
        assert result["same"] and result["bare"]
        assert result["other"].startswith(f"{tmp_path / 'megatron_lm'}: megatron dist_checkpointing load failed")
    assert not (tmp_path / "megatron_lm" / "transformer_config.json").exists()


def _train_and_save_then_die(rank: int, world_size: int, tmp: Path) -> None:
    """TP=2: init-load, two optimizer steps, save step 2, write what was saved, then SIGKILL."""
    from backends.megatron import build_model
    from lifecycle import Lifecycle

    fmt = (tmp / "format").read_text()
    model = build_model(tmp / "hf", tp=2)
    optimizer = torch.optim.AdamW(list(model.parameters()), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    cfg = {"checkpoint": {"root": str(tmp / "ckpt"), "save": {"format": fmt},
                          "pre_load": {"path": str(tmp / "hf")}}}
    lc = Lifecycle(cfg, role="actor", model=model, optimizer=optimizer, lr_scheduler=scheduler)
    lc.init_load()
    train_steps(lc, model, optimizer, scheduler)
    lc.save(2)
    save_file(weights_and_moments(model, optimizer), str(tmp / f"saved_rank{rank}.safetensors"))
    named = dict(model.chunks[0].named_parameters())
    dims = {n: getattr(p, "partition_dim", -1) if getattr(p, "tensor_model_parallel", False) else -1
            for n, p in named.items()}
    (tmp / f"dims_rank{rank}.json").write_text(json.dumps(dims))
    torch.distributed.barrier()
    os.kill(os.getpid(), signal.SIGKILL)


def _expected_full(tmp: Path) -> dict[str, torch.Tensor]:
    """The two TP=2 shards joined along each parameter's partition dim: the TP=1 tensors.

    A gated MLP's fc1 holds [gate; up] on every rank, so its halves join separately.
    """
    shards = [load_file(str(tmp / f"saved_rank{r}.safetensors")) for r in (0, 1)]
    dims = json.loads((tmp / "dims_rank0.json").read_text())
    full = {}
    for key, t in shards[0].items():
        dim, pieces = dims[key.split("/", 1)[1]], [t, shards[1][key]]
        if dim >= 0 and key.endswith("linear_fc1.weight"):
            halves = [piece.chunk(2, dim=dim) for piece in pieces]
            pieces = [halves[0][0], halves[1][0], halves[0][1], halves[1][1]]
        full[key] = t if dim < 0 else torch.cat(pieces, dim=dim)
    return full


def _resume_at_tp1(rank: int, world_size: int, tmp: Path) -> dict[str, Any]:
    from backends.megatron import build_model
    from lifecycle import Lifecycle

    fmt = (tmp / "format").read_text()
    torch.manual_seed(123 + rank)
    model = build_model(tmp / "hf", tp=1)
    optimizer = torch.optim.AdamW(list(model.parameters()), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    cfg = {"checkpoint": {"root": str(tmp / "ckpt"), "save": {"format": fmt}}}
    lc = Lifecycle(cfg, role="actor", model=model, optimizer=optimizer, lr_scheduler=scheduler)
    step = lc.resume()
    named = dict(model.chunks[0].named_parameters())
    differ = [key for key, want in _expected_full(tmp).items()
              if not torch.equal(want, named[key.split("/", 1)[1]].detach() if key.startswith("param/")
                                 else optimizer.state[named[key.split("/", 1)[1]]][key.split("/", 1)[0]])]
    steps = {float(optimizer.state[p]["step"]) for p in named.values()}
    return {"step": step, "progress": lc.progress.step, "differ": differ, "opt_steps": sorted(steps),
            "lr": scheduler.get_last_lr(), "sched_epoch": scheduler.last_epoch}


@pytest.mark.parametrize("fmt", ["mbridge", "dist_ckpt"])
def test_save_at_tp2_kill_then_resume_at_tp1_restores_weights_optimizer_and_step(tmp_path: Path, fmt: str) -> None:
    make_hf_checkpoint(tmp_path / "hf")
    (tmp_path / "format").write_text(fmt)
    assert run_ranks(_train_and_save_then_die, tmp_path, timeout_s=150, killed_ok=True) == [None, None]
    results = run_ranks(_resume_at_tp1, tmp_path, timeout_s=150)
    for result in results:
        assert result["step"] == result["progress"] == 2
        assert result["differ"] == []
        assert result["opt_steps"] == [2.0]
        assert result["sched_epoch"] == 2 and result["lr"] == [0.0025]


def _refusals_and_stateless_resume(rank: int, world_size: int, tmp: Path) -> dict[str, Any]:
    """One rank: an untied checkpoint into a tied model; a frozen parameter's missing state
    through save and load; crafted optimizer.json fields."""
    import transformers

    from backends.dist_ckpt import DistCkptBackend
    from backends.megatron import build_model
    from lifecycle.errors import CheckpointError

    backend, out = DistCkptBackend(), {}
    model = build_model(tmp / "hf", tp=1)
    model.bridge.load_weights(model.chunks, str(tmp / "hf"))
    backend.save_model(model, tmp / "untied")
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=0.01)
    for _ in range(2):
        for p in params[:-1]:
            p.grad = torch.full_like(p, 0.01)
        optimizer.step()
    backend.save_optimizer(optimizer, None, tmp / "optim", model=model)
    again = torch.optim.AdamW(params, lr=0.01)
    backend.load_optimizer(again, None, tmp / "optim", model=model)
    out["frozen_state"] = sorted(again.state.get(params[-1], {}))
    out["trained_step"] = float(again.state[params[0]]["step"])
    doc = json.loads((tmp / "optim" / "optimizer.json").read_text())
    for name, edit in {"nan": {"step": {"__float__": "nan"}}, "huge": {"step": 10**400}, "negative": {"step": -5},
                       "fraction": {"step": 0.5}, "string": {"step": "7"}, "true": {"step": True},
                       "keys_one": {"state_keys": ["exp_avg"]}, "keys_none": {"state_keys": None}}.items():
        (tmp / "optim" / "optimizer.json").write_text(json.dumps({**doc, "optimizer": {**doc["optimizer"], **edit}}))
        try:
            backend.load_optimizer(torch.optim.AdamW(params, lr=0.01), None, tmp / "optim", model=model)
            out[name] = "loaded"
        except CheckpointError as exc:
            out[name] = str(exc)
    config = transformers.AutoConfig.from_pretrained(str(tmp / "hf"))
    config.tie_word_embeddings = True
    try:
        backend.load_model(build_model(config, tp=1), tmp / "untied")
        out["tied"] = "loaded"
    except CheckpointError as exc:
        out["tied"] = str(exc)
    return out


def test_dist_ckpt_refuses_dropped_tensors_and_crafted_optimizer_json_and_keeps_a_frozen_param_stateless(
    tmp_path: Path,
) -> None:
    """An output layer was dropped silently by a tied model's load; a parameter without state
    came back with zero moments and the common step; a NaN, huge, negative, fractional or
    non-number step or a state key too few loaded and failed (or poisoned) the next step."""
    make_hf_checkpoint(tmp_path / "hf")
    [out] = run_ranks(_refusals_and_stateless_resume, tmp_path, world_size=1, timeout_s=120)
    assert out["frozen_state"] == [] and out["trained_step"] == 2.0
    where = f"{tmp_path / 'optim' / 'optimizer.json'}: does not fit the optimizer: "
    for name in ("nan", "huge", "negative", "fraction", "string", "true"):
        assert out[name].startswith(where + "step must be"), (name, out[name])
    assert out["keys_one"] == where + "state_keys ['exp_avg'] are not the ['exp_avg', 'exp_avg_sq'] its step reads"
    assert out["keys_none"].startswith(where + "state_keys must list")
    assert out["tied"].startswith(f"{tmp_path / 'untied'}: holds tensors this load has no place for: "
                                  "['output_layer.weight']")


@pytest.fixture
def small_disk(tmp_path: Path) -> Any:
    """A 200 KiB tmpfs, unmounted after the test: room for the run's folders, not for the weights."""
    with small_tmpfs(tmp_path / "small", "200k") as mount:
        yield mount


def _save_on_a_full_disk(rank: int, world_size: int, tmp: Path) -> str:
    from backends.megatron import build_model
    from lifecycle import Lifecycle
    from lifecycle.errors import CheckpointError

    model = build_model(tmp / "hf", tp=2)
    optimizer = torch.optim.AdamW(list(model.parameters()), lr=0.01)
    cfg = {"checkpoint": {"root": str(tmp / "small" / "ckpt"), "save": {"format": "mbridge"},
                          "pre_load": {"path": str(tmp / "hf")}}}
    lc = Lifecycle(cfg, role="actor", model=model, optimizer=optimizer)
    lc.init_load()
    train_steps(lc, model, optimizer, steps=(1,))
    try:
        lc.save(1)
    except CheckpointError as exc:
        return str(exc)
    return "saved"


def test_a_full_disk_on_rank0_fails_an_mbridge_save_on_every_rank_at_once(tmp_path: Path, small_disk: Path) -> None:
    """Rank 0 alone writes the HF files: on ENOSPC it gave up while rank 1 waited in the optimizer
    save's gather until the process group's timeout (30 s here), then both failed with raw errors."""
    make_hf_checkpoint(tmp_path / "hf")
    first, second = run_ranks(_save_on_a_full_disk, tmp_path, timeout_s=60)
    assert "HF export failed: OSError: [Errno 28] No space left on device" in first
    assert "rank 0 failed to write the HF export" in second
