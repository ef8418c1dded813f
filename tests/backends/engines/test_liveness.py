"""A receiver on the sender's host that dies fails the sync within seconds, naming it, not at
`timeout_s` (`backends.engines.liveness`).

The receivers are real processes, SIGKILLed at the point each test names: before they answer
the plan (1.5 s into working on it: one that dies before the sender first reads its pid is
not watched, see `liveness`), mid-transfer, or after they read every tensor (in the rollout's
`load_weights`). The sender's timeout is a minute; each test's hang guard is a few seconds. A
receiver that ends after setting every key it owes fails nothing. The other way round, a sender
that is alive but answers nothing (stopped, or anything silent on its port) fails its receiver
at the receiver's `timeout_s` (`backends.engines.link`).
"""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest

from backends.engines import Rendezvous, TransportError, WeightSync, receive_into
from backends.engines.liveness import Watch, rank_of, whoami
from lifecycle.errors import EngineError
from lifecycle.testing import MemoryRollout
from tests.backends.dist_util import free_port
from tests.backends.engines.kit import (
    REPO, HANG_GUARD_S, TRANSPORTS, assert_kept_old_weights, mixed_tensors, new_engine, old_rollout,
)

SENDER_TIMEOUT_S = 60.0
"""The sender's timeout_s: a failure that waited it out would overrun every hang guard here."""

_RECEIVER = """
import os, signal, sys, time
from pathlib import Path
from backends.engines import Rendezvous, receive_into
from lifecycle.testing import MemoryRollout
from tests.backends.engines.kit import die_at_release, new_engine

name, port, receivers, rank, when, ready = sys.argv[1:]

def die(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)

class Rollout(MemoryRollout):
    def load_weights(self, named_tensors):
        list(named_tensors)
        if when == "loading":
            die()

engine = new_engine(name, timeout_s=60)
if when == "planning":  # as a rollout allocating for the plan would: after the sender read its pid
    engine._receive_layout = lambda *args: (time.sleep(1.5), die())
if when == "receiving":
    die_at_release(engine, 1)
Path(ready).touch()
receive_into(engine, Rollout(), Rendezvous("127.0.0.1", int(port), receivers=int(receivers)), rank=int(rank))
print("received")
"""


