"""The Megatron formats and the converter against a hostile checkpoint: code a config.json names
never runs, mbridge reads no file the checks did not, a dtype that does not fit is refused, and
a conversion neither writes into a checkpoint nor builds a model its source cannot hold.
In-process: no rank is spawned."""

from __future__ import annotations

import io
import json
import os
import sys
import threading
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from lifecycle.convert import ConvertJob, check
from lifecycle.errors import CheckpointError, ConfigError
from tests.backends.megatron_util import TINY_QWEN2, make_hf_checkpoint

pytest.importorskip("megatron.core")
pytest.importorskip("mbridge")
pytestmark = pytest.mark.transformers

EVIL_CODE = "import pathlib\npathlib.Path({marker!r}).write_text('ran')\n"


def _evil_folder(folder: Path, config: dict[str, Any]) -> Path:
    """A folder whose config.json names `evil.py` beside it, which leaves a marker when imported."""
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "evil.py").write_text(EVIL_CODE.format(marker=str(folder / "ran")))
    return folder


def test_build_model_never_runs_the_code_a_config_json_names_even_when_stdin_says_yes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Before: transformers asked on stdin, and the "y" it read imported the folder's evil.py."""
    from backends.megatron import build_model

    evil = _evil_folder(tmp_path / "evil", {"model_type": "evilarch", "auto_map": {"AutoConfig": "evil.EvilConfig"}})
    monkeypatch.setattr(sys, "stdin", io.StringIO("y\n" * 4))
    with pytest.raises(ConfigError, match="auto_map names code shipped in the checkpoint folder") as info:
        build_model(evil, tp=1, pp=1)
    assert info.value.key == "hf_config.auto_map" and str(evil / "config.json") in str(info.value)
    with pytest.raises(ConfigError, match="auto_map") as info:
        check(ConvertJob(src=_weights_beside(evil), dst=tmp_path / "out", to="dist_ckpt"))
    assert info.value.key == "--hf-config"
    assert not (evil / "ran").exists()


def test_a_config_naming_code_for_an_architecture_transformers_defines_builds_transformers_own_class(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """DeepSeek-V3's official config.json names its own code for a model_type transformers knows:
    read (and its model built) with transformers' classes, the folder's code never imported."""
    from backends.hf_arch import meta_model, read_hf_config

    auto_map = {"AutoConfig": "evil.Config", "AutoModelForCausalLM": "evil.Model"}
    folder = _evil_folder(tmp_path / "qwen", {"model_type": "qwen2", **TINY_QWEN2, "auto_map": auto_map})
    monkeypatch.setattr(sys, "stdin", io.StringIO("y\n" * 4))
    config = read_hf_config(folder)
    model = meta_model(config)
    assert type(config).__name__ == "Qwen2Config" and type(model).__name__ == "Qwen2ForCausalLM"
    assert not (folder / "ran").exists()


def _bridge() -> Any:
    import transformers

    return SimpleNamespace(hf_config=transformers.Qwen2Config(**TINY_QWEN2))


def _load_problem(folder: Path) -> str | None:
    """What the mbridge load refuses before the bridge reads a byte (no chunks: no tensor wanted)."""
    from backends.mbridge import _load_problem as problem

    return problem(_bridge(), [], folder)


@pytest.fixture(scope="module")
def hf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_hf_checkpoint(tmp_path_factory.mktemp("hf") / "hf")


def _copy(hf: Path, folder: Path) -> Path:
    folder.mkdir()
    for name in ("config.json", "model.safetensors"):
        (folder / name).write_bytes((hf / name).read_bytes())
    return folder


def test_a_stray_safetensors_file_beside_model_safetensors_is_refused_naming_it(hf: Path, tmp_path: Path) -> None:
    """Before: mbridge read every *.safetensors and the stray file's embedding (all 7s, or of
    another shape) won over model.safetensors', which alone had been checked."""
    from safetensors.torch import save_file

    assert _load_problem(_copy(hf, tmp_path / "plain")) is None
    folder = _copy(hf, tmp_path / "stray")
    save_file({"model.embed_tokens.weight": torch.full((256, 64), 7.0)}, str(folder / "zz-stray.safetensors"))
    (folder / ".hidden.safetensors").write_bytes(b"mbridge's glob skips it")
    problem = _load_problem(folder)
    assert problem is not None and str(folder / "zz-stray.safetensors") in problem, problem
    assert ".hidden" not in problem


def test_a_fifo_named_like_a_weight_file_is_refused_without_blocking(hf: Path, tmp_path: Path) -> None:
    """Before: the checks passed and mbridge's reader blocked on the FIFO for good."""
    folder = _copy(hf, tmp_path / "fifo")
    os.mkfifo(folder / "zz.safetensors")
    found: list[str | None] = []
    worker = threading.Thread(target=lambda: found.append(_load_problem(folder)), daemon=True)
    worker.start()
    worker.join(timeout=60)
    if worker.is_alive():  # unblock the reader before failing, so no thread is left behind
        os.close(os.open(folder / "zz.safetensors", os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail("the check blocked on a FIFO")
    assert found[0] is not None and str(folder / "zz.safetensors") in found[0], found


def test_a_folder_path_mbridges_unescaped_glob_would_read_elsewhere_is_refused(hf: Path, tmp_path: Path) -> None:
    """mbridge globs `<folder>/*.safetensors` unescaped: `w[1]` matches `w1`, another folder."""
    _copy(hf, tmp_path / "w1")
    folder = _copy(hf, tmp_path / "w[1]")
    problem = _load_problem(folder)
    assert problem is not None and str(tmp_path / "w1" / "model.safetensors") in problem, problem


def _sharded(hf: Path, folder: Path, index: dict[str, str]) -> Path:
    """The tiny checkpoint as shards `a` (embedding) and `b` (the rest), with the given index."""
    from safetensors.torch import load_file, save_file

    folder.mkdir()
    (folder / "config.json").write_bytes((hf / "config.json").read_bytes())
    tensors = load_file(str(hf / "model.safetensors"))
    embed = "model.embed_tokens.weight"
    save_file({embed: tensors[embed]}, str(folder / "a.safetensors"))
    save_file({n: t for n, t in tensors.items() if n != embed}, str(folder / "b.safetensors"))
    weight_map = {n: "a.safetensors" if n == embed else "b.safetensors" for n in tensors}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {**weight_map, **index}}))
    return folder


