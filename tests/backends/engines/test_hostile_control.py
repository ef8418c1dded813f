"""The control messages are a peer's bytes: whatever a peer (or anyone reaching the store) puts
there fails the sync as an `EngineError` naming the key or the rank, never as a raw Python
error, and never by waiting out `timeout_s`.

Every sync here runs over real gloo groups or shared memory, the sender on the test's thread
and each receiver on a thread of its own. Each side must end well before `timeout_s` (a hang
guard, not a speed check), and each rollout keep its old weights and version, marked stale.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from collections.abc import Callable
from typing import Any

import pytest
from structlog.testing import capture_logs

from backends.engines import Rendezvous, TransportError
from backends.engines import receiver as receiver_module
from backends.engines import shm as shm_module
from backends.engines.control import SHOWN_CHARS
from backends.engines.link import StoreLink
from backends.engines.shm import _PREFIX, ShmEngine
from lifecycle.errors import EngineError
from lifecycle.testing import MemoryRollout
from tests.backends.dist_util import free_port
from tests.backends.engines.kit import (
    CLASSES,
    DEEP,
    HANG_GUARD_S,
    TIMEOUT_S,
    TRANSPORTS,
    assert_kept_old_weights,
    mixed_tensors,
    new_engine,
    old_rollout,
    sync_threads,
)


def _dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


# -- the rendezvous: `latest` ---------------------------------------------------------------

@pytest.mark.parametrize("latest", [b"v1", b"9" * 5000, b"-1", b"0", b"\xff"])
@pytest.mark.parametrize("name", TRANSPORTS)
def test_a_latest_key_that_is_no_sync_number_fails_the_receiver_at_once_naming_key_and_rendezvous(
        name: str, latest: bytes) -> None:
    """The receiver cannot tell which sync to join, so it cannot tell the sender either: the
    sender (given a short timeout here) waits for it; the receiver (given TIMEOUT_S) must not.
    The sender holds its store open until the receiver's attempt has ended, and then runs out
    of time at once: nothing here waits for a clock but the hang guards."""
    run, rollout = _sync_with_a_key_written(name, lambda link: "latest", latest)
    assert run.seconds < HANG_GUARD_S
    assert isinstance(run.error, TransportError), run.error
    error = run.errors[0]
    assert isinstance(error, TransportError), error
    assert re.match(rf"{name} engine: the rendezvous at 127\.0\.0\.1:\d+ holds {re.escape(repr(latest[:40]))} "
                    rf"\({len(latest)} bytes\) under 'latest', not the number of a sync", str(error)), str(error)
    assert_kept_old_weights(rollout)


def test_a_rank_claim_that_is_no_count_fails_the_receiver_at_once_naming_the_key() -> None:
    """Someone wrote `joined/1` before rank 1 claimed it: torch's store cannot add to it and drops
    the connection, which the receiver took for a lost one and retried until timeout_s, naming
    nothing. The sender (a short timeout here) waits for it, as for `latest` above."""
    run, rollout = _sync_with_a_key_written("gloo", lambda link: f"sync{link.number}/joined/1", b"x")
    assert run.seconds < HANG_GUARD_S
    assert isinstance(run.errors[0], TransportError), run.errors[0]
    assert re.match(r"gloo engine: sync 1 holds b'x' \(1 bytes\) under 'joined/1', not a count", str(run.errors[0]))
    assert_kept_old_weights(rollout)


def _sync_with_a_key_written(name: str, key: Callable[[StoreLink], str], value: bytes) -> tuple[Any, Any]:
    """A sync whose sender (timeout 1.5 s) writes `value` under `key` of its store as it opens it,
    before the receiver (TIMEOUT_S) joins; the sender holds its store open until the receiver's
    attempt has ended, then runs out of time at once: nothing waits for a clock but the guards."""
    overwritten, tried = threading.Event(), threading.Event()

    class Writing(StoreLink):
        def _open(self, rdv: Rendezvous, world: int) -> Any:
            control = super()._open(rdv, world)
            self.base.set(key(self), value)
            overwritten.set()
            tried.wait(HANG_GUARD_S)
            self.engine.deadline = min(self.engine.deadline, time.monotonic())
            return control

    class Late(CLASSES[name]):  # type: ignore[valid-type,misc]
        def init_process_group(self) -> None:
            overwritten.wait(HANG_GUARD_S)
            try:
                super().init_process_group()
            finally:
                tried.set()

    sender = new_engine(name, timeout_s=1.5)
    sender._link = Writing(sender)  # type: ignore[attr-defined]
    rollout = old_rollout()
    return sync_threads(sender, [Late(bucket_bytes=4096, timeout_s=TIMEOUT_S)], mixed_tensors(), [rollout]), rollout


class _Failing(MemoryRollout):
    def load_weights(self, named_tensors: Any) -> None:
        raise ValueError("boom")


@pytest.mark.parametrize("name", TRANSPORTS)
def test_close_frees_the_rendezvous_port_while_a_failed_syncs_exception_is_kept(name: str) -> None:
    """A caller keeps a failed sync's exception (a log record, a run report): its frames hold the
    sync's objects, which held the sender's store, and with it the port, after close()."""
    port = free_port()
    sender, receiver = new_engine(name), new_engine(name)
    run = sync_threads(sender, [receiver], mixed_tensors(), [_Failing()], port=port)
    kept = [run.error, run.errors[0]]
    assert isinstance(kept[0], EngineError) and isinstance(kept[1], ValueError), kept
    sender.close()
    receiver.close()
    again = sync_threads(new_engine(name), [new_engine(name)], mixed_tensors(1), port=port, version=2)
    assert again.error is None and again.versions == [2], (again.error, again.errors)
    assert kept[0].__traceback__ is not None


def test_the_sender_listens_only_on_an_ip_address_its_rendezvous_names_and_stops_at_close() -> None:
    """torch's own store listens on every interface; a sender for 127.0.0.1 is reachable there
    alone (127.0.0.2 is the same host, another address), and close() frees the port at once."""
    port = free_port()
    sender, receiver = new_engine("gloo"), new_engine("gloo")
    run = sync_threads(sender, [receiver], mixed_tensors(), port=port)
    assert run.error is None and run.versions == [1]
    socket.create_connection(("127.0.0.1", port), timeout=1).close()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.2", port), timeout=1)
    sender.close()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=1)
    receiver.close()


# -- a receiver's answers ---------------------------------------------------------------------

HOSTILE_ANSWERS: dict[str, tuple[bytes, str]] = {
    "nested too deep": (DEEP, r"rank 1: sent an unreadable answer b'\[\[\[\[.*' \(200000 bytes\)"),
    "a reason of 5 MB": (json.dumps({"ok": False, "error": "x" * 5_000_000}).encode(),
                         rf"rank 1: x{{{SHOWN_CHARS}}}\.\.\. \[5000000 characters in all\]"),
    "a reason that is no string": (b'{"ok": false, "error": [[[["no"]]]]}', r"rank 1: sent an unreadable answer"),
    "not UTF-8": (b'{"ok": true, "error": "\xff"}', r"rank 1: sent an unreadable answer"),
    "an int too long to read": (b'{"ok": false, "error": ' + b"9" * 5000 + b"}", r"rank 1: sent an unreadable answer"),
}


@pytest.mark.parametrize("case", list(HOSTILE_ANSWERS))
@pytest.mark.parametrize("name", TRANSPORTS)
def test_a_hostile_answer_fails_the_sender_at_once_naming_the_rank_in_a_bounded_message(
        name: str, case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The receiver accepts, but says so in bytes no honest receiver writes: the sender must
    name it, show at most SHOWN_CHARS of what it said, and close the sync so it ends too."""
    payload, reason = HOSTILE_ANSWERS[case]
    monkeypatch.setattr(receiver_module, "answer", lambda error, **said: payload)  # what `receiver.accept` answers the plan with
    rollout = old_rollout()
    run = sync_threads(new_engine(name, timeout_s=TIMEOUT_S), [new_engine(name, timeout_s=TIMEOUT_S)],
                       mixed_tensors(), [rollout])
    assert run.seconds < HANG_GUARD_S
    assert isinstance(run.error, EngineError), run.error
    said = str(run.error)
    assert said.startswith(f"{name} engine: 1 of 1 receiver(s) refused the plan of weights v1: rank 1: "), said[:300]
    assert re.search(reason, str(run.error)), str(run.error)[:300]
    assert len(str(run.error)) < 2 * SHOWN_CHARS
    assert isinstance(run.errors[0], EngineError), run.errors[0]
    assert_kept_old_weights(rollout)