def _receiver(tmp_path: Path, name: str, port: int, receivers: int, rank: int, when: str) -> subprocess.Popen[str]:
    ready = tmp_path / f"ready{rank}"
    process = subprocess.Popen([sys.executable, "-c", _RECEIVER, name, str(port), str(receivers), str(rank), when,
                                str(ready)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    while not ready.exists() and process.poll() is None:
        time.sleep(0.02)
    return process


@pytest.mark.parametrize(("name", "when"), [("gloo", "loading"), ("shm", "loading"), ("gloo", "planning"),
                                            ("shm", "planning"), ("shm", "receiving")])
def test_a_receiver_killed_on_the_senders_host_fails_the_sync_within_seconds_naming_it(
        tmp_path: Path, name: str, when: str) -> None:
    port = free_port()
    victim = _receiver(tmp_path, name, port, 1, 1, when)
    sender = new_engine(name, timeout_s=SENDER_TIMEOUT_S, bucket_bytes=4096)
    start = time.monotonic()
    try:
        with pytest.raises(EngineError) as raised:
            WeightSync(sender).sync(iter(mixed_tensors()), Rendezvous("127.0.0.1", port, receivers=1), 1)
    finally:
        sender.close()
        victim.kill()
        victim.communicate(timeout=HANG_GUARD_S)
    assert time.monotonic() - start < HANG_GUARD_S
    assert victim.returncode == -9
    assert re.search(rf"rank 1 \(pid {victim.pid}, on this host\) exited or was killed without setting '\S+/1' while "
                     "the sender was waiting for", str(raised.value)), str(raised.value)


class _SlowRollout(MemoryRollout):
    def load_weights(self, named_tensors: Iterable[tuple[str, Any]]) -> None:
        time.sleep(2.5)
        super().load_weights(named_tensors)


@pytest.mark.parametrize("name", TRANSPORTS)
def test_a_receiver_that_exits_after_answering_fails_nothing_while_another_is_still_loading(
        tmp_path: Path, name: str) -> None:
    port = free_port()
    rdv = Rendezvous("127.0.0.1", port, receivers=2)
    quick = _receiver(tmp_path, name, port, 2, 2, "never")
    slow, errors = _SlowRollout(), []

    def receive() -> None:
        try:
            receive_into(new_engine(name, timeout_s=SENDER_TIMEOUT_S), slow, rdv, rank=1)
        except Exception as exc:  # noqa: BLE001 - handed to the test
            errors.append(exc)

    thread = threading.Thread(target=receive, daemon=True)
    thread.start()
    sender = new_engine(name, timeout_s=SENDER_TIMEOUT_S, bucket_bytes=4096)
    try:
        WeightSync(sender).sync(iter(mixed_tensors()), rdv, 1)
    finally:
        sender.close()
        out, err = quick.communicate(timeout=HANG_GUARD_S)
        thread.join(HANG_GUARD_S)
    assert quick.returncode == 0 and out.strip() == "received", err[-2000:]
    assert not errors and slow.weights_version == 1


_STOPPING_SENDER = """
import os, signal, sys
from pathlib import Path
from backends.engines import Rendezvous, WeightSync
from tests.backends.engines.kit import mixed_tensors, new_engine

name, port, ready = sys.argv[1:]
engine = new_engine(name, timeout_s=60)
start = engine._start_send

def stop_at_bucket_3(k, nbytes):
    if k == 3:
        os.kill(os.getpid(), signal.SIGSTOP)
    return start(k, nbytes)

engine._start_send = stop_at_bucket_3
Path(ready).touch()
WeightSync(engine).sync(iter(mixed_tensors()), Rendezvous("127.0.0.1", int(port), receivers=1), 1)
"""

STOPPED_TIMEOUT_S = 2.0
"""The timeout_s of a receiver whose sender stops: its store calls must end by then, near enough."""


def test_a_sender_stopped_mid_sync_fails_its_receiver_at_its_timeout(tmp_path: Path) -> None:
    """A sender alive but stopped (SIGSTOP: a debugger, a frozen node) answers no store call, and
    torch's store client waits for a reply without a limit: the receiver waited forever (on every
    engine; shm here, whose every bucket is signalled through the store)."""
    name, port, ready = "shm", free_port(), tmp_path / "ready"
    sender = subprocess.Popen([sys.executable, "-c", _STOPPING_SENDER, name, str(port), str(ready)], cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        while not ready.exists() and sender.poll() is None:
            time.sleep(0.02)
        rollout = old_rollout()
        error = _receive_guarded(new_engine(name, timeout_s=STOPPED_TIMEOUT_S), rollout,
                                 Rendezvous("127.0.0.1", port, receivers=1))  # the hang guard: 5x timeout_s
        assert isinstance(error, TransportError), error
        assert re.match(f"{name} engine: .+ within timeout_s={STOPPED_TIMEOUT_S:g}", str(error)), str(error)
        assert_kept_old_weights(rollout)
    finally:
        sender.kill()  # SIGKILL ends a stopped process too
        sender.communicate(timeout=HANG_GUARD_S)
    assert sender.returncode == -9


def test_a_rendezvous_that_accepts_and_never_answers_fails_a_joining_receiver_at_its_timeout() -> None:
    """Something listens on the port but says nothing (the kernel completes each connection): the
    handshake of torch's store client waited for its reply forever."""
    with socket.create_server(("127.0.0.1", 0)) as silent:
        port = silent.getsockname()[1]
        error = _receive_guarded(new_engine("gloo", timeout_s=1), MemoryRollout(), Rendezvous("127.0.0.1", port))
    assert isinstance(error, TransportError), error
    assert str(error) == f"gloo engine: joining a sync at 127.0.0.1:{port} did not finish within timeout_s=1"


def _receive_guarded(engine: Any, rollout: MemoryRollout, rdv: Rendezvous) -> BaseException | None:
    """What `receive_into` raised, on a thread of its own with a hang guard: a receive that still
    hangs fails the test instead of stopping the run (its daemon thread is left behind)."""
    raised: list[BaseException | None] = [None]

    def receive() -> None:
        try:
            receive_into(engine, rollout, rdv, rank=1)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            raised[0] = exc

    thread = threading.Thread(target=receive, daemon=True)
    thread.start()
    thread.join(HANG_GUARD_S)
    assert not thread.is_alive(), f"the receiver still waits after {HANG_GUARD_S}s"
    return raised[0]


def test_a_watch_opens_pidfds_only_for_live_processes_posted_from_its_own_pid_space() -> None:
    """What a store writer may post as `pid/{rank}`: nothing else is watched, nothing raises."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    while (posted := _posted(child.pid)) is None:
        time.sleep(0.01)
    space, _, started = posted.split(" ")
    try:
        watch = Watch(range(1, 11))
        watch.learn({1: posted.encode(), 2: f"other-boot/1 {child.pid} {started}".encode(), 3: b"garbage",
                     4: whoami().encode(), 5: f"{space} 0 1".encode(), 6: f"{space} 99999999999 1".encode(),
                     7: f"{space} -{child.pid} {started}".encode(), 8: b"\xff\xfe " + str(child.pid).encode(),
                     9: f"{space} {child.pid} {int(started) + 1}".encode(), 10: f"{space} {child.pid}".encode()})
        keys = [f"status/{rank}" for rank in range(1, 11)]
        assert watch.unread == [] and watch.watching and watch.dead(keys) == {}
        child.kill()
        child.wait(timeout=HANG_GUARD_S)
        assert watch.dead(keys) == {1: child.pid}
        assert watch.dead(["status/2", "heard"]) == {}
        watch.close()
        assert not watch.watching and watch.dead(keys) == {}
    finally:
        child.kill()
        child.wait(timeout=HANG_GUARD_S)


def _posted(pid: int) -> str | None:
    """What process `pid` would post as `pid/{rank}` (`whoami`), read from outside it."""
    from backends.engines import liveness

    started = liveness._started(pid)
    return None if started is None else f"{whoami().split(' ')[0]} {pid} {started}"


def test_a_pid_that_names_no_process_when_read_is_not_watched_it_could_be_another_machines() -> None:
    """A clone of one memory snapshot shares the boot id: an id that names nothing here may be a
    live receiver there, and failing its sync would be wrong."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    posted = _posted(child.pid)
    child.wait(timeout=HANG_GUARD_S)
    watch = Watch(range(1, 2))
    watch.learn({1: (posted or f"{whoami().split(' ')[0]} {child.pid} 1").encode()})
    assert watch.dead(["accepted/1"]) == {} and watch.unread == []
    watch.close()


def test_rank_of_reads_the_last_part_of_a_receivers_key_and_nothing_else() -> None:
    assert [rank_of(key) for key in ("accepted/2", "done/3/12", "heard", "/5", "status/-1", "status/1x",
                                     "status/" + "9" * 12)] == [2, 12, None, None, None, None, None]
