"""The README is a manual: its runnable Python blocks run as written, its test command is CI's.

A block fenced as plain ```python must run in a fresh interpreter, in an empty folder, with
only this repository importable. Blocks that need a cluster, a GPU or other processes are
fenced with a second word (```python ray) and say so in the text above them.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
FENCE = re.compile(r"^```(?P<info>[^\n`]*)\n(?P<body>.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)


def _blocks(language: str) -> list[tuple[str, str]]:
    """(info string, body) of every fenced block whose info string starts with `language`."""
    found = []
    for m in FENCE.finditer(README.read_text()):
        info = m["info"].strip()
        if info.split(" ", 1)[0] == language:
            found.append((info, m["body"]))
    return found


RUNNABLE = [body for info, body in _blocks("python") if info == "python"]


def test_the_readme_has_runnable_python_blocks() -> None:
    assert len(RUNNABLE) >= 2, "the API block and the testing block are meant to run as written"


@pytest.mark.parametrize("body", RUNNABLE, ids=[f"block{i}" for i in range(len(RUNNABLE))])
def test_runnable_python_block_runs_as_written(body: str, tmp_path: Path) -> None:
    script = tmp_path / "block.py"
    script.write_text(body)
    env = {**os.environ, "PYTHONPATH": str(REPO), "TMPDIR": str(tmp_path)}
    done = subprocess.run([sys.executable, str(script)], check=False, cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, f"README block failed:\n{body}\n--- stderr ---\n{done.stderr[-4000:]}"


def test_ci_runs_the_readme_test_command() -> None:
    """`.ci/run` ends with the command the README tells a new user to run the tests with."""
    ci = (REPO / ".ci" / "run").read_text().strip().splitlines()
    command = ci[-1].strip()
    assert command == "python -m pytest -q"
    assert any(line.rstrip().endswith(f"&& {command}") for _, body in _blocks("bash") for line in body.splitlines())
