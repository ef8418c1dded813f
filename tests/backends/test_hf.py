"""HFBackend: safetensors layout, sharding, tied weights, strict loading, optimizer without pickle."""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from torch import nn

import backends.hf as hf
from backends.base import backend_class
from backends.hf import HFBackend, plan_shards
from lifecycle.errors import CheckpointError

transformers = pytest.importorskip("transformers")


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
    assert (cls.name, cls.parallel_invariant, cls.supports_async) == ("hf", False, True)


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
    assert info["missing_keys"] == [] and info["unexpected_keys"] == []
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
    HFBackend().save_model(model, tmp_path / "model")
    HFBackend().save_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), None, tmp_path / "optim")
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
