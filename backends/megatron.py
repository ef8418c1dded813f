"""What the `mbridge` and `dist_ckpt` backends share: the model, the CPU patches, sharded state.

megatron-core and mbridge are imported here and in those two modules only, so a worker that
never uses a Megatron format never pays for (or needs) them. The CPU patches (what megatron-core
and mbridge assume of CUDA, made CPU-safe) are applied only when CUDA is absent, only around the call that
needs them, and registered with the running lifecycle phase so they are undone even if the
call never returns normally. `backends.dist_ckpt`'s load swaps Megatron's DCP reader factory
the same way, so its pickled `.metadata` is read by `backends.dcp_metadata`'s restricted
unpickler, and its planner for `CheckedBytesPlanner`.
"""

from __future__ import annotations

import enum
import importlib.util
import pickle
import queue
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
from megatron.core import parallel_state
from megatron.core.dist_checkpointing.strategies import (
    filesystem_async as mcore_fs_async,
)
from megatron.core.dist_checkpointing.strategies import torch as mcore_dcp
from torch import nn
from torch.distributed.checkpoint._traverse import set_element

from backends.base import current_rank, failed_ranks
from backends.hf_arch import read_hf_config
from backends.hf_config import bridge_view, config_dtype
from lifecycle.errors import CheckpointError, ConfigError, shorten
from lifecycle.phase import temporarily

TRANSFORMER_CONFIG = "transformer_config.json"
_T = TypeVar("_T")
_M = TypeVar("_M", nn.Module, torch.Tensor)
_ARCH_FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
                "kv_channels", "normalization", "gated_linear_unit", "add_qkv_bias", "qk_layernorm")


def transformer_engine_available() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def _noop(*_: Any, **__: Any) -> None:
    return None


def _cpu_device(*_: Any) -> str:
    return "cpu"


def _stay_on_cpu(obj: _M, *_: Any, **__: Any) -> _M:
    return obj


@contextmanager
def cpu_safe() -> Iterator[None]:
    """Megatron-Core and mbridge call `torch.cuda` in places that do not need a GPU for a
    checkpoint; without CUDA those calls become no-ops or name the CPU, for this block only."""
    if torch.cuda.is_available():
        yield
        return
    with temporarily(torch.cuda, synchronize=_noop, current_device=_cpu_device), \
            temporarily(nn.Module, cuda=_stay_on_cpu), temporarily(torch.Tensor, cuda=_stay_on_cpu):
        yield


