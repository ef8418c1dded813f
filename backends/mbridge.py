"""NVIDIA mbridge: a Megatron-Core model saved and loaded as plain HF safetensors.

The files are what `transformers` reads, so `model` and `hf_model` are the same bytes and
are written once. Loading goes through the bridge, which splits each full tensor across the
current TP / PP layout: a checkpoint saved at TP2 loads at TP1. Optimizer state has no HF
form; it is written in Megatron's sharded format by the `dist_ckpt` backend's code.
"""

from __future__ import annotations

import functools
import glob
import hashlib
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import torch

from backends.base import (
    MBRIDGE_CAPABILITIES,
    FormatBackend,
    FormatCapabilities,
    listed,
    reduce_int,
)
from backends.dist_ckpt import DistCkptBackend
from backends.hf import INDEX, SINGLE, placement_problem, weight_files
from backends.hf_arch import expected_shapes
from backends.megatron import (
    MegatronModel,
    agree,
    as_megatron_model,
    bridge_of,
    chunks_of,
    cpu_safe,
    library_errors,
)
from backends.megatron_files import write_hf_export
from backends.safetensors_io import NAMES, read_header
from lifecycle.boundary import lstat, os_errors
from lifecycle.errors import CheckpointError, shorten
from lifecycle.jsontree import read_config_json

_ARCH_KEYS = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "intermediate_size", "vocab_size", "tie_word_embeddings")


def _saved_config(bridge: Any, path: Path) -> dict[str, Any]:
    """What transformers makes of the folder's config.json, read into the model's config class:
    `save_pretrained` leaves out values equal to the class defaults, and a class may derive one
    key from another (Llama's num_key_value_heads). Read bounded, never blocking on a FIFO;
    anything but a JSON object with a model_type is a CheckpointError naming the file."""
    saved = read_config_json(path)
    if not isinstance(saved, dict):
        raise CheckpointError(f"{path}: must be a JSON object, found {type(saved).__name__}")
    if "model_type" not in saved:
        raise CheckpointError(f"{path}: has no model_type, so nothing says which architecture it is")
    cls = type(bridge.hf_config)
    try:
        read = cls.from_dict(saved).to_dict()
    except Exception as exc:  # noqa: BLE001 - transformers' own refusal of a hostile value, as one line
        raise CheckpointError(f"{path}: {cls.__name__} cannot read it: {type(exc).__name__}: "
                              f"{shorten(str(exc), 300)}") from None
    return {**read, "model_type": saved["model_type"]}


def _architecture_problem(bridge: Any, folder: Path) -> str | None:
    path = folder / "config.json"
    if lstat(path) is None:
        return f"{folder}: not an HF folder (no config.json)"
    saved = _saved_config(bridge, path)
    mine = bridge.hf_config.to_dict()
    differ = [f"{k}: checkpoint {shorten(saved.get(k))}, model {shorten(mine.get(k))}"
              for k in _ARCH_KEYS if k in mine and saved.get(k) != mine.get(k)]
    return f"{path}: another architecture than the model's:\n  " + "\n  ".join(differ) if differ else None


def _stored_tensors(folder: Path) -> dict[str, Mapping[str, Any]]:
    """Every tensor the bridge can read -> its header entry (dtype, shape), from the one file it reads
    it from (the truth, not the index's claims). The files mbridge would open are checked first
    (`_unread_files`), so none is opened unchecked and none blocks; with an index, a tensor in
    another file than the one it maps it to (a second copy) is refused, as the hf backend does."""
    _unread_files(folder)
    files = weight_files(folder)
    mapped = {name: path for path, names in files for name in names}
    entries: dict[str, Mapping[str, Any]] = {}
    problems: list[str] = []
    for path, indexed in files:
        header = read_header(path)
        problems += [f"{path}: tensor {n!r} listed in {INDEX} but not in the file" for n in indexed
                     if n not in header.tensors]
        for name, entry in header.tensors.items():
            if problem := placement_problem(name, path, mapped):
                problems.append(f"{path}: {problem}")
            else:
                entries[name] = entry
    if problems:
        raise CheckpointError(f"{folder}: the weight files do not say which tensor to read:\n  {listed(problems)}")
    return entries