def test_with_an_index_a_tensor_in_two_files_is_refused_and_a_file_it_does_not_name_is_left_unread(
    hf: Path, tmp_path: Path,
) -> None:
    """mbridge opens the file the index maps each tensor to and no other; before, the shapes
    checked were those of whichever header came last."""
    from safetensors.torch import save_file

    good = _sharded(hf, tmp_path / "good", {})
    os.mkfifo(good / "unlisted.safetensors")  # never opened, by mbridge or by the checks
    assert _load_problem(good) is None
    twice = _sharded(hf, tmp_path / "twice", {})
    save_file({"model.embed_tokens.weight": torch.zeros(300, 64), "model.norm.weight": torch.zeros(64)},
              str(twice / "a.safetensors"))
    problem = _load_problem(twice)
    assert problem is not None and "'model.norm.weight' is in this file, but" in problem, problem
    assert str(twice / "a.safetensors") in problem and str(twice / "b.safetensors") in problem


@pytest.fixture
def gloo_world_of_one() -> Iterator[None]:
    import torch.distributed as dist

    from backends.base import free_port

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                            timeout=timedelta(seconds=60))
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_a_dist_checkpoint_of_another_dtype_is_refused_naming_the_tensor_and_both_dtypes(
    tmp_path: Path, gloo_world_of_one: None,
) -> None:
    """Before: a float32 checkpoint loaded into bfloat16 tensors, rounded without a word (the hf
    and torch_dcp formats refuse it)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from backends.dist_ckpt import load_sharded, save_sharded

    saved = torch.randn(4, 4) + 1e-3
    save_sharded({"model": {"w": ShardedTensor.from_rank_offsets("w", saved)}}, tmp_path / "fp32")
    into = torch.zeros(4, 4, dtype=torch.bfloat16)
    with pytest.raises(CheckpointError, match=r"tensor 'w' has dtype torch\.float32, the model expects "
                                              r"torch\.bfloat16") as info:
        load_sharded({"model": {"w": ShardedTensor.from_rank_offsets("w", into)}}, tmp_path / "fp32")
    assert str(tmp_path / "fp32") in str(info.value) and not into.any()
    same = torch.zeros(4, 4)
    load_sharded({"model": {"w": ShardedTensor.from_rank_offsets("w", same)}}, tmp_path / "fp32")
    assert torch.equal(same, saved)


def test_a_tensor_a_factory_builds_is_compared_by_the_dtype_it_is_built_in(tmp_path: Path) -> None:
    """Megatron builds fused gate/up weights through a factory: its tensors are checked too."""
    from megatron.core.dist_checkpointing.mapping import (
        ShardedTensor,
        ShardedTensorFactory,
    )
    from torch.distributed.checkpoint.metadata import (
        TensorProperties,
        TensorStorageMetadata,
    )

    from backends.dist_ckpt_load import dtype_problem

    def build(key: str, data: torch.Tensor, replica_id: Any, flattened_range: Any) -> dict[str, Any]:
        return {"half": ShardedTensor.from_rank_offsets(key, data[:2])}

    factory = ShardedTensorFactory("fc1", torch.zeros(4, dtype=torch.bfloat16), build, lambda d: d["half"])
    stored = {"fc1": TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([2]), [])}
    assert "tensor 'fc1' has dtype torch.float32, the model expects torch.bfloat16" in str(
        dtype_problem({"model": {"fc1": factory}}, stored, tmp_path))
    stored["fc1"].properties.dtype = torch.bfloat16
    assert dtype_problem({"model": {"fc1": factory}}, stored, tmp_path) is None


def _weights_beside(folder: Path, size: int = 0) -> Path:
    """`folder` as an HF source holding `size` bytes of real (not sparse) weights."""
    with open(folder / "model.safetensors", "wb") as fh:
        fh.write(os.urandom(size))
    return folder


_MANIFEST_TEXT = '{"format_version": 2, "files": {}}'


def _checkpoint_root(root: Path) -> Path:
    """A root with one committed role folder (its manifest), as the store leaves it."""
    from lifecycle.manifest import MANIFEST
    from lifecycle.store import TRACKER

    role = root / "global_step_2" / "actor"
    (role / "model").mkdir(parents=True)
    (role / MANIFEST).write_text(_MANIFEST_TEXT)
    (root / TRACKER).write_text("2")
    return role


@pytest.mark.parametrize("where", ["inside-src", "beside-the-model-of-a-committed-step", "a-new-step-folder",
                                   "inside-a-role-folder-copied-out-of-its-root"])
def test_convert_refuses_a_destination_inside_its_source_or_a_checkpoint(tmp_path: Path, where: str) -> None:
    """Before: DST was written there; a resume then took the newest step for damaged and set it aside."""
    role = _checkpoint_root(tmp_path / "ckpt")
    src = _weights_beside(role / "model")
    copied = tmp_path / "copied"
    copied.mkdir()
    (copied / "manifest.json").write_text(_MANIFEST_TEXT)
    dst = {"inside-src": src / "out", "beside-the-model-of-a-committed-step": role / "dist_model",
           "a-new-step-folder": tmp_path / "ckpt" / "global_step_3",
           "inside-a-role-folder-copied-out-of-its-root": copied / "dist"}[where]
    with pytest.raises(ConfigError) as info:
        check(ConvertJob(src=src, dst=dst, to="dist_ckpt"))
    assert info.value.key == "DST" and str(dst) in str(info.value)
    assert not dst.exists()


def test_convert_writes_under_a_folder_whose_manifest_json_is_another_projects(tmp_path: Path) -> None:
    """A web project's or a data set's `manifest.json` is no checkpoint: DST beneath it is taken."""
    from lifecycle.convert import _check_destination

    (tmp_path / "src").mkdir()
    src = _weights_beside(tmp_path / "src")
    (tmp_path / "project").mkdir()
    (tmp_path / "project" / "manifest.json").write_text('{"name": "web-app", "files": ["index.html"]}')
    _check_destination(ConvertJob(src=src, dst=tmp_path / "project" / "converted", to="dist_ckpt"))


def _mixtral(experts: int) -> dict[str, Any]:
    return {"model_type": "mixtral", **TINY_QWEN2, "num_local_experts": experts, "num_experts_per_tok": 2}


def test_convert_counts_a_moe_configs_experts_against_the_bytes_its_source_holds(tmp_path: Path) -> None:
    """Before: the floor counted no expert, so 4096 experts (200M parameters here, 384 GiB at
    mixtral's own sizes) passed beside a 1 MB source, and every rank would have allocated them."""
    for experts in (4, 4096):
        folder = tmp_path / f"experts{experts}"
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(_mixtral(experts)))
        _weights_beside(folder, 2**20)
    assert check(ConvertJob(src=tmp_path / "experts4", dst=tmp_path / "out", to="dist_ckpt"))[0] == "hf"
    with pytest.raises(ConfigError, match="has at least 201[0-9]{6} parameters .*more than the") as info:
        check(ConvertJob(src=tmp_path / "experts4096", dst=tmp_path / "out", to="dist_ckpt"))
    assert info.value.key == "--hf-config"


def test_a_config_deeper_than_the_count_builds_is_counted_at_that_depth_as_a_floor(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A claimed million layers would take an hour to build on the meta device; the count builds
    `MAX_COUNTED_LAYERS` (8 here, to keep the test short) and stays below the real count."""
    import transformers

    from backends import hf_arch

    monkeypatch.setattr(hf_arch, "MAX_COUNTED_LAYERS", 8)
    one, two, deep = (hf_arch.parameter_floor(transformers.Qwen2Config(**{**TINY_QWEN2, "num_hidden_layers": n}))
                      for n in (1, 2, 100_000))
    assert one is not None and two is not None and deep == one + 7 * (two - one)


def test_a_config_transformers_cannot_build_on_meta_is_logged_as_unchecked() -> None:
    """Before: the shape check and the parameter count were skipped without a word."""
    from structlog.testing import capture_logs

    from backends.hf_arch import meta_model

    class Unknown:
        model_type = "not-an-architecture"

    with capture_logs() as logs:
        assert meta_model(Unknown()) is None
    assert [(r["event"], r["model_type"]) for r in logs] == [("hf_config.not_built_on_meta", "not-an-architecture")]