@dataclass(kw_only=True)
class MegatronModel:
    """A Megatron-Core model as one lifecycle part: its chunks (one per virtual pipeline stage)
    and, when it was built from an HF config, the mbridge bridge that maps it to HF names."""

    chunks: list[nn.Module]
    bridge: Any = None

    @property
    def training(self) -> bool:
        return bool(self.chunks[0].training)

    @property
    def config(self) -> Any:
        """The Megatron `TransformerConfig` the chunks were built with."""
        return self.chunks[0].config

    def parameters(self) -> Iterator[nn.Parameter]:
        for chunk in self.chunks:
            yield from chunk.parameters()

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
        """Every chunk's, under `chunk{i}.` (the names `state_dict` gives without a bridge), as a
        module holding the chunks names them, so `flatten_parameters` takes the model."""
        return self._named("named_parameters", prefix, recurse, remove_duplicate)

    def named_buffers(self, prefix: str = "", recurse: bool = True,
                      remove_duplicate: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        return self._named("named_buffers", prefix, recurse, remove_duplicate)

    def _named(self, method: str, prefix: str, recurse: bool, remove_duplicate: bool) -> Iterator[tuple[str, Any]]:
        seen: set[int] = set()
        for i, chunk in enumerate(self.chunks):
            for name, tensor in getattr(chunk, method)(f"{prefix}.chunk{i}" if prefix else f"chunk{i}", recurse,
                                                       remove_duplicate):
                if not remove_duplicate or id(tensor) not in seen:  # shared by two chunks: once, as a module does
                    seen.add(id(tensor))
                    yield name, tensor

    def train(self, mode: bool = True) -> MegatronModel:
        for chunk in self.chunks:
            chunk.train(mode)
        return self

    def eval(self) -> MegatronModel:
        return self.train(False)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Full HF-named tensors when there is a bridge (what a rollout engine loads), else the
        local chunks' own tensors. With a bridge this is a collective: every rank calls it."""
        if self.bridge is not None:
            with cpu_safe():
                return dict(self.bridge.export_weights(self.chunks))
        return {f"chunk{i}.{k}": v for i, c in enumerate(self.chunks) for k, v in c.state_dict().items()
                if isinstance(v, torch.Tensor)}

    def fingerprint(self) -> dict[str, Any]:
        """The architecture, independent of TP / PP, so a resharded resume still matches."""
        if self.bridge is not None:
            return dict(self.bridge.hf_config.to_dict())
        return {name: plain_value(getattr(self.config, name, None)) for name in _ARCH_FIELDS}


def chunks_of(model: Any) -> list[nn.Module]:
    """A MegatronModel, a list of chunks, or one module (a GPTModel someone else built)."""
    if isinstance(model, MegatronModel):
        return model.chunks
    if isinstance(model, (list, tuple)) and all(isinstance(m, nn.Module) for m in model):
        return list(model)
    if isinstance(model, nn.Module):
        return [model]
    raise CheckpointError(f"a Megatron backend needs a MegatronModel or Megatron-Core module(s), "
                          f"got {type(model).__name__}")


def as_megatron_model(model: Any, fmt: str, key: str) -> MegatronModel:
    """The model a Megatron format works on; a GPTModel or chunk list built elsewhere is wrapped,
    so the config hash and weight sync see the architecture, not one rank's shards."""
    if isinstance(model, MegatronModel):
        return model
    try:
        return MegatronModel(chunks=chunks_of(model))
    except CheckpointError as exc:
        raise ConfigError(key, f"{fmt} is a Megatron format: {exc}") from None


def bridge_of(model: Any, what: str, key: str = "checkpoint.save.format") -> Any:
    bridge = getattr(model, "bridge", None)
    if bridge is None:
        raise ConfigError(key, f"{what} needs an mbridge bridge, and the model has none: build it with "
                          "backends.megatron.build_model(hf_config_dir, tp=..., pp=...) so it carries one")
    return bridge


def _bridge_class(model_type: str) -> type:
    """mbridge's class for the architecture; without Transformer Engine, a subclass on the
    local layer spec whose name map knows the local spec's separate layer norms."""
    from mbridge.core.bridge import _MODEL_REGISTRY
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    import mbridge  # noqa: F401 - importing it registers the architectures

    if model_type not in _MODEL_REGISTRY:
        raise ConfigError("hf_config", f"mbridge has no bridge for model_type {model_type!r}; "
                          f"known: {', '.join(sorted(_MODEL_REGISTRY))}")
    base = _MODEL_REGISTRY[model_type]
    if transformer_engine_available():
        return base

    def layer_spec(self: Any, vp_stage: int | None = None) -> Any:
        return get_gpt_decoder_block_spec(self.config, use_transformer_engine=False, vp_stage=vp_stage)

    layer = "model.layers.{layer_number}."
    return type(f"Local{base.__name__}", (base,), {
        "_get_transformer_layer_spec": layer_spec,
        "_OTHER_MAPPING": {**base._OTHER_MAPPING, "input_layernorm.weight": [layer + "input_layernorm.weight"]},
        "_MLP_MAPPING": {**base._MLP_MAPPING,
                         "pre_mlp_layernorm.weight": [layer + "post_attention_layernorm.weight"]},
    })


def _check_sizes(tp: int, pp: int) -> None:
    for name, size in (("tp", tp), ("pp", pp)):
        if type(size) is not int or size < 1:
            raise ConfigError(f"parallel.{name}", f"must be an integer >= 1, got {shorten(size)}")


def check_layout(hf_config: Any, *, tp: int, pp: int) -> None:
    """Refuse a TP / PP the architecture cannot be split by, before any rank starts: Megatron
    itself raised a raw ValueError or AssertionError per rank. `hf_config` is a folder or a
    `PretrainedConfig`; mbridge pads no vocabulary, so the vocabulary must divide too."""
    from transformers import PretrainedConfig

    _check_sizes(tp, pp)
    if not isinstance(hf_config, PretrainedConfig):
        hf_config = read_hf_config(Path(hf_config))
    heads = getattr(hf_config, "num_attention_heads", None)
    split = {"num_attention_heads": heads, "num_key_value_heads": getattr(hf_config, "num_key_value_heads", heads),
             "vocab_size": getattr(hf_config, "vocab_size", None),
             "intermediate_size": getattr(hf_config, "intermediate_size", None)}
    for name, size, by in [*((n, v, ("tp", tp)) for n, v in split.items()),
                           ("num_hidden_layers", getattr(hf_config, "num_hidden_layers", None), ("pp", pp))]:
        if type(size) is int and size % by[1]:
            raise ConfigError(f"parallel.{by[0]}", f"{by[0]}={by[1]} does not divide the HF config's "
                              f"{name}={size}: pick a {by[0]} that does")


def init_parallel(tp: int, pp: int) -> None:
    """Megatron's process groups for this TP / PP, over the already-initialised default group."""
    import torch.distributed as dist

    _check_sizes(tp, pp)
    if not (dist.is_available() and dist.is_initialized()):
        raise ConfigError("parallel", "initialise torch.distributed first (gloo on CPU, nccl on GPU), "
                          f"with a world size that is a multiple of tp*pp = {tp * pp}")
    if parallel_state.model_parallel_is_initialized():
        have = (parallel_state.get_tensor_model_parallel_world_size(),
                parallel_state.get_pipeline_model_parallel_world_size())
        if have != (tp, pp):
            raise ConfigError("parallel", f"Megatron is already initialised at tp={have[0]} pp={have[1]}, "
                              f"not tp={tp} pp={pp}")
        return
    if dist.get_world_size() % (tp * pp):
        raise ConfigError("parallel", f"world size {dist.get_world_size()} is not a multiple of tp*pp = {tp * pp}")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)


