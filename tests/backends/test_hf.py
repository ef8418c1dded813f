"""HFBackend: safetensors layout, sharding, tied weights, strict loading, optimizer without pickle."""

from __future__ import annotations

import json
import math
import os
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from torch import nn

import backends.hf as hf
import backends.safetensors_io as sio
from backends.base import backend_class
from backends.hf import HFBackend, plan_shards
from backends.safetensors_io import write_file
from lifecycle.checksum import file_digest
from lifecycle.errors import CheckpointError
from tests.edits import edit_json, swap_strings
from tests.guards import within

HANG_GUARD_S = 20

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.transformers


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.body = nn.Linear(8, 8)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.embed.weight


class SharedBuffer(nn.Module):
    """Two buffers that are different views of one storage: safetensors refuses those as-is."""

    def __init__(self) -> None:
        super().__init__()
        base = torch.arange(10.0)
        self.register_buffer("low", base[:4])
        self.register_buffer("high", base[4:])


def mlp(width: int = 8) -> nn.Module:
    return nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 2))


def same_state(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def qwen2(tied: bool = False) -> Any:
    torch.manual_seed(0)
    config = transformers.Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      tie_word_embeddings=tied)
    return transformers.Qwen2ForCausalLM(config).eval()


def test_registry_resolves_hf_backend() -> None:
    cls = backend_class("hf")
    assert cls is HFBackend
    assert (cls.name, cls.capabilities.parallel_invariant, cls.capabilities.supports_async) == ("hf", False, True)


def test_small_model_is_one_file_without_index(tmp_path: Path) -> None:
    model = mlp()
    HFBackend().save_model(model, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt"}
    fresh = mlp()
    HFBackend().load_model(fresh, tmp_path)
    assert same_state(model, fresh)


def test_large_model_is_sharded_with_hf_index(tmp_path: Path) -> None:
    model = mlp(32)  # 32*32*4 = 4096 bytes for the first weight
    HFBackend(max_shard_bytes=4200).save_model(model, tmp_path)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                     "model.safetensors.index.json"]
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert set(index) == {"metadata", "weight_map"}
    assert index["metadata"]["total_size"] == sum(t.numel() * 4 for t in model.state_dict().values())
    assert index["weight_map"] == {
        "0.weight": "model-00001-of-00002.safetensors", "0.bias": "model-00002-of-00002.safetensors",
        "2.weight": "model-00002-of-00002.safetensors", "2.bias": "model-00002-of-00002.safetensors",
    }
    fresh = mlp(32)
    HFBackend().load_model(fresh, tmp_path)
    assert same_state(model, fresh)


def test_save_returns_the_digest_of_every_weight_file_it_wrote(tmp_path: Path) -> None:
    model = mlp(32)
    digests = HFBackend(max_shard_bytes=4200).save_model(model, tmp_path)
    shards = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert sorted(digests) == shards and len(shards) == 2
    assert all(digests[name] == file_digest(tmp_path / name) for name in shards)
    optim = HFBackend().save_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), None, tmp_path / "optim")
    assert optim == {"optimizer.safetensors": file_digest(tmp_path / "optim" / "optimizer.safetensors")}


def test_load_checks_the_files_it_is_given_digests_for_and_returns_them(tmp_path: Path) -> None:
    model = mlp(32)
    digests = HFBackend(max_shard_bytes=4200).save_model(model, tmp_path)
    first, second = sorted(digests)
    fresh = mlp(32)
    assert HFBackend().load_model(fresh, tmp_path, expected={first: digests[first]}) == {first}
    assert same_state(model, fresh)
    assert HFBackend().load_model(fresh, tmp_path) == set()
    with pytest.raises(CheckpointError, match=f"{second}: checksum [0-9a-f]+ != manifest 0+"):
        HFBackend().load_model(fresh, tmp_path, expected={**digests, second: "0" * 16})


def test_resaving_smaller_removes_stale_shards(tmp_path: Path) -> None:
    model = mlp(32)
    HFBackend(max_shard_bytes=4200).save_model(model, tmp_path)
    HFBackend().save_model(model, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]


