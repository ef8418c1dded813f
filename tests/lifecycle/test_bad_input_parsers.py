"""Files that pass their checksums (the manifest re-signed) but that no parser should take.

Each case goes through `Lifecycle.resume()` with `resume.on_damaged: refuse`: the step is
refused with a `CheckpointError` naming the file and what is wrong in it (never a raw
`RecursionError`, `TypeError` or `RuntimeError` from deep inside a parser, and never a
resume that succeeds and fails at the first train step), and the step before it still
resumes with exactly its weights.
"""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file

from backends.safetensors_io import write_file
from tests.edits import edit_header, edit_json, nested, swap_strings
from tests.lifecycle import test_bad_input
from tests.lifecycle.test_bad_input import (
    EXTRA_JSON,
    OPTIM_JSON,
    RNG,
    WEIGHTS,
    lifecycle_at,
    refused,
    resign,
    resumes_at,
    step_folder,
)

root = test_bad_input.root
"""The fixture: a run with two committed steps whose weights say which step they are."""

OPTIM_TENSORS = "optimizer/optimizer.safetensors"
INDEX = "model/model.safetensors.index.json"


def refused_then_the_previous_step_resumes(root: Path, *needles: str) -> None:
    resign(step_folder(root))
    refused(lifecycle_at(root), *needles)
    shutil.rmtree(root / "global_step_2")
    resumes_at(root, 1)


def first_tensor(header: dict[str, Any]) -> dict[str, Any]:
    return header[next(name for name in header if name != "__metadata__")]


# JSON files: nesting, huge numbers -----------------------------------------------------------

JSON_CASES: dict[str, tuple[str, Callable[[Path], None], str]] = {
    "extra-nested-deep": (EXTRA_JSON, lambda p: p.write_text("[" * 100_000 + "]" * 100_000),
                          "not valid JSON: nested too deeply"),
    "extra-user-nested-600": (EXTRA_JSON, lambda p: edit_json(p, lambda d: d["progress"].update(user=nested(600))),
                              "is nested more than 64 levels deep"),
    "extra-huge-integer": (EXTRA_JSON, lambda p: p.write_text('{"format_version": ' + "9" * 5000 + "}"),
                           "not valid JSON"),
    "optimizer-nested-deep": (OPTIM_JSON, lambda p: p.write_text(
        '{"format_version": 1, "optimizer": ' + "[" * 100_000 + "]" * 100_000 + "}"), "nested too deeply"),
    "optimizer-nested-800": (OPTIM_JSON, lambda p: edit_json(p, lambda d: d.update(optimizer=nested(800))),
                             "is nested more than 64 levels deep"),
    "optimizer-huge-integer": (OPTIM_JSON, lambda p: p.write_text('{"format_version": ' + "9" * 5000 + "}"),
                               "not valid JSON"),
    "index-nested-deep": (INDEX, lambda p: p.write_text('{"weight_map": ' + "[" * 100_000 + "]" * 100_000 + "}"),
                          "not valid JSON: nested too deeply"),
    "index-huge-integer": (INDEX, lambda p: p.write_text('{"weight_map": {"a": ' + "9" * 5000 + "}}"),
                           "not valid JSON"),
}


@pytest.mark.parametrize("rel,plant,needle", JSON_CASES.values(), ids=JSON_CASES.keys())
def test_a_json_file_no_parser_takes_is_named(root: Path, rel: str, plant: Any, needle: str) -> None:
    path = step_folder(root) / rel
    plant(path)
    refused_then_the_previous_step_resumes(root, str(path), needle)


# safetensors headers -------------------------------------------------------------------------

HEADER_CASES: dict[str, tuple[Callable[[dict[str, Any]], None], str]] = {
    "offsets-as-strings": (lambda h: first_tensor(h).update(data_offsets=[str(x) for x in
                                                                          first_tensor(h)["data_offsets"]]),
                           "data_offsets must be two non-negative integers"),
    "fractional-shape": (lambda h: first_tensor(h).update(shape=[16.5]), "shape must be a list"),
    "negative-shape": (lambda h: first_tensor(h).update(shape=[-1, -36]), "shape must be a list"),
    "overflowing-empty-shape": (lambda h: h.update(zz={"dtype": "F32", "shape": [2**62, 2**62, 0],
                                                      "data_offsets": [0, 0]}), "would need more than"),
    "unknown-dtype": (lambda h: first_tensor(h).update(dtype="F128"), "dtype must be one of"),
    "metadata-a-list": (lambda h: h.update(__metadata__=[1, 2]), "__metadata__ must map names to strings"),
}


@pytest.mark.parametrize("rel", [WEIGHTS, OPTIM_TENSORS, RNG])
@pytest.mark.parametrize("edit,needle", HEADER_CASES.values(), ids=HEADER_CASES.keys())
def test_a_safetensors_header_no_parser_takes_is_named(root: Path, rel: str, edit: Any, needle: str) -> None:
    path = step_folder(root) / rel
    edit_header(path, edit)
    refused_then_the_previous_step_resumes(root, str(path), needle)


def test_a_safetensors_header_nested_deep_is_named(root: Path) -> None:
    path = step_folder(root) / WEIGHTS
    body = b'{"w": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"
    path.write_bytes(struct.pack("<Q", len(body)) + body + bytes(64))
    refused_then_the_previous_step_resumes(root, f"{path}: not valid JSON: nested too deeply")


# Shards and the index ------------------------------------------------------------------------

def test_a_stray_copy_in_a_shard_the_index_does_not_map_is_named_with_both_shards(root: Path) -> None:
    model = step_folder(root) / "model"
    tensors = load_file(str(model / "model.safetensors"))
    (model / "model.safetensors").unlink()
    first, second = model / "model-00001-of-00002.safetensors", model / "model-00002-of-00002.safetensors"
    write_file(first, {"body.weight": tensors["body.weight"]})
    write_file(second, {**{n: t for n, t in tensors.items() if n != "body.weight"},
                        "body.weight": tensors["body.weight"] * 0})
    weight_map = {n: (first if n == "body.weight" else second).name for n in tensors}
    (step_folder(root) / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    refused_then_the_previous_step_resumes(
        root, f"{second}: tensor 'body.weight' is in this file, but model.safetensors.index.json maps it to {first}")


# Optimizer state that would load and then fail (or train wrongly) ----------------------------

def test_optimizer_state_of_two_parameters_swapped_is_named(root: Path) -> None:
    path = step_folder(root) / OPTIM_JSON
    swap_strings(path, "optimizer.state[0].exp_avg", "optimizer.state[1].exp_avg")
    refused_then_the_previous_step_resumes(
        root, str(path), "state of parameter 0, key 'exp_avg': has shape [6], its parameter has [6, 6]")


@pytest.mark.parametrize("lr", ["fast", {"__float__": "nan"}, None], ids=["string", "nan", "null"])
def test_a_learning_rate_that_is_not_a_finite_number_is_named(root: Path, lr: Any) -> None:
    path = step_folder(root) / OPTIM_JSON
    edit_json(path, lambda d: d["optimizer"]["param_groups"][0].update(lr=lr))
    refused_then_the_previous_step_resumes(root, str(path), "param_groups[0].lr: must be a finite number")