def _seed_cuda_rng(seed: int) -> None:
    """Megatron initialises TP-sharded weights on the GPU from its own RNG tracker."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, model_parallel_cuda_manual_seed

    if not get_cuda_rng_tracker().is_initialized():
        model_parallel_cuda_manual_seed(seed)


def build_model(
    hf_config: Any, *, tp: int = 1, pp: int = 1, dtype: torch.dtype | None = None, seed: int = 1234
) -> MegatronModel:
    """Model chunks and bridge for an HF architecture (a folder or a `PretrainedConfig`) at
    this TP / PP. Weights are initialised, not loaded: init-load or resume fills them."""
    from transformers import PretrainedConfig

    if not isinstance(hf_config, PretrainedConfig):  # no code of the folder's runs: `backends.hf_arch`
        hf_config = read_hf_config(Path(hf_config))
    check_layout(hf_config, tp=tp, pp=pp)
    init_parallel(tp, pp)
    on_gpu = torch.cuda.is_available()
    if on_gpu:
        _seed_cuda_rng(seed)
    # The checkpoint's own dtype, so a float32 checkpoint round-trips exactly (mbridge: bf16).
    dtype = dtype or config_dtype(hf_config) or torch.float32
    with bridge_view(hf_config):
        bridge = _bridge_class(hf_config.model_type)(hf_config, dtype=dtype)
        if not on_gpu and getattr(bridge.config, "num_moe_experts", None):
            raise ConfigError("hf_config", f"{hf_config.model_type} has MoE layers, which Megatron builds "
                              "only with CUDA (torch.cuda streams): build it on a GPU machine")
        if not on_gpu:
            bridge.set_extra_args(use_cpu_initialization=True, sequence_parallel=False)
        if importlib.util.find_spec("scaled_masked_softmax_cuda") is None:
            # mbridge asks for Megatron's fused softmax; without its kernel (apex or
            # Megatron-LM's), a half-precision forward would fail on import.
            bridge.set_extra_args(masked_softmax_fusion=False)
        with cpu_safe():
            chunks = bridge.get_model(wrap_with_ddp=False, bf16=dtype is torch.bfloat16, fp16=dtype is torch.float16,
                                      use_cpu_initialization=not on_gpu)
    return MegatronModel(chunks=list(chunks), bridge=bridge)


def sharded_model_state(chunks: list[nn.Module]) -> dict[str, Any]:
    """Megatron-LM's own nesting (`model`, or `model0`, `model1`... with virtual pipelines), so
    checkpoints written by Megatron-LM and by this library read each other."""
    if len(chunks) == 1:
        return {"model": chunks[0].sharded_state_dict()}
    return {f"model{i}": chunk.sharded_state_dict() for i, chunk in enumerate(chunks)}


@contextmanager
def library_errors(what: str, folder: Path) -> Iterator[None]:
    """Megatron's CheckpointingException, DCP's CheckpointException (a BaseException, one
    traceback per rank) and the usual I/O errors become one CheckpointError naming the folder."""
    from megatron.core.dist_checkpointing.core import CheckpointingException
    from safetensors import SafetensorError
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as exc:
        ranks = "; ".join(f"rank {r}: {type(e).__name__}: {e}" for r, (e, _) in exc.failures.items())
        raise CheckpointError(f"{folder}: {what} failed: {ranks}") from exc
    except (CheckpointingException, SafetensorError, OSError, RuntimeError, ValueError, KeyError, TypeError,
            AttributeError, IndexError, EOFError, pickle.UnpicklingError) as exc:
        # TypeError, AttributeError: a metadata.json of another shape; the last three: a damaged common.pt
        raise CheckpointError(f"{folder}: {what} failed: {type(exc).__name__}: {exc}") from exc


@contextmanager
def in_process_write_results() -> Iterator[None]:
    """Megatron's torch_dist writer hands its write results over the queue of a multiprocessing
    Manager, which it starts on a process's first save: a spawned interpreter that imports torch to
    unpickle them (seconds of CPU per rank, and a process left running). A synchronous save (ours)
    puts the results and takes them back in this very process, so for the call a plain thread-safe
    queue stands in; Megatron's own queue is put back afterwards, for an async save of Megatron's."""
    if not hasattr(mcore_fs_async, "_results_queue"):
        yield  # another megatron-core layout: leave its writer as it is
        return
    with temporarily(mcore_fs_async, _results_queue=queue.Queue()):
        yield


class CheckedBytesPlanner(mcore_dcp.MCoreLoadPlanner):
    """Megatron's load planner, but an entry DCP stored as bytes (a layer's `_extra_state`) is
    read with `torch.load(weights_only=True)` instead of DCP's `weights_only=False`, and a
    refusal is a CheckpointError. The object is stored where DCP's own `load_bytes` stores it."""

    def load_bytes(self, read_item: Any, value: Any) -> None:
        fqn = read_item.dest_index.fqn
        try:
            loaded = torch.load(value, weights_only=True)
        except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as exc:
            raise CheckpointError(f"entry {fqn!r}: refused to unpickle it: {exc}") from exc
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded


def on_rank0(write: Callable[[], _T], what: str, folder: Path) -> _T | None:
    """`write()` on rank 0 alone (None elsewhere), then every rank learns whether it failed.

    Rank 0 writes what no other rank holds (the HF files, the JSON beside the shards) while its
    peers move on into the next collective (the optimizer's gathers): a rank 0 that hit a full
    disk would give up and leave them waiting there until the process group's timeout. Rank 0
    raises its own error (a `CheckpointError` naming `folder`), the others one naming rank 0.
    """
    result = None
    if current_rank() == 0:
        try:
            result = write()
        except BaseException as exc:
            failed_ranks(True)
            if isinstance(exc, (CheckpointError, ConfigError)) or not isinstance(exc, Exception):
                raise
            raise CheckpointError(f"{folder}: {what} failed: {type(exc).__name__}: {exc}") from exc
    if failed_ranks(False):
        raise CheckpointError(f"{folder}: rank 0 failed to write the {what} (see its error)")
    return result


def agree(problem: str | None) -> None:
    """Raise on every rank when any rank has a problem, so none is left waiting in a
    collective for a peer that has already given up."""
    failed = failed_ranks(problem is not None)
    if problem is not None:
        raise CheckpointError(problem)
    if failed:
        raise CheckpointError(f"{failed} other rank(s) refused the checkpoint (see their errors)")


def plain_value(value: Any) -> Any:
    """A config value as JSON holds it: dtypes and enums by name, containers item by item."""
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    if isinstance(value, enum.Enum):
        return value.name
    if isinstance(value, (list, tuple)):
        return [plain_value(v) for v in value]
    if isinstance(value, dict):
        return {k: plain_value(v) for k, v in value.items()}
    return value