def test_plan_shards_gives_an_oversized_tensor_its_own_shard() -> None:
    assert plan_shards({"a": 10, "b": 100, "c": 10, "d": 10}, 30) == [["a"], ["b"], ["c", "d"]]


def test_tied_weights_are_saved_once_and_stay_tied_after_load(tmp_path: Path) -> None:
    model = Tied()
    HFBackend().save_model(model, tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert sorted(f.keys()) == ["body.bias", "body.weight", "embed.weight"]
    fresh = Tied()
    HFBackend().load_model(fresh, tmp_path)
    assert same_state(model, fresh) and fresh.head.weight is fresh.embed.weight


def test_tensors_sharing_storage_are_saved(tmp_path: Path) -> None:
    HFBackend().save_model(SharedBuffer(), tmp_path)
    fresh = SharedBuffer()
    fresh.low.zero_()
    HFBackend().load_model(fresh, tmp_path)
    assert fresh.low.tolist() == [0.0, 1.0, 2.0, 3.0]


def test_empty_tensors_are_not_mistaken_for_tied_ones(tmp_path: Path) -> None:
    model = nn.Module()
    model.register_buffer("a", torch.zeros(0))
    model.register_buffer("b", torch.zeros(0))
    HFBackend().save_model(model, tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert sorted(f.keys()) == ["a", "b"]


@pytest.mark.parametrize("tied", [False, True])
def test_qwen2_folder_loads_with_from_pretrained(tmp_path: Path, tied: bool) -> None:
    model = qwen2(tied)
    HFBackend().export_hf(model, tmp_path)
    assert (tmp_path / "config.json").is_file()
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]  # lists on transformers 4, sets on 5
    ids = torch.randint(0, 256, (1, 6))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)


def test_sharded_qwen2_folder_loads_with_from_pretrained(tmp_path: Path) -> None:
    model = qwen2()
    HFBackend(max_shard_bytes=64 * 1024).save_model(model, tmp_path)
    assert (tmp_path / "model.safetensors.index.json").is_file()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert same_state(model, loaded)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_model_round_trips(tmp_path: Path) -> None:
    model = mlp().cuda()
    HFBackend().save_model(model, tmp_path)
    fresh = mlp().cuda()
    HFBackend().load_model(fresh, tmp_path)
    assert same_state(model, fresh)


def test_truncated_file_names_the_file(tmp_path: Path) -> None:
    HFBackend().save_model(mlp(), tmp_path)
    path = tmp_path / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(CheckpointError, match="model.safetensors.*truncated"):
        HFBackend().load_model(mlp(), tmp_path)


def test_pickled_weights_are_not_read(tmp_path: Path) -> None:
    torch.save(mlp().state_dict(), tmp_path / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        HFBackend().load_model(mlp(), tmp_path)


def test_missing_and_unexpected_tensors_are_named(tmp_path: Path) -> None:
    HFBackend().save_model(nn.Linear(4, 4, bias=False), tmp_path)
    with pytest.raises(CheckpointError, match="'bias' missing"):
        HFBackend().load_model(nn.Linear(4, 4), tmp_path)
    HFBackend().save_model(nn.Linear(4, 4), tmp_path)
    with pytest.raises(CheckpointError, match="unexpected tensor 'bias'"):
        HFBackend().load_model(nn.Linear(4, 4, bias=False), tmp_path)


def test_shape_and_dtype_mismatch_are_named(tmp_path: Path) -> None:
    HFBackend().save_model(nn.Linear(4, 4), tmp_path)
    with pytest.raises(CheckpointError, match=r"'weight' has shape \[4, 4\], the model expects \[3, 4\]"):
        HFBackend().load_model(nn.Linear(4, 3), tmp_path)
    with pytest.raises(CheckpointError, match="'weight' has dtype torch.float32, the model expects torch.bfloat16"):
        HFBackend().load_model(nn.Linear(4, 4).to(torch.bfloat16), tmp_path)


def test_failed_load_leaves_the_model_untouched(tmp_path: Path) -> None:
    HFBackend().save_model(nn.Linear(4, 4), tmp_path)
    target = nn.Sequential(nn.Linear(4, 4))
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(CheckpointError):
        HFBackend().load_model(target, tmp_path)
    assert all(torch.equal(before[k], v) for k, v in target.state_dict().items())


def test_index_pointing_outside_the_folder_is_refused(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": {"weight": "../elsewhere.safetensors"}}))
    with pytest.raises(CheckpointError, match="elsewhere"):
        HFBackend().load_model(nn.Linear(2, 2), tmp_path)


def test_only_rank0_writes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hf, "current_rank", lambda: 1)
    model = mlp()
    assert HFBackend().save_model(model, tmp_path / "model") == {}
    assert HFBackend().save_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), None, tmp_path / "optim") == {}
    assert list(tmp_path.iterdir()) == []


