"""Hostile input to the CLI's arguments, the Ray driver's settings and the run report's helpers:
each is refused by name, or shown escaped, never joined or hashed by guess."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from lifecycle import Lifecycle
from lifecycle.cli import _parser, main
from lifecycle.config import MAX_TIMEOUT_S
from lifecycle.errors import ConfigError, LifecycleError
from lifecycle.ray.run_report import (
    Failure,
    Overdue,
    RunSummary,
    fingerprint,
    merge_batches,
    render_summary,
)
from lifecycle.ray.settings import MAX_THREADS, DriverConfig, trainer_roles

_HOSTILE = "\x1b]52;c;cm0gLXJmIH4=\x07\x1b]0;owned\x07\rforged\u202e\n"
"""An OSC 52 clipboard write, a window title, a carriage return, a bidi override and a line break."""


@pytest.fixture
def root(tmp_path: Path) -> Path:
    model = torch.nn.Linear(8, 8)
    for role in ("actor", "critic"):
        lc = Lifecycle({"checkpoint": {"root": str(tmp_path), "roles": ["actor", "critic"]}}, role=role, model=model)
        lc.init_load()
        lc.save(1)
    return tmp_path


def test_roles_given_in_several_flags_are_all_kept_in_order_each_once() -> None:
    args = _parser().parse_args(["verify", "r", "--roles", "actor", "--roles", "critic", "actor", "--roles", "ref"])
    assert args.roles == ["actor", "critic", "ref"]


def test_verify_with_roles_in_two_flags_checks_the_first_flags_role_and_fails_on_its_damage(
        root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = next((root / "global_step_1" / "actor").rglob("*.safetensors"))
    data = bytearray(target.read_bytes())
    data[-1] ^= 0xFF
    target.write_bytes(bytes(data))
    assert main(["verify", str(root), "--roles", "actor", "--roles", "critic"]) == 1
    assert f"{target}: checksum" in capsys.readouterr().out


@pytest.mark.parametrize("key", ["call_timeout_s", "poll_s", "save_grace_s"])
def test_driver_timeouts_past_the_engines_max_timeout_are_refused_naming_the_key(key: str) -> None:
    for value in (MAX_TIMEOUT_S * 2, 1e10, 10**30):
        with pytest.raises(ConfigError) as info:
            DriverConfig(steps=1, **{key: value})
        assert info.value.key == f"driver.{key}" and f"{MAX_TIMEOUT_S:g}" in str(info.value)
    assert getattr(DriverConfig(steps=1, **{key: MAX_TIMEOUT_S}), key) == MAX_TIMEOUT_S


@pytest.mark.parametrize(("work_dir", "said"), [
    ("", "empty path"), ("runs/a\x00b", "NUL byte"), ("x" * 5000, "longer than"), (Path("runs/a\x00b"), "NUL byte"),
])
def test_driver_work_dir_that_names_no_folder_is_refused_as_checkpoint_root_is(work_dir: Any, said: str) -> None:
    with pytest.raises(ConfigError) as info:
        DriverConfig(steps=1, work_dir=work_dir)
    assert info.value.key == "driver.work_dir" and said in str(info.value)
    assert DriverConfig(steps=1, work_dir=Path("runs/a")).work_dir == Path("runs/a")


def test_driver_threads_past_the_cap_are_refused_naming_the_key() -> None:
    for value in (MAX_THREADS + 1, 2**31):
        with pytest.raises(ConfigError) as info:
            DriverConfig(steps=1, threads=value)
        assert info.value.key == "driver.threads" and str(MAX_THREADS) in str(info.value)
    assert DriverConfig(steps=1, threads=MAX_THREADS).threads == MAX_THREADS


@pytest.mark.parametrize("roles", [[["a"], ["a"]], [{}, {}], ["actor", {}, {}, "actor"]])
def test_trainer_roles_with_equal_unhashable_items_is_a_config_error_naming_them_not_strings(roles: list[Any]) -> None:
    with pytest.raises(ConfigError) as info:
        trainer_roles(roles)
    assert info.value.key == "recipe.roles" and "not a string" in str(info.value)
    assert ("'actor': given twice" in str(info.value)) == ("actor" in roles)


def test_run_summary_shows_failure_and_overdue_texts_with_terminal_controls_escaped() -> None:
    overdue = Overdue(worker=f"actor{_HOSTILE}", trigger=f"train{_HOSTILE}", state="", step=3, elapsed_s=2.0,
                      budget_s=1.0, overdue=2)
    summary = RunSummary(overdue=[overdue], failures=[
        Failure(step=3, phase="train", worker="actor", error=f"CheckpointError: /ckpt/{_HOSTILE}damaged",
                incarnation=0, resumed_at=2, recovery_s=1.0)])
    text = render_summary(summary, "actor/reward")
    assert text.isascii() and all(line.isprintable() for line in text.splitlines())
    assert "\\x1b]52;c;" in text and "\\r" in text and "\\u202e" in text
    assert len(text.splitlines()) == len(render_summary(RunSummary(overdue=[overdue], failures=[
        Failure(step=3, phase="train", worker="actor", error="plain", incarnation=0, resumed_at=2)]),
        "actor/reward").splitlines())


def test_run_summary_shows_plain_failure_and_overdue_texts_as_they_are() -> None:
    overdue = Overdue(worker="actor", trigger="train_step", state="", step=3, elapsed_s=2.0, budget_s=1.0, overdue=2)
    summary = RunSummary(overdue=[overdue], failures=[
        Failure(step=3, phase="train", worker="actor", error="CheckpointError: /ckpt/ damaged é",
                incarnation=0, resumed_at=2)])
    text = render_summary(summary, "actor/reward")
    assert "actor in train of step 3: CheckpointError: /ckpt/ damaged é" in text
    assert "actor overdue in train_step of step 3" in text


@pytest.mark.parametrize("extra", [["x\x1b]0;PWNED\x07\nerror: forged line"], ["--bogus\x1b[2J\r"]])
def test_unrecognized_arguments_are_echoed_escaped(tmp_path: Path, extra: list[str],
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["inspect", str(tmp_path), *extra])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "unrecognized arguments" in err
    assert "\x1b" not in err and "\r" not in err and "\\x1b" in err
    assert [line for line in err.splitlines() if line.startswith("error:")] == []


@pytest.mark.parametrize(("first", "second"), [
    (torch.tensor([16_777_217, 50_000_001]), torch.tensor([1.0])),
    (torch.tensor([2**53 + 1]), torch.tensor([1.0], dtype=torch.float64)),
    (torch.tensor([2**31 - 1], dtype=torch.int32), torch.tensor([1.0], dtype=torch.float32)),
    (torch.tensor([2**40], dtype=torch.int64), torch.tensor([1], dtype=torch.uint8).to(torch.float16)),
    (np.array([2**53 + 1], dtype=np.int64), np.array([1.0], dtype=np.float32)),
    (np.array([2**53 + 1], dtype=np.int64), np.array([1.0], dtype=np.float64)),
    (np.array([2**64 - 1], dtype=np.uint64), np.array([-1], dtype=np.int64)),
])
def test_merge_batches_refuses_dtypes_whose_promotion_would_change_values_naming_the_key(first: Any,
                                                                                     second: Any) -> None:
    with pytest.raises(LifecycleError, match="batch key 'ids'.*would change values"):
        merge_batches([{"ids": first}, {"ids": second}])


@pytest.mark.parametrize(("first", "second", "dtype"), [
    (torch.tensor([1, 2], dtype=torch.int32), torch.tensor([1.0], dtype=torch.float64), torch.float64),
    (torch.tensor([1.5], dtype=torch.bfloat16), torch.tensor([1.0], dtype=torch.float32), torch.float32),
    (torch.tensor([1.5], dtype=torch.bfloat16), torch.tensor([1.0], dtype=torch.float16), torch.float32),
    (torch.tensor([True]), torch.tensor([3], dtype=torch.int8), torch.int8),
    (torch.tensor([7], dtype=torch.uint8), torch.tensor([-3], dtype=torch.int16), torch.int16),
    (np.array([1, 2], dtype=np.int16), np.array([0.5], dtype=np.float32), np.float32),
    (np.array(["ab"]), np.array(["abcd"]), np.dtype("<U4")),
])
def test_merge_batches_joins_dtypes_whose_promotion_keeps_every_value(first: Any, second: Any, dtype: Any) -> None:
    out = merge_batches([{"ids": first}, {"ids": second}])["ids"]
    assert out.dtype == dtype and len(out) == len(first) + len(second)


@pytest.mark.parametrize(("a", "b"), [
    ([2**53 + 1, 0.5], [2**53, 0.5]),
    ([[7, 2**60 + 1], [0.5, 0.5]], [[7, 2**60], [0.5, 0.5]]),
    ([2**63 + 1, 1], [2**63, 1]),
    ((0.5, -(2**53) - 1), (0.5, -(2**53))),
    ([[[1, 2**54 + 1]], [[0.5, 0.5]]], [[[1, 2**54]], [[0.5, 0.5]]]),
])
def test_fingerprint_tells_apart_lists_of_ints_past_float_precision_mixed_with_floats(a: Any, b: Any) -> None:
    assert a != b and fingerprint(a) != fingerprint(b)


def test_fingerprint_keeps_equal_number_lists_equal_and_exact_ones_on_the_fast_path() -> None:
    assert fingerprint([1, 2.0, True]) == fingerprint([1.0, 2, 1])
    assert fingerprint([[1, 2], [3, 4]]) != fingerprint([[1, 2], [3, 5]])
    assert fingerprint([2**53, 0.5]) == fingerprint([float(2**53), 0.5])


def test_merge_batches_joins_the_arrays_of_many_rollouts() -> None:
    merged = merge_batches([{"ids": np.array([i], dtype=np.int32)} for i in range(100)])["ids"]
    assert merged.tolist() == list(range(100))
    merged = merge_batches([{"ids": torch.tensor([i])} for i in range(100)])["ids"]
    assert merged.tolist() == list(range(100))