def _unread_files(folder: Path) -> None:
    """Without an index mbridge reads every `*.safetensors` its `glob` finds in the folder, a
    later file's copy of a tensor replacing an earlier one's: a stray file's weights would win,
    a FIFO would block. So that glob, run as mbridge runs it (unescaped: a `[`, `*` or `?` in
    the folder's path makes it match elsewhere), must find `model.safetensors` alone. With an
    index, mbridge opens only the files the index names, which `weight_files` checks."""
    if lstat(folder / INDEX) is not None:
        return
    single = str(folder / SINGLE)
    with os_errors("cannot list the folder", folder):
        found = sorted(glob.glob(os.path.join(str(folder), "*.safetensors")))
    if others := [path for path in found if path != single]:
        raise CheckpointError(f"{folder}: without {INDEX}, mbridge reads every *.safetensors it finds and the "
                              f"last copy of a tensor wins; refusing {shorten(others, 300)} beside {SINGLE} "
                              "(remove them, or write an index that names each tensor's file)")
    if lstat(folder / SINGLE) is not None and not found:
        raise CheckpointError(f"{folder}: without {INDEX}, mbridge looks for {SINGLE} with an unescaped glob, "
                              "which the '[', '*' or '?' in this path keeps from finding it; rename the folder")


def _wanted(bridge: Any, chunks: list[Any]) -> dict[str, torch.dtype]:
    """The HF tensors this rank's chunks will ask the bridge for -> the dtype of the parameter
    each is loaded into (the bridge casts into it)."""
    wanted: dict[str, torch.dtype] = {}
    for chunk in chunks:
        state = chunk.state_dict()
        for local, global_name in bridge._weight_name_mapping_mcore_local_to_global(chunk).items():
            if "_extra_state" not in local:
                wanted.update(dict.fromkeys(bridge._weight_name_mapping_mcore_to_hf(global_name), state[local].dtype))
    return wanted


def _tensors_problem(bridge: Any, wanted: Mapping[str, torch.dtype], stored: Mapping[str, Mapping[str, Any]],
                     folder: Path) -> str | None:
    """Tensors the bridge will read that the folder lacks, or holds in another shape than
    transformers builds for this config (the bridge would stop in a scatter on one rank while its
    TP peers wait for it, or concatenate a misplaced split, gate/up or q/k/v, without a word) or
    in another dtype than the model's parameter (the bridge would cast it: float32 rounded to bf16)."""
    if missing := sorted(wanted.keys() - stored.keys()):
        return f"{folder}: missing tensors {missing[:10]}{' ...' if len(missing) > 10 else ''}"
    expected = expected_shapes(bridge.hf_config) or {}
    wrong = [f"{name}: {list(stored[name]['shape'])}, expected {list(expected[name])}" for name in sorted(wanted)
             if name in expected and tuple(stored[name]["shape"]) != expected[name]]
    if wrong:
        return (f"{folder}: tensors of another shape than this config's model has:\n  "
                + "\n  ".join(wrong[:10]) + ("\n  ..." if len(wrong) > 10 else ""))
    cast = [f"tensor {name!r} has dtype {NAMES[stored[name]['dtype']]}, the model expects {dtype}"
            for name, dtype in sorted(wanted.items()) if not _widens(NAMES[stored[name]["dtype"]], dtype)]
    if cast:
        return (f"{folder}: tensors of another dtype than the model's parameters, which the bridge would round "
                f"(build the model in the checkpoint's dtype, or a wider one):\n  {listed(cast)}")
    return None


def _widens(stored: torch.dtype, wanted: torch.dtype) -> bool:
    """Whether casting `stored` into `wanted` keeps every value exactly (bfloat16 or float16 into
    float32: a hub checkpoint loaded into a float32 model); a narrowing cast rounds."""
    if stored == wanted:
        return True
    if not (stored.is_floating_point and wanted.is_floating_point):
        return False
    have, want = torch.finfo(stored), torch.finfo(wanted)
    return want.bits > have.bits and want.eps <= have.eps and want.max >= have.max and want.tiny <= have.tiny


def _read_problem(bridge: Any, wanted: Mapping[str, torch.dtype], folder: Path
                  ) -> tuple[str | None, dict[str, Mapping[str, Any]]]:
    """Why this rank cannot load `folder` (None when it can), and the tensors stored there."""
    try:
        if not any(folder.glob("*.safetensors")):
            return f"{folder}: no .safetensors files (pickled .bin weights are not read)", {}
        if problem := _architecture_problem(bridge, folder):
            return problem, {}
        stored = _stored_tensors(folder)
        return _tensors_problem(bridge, wanted, stored, folder), stored
    except CheckpointError as exc:
        return str(exc), {}


def _load_problem(bridge: Any, chunks: list[Any], folder: Path) -> str | None:
    """Why this rank cannot load `folder`, found before any rank enters the bridge's scatters."""
    return _read_problem(bridge, _wanted(bridge, chunks), folder)[0]