def trained(scheduler: str) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(0)
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = (torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 0.9**e) if scheduler == "lambda"
             else torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5))
    for _ in range(3):
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    return model, opt, sched


def assert_same_tree(a: Any, b: Any) -> None:
    assert type(a) is type(b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_same_tree(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same_tree(x, y)
    else:
        assert a == b


@pytest.mark.parametrize("scheduler", ["lambda", "step"])
def test_optimizer_and_scheduler_round_trip(tmp_path: Path, scheduler: str) -> None:
    model, opt, sched = trained(scheduler)
    HFBackend().save_optimizer(opt, sched, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["optimizer.json", "optimizer.safetensors"]
    model2 = mlp()
    model2.load_state_dict(model.state_dict())
    opt2 = torch.optim.AdamW(model2.parameters(), lr=0.5)
    sched2 = (torch.optim.lr_scheduler.LambdaLR(opt2, lambda e: 0.9**e) if scheduler == "lambda"
              else torch.optim.lr_scheduler.StepLR(opt2, step_size=2, gamma=0.5))
    HFBackend().load_optimizer(opt2, sched2, tmp_path)
    assert_same_tree(opt.state_dict(), opt2.state_dict())
    assert_same_tree(sched.state_dict(), sched2.state_dict())
    batch = torch.randn(4, 8)
    for m, o, s in ((model, opt, sched), (model2, opt2, sched2)):
        m(batch).sum().backward()
        o.step()
        s.step()
    assert same_state(model, model2)


class WarmupWithHelper:
    def __init__(self) -> None:
        self.helper = lambda e: e

    def __call__(self, epoch: int) -> float:
        return 1.0


def test_scheduler_value_without_json_form_names_the_key(tmp_path: Path) -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, WarmupWithHelper())
    with pytest.raises(CheckpointError, match=r"lr_scheduler\.lr_lambdas\[0\]\.helper"):
        HFBackend().save_optimizer(opt, sched, tmp_path)


def test_bad_optimizer_files_name_the_file(tmp_path: Path) -> None:
    model, opt, sched = trained("step")
    HFBackend().save_optimizer(opt, sched, tmp_path)
    (tmp_path / "optimizer.json").write_text("{oops")
    with pytest.raises(CheckpointError, match="optimizer.json"):
        HFBackend().load_optimizer(opt, sched, tmp_path)


def test_pickled_optimizer_tensors_are_never_unpickled(tmp_path: Path) -> None:
    model, opt, sched = trained("step")
    HFBackend().save_optimizer(opt, sched, tmp_path)

    class Exploit:
        def __reduce__(self) -> tuple[Any, ...]:
            return (open, (str(tmp_path / "pwned"), "w"))

    (tmp_path / "optimizer.safetensors").write_bytes(pickle.dumps(Exploit()))
    with pytest.raises(CheckpointError, match="optimizer.safetensors"):
        HFBackend().load_optimizer(opt, sched, tmp_path)
    assert not (tmp_path / "pwned").exists()


def test_optimizer_of_another_model_is_refused(tmp_path: Path) -> None:
    model, opt, sched = trained("step")
    HFBackend().save_optimizer(opt, sched, tmp_path)
    other = torch.optim.AdamW(nn.Linear(2, 2).parameters())
    with pytest.raises(CheckpointError, match="optimizer.json.*does not fit"):
        HFBackend().load_optimizer(other, None, tmp_path)


# Hostile weight folders: FIFOs, indexes no parser takes, shards that disagree with the index ---

INDEX = "model.safetensors.index.json"


def sharded(folder: Path) -> nn.Module:
    """A model saved as two shards with an index: 0.weight in the first, the rest in the second."""
    model = mlp(32)
    HFBackend(max_shard_bytes=4200).save_model(model, folder)
    return model


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
@pytest.mark.parametrize("fifo", [INDEX, "model-00002-of-00002.safetensors"])
def test_a_fifo_in_a_weight_folder_is_refused_without_blocking(tmp_path: Path, fifo: str) -> None:
    sharded(tmp_path)
    (tmp_path / fifo).unlink()
    os.mkfifo(tmp_path / fifo)
    with pytest.raises(CheckpointError, match=f"{tmp_path / fifo}: a FIFO, not a regular file"):
        within(HANG_GUARD_S, lambda: HFBackend().load_model(mlp(32), tmp_path))


@pytest.mark.parametrize("text", ['{"weight_map": {"a": ' + "9" * 5000 + "}}", "[1]", '{"weight_map": [1]}', "{oops"],
                         ids=["huge-integer", "a-list", "weight-map-a-list", "not-json"])
def test_an_index_no_parser_takes_is_refused_naming_it(tmp_path: Path, text: str) -> None:
    sharded(tmp_path)
    (tmp_path / INDEX).write_text(text)
    with pytest.raises(CheckpointError, match=f"{tmp_path / INDEX}: not (valid JSON|a valid safetensors index)"):
        HFBackend().load_model(mlp(32), tmp_path)


def test_an_index_nested_too_deeply_for_the_parser_is_refused_naming_it(tmp_path: Path) -> None:
    sharded(tmp_path)
    (tmp_path / INDEX).write_text('{"weight_map": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(CheckpointError, match=f"^{tmp_path / INDEX}: not valid JSON: nested too deeply$"):
        HFBackend().load_model(mlp(32), tmp_path)


def test_each_weight_file_s_header_is_parsed_once_per_load(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = sharded(tmp_path)
    parsed: list[str] = []
    real = sio.read_header

    def counting(path: Path) -> Any:
        parsed.append(Path(path).name)
        return real(path)

    monkeypatch.setattr(sio, "read_header", counting)
    monkeypatch.setattr(hf, "read_header", counting)
    fresh = mlp(32)
    HFBackend().load_model(fresh, tmp_path)
    assert sorted(parsed) == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert same_state(model, fresh)


@pytest.mark.parametrize("target", ["config.json", "sub", "", 7])
def test_an_index_mapping_a_tensor_to_anything_but_a_safetensors_file_is_refused(tmp_path: Path, target: Any) -> None:
    sharded(tmp_path)
    (tmp_path / "sub").mkdir()
    index = json.loads((tmp_path / INDEX).read_text())
    index["weight_map"]["0.bias"] = target
    (tmp_path / INDEX).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=rf"{tmp_path / INDEX}: tensor '0.bias' maps to {target!r}"):
        HFBackend().load_model(mlp(32), tmp_path)


def test_a_copy_of_a_tensor_in_a_shard_the_index_does_not_map_it_to_is_refused(tmp_path: Path) -> None:
    """The index puts 0.weight in shard 1; a stray copy in shard 2 would be what loads last."""
    model = sharded(tmp_path)
    second = tmp_path / "model-00002-of-00002.safetensors"
    rest = {n: t for n, t in model.state_dict().items() if n != "0.weight"}
    write_file(second, {**rest, "0.weight": torch.zeros(32, 32)})
    target = mlp(32)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(CheckpointError, match=rf"{second}: tensor '0.weight' is in this file, but {INDEX} maps it "
                                              rf"to {tmp_path / 'model-00001-of-00002.safetensors'}"):
        HFBackend().load_model(target, tmp_path)
    assert all(torch.equal(before[k], v) for k, v in target.state_dict().items())


def test_a_tensor_in_a_shard_but_not_in_the_index_is_refused(tmp_path: Path) -> None:
    sharded(tmp_path)
    index = json.loads((tmp_path / INDEX).read_text())
    del index["weight_map"]["2.bias"]
    (tmp_path / INDEX).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=f"model-00002-of-00002.safetensors: tensor '2.bias' is in this file "
                                              f"but not listed in {INDEX}"):
        HFBackend().load_model(mlp(32), tmp_path)


def test_an_hf_cache_snapshot_of_symlinks_loads(tmp_path: Path) -> None:
    blobs, snapshot = tmp_path / "blobs", tmp_path / "snapshot"
    model = sharded(blobs)
    snapshot.mkdir()
    for i, path in enumerate(sorted(blobs.iterdir())):
        path.rename(blobs / f"blob{i}")
        (snapshot / path.name).symlink_to(blobs / f"blob{i}")
    fresh = mlp(32)
    HFBackend().load_model(fresh, snapshot)
    assert same_state(model, fresh)


# Optimizer state that loads but cannot train ----------------------------------------------

def saved_adam(folder: Path) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    HFBackend().save_optimizer(opt, None, folder)
    return model


def edit_optimizer(folder: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    edit_json(folder / "optimizer.json", lambda doc: edit(doc["optimizer"]))


def swap_tensors(folder: Path, a: str, b: str) -> None:
    """Point state `a` at the tensor of state `b` and back: the tensors of two parameters swapped."""
    swap_strings(folder / "optimizer.json", a, b)


def refused_by_the_optimizer(folder: Path, *needles: str) -> None:
    """Refused naming optimizer.json and every needle, before the running optimizer changed."""
    model = nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters(), lr=0.5)
    with pytest.raises(CheckpointError) as caught:
        HFBackend().load_optimizer(opt, None, folder)
    message = str(caught.value)
    for needle in (f"{folder / 'optimizer.json'}: does not fit the optimizer", *needles):
        assert needle in message, f"{needle!r} not in: {message}"
    assert not opt.state and opt.param_groups[0]["lr"] == 0.5


@pytest.mark.parametrize("key", ["exp_avg", "exp_avg_sq"])
def test_state_tensors_of_two_parameters_swapped_are_refused(tmp_path: Path, key: str) -> None:
    saved_adam(tmp_path)
    swap_tensors(tmp_path, f"optimizer.state[0].{key}", f"optimizer.state[1].{key}")
    refused_by_the_optimizer(tmp_path, f"state of parameter 0, key {key!r}: has shape [3], its parameter has [3, 4]")


def test_a_step_count_of_a_parameter_s_shape_is_refused(tmp_path: Path) -> None:
    saved_adam(tmp_path)
    swap_tensors(tmp_path, "optimizer.state[0].step", "optimizer.state[0].exp_avg")
    refused_by_the_optimizer(tmp_path, "state of parameter 0, key 'step': must be one finite number >= 0")


STATE_EDITS: dict[str, tuple[Callable[[dict[str, Any]], None], str]] = {  # what the first step would meet
    "nan-step": (lambda o: o["state"]["0"].update(step={"__float__": "nan"}), "key 'step': must be one finite number"),
    "negative-step": (lambda o: o["state"]["0"].update(step=-1.0), "key 'step': must be one finite number >= 0"),
    "missing-buffer": (lambda o: o["state"]["0"].pop("exp_avg_sq"), "lacks ['exp_avg_sq'], which its optimizer's step reads"),
    "null-buffer": (lambda o: o["state"]["0"].update(exp_avg=None), "key 'exp_avg': must be a tensor of its parameter's shape"),
    "one-tensor-twice": (lambda o: o["state"]["0"].update(exp_avg_sq=o["state"]["0"]["exp_avg"]),
                         "key 'exp_avg_sq': is the very tensor given for the state of parameter 0, key 'exp_avg'"),
}


@pytest.mark.parametrize("edit", STATE_EDITS)
def test_a_state_the_first_step_would_fail_or_train_wrong_on_is_refused(tmp_path: Path, edit: str) -> None:
    """Each loaded through `load_state_dict` without a word: then a NaN step made every weight
    NaN after one step, -1 divided by zero, a missing or null buffer raised a raw KeyError or
    AttributeError, and one tensor for two buffers trained on aliased moments."""
    saved_adam(tmp_path)
    change, needle = STATE_EDITS[edit]
    edit_json(tmp_path / "optimizer.json", lambda doc: change(_by_string_keys(doc["optimizer"])))
    refused_by_the_optimizer(tmp_path, needle)


def _by_string_keys(optimizer: dict[str, Any]) -> dict[str, Any]:
    """optimizer.json's state, keyed by parameter number as a string, for editing in place."""
    pairs = optimizer["state"]["__dict__"]
    return {"state": {str(k): v for k, v in pairs}}


@pytest.mark.parametrize("lr", ["fast", math.nan, math.inf, None, True, [0.1], 10**400],
                         ids=["string", "nan", "inf", "null", "bool", "list", "beyond-float"])
def test_a_learning_rate_that_is_not_a_finite_number_is_refused(tmp_path: Path, lr: Any) -> None:
    saved_adam(tmp_path)
    edit_optimizer(tmp_path, lambda o: o["param_groups"][0].update(
        lr={"__float__": repr(lr)} if isinstance(lr, float) else lr))
    refused_by_the_optimizer(tmp_path, "param_groups[0].lr: must be a finite number like the running optimizer's 0.5")


@pytest.mark.parametrize("betas", [[0.9], ["a", 0.99], None], ids=["one", "string", "null"])
def test_betas_that_are_not_two_finite_numbers_are_refused(tmp_path: Path, betas: Any) -> None:
    saved_adam(tmp_path)
    edit_optimizer(tmp_path, lambda o: o["param_groups"][0].update(betas=betas))
    refused_by_the_optimizer(tmp_path, "param_groups[0].betas: must be 2 finite numbers")


def test_a_missing_hyper_parameter_is_refused(tmp_path: Path) -> None:
    saved_adam(tmp_path)
    edit_optimizer(tmp_path, lambda o: o["param_groups"][0].pop("eps"))
    refused_by_the_optimizer(tmp_path, "param_groups[0].eps: missing")


def test_a_scheduler_built_since_the_save_does_not_make_its_initial_lr_a_missing_hyper_parameter(
    tmp_path: Path,
) -> None:
    """Building a torch scheduler adds `initial_lr` to the running groups; a save made without
    one lacks it, and `load_state_dict` takes the saved groups as they are."""
    saved_adam(tmp_path)
    model = nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters(), lr=0.5)
    torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 1.0)
    assert opt.param_groups[0]["initial_lr"] == 0.5
    HFBackend().load_optimizer(opt, None, tmp_path)
    assert opt.param_groups[0]["lr"] == 0.01 and "initial_lr" not in opt.param_groups[0]
    assert set(opt.state[model.weight]) == {"step", "exp_avg", "exp_avg_sq"}


