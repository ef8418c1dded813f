"""One writer per role and root: a second writer is refused at once, naming the holder; the
kernel drops the lock of a writer that dies; two processes racing leave only good steps."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from lifecycle import CheckpointError, Lifecycle, State
from lifecycle.store import CheckpointStore
from lifecycle.writer_lock import WriterLock
from tests.lifecycle.hostile import REPO, ROLE, fill, has_weights_of, lifecycle_at, saved_run

HOLD = """
import sys, time
from pathlib import Path
from lifecycle.writer_lock import WriterLock
lock = WriterLock(Path(sys.argv[1]), sys.argv[2])
lock.acquire()
print("HELD", flush=True)
time.sleep(600)
"""


def start_holder(root: Path, role: str = ROLE) -> subprocess.Popen[str]:
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(root), role], stdout=subprocess.PIPE, text=True,
                              cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert holder.stdout is not None and holder.stdout.readline().strip() == "HELD"
    return holder


def test_a_second_writer_is_refused_at_once_naming_the_holder(tmp_path: Path) -> None:
    saved_run(tmp_path, steps=(1,))
    holder = start_holder(tmp_path)
    try:
        lc = lifecycle_at(tmp_path)
        assert lc.resume() == 1
        fill(lc.parts.model, 2)
        started = time.monotonic()
        with pytest.raises(CheckpointError, match=f"host {socket.gethostname()} pid {holder.pid}") as caught:
            lc.save(2)
        assert time.monotonic() - started < 30  # a hang guard: refused, not waited for
        assert f".lock-{ROLE}" in str(caught.value) and lc.state is State.FAILED
        assert not (tmp_path / "global_step_2").exists()  # nothing staged, nothing of the holder's touched
    finally:
        holder.kill()
        holder.wait()
    again = lifecycle_at(tmp_path)  # the kernel dropped the killed holder's lock
    assert again.resume() == 1 and has_weights_of(again.parts.model, 1)
    fill(again.parts.model, 2)
    again.save(2)
    assert CheckpointStore(tmp_path).validate(2, ROLE, deep=True) == []


def test_other_roles_are_not_held_up_by_a_writer_of_one_role(tmp_path: Path) -> None:
    holder = start_holder(tmp_path, "critic")
    try:
        lc = lifecycle_at(tmp_path)
        lc.init_load()
        lc.save(1)
    finally:
        holder.kill()
        holder.wait()


def test_an_async_save_holds_the_lock_until_its_background_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from backends.hf import HFBackend
    from tests.lifecycle.hostile import Net

    release = threading.Event()
    save_model = HFBackend.save_model

    def gated(self: HFBackend, model: object, folder: Path) -> None:
        assert release.wait(60)
        save_model(self, model, folder)

    monkeypatch.setattr(HFBackend, "save_model", gated)
    lc = Lifecycle({"checkpoint": {"root": str(tmp_path), "save": {"async": True}}}, role=ROLE, model=Net())
    lc.init_load()
    pending = lc.save(1)
    other = WriterLock(tmp_path, ROLE)
    with pytest.raises(CheckpointError, match=f"pid {os.getpid()}"):
        other.acquire()  # the background write is still running
    release.set()
    pending.wait(60)
    other.acquire()  # released once committed
    other.release()
    lc.close()


RACER = """
import json, sys
from pathlib import Path
from lifecycle import CheckpointError
from tests.lifecycle.hostile import lifecycle_at, fill
root, first = Path(sys.argv[1]), int(sys.argv[2])
lc = lifecycle_at(root)
lc.init_load()
outcomes = []
for step in range(first, first + 24, 2):
    fill(lc.parts.model, step)
    try:
        lc.save(step)
        outcomes.append([step, "committed"])
    except CheckpointError as exc:
        outcomes.append([step, "refused: " + str(exc)])
        lc = lifecycle_at(root)
        lc.init_load()
print(json.dumps(outcomes))
"""


@pytest.mark.slow
def test_two_processes_saving_one_role_leave_only_steps_that_verify(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    racers = [subprocess.Popen([sys.executable, "-c", RACER, str(tmp_path), str(first)], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, cwd=REPO, env=env) for first in (1, 2)]
    try:
        results = [racer.communicate(timeout=300) for racer in racers]
    finally:
        for racer in racers:
            if racer.poll() is None:
                racer.send_signal(signal.SIGKILL)
                racer.wait()
    outcomes: list[list] = []
    for racer, (out, err) in zip(racers, results):
        assert racer.returncode == 0 and "Traceback" not in err, err
        outcomes += json.loads(out.strip().splitlines()[-1])
    committed = sorted(step for step, what in outcomes if what == "committed")
    refusals = [what for _, what in outcomes if what != "committed"]
    assert all(("pid" in what and "one writer per role" in what)  # saving at the same time, or one step
               or re.search(r"cannot save step \d+ \(role actor\): step \d+ is committed", what)  # below the other's
               for what in refusals), refusals
    store = CheckpointStore(tmp_path)
    assert store.steps() == committed
    for step in committed:
        assert store.validate(step, ROLE, deep=True) == [], step
    lc = lifecycle_at(tmp_path, on_damaged="refuse")
    assert lc.resume() == committed[-1] and has_weights_of(lc.parts.model, committed[-1])