def _ignored(hf_config: Any) -> re.Pattern[str]:
    """Stored names transformers itself skips when it loads this architecture, so no bridge asks
    for them either: rotary `inv_freq` buffers older checkpoints kept, a tied model's
    `lm_head.weight`, and the model class's own `_keys_to_ignore_on_load_unexpected`
    (DeepSeek-V3's multi-token-prediction layer)."""
    patterns = [r"(^|\.)rotary_emb\.inv_freq$"]
    if getattr(hf_config, "tie_word_embeddings", False):
        patterns.append(r"^lm_head\.weight$")
    try:
        from transformers import MODEL_FOR_CAUSAL_LM_MAPPING

        model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(hf_config)]
    except (ImportError, KeyError, ValueError):
        model_class = None
    patterns += [p for p in getattr(model_class, "_keys_to_ignore_on_load_unexpected", None) or [] if isinstance(p, str)]
    return _any_of(tuple(patterns))


@functools.lru_cache(maxsize=64)
def _any_of(patterns: tuple[str, ...]) -> re.Pattern[str]:
    """One regex matching any of `patterns`, compiled once per architecture rather than per load."""
    return re.compile("|".join(f"(?:{p})" for p in patterns))


def _unplaced_problem(wanted: Mapping[str, torch.dtype], stored: list[str], folder: Path,
                      device: torch.device, ignored: re.Pattern[str]) -> str | None:
    """Stored tensors no rank asks for (a 4-layer folder under a 2-layer config.json, a bias the
    bridge does not build), which the bridge would skip without a word. PP stages (and expert
    ranks) ask for different tensors, so "asked for" is a mask over the sorted stored names,
    max-reduced over every rank; ranks that read other names from the folder are told first, so
    the masks line up. A collective: every rank calls it, with the names its checks agreed on."""
    import torch.distributed as dist

    digest = int.from_bytes(hashlib.blake2b("\0".join(stored).encode(), digest_size=7).digest(), "big")
    if reduce_int(digest, "max") != reduce_int(digest, "min"):
        return f"{folder}: the ranks read different tensor names from it (a folder that differs between machines?)"
    asked = torch.tensor([name in wanted for name in stored], dtype=torch.int32, device=device)
    if stored and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(asked, op=dist.ReduceOp.MAX)
    if unplaced := [name for name, hit in zip(stored, asked.tolist()) if not hit and not ignored.search(name)]:
        return (f"{folder}: holds tensors this model has no place for: {shorten(unplaced, 300)} (more layers than "
                "its config.json says, or biases the bridge does not build); refusing to drop them")
    return None


class MBridgeBackend(FormatBackend):
    """Megatron-Core models built with `backends.megatron.build_model` (they carry a bridge)."""

    name: ClassVar[str] = "mbridge"
    capabilities: ClassVar[FormatCapabilities] = MBRIDGE_CAPABILITIES

    @staticmethod
    def check_model(model: Any, contents: list[str], key: str) -> MegatronModel:
        wrapped = as_megatron_model(model, "mbridge", key)
        bridge_of(wrapped, "the mbridge format", key=key)
        return wrapped

    def save_model(self, model: Any, folder: Path) -> dict[str, str]:
        return write_hf_export(model, folder)

    def export_hf(self, model: Any, folder: Path) -> dict[str, str]:
        return write_hf_export(model, folder)

    def load_model(self, model: Any, folder: Path, *, expected: Mapping[str, str] | None = None) -> set[str]:
        """The bridge reads the files itself, unhashed: mbridge does not claim `verifies_reads`,
        so resume hashes every file against the manifest before this load starts."""
        bridge, chunks = bridge_of(model, "the mbridge format"), chunks_of(model)
        wanted = _wanted(bridge, chunks)
        problem, stored = _read_problem(bridge, wanted, folder)
        agree(problem)
        device = next((p.device for chunk in chunks for p in chunk.parameters()), torch.device("cpu"))
        agree(_unplaced_problem(wanted, sorted(stored), folder, device, _ignored(bridge.hf_config)))
        with library_errors("mbridge load", folder), cpu_safe():
            bridge.load_weights(chunks, str(folder))
        return set()

    def save_optimizer(
        self, optimizer: Any, lr_scheduler: Any, folder: Path, *, model: Any = None
    ) -> dict[str, str]:
        return DistCkptBackend().save_optimizer(optimizer, lr_scheduler, folder, model=model)

    def load_optimizer(
        self, optimizer: Any, lr_scheduler: Any, folder: Path, *, model: Any = None,
        expected: Mapping[str, str] | None = None,
    ) -> set[str]:
        return DistCkptBackend().load_optimizer(optimizer, lr_scheduler, folder, model=model, expected=expected)
