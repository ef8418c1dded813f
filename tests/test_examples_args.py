"""The examples and benchmarks refuse argument values they cannot run with, as argparse errors.

Each case calls the script's `main` in this process with the bad value: argparse refuses it
(exit 2, a message naming the argument) before anything is built, measured or written.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _script(name: str, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """examples/<name>.py, or examples/bench/<name>.py (which import their neighbour `record`)."""
    if (EXAMPLES / f"{name}.py").is_file():
        spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        monkeypatch.setitem(sys.modules, spec.name, module)  # its dataclasses look their module up
        spec.loader.exec_module(module)
        return module
    monkeypatch.syspath_prepend(str(EXAMPLES / "bench"))
    return importlib.import_module(name)


def _refused(module: ModuleType, argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exited:
        module.main(argv)
    err = capsys.readouterr().err
    assert exited.value.code == 2, err
    assert "Traceback" not in err
    return err


@pytest.mark.parametrize(("script", "argv", "said"), [
    ("save_load", ["--repeats", "0"], "argument --repeats: must be an integer >= 1, got 0"),
    ("save_load", ["--tensors", "0"], "argument --tensors: must be an integer >= 1, got 0"),
    ("save_load", ["--gib", "nan"], "argument --gib: must be a finite number, got nan"),
    ("save_load", ["--formats", "npz"], "argument --formats: invalid choice: 'npz'"),
    ("transition_overhead", ["--n", "1"], "argument --n: must be an integer >= 2, got 1"),
    ("transition_overhead", ["--rounds", "0"], "argument --rounds: must be an integer >= 1, got 0"),
    ("async_save", ["--saves", "0"], "argument --saves: must be an integer >= 1, got 0"),
    ("async_save", ["--step-s", "-1"], "argument --step-s: must be a number >= 0, got -1"),
    ("megatron_load", ["--repeat", "0"], "argument --repeat: must be an integer >= 1, got 0"),
    ("weight_sync", ["--bucket-mib", "0.00001"], "--bucket-mib 1e-05: engine.bucket_bytes must be in 64.."),
    ("weight_sync", ["--tensors", "2"], "argument --tensors: must be an integer >= 3, got 2"),
    ("weight_sync", ["--scale", "--sizes", "0"], "argument --sizes: must be a number > 0, got 0"),
    ("quickstart", ["--save-every", "0"], "argument --save-every: must be an integer >= 1, got '0'"),
    ("quickstart", ["--steps", "3", "--save-every", "5"], "nothing would be saved"),
])
def test_a_value_the_script_cannot_run_with_is_refused_naming_the_argument(
        script: str, argv: list[str], said: str, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    assert said in _refused(_script(script, monkeypatch), argv, capsys)


def test_ppo_toy_refuses_a_kill_past_the_last_step(monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("ray")
    err = _refused(_script("ppo_toy", monkeypatch), ["--steps", "10", "--fail-at", "12"], capsys)
    assert "--fail-at 12 is past --steps 10: no worker would be killed" in err


@pytest.mark.parametrize("script", ["save_load", "async_save"])
def test_a_bench_work_folder_that_does_not_exist_is_refused_not_created(
        script: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "no" / "such"
    err = _refused(_script(script, monkeypatch), ["--dir", str(missing)], capsys)
    assert "argument --dir:" in err and "is not an existing folder" in err
    assert not (tmp_path / "no").exists()


def test_the_shared_argument_types_take_the_values_they_allow(monkeypatch: pytest.MonkeyPatch) -> None:
    record = _script("record", monkeypatch)
    assert record.at_least(2)("2") == 2 and record.positive_float("0.5") == 0.5
    assert record.non_negative_float("0") == 0.0