# -- shm: the published buckets and the orphan sweep --------------------------------------------

@pytest.mark.parametrize("slots", [DEEP, b'{"a": ' * 50_000 + b"1" + b"}" * 50_000, b"\xff\xfe"])
def test_shm_slots_that_cannot_be_read_are_refused_by_the_receiver_and_the_sender_is_told_at_once(slots: bytes) -> None:
    class Publishing(ShmEngine):
        def _connect(self, topology: Any) -> None:
            super()._connect(topology)
            self._control().set("slots", slots)

    rollout = old_rollout()
    run = sync_threads(Publishing(bucket_bytes=4096, timeout_s=TIMEOUT_S), [new_engine("shm", timeout_s=TIMEOUT_S)],
                       mixed_tensors(), [rollout])
    assert run.seconds < HANG_GUARD_S
    reason = rf"the sender published {re.escape(repr(slots[:120]))} \({len(slots)} bytes\) as its buckets, not 2"
    assert isinstance(run.errors[0], EngineError), run.errors[0]
    assert str(run.errors[0]).startswith("shm engine: rank 1 refuses the plan of weights v1: ")
    assert re.search(reason, str(run.errors[0])), str(run.errors[0])
    assert isinstance(run.error, EngineError), run.error
    assert str(run.error).startswith("shm engine: 1 of 1 receiver(s) refused the plan of weights v1: rank 1: ")
    assert re.search(reason, str(run.error)), str(run.error)
    assert_kept_old_weights(rollout)


