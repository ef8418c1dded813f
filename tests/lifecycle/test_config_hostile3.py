"""Config and CLI input that once escaped as another exception than a `ConfigError` naming its key,
or as a traceback: Ctrl-C and closed streams in the CLI, mappings that fail as they are read, a
free-form option that holds itself, `DriverConfig`'s constructor, 'None' written as a path, control
characters in a Ray address, numpy scalars and YAML 1.1's exponent numbers.

The plugin format lives here and is selected by import path, as an uninstalled package's would be.
Ray is not started: `lifecycle.ray.settings` checks values only.
"""

from __future__ import annotations

import copy
import pickle
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from backends.base import PLAIN_TORCH, FormatBackend, FormatCapabilities
from lifecycle import cli
from lifecycle.config import LifecycleConfig
from lifecycle.config_file import FREE_FORM_LIMIT, YAML_DEPTH_LIMIT
from lifecycle.ray.settings import DriverConfig, reachable
from tests.lifecycle.test_config_hostile2 import _refused

HERE = __name__



def _file(tmp_path: Path, text: str) -> str:
    path = tmp_path / "lifecycle.yaml"
    path.write_text(text)
    return str(path)


# --- the CLI: Ctrl-C, a closed stdout or stderr ----------------------------------------------------

def test_ctrl_c_during_verify_prints_one_interrupted_line_and_exits_130_without_a_traceback(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    import lifecycle.report

    def interrupted(*args: object) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(lifecycle.report, "verify_root", interrupted)
    assert cli.main(["verify", str(tmp_path)]) == 130
    captured = capsys.readouterr()
    assert captured.err == "error: verify: interrupted\n"
    assert captured.out == ""


def test_ctrl_c_while_the_command_line_is_parsed_names_the_command_and_exits_130(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    def interrupted() -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_parser", interrupted)
    assert cli.main(["inspect", "/some/root"]) == 130
    assert capsys.readouterr().err == "error: inspect: interrupted\n"


def test_a_closed_stdout_is_reported_on_stderr_with_exit_2_not_an_attribute_error(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    monkeypatch.setattr(sys, "stdout", None)
    for argv in (["diagram"], ["inspect", str(tmp_path)]):
        assert cli.main(argv) == 2
        assert capsys.readouterr().err == "error: stdout is closed\n"


def test_with_stderr_closed_the_error_line_is_dropped_rather_than_written_to_stdout(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    monkeypatch.setattr(sys, "stderr", None)
    assert cli.main(["inspect", str(tmp_path / "nonexistent")]) == 2
    assert capsys.readouterr().out == ""


_INTERRUPTED_CHILD = (
    "import os, signal, sys, runpy, lifecycle.report\n"
    "signal.signal(signal.SIGINT, signal.default_int_handler)\n"  # as at a terminal: a background job ignores it
    "def verify_root(root, step, roles, out, err):\n"
    "    out.write('checked so far\\n')\n"
    "    os.kill(os.getpid(), signal.SIGINT)\n"
    "    signal.pause()\n"
    "lifecycle.report.verify_root = verify_root\n"
    "sys.argv = ['lifecycle', 'verify', sys.argv[1]]\n"
)


@pytest.mark.skipif(sys.platform == "win32", reason="a process ends by a signal on POSIX only")
@pytest.mark.parametrize("start", ["runpy.run_module('lifecycle', run_name='__main__')",
                                   "from lifecycle.cli import entry; entry()"])
def test_ctrl_c_ends_python_m_lifecycle_and_the_console_script_by_sigint_after_the_error_line_and_its_output(
        tmp_path: Path, start: str) -> None:
    """A shell stops a `for` loop over files only when the command died by SIGINT (not exit 130)."""
    import signal
    import subprocess

    done = subprocess.run([sys.executable, "-c", _INTERRUPTED_CHILD + start, str(tmp_path)], capture_output=True,
                          text=True, timeout=60, cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == -signal.SIGINT, done.stderr
    assert done.stderr == "error: verify: interrupted\n"
    assert done.stdout == "checked so far\n"


# --- mappings and lists that fail as they are read -------------------------------------------------

class _Lazy(Mapping[str, Any]):
    """A mapping from another tool that resolves each value when read, and one cannot be."""

    def __init__(self, keys: list[str]) -> None:
        self.names = keys

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)

    def __getitem__(self, key: str) -> Any:
        raise KeyError(key)


class _Gone(Mapping[str, Any]):
    def __iter__(self) -> Iterator[str]:
        raise RuntimeError("backing store gone")

    def __len__(self) -> int:
        return 1

    def __getitem__(self, key: str) -> Any:
        return 1


class _BadItems(Sequence[str]):
    def __len__(self) -> int:
        return 2

    def __getitem__(self, index: Any) -> Any:
        raise TypeError("cannot index")


@pytest.mark.parametrize("data, key, said", [
    (_Lazy(["checkpoint"]), "", "cannot read the config: KeyError"),
    ({"checkpoint": _Lazy(["root"])}, "checkpoint", "cannot read section checkpoint: KeyError"),
    (_Gone(), "", "backing store gone"),
    ({"checkpoint": {"roles": _BadItems()}}, "checkpoint.roles", "cannot read the list: TypeError"),
    ({"checkpoint": {"save": {"format": f"{HERE}:LabelsFormat", "labels": _Gone()}}}, "checkpoint.save.labels",
     "cannot read the mapping: RuntimeError"),
    ({"checkpoint": {"save": {"format": f"{HERE}:LabelsFormat", "labels": {"a": [_Lazy(["k"])]}}}},
     "checkpoint.save.labels", "cannot read the value: KeyError"),
])
def test_a_mapping_or_list_that_fails_as_it_is_read_is_a_config_error_naming_its_key(
        data: Any, key: str, said: str) -> None:
    _refused(lambda: LifecycleConfig.from_dict(data), key, said)


# --- a plugin's free-form option that holds itself -------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class LabelsOptions:
    labels: dict[str, Any] = field(default_factory=dict)
    """Free-form tags."""


class LabelsFormat(FormatBackend):
    capabilities = FormatCapabilities(family=PLAIN_TORCH, contents=frozenset({"model", "optimizer"}))
    Options = LabelsOptions


def _labels_yaml(tmp_path: Path, labels: str) -> str:
    return _file(tmp_path, f"checkpoint:\n  save:\n    format: '{HERE}:LabelsFormat'\n    contents: [model]\n"
                           f"    labels: {labels}\n")


def test_a_free_form_option_holding_itself_through_a_yaml_anchor_is_refused_naming_the_key(tmp_path: Path) -> None:
    path = _labels_yaml(tmp_path, "&l {team: rl, self: *l}")
    _refused(lambda: LifecycleConfig.from_yaml(path), "checkpoint.save.labels", "holds itself")


def test_a_free_form_option_nested_past_the_yaml_depth_limit_from_code_is_refused_naming_the_key() -> None:
    deep: dict[str, Any] = {}
    for _ in range(YAML_DEPTH_LIMIT + 1):
        deep = {"x": deep}
    save = {"format": f"{HERE}:LabelsFormat", "contents": ["model"], "labels": deep}
    _refused(lambda: LifecycleConfig.from_dict({"checkpoint": {"save": save}}), "checkpoint.save.labels",
             f"nested deeper than {YAML_DEPTH_LIMIT} levels")


def test_a_free_form_option_whose_yaml_aliases_expand_past_the_limit_is_refused_and_a_shared_alias_loads(
        tmp_path: Path) -> None:
    levels = ["a: &a [x, x, x, x, x, x, x, x, x, x]"]
    levels += [f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join([f'*{chr(97 + i)}'] * 10)}]" for i in range(6)]
    path = _labels_yaml(tmp_path, "{" + ", ".join(levels) + "}")  # 10**7 values written out
    _refused(lambda: LifecycleConfig.from_yaml(path), "checkpoint.save.labels", f"more than {FREE_FORM_LIMIT}")
    shared = _labels_yaml(tmp_path, "{a: &a {team: rl}, b: *a, c: [*a, *a]}")
    config = LifecycleConfig.from_yaml(shared)
    assert config.to_dict()["checkpoint"]["save"]["labels"]["c"] == [{"team": "rl"}, {"team": "rl"}]


def test_a_free_form_option_of_a_list_holding_itself_from_code_is_refused_and_to_dict_is_never_reached() -> None:
    looped: list[Any] = ["a"]
    looped.append(looped)
    save = {"format": f"{HERE}:LabelsFormat", "contents": ["model"], "labels": {"loop": looped}}
    _refused(lambda: LifecycleConfig.from_dict({"checkpoint": {"save": save}}), "checkpoint.save.labels",
             "holds itself")


# --- DriverConfig's constructor ---------------------------------------------------------------------

def test_driver_config_refuses_a_misspelt_key_naming_it_and_the_valid_ones() -> None:
    _refused(lambda: DriverConfig(steps=3, save_evry=1), "driver.save_evry",  # type: ignore[call-arg]
             "unknown keyword argument; valid ones:", "save_every", "steps")


def test_driver_config_refuses_a_positional_argument_as_a_config_error() -> None:
    _refused(lambda: DriverConfig(3), "driver", "keyword arguments only")  # type: ignore[misc]


def test_driver_config_without_steps_is_a_config_error_naming_driver_steps() -> None:
    _refused(lambda: DriverConfig(), "driver.steps", "required")  # type: ignore[call-arg]


def test_driver_config_still_pickles_and_copies_with_its_required_steps() -> None:
    config = DriverConfig(steps=7, save_every=2)
    assert pickle.loads(pickle.dumps(config)) == config
    assert copy.copy(config) == config and copy.deepcopy(config) == config


# --- 'None' written as a path ----------------------------------------------------------------------

@pytest.mark.parametrize("word", ["None", "none", "NONE", "null", "Null", "NULL", "~"])
def test_a_path_written_as_a_null_word_is_refused_with_a_hint_to_write_null(tmp_path: Path, word: str) -> None:
    path = _file(tmp_path, f"checkpoint:\n  root: '{word}'\n")
    _refused(lambda: LifecycleConfig.from_yaml(path), "checkpoint.root", "write null or leave the key out")


def test_an_unquoted_none_root_in_yaml_is_refused_while_null_and_a_dotted_none_folder_load(tmp_path: Path) -> None:
    _refused(lambda: LifecycleConfig.from_yaml(_file(tmp_path, "checkpoint: {root: None}\n")), "checkpoint.root",
             "'None' is text")
    assert LifecycleConfig.from_yaml(_file(tmp_path, "checkpoint: {root: null}\n")).checkpoint.root is None
    assert LifecycleConfig.from_yaml(_file(tmp_path, "checkpoint: {root: ./None}\n")).checkpoint.root == "./None"
    _refused(lambda: DriverConfig(steps=1, work_dir="None"), "driver.work_dir", "write null")


# --- a Ray address with control characters ---------------------------------------------------------

@pytest.mark.parametrize("address", ["auto\x00", "\x1b[2J\x1b[Hhost:80", "host:80\u202e"])
def test_driver_config_refuses_an_address_with_control_characters_quoting_it(address: str) -> None:
    error = _refused(lambda: DriverConfig(steps=1, address=address), "driver.address", "control characters")
    assert str(error).isprintable()


def test_reachable_quotes_an_address_with_control_characters_rather_than_writing_it_raw() -> None:
    error = _refused(lambda: reachable("\x1b[2J\x1b[Hevilhost:6379"), "driver.address", "no Ray address")
    assert "\x1b" not in str(error) and "\\x1b" in str(error)


# --- numpy scalars and YAML 1.1's exponent numbers --------------------------------------------------

def test_numpy_booleans_and_integers_are_taken_as_plain_python_values() -> None:
    config = LifecycleConfig.from_dict({"checkpoint": {"fsync": np.bool_(True), "keep_last": np.int64(3)},
                                        "engine": {"timeout_s": np.float32(3)}})
    assert config.checkpoint.fsync is True
    assert config.checkpoint.keep_last == 3 and type(config.checkpoint.keep_last) is int
    assert config.engine.timeout_s == 3.0 and type(config.engine.timeout_s) is float


def test_numpy_booleans_are_still_no_integers_and_integers_no_booleans() -> None:
    _refused(lambda: LifecycleConfig.from_dict({"checkpoint": {"keep_last": np.bool_(True)}}),
             "checkpoint.keep_last", "expected an integer")
    _refused(lambda: LifecycleConfig.from_dict({"checkpoint": {"fsync": np.int64(1)}}),
             "checkpoint.fsync", "expected a boolean")


@pytest.mark.parametrize("text, key, hint", [
    ("engine: {timeout_s: 1.5e3}\n", "engine.timeout_s", "write 1000 or 1.0e+3"),
    ("watchdog: {save_s: 1e-3}\n", "watchdog.save_s", "write 1000 or 1.0e+3"),
    ("engine: {bucket_bytes: 1e9}\n", "engine.bucket_bytes", "write 1000"),
])
def test_a_yaml_exponent_number_read_as_text_says_why_and_how_to_write_it(
        tmp_path: Path, text: str, key: str, hint: str) -> None:
    _refused(lambda: LifecycleConfig.from_yaml(_file(tmp_path, text)), key, "YAML 1.1 reads", hint)


def test_text_that_is_no_exponent_number_gets_no_yaml_hint() -> None:
    error = _refused(lambda: LifecycleConfig.from_dict({"engine": {"timeout_s": "soon"}}), "engine.timeout_s",
                     "expected a number")
    assert "YAML" not in str(error)


# --- a long sequence from code is refused before it is read (review 11) ----------------------------

class _Counted(Sequence[int]):
    """A sequence of a billion items that counts the items read from it."""

    def __init__(self) -> None:
        self.read = 0

    def __len__(self) -> int:
        return 10**9

    def __getitem__(self, index: Any) -> Any:
        self.read += 1
        return 0


def test_a_free_form_option_of_a_billion_item_range_from_code_is_refused_naming_the_key_without_reading_it() -> None:
    counted = _Counted()
    for labels in ({"x": range(10**9)}, {"x": counted}, {"a": list(range(10)), "b": {"c": counted}}):
        save = {"format": f"{HERE}:LabelsFormat", "contents": ["model"], "labels": labels}
        _refused(lambda: LifecycleConfig.from_dict({"checkpoint": {"save": save}}), "checkpoint.save.labels",
                 f"more than {FREE_FORM_LIMIT}")
    assert counted.read == 0


def test_a_free_form_option_that_passes_the_limit_only_with_its_siblings_is_refused_before_the_last_is_read() -> None:
    counted = _Counted()
    half = FREE_FORM_LIMIT // 2
    labels = {"a": list(range(half)), "b": list(range(half)), "c": counted}
    save = {"format": f"{HERE}:LabelsFormat", "contents": ["model"], "labels": labels}
    _refused(lambda: LifecycleConfig.from_dict({"checkpoint": {"save": save}}), "checkpoint.save.labels",
             f"more than {FREE_FORM_LIMIT}")
    assert counted.read == 0


def test_a_free_form_option_just_under_the_limit_from_code_still_loads_whole() -> None:
    labels = {"x": list(range(FREE_FORM_LIMIT - 10))}
    save = {"format": f"{HERE}:LabelsFormat", "contents": ["model"], "labels": labels}
    config = LifecycleConfig.from_dict({"checkpoint": {"save": save}})
    assert len(config.to_dict()["checkpoint"]["save"]["labels"]["x"]) == FREE_FORM_LIMIT - 10


def test_a_list_key_given_a_billion_item_range_from_code_is_refused_naming_the_key_without_reading_it() -> None:
    counted = _Counted()
    for roles in (range(10**9), counted):
        _refused(lambda: LifecycleConfig.from_dict({"checkpoint": {"roles": roles}}), "checkpoint.roles",
                 f"more than {FREE_FORM_LIMIT}")
    assert counted.read == 0
