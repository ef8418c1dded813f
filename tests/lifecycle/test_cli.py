from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from lifecycle.machine import MACHINES, mermaid
from lifecycle.table import DONE, FAIL, Table


def _diagram(*args: str) -> str:
    return subprocess.run([sys.executable, "-m", "lifecycle", "diagram", *args], capture_output=True, text=True,
                          check=True).stdout


def _edges(text: str) -> set[tuple[str, str, str]]:
    return {(m["src"], m["dst"], m["label"])
            for m in re.finditer(r"^\s*(?P<src>\w+) --> (?P<dst>\w+): (?P<label>\w+)$", text, re.M)}


def _table_edges(table: Table) -> set[tuple[str, str, str]]:  # type: ignore[type-arg]
    edges = set()
    for row in table.rows:
        for src in row.sources:
            edges.add((src.name, (row.working or row.done).name, row.trigger))
        if row.working is not None:
            edges.add((row.working.name, row.done.name, DONE))
            if row.failed is not None:
                edges.add((row.working.name, row.failed.name, FAIL))
    return edges


def test_diagram_command_prints_the_mermaid_generated_from_the_table() -> None:
    result = _diagram()
    assert result == mermaid() == MACHINES["trainer"].mermaid()
    assert result.startswith("stateDiagram-v2\n")


@pytest.mark.parametrize("machine", ["trainer", "rollout", "driver"])
def test_each_machine_is_drawn_from_its_own_table(machine: str) -> None:
    table = MACHINES[machine]
    text = _diagram("--machine", machine)
    assert text == table.mermaid()
    assert _edges(text) == _table_edges(table)
    assert f"[*] --> {table.initial.name}\n" in text
    assert {m for m in re.findall(r"^\s*(\w+) --> \[\*\]$", text, re.M)} == {s.name for s in table.terminal}
    assert {name for edge in _edges(text) for name in edge[:2]} == {s.name for s in table.states}


def test_an_unknown_machine_is_refused_naming_the_choices() -> None:
    result = subprocess.run([sys.executable, "-m", "lifecycle", "diagram", "--machine", "ppo"],
                            capture_output=True, text=True)
    assert result.returncode == 2 and "'driver', 'rollout', 'trainer'" in result.stderr


def test_unknown_command_exits_non_zero_with_usage() -> None:
    result = subprocess.run([sys.executable, "-m", "lifecycle", "bogus"], capture_output=True, text=True)
    assert result.returncode == 2 and "usage" in result.stderr


def _main(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """The CLI in this process (no interpreter start-up): its exit status, stdout and stderr."""
    from lifecycle.cli import main

    try:
        rc = main(list(args))
    except SystemExit as exc:  # argparse refusing an argument
        rc = int(exc.code or 0)
    out, err = capsys.readouterr()
    return rc, out, err


def test_a_step_of_plain_digits_past_the_largest_step_is_called_out_of_range(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """It was called 'not a step number (digits 0-9)', though it is all digits."""
    from lifecycle.boundary import MAX_STEP

    rc, _, err = _main(capsys, "verify", str(tmp_path), "--step", "1" + "0" * 19)
    assert rc == 2 and f"10000000000000000000 is out of range: a step is at most {MAX_STEP}" in err
    assert "not a step number" not in err


@pytest.mark.parametrize("roles", [["../etc"], ["actor", ""]], ids=["path", "empty"])
def test_a_role_name_the_library_refuses_is_refused_while_parsing_naming_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], roles: list[str]) -> None:
    """`../etc` was echoed on an empty root, and `actor ''` verified actor before refusing ''."""
    rc, out, err = _main(capsys, "verify", str(tmp_path), "--roles", *roles)
    assert rc == 2 and out == ""
    assert f"argument --roles: {roles[-1]!r} is not a valid role name" in err


def test_a_line_break_in_a_root_argument_is_escaped_not_a_second_error_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "nowhere\nerror: forged line"
    rc, _, err = _main(capsys, "inspect", str(root))
    assert rc == 2 and err.count("\n") == 1 and err.startswith("error: ")
    assert "nowhere\\nerror: forged line" in err


def test_an_error_keeps_the_librarys_own_indented_lines_and_escapes_any_other_break(
        capsys: pytest.CaptureFixture[str]) -> None:
    from lifecycle.cli import _error

    _error("step 2: cannot load:\n  a\x1b[31m\n  b\nerror: c")
    assert capsys.readouterr().err == "error: step 2: cannot load:\n  a\\x1b[31m\n  b\\nerror: c\n"