def test_a_key_only_a_scheduler_adds_is_still_checked_when_the_save_has_it(tmp_path: Path) -> None:
    saved_adam(tmp_path)
    edit_optimizer(tmp_path, lambda o: o["param_groups"][0].update(initial_lr={"__float__": "nan"}))
    model = nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters(), lr=0.5)
    torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 1.0)
    with pytest.raises(CheckpointError, match=r"param_groups\[0\]\.initial_lr: must be a finite number"):
        HFBackend().load_optimizer(opt, None, tmp_path)


def test_state_of_a_parameter_no_group_lists_is_refused(tmp_path: Path) -> None:
    saved_adam(tmp_path)
    edit_optimizer(tmp_path, lambda o: o["state"]["__dict__"].append([7, {}]))
    refused_by_the_optimizer(tmp_path, "optimizer.state holds parameter 7, which no param_group lists")


def test_swapped_state_is_refused_against_the_running_optimizer_s_own_state(tmp_path: Path) -> None:
    """An optimizer that already stepped is its own reference, whatever the key is called."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    opt = torch.optim.Rprop(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    HFBackend().save_optimizer(opt, None, tmp_path)
    swap_tensors(tmp_path, "optimizer.state[0].prev", "optimizer.state[1].prev")
    with pytest.raises(CheckpointError, match=r"optimizer.json: does not fit the optimizer: state of parameter 0, "
                                              r"key 'prev': has shape \[3\], the running optimizer's has \[3, 4\]"):
        HFBackend().load_optimizer(opt, None, tmp_path)


OPTIMIZERS: dict[str, Callable[[list[nn.Parameter]], torch.optim.Optimizer]] = {
    "sgd-momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    "adamw-amsgrad": lambda p: torch.optim.AdamW(p, amsgrad=True),
    "adamw-tensor-lr": lambda p: torch.optim.AdamW(p, lr=torch.tensor(0.01)),
    "rmsprop-centered": lambda p: torch.optim.RMSprop(p, centered=True, momentum=0.5),
    "adagrad": lambda p: torch.optim.Adagrad(p),
    "asgd": lambda p: torch.optim.ASGD(p),
    "rprop": lambda p: torch.optim.Rprop(p),
    "lbfgs": lambda p: torch.optim.LBFGS(p, history_size=3),  # flat buffers over the whole group
    "adafactor": lambda p: torch.optim.Adafactor(p),  # factored second moments
}


@pytest.mark.parametrize("make", OPTIMIZERS.values(), ids=OPTIMIZERS.keys())
@pytest.mark.parametrize("stepped", [False, True], ids=["fresh", "stepped"])
def test_every_optimizer_s_own_state_passes_the_checks(tmp_path: Path, make: Any, stepped: bool) -> None:
    torch.manual_seed(0)
    model = mlp()
    opt = make(list(model.parameters()))
    batch = torch.randn(4, 8)

    def closure(m: nn.Module, o: torch.optim.Optimizer) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            o.zero_grad()
            loss = m(batch).pow(2).sum()
            loss.backward()
            return loss
        return run

    for _ in range(2):
        opt.step(closure(model, opt))
    HFBackend().save_optimizer(opt, None, tmp_path)
    model2 = mlp()
    model2.load_state_dict(model.state_dict())
    opt2 = make(list(model2.parameters()))
    if stepped:
        opt2.step(closure(model2, opt2))
        model2.load_state_dict(model.state_dict())
    HFBackend().load_optimizer(opt2, None, tmp_path)
    assert same_state(model, model2), "the load moved no weight (a zero-lr step moves Adafactor's)"
    opt.step(closure(model, opt))
    opt2.step(closure(model2, opt2))
    assert same_state(model, model2)


@pytest.mark.parametrize(("make", "key"), [
    (lambda ps: torch.optim.RMSprop(ps, lr=0.01, momentum=0.9, centered=True), "grad_avg"),
    (lambda ps: torch.optim.Adam(ps, lr=0.01, amsgrad=True), "max_exp_avg_sq"),
    (lambda ps: torch.optim.NAdam(ps, lr=0.01), "mu_product"),
], ids=["rmsprop-centered", "adam-amsgrad", "nadam"])
def test_a_state_lacking_what_a_torch_optimizers_step_reads_is_refused(tmp_path: Path, make: Any, key: str) -> None:
    """Each loaded and then raised a raw KeyError at the first step (NAdam inside the load)."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    opt = make(list(model.parameters()))
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    HFBackend().save_optimizer(opt, None, tmp_path)
    edit_json(tmp_path / "optimizer.json", lambda doc: _by_string_keys(doc["optimizer"])["state"]["0"].pop(key))
    fresh = nn.Linear(4, 3)
    with pytest.raises(CheckpointError, match=f"state of parameter 0 lacks \\['{key}'\\], which its optimizer's step"):
        HFBackend().load_optimizer(make(list(fresh.parameters())), None, tmp_path)
