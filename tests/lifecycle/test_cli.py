from __future__ import annotations

import re
import subprocess
import sys

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