def test_the_shm_orphan_sweep_skips_what_is_not_a_dead_senders_bucket_and_never_fails_a_sync(tmp_path: Path) -> None:
    shm_dir, outside = tmp_path / "shm", tmp_path / "outside"
    shm_dir.mkdir()
    outside.write_bytes(b"keep me")
    dead, token = _dead_pid(), "0123456789ab"
    junk = {  # what keeps each: the name pattern, the pid check (_alive), or the file-type check
        "a pid too long for the name pattern": f"{_PREFIX}99999999999999999999-{token}-0",
        "a pid past pid_max, alive to the pid check": f"{_PREFIX}{1 << 22}-{token}-0",
        "an odd-named file of a dead pid": f"{_PREFIX}{dead}-odd",
        "an odd-named folder of a dead pid": f"{_PREFIX}{dead}-x",
        "a bucket-named folder of a dead pid, no regular file": f"{_PREFIX}{dead}-{token}-0",
        "a bucket-named link of a dead pid, no regular file": f"{_PREFIX}{dead}-{token}-1",
    }
    (shm_dir / junk["a pid too long for the name pattern"]).write_text("x")
    (shm_dir / junk["a pid past pid_max, alive to the pid check"]).write_text("x")
    (shm_dir / junk["an odd-named file of a dead pid"]).write_text("x")
    (shm_dir / junk["an odd-named folder of a dead pid"]).mkdir()
    (shm_dir / junk["a bucket-named folder of a dead pid, no regular file"]).mkdir()
    (shm_dir / junk["a bucket-named link of a dead pid, no regular file"]).symlink_to(outside)
    orphan = shm_dir / f"{_PREFIX}{dead}-{'f' * 12}-0"
    orphan.write_bytes(bytes(64))
    rollout = MemoryRollout()
    sender = new_engine("shm", shm_dir=shm_dir, timeout_s=TIMEOUT_S)
    run = sync_threads(sender, [new_engine("shm", shm_dir=shm_dir, timeout_s=TIMEOUT_S)], mixed_tensors(), [rollout])
    assert run.seconds < HANG_GUARD_S
    assert run.error is None and run.errors == [None], (run.error, run.errors)
    assert rollout.weights_version == 1 and not rollout.stale
    assert not orphan.exists()
    for case, name in junk.items():
        assert os.path.lexists(shm_dir / name), case
    assert outside.read_bytes() == b"keep me"
    sender.close()


