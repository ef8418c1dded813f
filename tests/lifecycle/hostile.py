"""Helpers for tests that attack a checkpoint root: a run to attack, and processes that run
without root's powers (we are root on the build machines, and root reads anything)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from lifecycle import Lifecycle
from tests.lifecycle.test_bad_input import Net, fill, has_weights_of

ROLE = "actor"
REPO = Path(__file__).resolve().parents[2]

__all__ = ["ROLE", "Net", "fill", "has_weights_of", "lifecycle_at", "run_unprivileged", "saved_run"]


def lifecycle_at(root: Path, *, role: str = ROLE, roles: list[str] | None = None, verify: bool = True,
                 keep_last: int | None = None, save_format: str = "hf", **resume: Any) -> Lifecycle:
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    checkpoint: dict[str, Any] = {"root": str(root), "load": {"verify": verify}, "keep_last": keep_last,
                                  "save": {"format": save_format}}
    if roles:
        checkpoint["roles"] = roles
    return Lifecycle({"checkpoint": checkpoint, "resume": resume}, role=role, model=model, optimizer=optimizer)


def saved_run(root: Path, steps: tuple[int, ...] = (1, 2), *, roles: tuple[str, ...] = (ROLE,)) -> None:
    """Committed steps whose weights say which step they are, for every role."""
    for role in roles:
        lc = lifecycle_at(root, role=role, roles=list(roles))
        lc.init_load()
        for step in steps:
            fill(lc.parts.model, step)
            lc.save(step)
        lc.close()


def run_unprivileged(code: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """`python -c code args...` in the repository, without the capabilities that let root
    ignore file permissions, so a chmod 000 file is as unreadable as it is for a user."""
    command = [sys.executable, "-c", code, *args]
    if os.geteuid() == 0:
        capsh = shutil.which("capsh")
        if capsh is None:
            pytest.skip("running as root without capsh: cannot drop the permission-bypassing capabilities")
        command = [capsh, "--drop=cap_dac_override,cap_dac_read_search,cap_fowner", "--",
                   "-c", 'exec "$0" "$@"', *command]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=REPO, env=env)
