from __future__ import annotations

import subprocess
import sys

from lifecycle.machine import mermaid


def test_diagram_command_prints_the_mermaid_generated_from_the_table() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "lifecycle", "diagram"], capture_output=True, text=True, check=True
    )
    assert result.stdout == mermaid()
    assert result.stdout.startswith("stateDiagram-v2\n")


def test_unknown_command_exits_non_zero_with_usage() -> None:
    result = subprocess.run([sys.executable, "-m", "lifecycle", "bogus"], capture_output=True, text=True)
    assert result.returncode == 2 and "usage" in result.stderr