def test_the_shm_orphan_sweep_judges_a_pid_only_in_its_own_pid_namespace(tmp_path: Path) -> None:
    """A sender in another pid namespace sharing shm_dir (another container's) has a pid that names
    no process here: its live buckets were swept, and its next syncs refused."""
    dead, ours = _dead_pid(), shm_module._PID_NS
    mine = tmp_path / f"{_PREFIX}ns{ours}-{dead}-{'a' * 12}-0"
    theirs = tmp_path / f"{_PREFIX}ns{ours + 1}-{dead}-{'b' * 12}-0"
    unnamed = tmp_path / f"{_PREFIX}{dead}-{'c' * 12}-0"  # named before names had a namespace: judged by pid
    for path in (mine, theirs, unnamed):
        path.write_bytes(b"")
    shm_module._remove_orphans(tmp_path)
    assert [path.exists() for path in (mine, theirs, unnamed)] == [False, True, False]
    sender = ShmEngine(shm_dir=tmp_path)
    try:
        sender._create(4096)
        assert all(Path(path).name.startswith(f"{_PREFIX}ns{ours}-{os.getpid()}-") for path in sender._paths)
        assert all(shm_module._NAME.fullmatch(Path(path).name) for path in sender._paths)
    finally:
        sender.close()
    assert theirs.exists() and sorted(os.listdir(tmp_path)) == [theirs.name]


def test_closing_a_sender_whose_shm_dir_is_a_plain_file_logs_no_bucket_kept(tmp_path: Path) -> None:
    """No bucket could be created there, so none was kept: close() logged one warning per slot."""
    plain = tmp_path / "plain"
    plain.write_text("x")
    sender = ShmEngine(shm_dir=plain)
    with pytest.raises(EngineError, match="cannot create the shared bucket"):
        sender._create(4096)
    with capture_logs() as logs:
        sender.close()
    assert [log for log in logs if log["event"] == "engine.shm_bucket_kept"] == []


def test_an_orphan_the_sweep_cannot_remove_is_logged_and_the_rest_are_removed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    dead = _dead_pid()
    orphans = [tmp_path / f"{_PREFIX}{dead}-{token * 12}-0" for token in "abc"]
    for orphan in orphans:
        orphan.write_bytes(b"")
    unlink = os.unlink

    def failing(path: Any, *, dir_fd: int | None = None) -> None:
        if path == orphans[1].name:
            raise PermissionError(1, "Operation not permitted", path)
        unlink(path, dir_fd=dir_fd)

    monkeypatch.setattr(shm_module.os, "unlink", failing)
    with capture_logs() as logs:
        shm_module._remove_orphans(tmp_path)
    assert [orphan.exists() for orphan in orphans] == [False, True, False]
    assert [(log["event"], log["path"]) for log in logs] == [("engine.shm_orphan_kept", str(orphans[1]))]
    assert "Operation not permitted" in logs[0]["error"]
