"""The receiver decides: plans it will not take fail both sides at once and apply nothing.

Every sync here runs over real gloo groups or shared memory, the sender on the test's thread
and each receiver on a thread of its own. A refused plan must fail the sender and every
receiver well before `timeout_s` (a hang guard, not a speed check), name the rank and the
problem on both sides, and leave each rollout on its old weights and version, marked stale.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from backends.engines import CheckpointEngine, Incoming, receive_into
from backends.engines.slots import HEADER_BYTES
from backends.engines.digests import Checksums
from backends.engines.gloo import GlooEngine
from backends.engines.plan import align
from backends.engines.shm import _PREFIX, ShmEngine
from lifecycle.errors import EngineError
from lifecycle.testing import MemoryRollout
from tests.backends.dist_util import free_port
from tests.backends.engines.kit import (
    CLASSES,
    HANG_GUARD_S,
    TIMEOUT_S,
    TRANSPORTS,
    Run,
    assert_kept_old_weights,
    mixed_tensors,
    new_engine,
    old_rollout,
    sync_threads,
)


def _assert_refused(run: Run, name: str, reason: str, rollouts: list[MemoryRollout]) -> None:
    """Every receiver refused the plan for `reason` (a regex); the sender names each rank and
    why; no message grows with what a hostile sender published."""
    assert run.seconds < HANG_GUARD_S
    count = len(rollouts)
    assert isinstance(run.error, EngineError), run.error
    sender = str(run.error)
    assert sender.startswith(f"{name} engine: {count} of {count} receiver(s) refused the plan of weights v1: ")
    for rank, (error, rollout) in enumerate(zip(run.errors, rollouts), start=1):
        assert isinstance(error, EngineError), error
        assert str(error).startswith(f"{name} engine: rank {rank} refuses the plan of weights v1: ")
        assert re.search(reason, str(error)), str(error)
        assert re.search(f"rank {rank}: [^;]*{reason}", sender), sender
        assert len(str(error)) < 2000
        assert_kept_old_weights(rollout)
    assert len(sender) < 2000 * count


def _hostile(name: str, edit: Callable[[dict[str, Any]], object] | bytes) -> CheckpointEngine:
    """A sender that publishes its plan edited by `edit` (or `edit` itself, as raw bytes)."""

    class Hostile(CLASSES[name]):  # type: ignore[valid-type,misc]
        def _send_layout(self, metas: Any) -> Any:
            layout = super()._send_layout(metas)
            if isinstance(edit, bytes):
                layout.raw = edit
            else:
                data = json.loads(layout.plan.to_bytes())
                edit(data)
                layout.raw = json.dumps(data).encode()
            return layout

    return Hostile(bucket_bytes=4096, timeout_s=TIMEOUT_S)


def _engines(name: str, count: int = 2, **kwargs: Any) -> list[CheckpointEngine]:
    return [new_engine(name, timeout_s=TIMEOUT_S, **kwargs) for _ in range(count)]


# mixed_tensors() at 4096-byte buckets: embed.weight (tensor 0) in chunks over buckets 0..4,
# then in bucket 4: norm.weight, half, bf16, ids, mask, scalar, empty, transposed, bytes (1..9).
# One plan of each family end to end; every kind of bad plan is refused in test_plan.py.
BAD_PLANS: dict[str, tuple[Callable[[dict[str, Any]], object] | bytes, str]] = {
    "not json": (b'{"bucket_bytes":', r"it is not JSON"),
    "bool for an int": (lambda d: d["buckets"][4][1].__setitem__(0, True),
                        r"bucket 4 piece 1 index must be an integer .* got True"),
    "absurd bucket_bytes": (lambda d: d.update(bucket_bytes=1 << 50),
                            r"bucket_bytes must be an integer in 64\.\.1099511627776, got 1125899906842624"),
    "duplicate name": (lambda d: d["tensors"][9].__setitem__(0, "ids"), r"tensors 4 and 9 are both named 'ids'"),
    "chunks out of order": (lambda d: d["buckets"].insert(1, d["buckets"].pop(2)),
                            r"bucket 1 piece 0 \(tensor 0 'embed\.weight'\) carries its bytes 8192\.\.12288, which"),
    "piece past its bucket": (lambda d: d["buckets"][4][9].__setitem__(1, 4032),
                              r"bucket 4 piece 9 \(tensor 9 'bytes'\) ends at byte 4109 of its bucket, past"),
}


@pytest.mark.parametrize("case", list(BAD_PLANS))
@pytest.mark.parametrize("name", TRANSPORTS)
def test_a_bad_plan_fails_both_sides_at_once_naming_the_problem_and_applies_nothing(name: str, case: str) -> None:
    edit, reason = BAD_PLANS[case]
    rollouts = [old_rollout(), old_rollout()]
    receivers = _engines(name, 1) + _engines(name, 1, apply="streamed")
    run = sync_threads(_hostile(name, edit), receivers, mixed_tensors(), rollouts)
    _assert_refused(run, name, reason, rollouts)


@pytest.mark.parametrize("name", TRANSPORTS)
def test_a_receiver_that_verifies_refuses_a_plan_without_checksums_on_both_sides(name: str) -> None:
    rollouts = [old_rollout(), old_rollout()]
    run = sync_threads(new_engine(name, verify=False, timeout_s=TIMEOUT_S), _engines(name), mixed_tensors(), rollouts)
    _assert_refused(run, name, r"it sends no checksums \(the sender's engine\.verify is false\) and this "
                               r"receiver verifies every bucket", rollouts)


@pytest.mark.parametrize("name", TRANSPORTS)
def test_one_refusal_fails_the_sync_for_the_receiver_that_accepted_too_and_it_applies_nothing(name: str) -> None:
    rollouts = [old_rollout(), old_rollout()]
    receivers = _engines(name, 1, verify=False) + _engines(name, 1)
    run = sync_threads(new_engine(name, verify=False, timeout_s=TIMEOUT_S), receivers, mixed_tensors(), rollouts)
    assert run.seconds < HANG_GUARD_S
    assert isinstance(run.error, EngineError)
    assert str(run.error).startswith(f"{name} engine: 1 of 2 receiver(s) refused the plan of weights v1: rank 2: ")
    assert "rank 1" not in str(run.error)
    assert all(isinstance(error, EngineError) for error in run.errors)
    for rollout in rollouts:
        assert_kept_old_weights(rollout)


@pytest.mark.parametrize("name", TRANSPORTS)
def test_the_receivers_verify_decides_whether_it_checks_checksums(name: str) -> None:
    checked: dict[bool, int] = {True: 0, False: 0}

    class Counting(Checksums):
        def later(self, data: torch.Tensor) -> Any:
            checked[self.name == "verifying"] += 1
            return super().later(data)

    rollouts = [MemoryRollout(), MemoryRollout()]
    receivers = [new_engine(name, timeout_s=TIMEOUT_S, verify=v) for v in (False, True)]
    for receiver, label in zip(receivers, ("unverified", "verifying")):
        receiver.checksums = Counting(label)
    run = sync_threads(new_engine(name, timeout_s=TIMEOUT_S), receivers, mixed_tensors(), rollouts)
    assert run.error is None and run.errors == [None, None]
    assert checked[False] == 0 and checked[True] == run.figures["buckets"]  # type: ignore[index]
    run = sync_threads(new_engine(name, verify=False, timeout_s=TIMEOUT_S), _engines(name, 1, verify=False),
                       mixed_tensors(), [MemoryRollout()])
    assert run.error is None and run.errors == [None]


@pytest.mark.parametrize("name", TRANSPORTS)
def test_the_sender_sends_bucket_0_only_once_every_receiver_accepted_the_plan(name: str) -> None:
    times: dict[str, float] = {}

    class Slow(CLASSES[name]):  # type: ignore[valid-type,misc]
        def _receive_layout(self, raw: bytes, expected: Any) -> Any:
            time.sleep(0.5)
            layout = super()._receive_layout(raw, expected)
            times["checked"] = time.monotonic()
            return layout

    class Recording(CLASSES[name]):  # type: ignore[valid-type,misc]
        def _start_send(self, k: int, nbytes: int) -> Any:
            times.setdefault("bucket 0", time.monotonic())
            return super()._start_send(k, nbytes)

    receivers = [new_engine(name), Slow(bucket_bytes=4096, timeout_s=TIMEOUT_S)]
    run = sync_threads(Recording(bucket_bytes=4096, timeout_s=TIMEOUT_S), receivers, mixed_tensors(),
                       [MemoryRollout(), MemoryRollout()])
    assert run.error is None and run.errors == [None, None]
    assert times["checked"] < times["bucket 0"]


@pytest.mark.parametrize("name", TRANSPORTS)
def test_a_clean_sync_drops_its_answers_a_refused_one_is_closed_and_the_next_one_lands(name: str) -> None:
    sender, receiver, rollout = new_engine(name), new_engine(name), old_rollout()
    port = free_port()
    keys = ["accepted/1", "status/1", "plan", "version"] + (["slots"] if name == "shm" else [])

    def stored(sync: int, key: str) -> bool:
        return bool(sender._link.base.check([f"sync{sync}/{key}"]))  # type: ignore[attr-defined]

    assert sync_threads(sender, [receiver], mixed_tensors(), [rollout], port=port).error is None
    assert stored(1, "closed") and not any(stored(1, key) for key in keys)
    sender.verify = False
    run = sync_threads(sender, [receiver], mixed_tensors(), [rollout], port=port, version=2)
    assert isinstance(run.error, EngineError) and isinstance(run.errors[0], EngineError)
    assert stored(2, "closed") and stored(2, "accepted/1") and not stored(2, "status/1")
    assert rollout.stale and rollout.weights_version == 1
    sender.verify = True
    run = sync_threads(sender, [receiver], mixed_tensors(), [rollout], port=port, version=3)
    assert run.error is None and run.versions == [3] and not rollout.stale
    assert stored(3, "closed") and not any(stored(3, key) for key in keys)
    sender.close()
    receiver.close()


# -- the weights a rollout expects ----------------------------------------------------------

@pytest.mark.parametrize("name", TRANSPORTS)
def test_a_rollout_refuses_a_sync_that_leaves_out_a_weight_it_expects_and_the_sender_is_told(name: str) -> None:
    expected = {n for n, _ in mixed_tensors()} | {"lm_head.weight"}
    rollouts = [old_rollout(), old_rollout()]
    run = sync_threads(new_engine(name, timeout_s=TIMEOUT_S), _engines(name), mixed_tensors(), rollouts,
                       expected=expected)
    _assert_refused(run, name, r"it leaves out 1 of the 11 weight\(s\) this rollout expects: 'lm_head\.weight'",
                    rollouts)


@pytest.mark.parametrize("name", TRANSPORTS)
def test_a_sync_that_brings_every_expected_weight_and_more_lands(name: str) -> None:
    rollout = MemoryRollout()
    run = sync_threads(new_engine(name), [new_engine(name)], mixed_tensors(), [rollout],
                       expected=["embed.weight", "ids"])
    assert run.error is None and run.versions == [1] and len(rollout.weights) == len(mixed_tensors())


def test_the_naive_engine_refuses_missing_weights_before_handing_any_out() -> None:
    engine, rollout = new_engine("naive"), old_rollout()
    with engine.session(None, 0):
        engine.send_weights(iter(mixed_tensors()), 1)
        with pytest.raises(EngineError, match=r"naive engine: the rollout refuses weights v1: it leaves out 1 of "
                                              r"the 2 weight\(s\) this rollout expects: 'lm_head\.weight'"):
            receive_into(engine, rollout, expected=["ids", "lm_head.weight"])
    assert_kept_old_weights(rollout)


def test_an_engine_whose_receive_weights_takes_no_expected_says_so() -> None:
    class Old(GlooEngine):
        def receive_weights(self, version: int | None = None) -> Incoming:  # type: ignore[override]
            return super().receive_weights(version)

    rollout = MemoryRollout()
    with pytest.raises(EngineError, match=r"gloo engine: its receive_weights takes no `expected`.*the sender may "
                                          r"not know"):
        receive_into(Old(), rollout, None, expected=["x"])
    assert rollout.calls == []


@pytest.mark.parametrize("option", ["expected", "into"])
def test_an_engine_that_cannot_take_an_option_refuses_the_sync_and_its_sender_fails_at_once_not_at_its_timeout(
        option: str) -> None:
    class Old(GlooEngine):
        def receive_weights(self, version: int | None = None) -> Incoming:  # type: ignore[override]
            return super().receive_weights(version)

    named = mixed_tensors()
    rollout = MemoryRollout()
    receiver = Old(bucket_bytes=4096, timeout_s=60)
    run = sync_threads(new_engine("gloo", timeout_s=60), [receiver], named, [rollout],
                       **{option: [name for name, _ in named] if option == "expected" else [dict(named)]})
    why = rf"its receive_weights takes no `{option}`"
    assert isinstance(run.errors[0], EngineError) and re.search(why, str(run.errors[0])), run.errors[0]
    assert "may not know" not in str(run.errors[0])
    assert isinstance(run.error, EngineError) and re.search(why, str(run.error)), run.error
    assert "refused the plan of weights v1" in str(run.error)  # answered at the plan, before bucket 0 moved
    assert run.seconds < 30, f"the sender waited {run.seconds:.0f}s, as if nobody had told it"
    assert rollout.calls == []


def test_an_in_process_engine_that_cannot_take_into_raises_at_once_with_no_sync_to_refuse() -> None:
    rollout = MemoryRollout()
    with pytest.raises(EngineError, match=r"naive engine: its receive_weights takes no `into`[^(]*$"):
        receive_into(new_engine("naive"), rollout, into={"x": torch.zeros(2)})
    assert rollout.calls == []


def test_an_engine_without_a_plan_refuses_by_receiving_and_aborting_at_once() -> None:
    read: list[int] = []

    def tensors() -> Any:
        read.append(1)
        yield "x", torch.zeros(2)

    class Plain(CheckpointEngine):
        def receive_weights(self, version: int | None = None, *, expected: Any = None) -> Incoming:
            self.incoming = Incoming(1).feed(tensors())
            return self.incoming

    engine = Plain()
    engine.refuse("no thanks")
    assert engine.incoming.held and engine.incoming.stop_reason == "no thanks" and read == []


# -- the shared buckets an shm receiver maps --------------------------------------------------

def _bucket_name(token: str, slot: int = 0) -> str:
    return f"{_PREFIX}{os.getpid()}-{token * 12}-{slot}"


def _file(path: Path, size: int) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(bytes(size))
    return str(path)


def _owned_by_nobody(path: Path) -> str:
    """A file of a bucket's size that another user (nobody, 65534) owns: root here can make one."""
    made = _file(path, 4160)
    os.chown(made, 65534, 65534)
    return made


def _link_to_target(shm: Path, target: Path, real: list[str]) -> list[str]:
    link = shm / _bucket_name("a")
    link.symlink_to(target)
    return [str(link), real[1]]


def _second_name_of_target(shm: Path, target: Path, real: list[str]) -> list[str]:
    os.link(target, shm / _bucket_name("b"))
    return [str(shm / _bucket_name("b")), real[1]]


HOSTILE_SLOTS: dict[str, tuple[Callable[[Path, Path, list[str]], object], str]] = {
    "a file outside shm_dir, not named as a bucket": (lambda shm, target, real: [str(target), real[1]],
                                                      r"is not a bucket of this engine directly inside"),
    "a bucket-named file outside shm_dir": (
        lambda shm, target, real: [_file(shm.parent / "elsewhere" / _bucket_name("h"), 4160), real[1]],
        r"is not a bucket of this engine directly inside"),
    "/etc/passwd": (lambda shm, target, real: ["/etc/passwd", real[1]], r"'/etc/passwd' is not a bucket of this engine"),
    "a link inside shm_dir": (_link_to_target, r"is not a regular file \(a link, a folder or a device\)"),
    "a second name of the target": (_second_name_of_target, r"it has 2 names"),
    "a bucket in a subfolder": (lambda shm, target, real: [_file(shm / "sub" / _bucket_name("c"), 4160), real[1]],
                                r"is not a bucket of this engine directly inside"),
    "another user's bucket-named file": (lambda shm, target, real: [_owned_by_nobody(shm / _bucket_name("e")),
                                                                    real[1]], r"it belongs to uid 65534, not to"),
    "an empty file": (lambda shm, target, real: [_file(shm / _bucket_name("d"), 0), real[1]],
                      r"its 0 bytes are no bucket's size"),
    "one path": (lambda shm, target, real: [real[0]], r"not 2 distinct paths"),
    "the same path twice": (lambda shm, target, real: [real[0], real[0]], r"not 2 distinct paths"),
    "the same path twice, spelled apart": (lambda shm, target, real: [real[0], str(Path(real[0]).parent / "."
                                                                            / Path(real[0]).name)],
                                           r"not 2 distinct paths"),
    "not a list": (lambda shm, target, real: "nope", r"not 2 distinct paths"),
    "a NUL in its folder": (lambda shm, target, real: [f"{shm}\x00/{_bucket_name('f')}", real[1]],
                            r"is not a bucket of this engine directly inside"),
    "a path of a megabyte": (lambda shm, target, real: [f"{shm}{'/.' * 500_000}/{_bucket_name('g')}", real[1]],
                             r"\.\.\. \[\d+ characters in all\] is not a bucket of this engine directly inside"),
    "a pid too long for the name pattern": (
        lambda shm, target, real: [str(shm / f"{_PREFIX}99999999-{'a' * 12}-0"), real[1]],
        r"is not a bucket of this engine directly inside"),
}


def _hostile_shm(shm_dir: Path, publish: Callable[[list[str]], object]) -> ShmEngine:
    class HostileShm(ShmEngine):
        def _create(self, size: int) -> list[torch.Tensor]:
            buffers = super()._create(size)
            self._paths = publish(list(self._paths))  # type: ignore[assignment]
            return buffers

    return HostileShm(bucket_bytes=4096, timeout_s=TIMEOUT_S, shm_dir=shm_dir)


@pytest.mark.parametrize("case", list(HOSTILE_SLOTS))
def test_an_shm_receiver_maps_only_buckets_of_its_own_engine_in_its_own_folder(case: str, tmp_path: Path) -> None:
    if "another user" in case and os.geteuid() != 0:
        pytest.skip("only root can make a file another user owns")
    shm_dir, target = tmp_path / "shm", tmp_path / "passwd"
    shm_dir.mkdir()
    target.write_bytes(b"root:x:0:0:root:/root:/bin/bash\n" * 130)
    before = (target.read_bytes(), target.stat().st_mtime_ns)
    publish, reason = HOSTILE_SLOTS[case]
    rollout, receiver = old_rollout(), new_engine("shm", shm_dir=shm_dir, timeout_s=TIMEOUT_S)
    sender = _hostile_shm(shm_dir, lambda real: publish(shm_dir, target, real))
    run = sync_threads(sender, [receiver], mixed_tensors(), [rollout])
    _assert_refused(run, "shm", reason, [rollout])
    assert receiver.slots == []  # type: ignore[attr-defined]
    assert (target.read_bytes(), target.stat().st_mtime_ns) == before
    assert_kept_old_weights(rollout)


def test_an_shm_receiver_refuses_shared_buckets_smaller_than_the_plan_needs(tmp_path: Path) -> None:
    shm_dir = tmp_path / "shm"
    small = [_file(shm_dir / _bucket_name("e", slot), HEADER_BYTES + 128) for slot in range(2)]
    rollout = old_rollout()
    run = sync_threads(_hostile_shm(shm_dir, lambda real: small),
                       [new_engine("shm", shm_dir=shm_dir, timeout_s=TIMEOUT_S)], mixed_tensors(), [rollout])
    wanted = HEADER_BYTES + align(4096)
    _assert_refused(run, "shm", rf"its bucket_bytes=4096 needs shared buckets of {wanted} bytes; the "
                                rf"sender's hold \[{HEADER_BYTES + 128}, {HEADER_BYTES + 128}\]", [rollout])
    assert all(Path(path).read_bytes() == bytes(HEADER_BYTES + 128) for path in small)


# -- plans by id: posted once, named in every sync ------------------------------------------------

@pytest.mark.parametrize("name", TRANSPORTS)
def test_an_unchanged_plan_is_posted_once_and_each_sync_names_it_by_its_id(name: str) -> None:
    from backends.engines.control import ControlStore

    posted: list[int] = []
    named: list[bytes] = []
    sets = ControlStore.set

    def setting(self: ControlStore, key: str, value: bytes | str) -> None:
        if key == "plan":
            named.append(value if isinstance(value, bytes) else value.encode())
        sets(self, key, value)

    sender, receivers = new_engine(name), [new_engine(name), new_engine(name)]
    port = free_port()
    plans = ControlStore.plans

    class Recording:
        """The store's plans, each write counted."""

        def __init__(self, plans: Any) -> None:
            self.plans = plans

        def set(self, key: str, value: bytes) -> None:
            posted.append(len(value))
            self.plans.set(key, value)

        def __getattr__(self, attribute: str) -> Any:
            return getattr(self.plans, attribute)

    recording = property(lambda control: Recording(plans.fget(control)))
    ControlStore.plans = recording  # type: ignore[method-assign,assignment]
    ControlStore.set = setting  # type: ignore[method-assign]
    try:
        for version in (1, 2, 3):
            run = sync_threads(sender, receivers[:1 + (version > 1)], mixed_tensors(version), port=port,
                               version=version)
            assert run.error is None and run.errors == [None] * len(run.errors), (run.error, run.errors)
        run = sync_threads(sender, receivers, [*mixed_tensors(4), ("extra", torch.ones(3))], port=port, version=4)
        assert run.error is None and run.versions == [4, 4]
    finally:
        ControlStore.set = sets  # type: ignore[method-assign]
        ControlStore.plans = plans  # type: ignore[method-assign]
        for engine in (sender, *receivers):
            engine.close()
    assert len(posted) == 2  # once, and once more when it changed
    assert len(named) == 4 and all(len(value) < 100 < min(posted) for value in named)
    assert len(set(named)) == 2  # syncs 1-3 name one plan (the second receiver, new at 2, read it from the
    # store), sync 4 another


def _storing(name: str, stored: bytes) -> CheckpointEngine:
    """A sender that names its plan by its id but stores `stored` under that id."""
    from backends.engines.control import ControlStore, plan_id

    sender = new_engine(name, timeout_s=TIMEOUT_S)

    def publish(control: ControlStore, raw: bytes) -> str:
        control.plans.set(plan_id(raw), stored)
        return plan_id(raw)

    sender._link.publish = publish  # type: ignore[attr-defined]
    return sender


@pytest.mark.parametrize("name", TRANSPORTS)
@pytest.mark.parametrize(("how", "reason"), [
    ("other bytes under its id", r"the plan stored under its id [0-9a-f]{32} has another id \([0-9a-f]{32}\)"),
    ("an id that is no id", r"it names its plan by 'ZZ', not by 32 lowercase hex digits"),
    ("an older format", r"it is in wire format 5 and this receiver reads format 6"),
])
def test_a_plan_named_by_an_id_it_does_not_hash_to_or_by_no_id_is_refused_before_a_byte_moves(
    name: str, how: str, reason: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    import backends.engines.pipeline as pipeline

    other = json.dumps({"format": 6, "bucket_bytes": 4096, "verify": True, "tensors": [], "buckets": []}).encode()
    sender = _storing(name, other) if how == "other bytes under its id" else new_engine(name, timeout_s=TIMEOUT_S)
    if how == "an id that is no id":
        monkeypatch.setattr(pipeline, "reference", lambda ident: b'{"format": 6, "id": "ZZ"}')
    elif how == "an older format":
        monkeypatch.setattr(pipeline, "reference", lambda ident: json.dumps({"format": 5, "id": ident}).encode())
    rollouts = [old_rollout(), old_rollout()]
    run = sync_threads(sender, _engines(name), mixed_tensors(), rollouts)
    _assert_refused(run, name, reason, rollouts)


# -- a plan someone else named: the sender checks which plan each receiver took ------------------

_TWINS = [("w0", torch.arange(300.0)), ("w1", -torch.arange(300.0)), ("w2", torch.ones(50))]
"""Two tensors of one shape and dtype: a plan that swaps their names fits every receiver check."""


def _forged(name: str, monkeypatch: pytest.MonkeyPatch) -> CheckpointEngine:
    """A sender whose sync's `plan` key names a forged plan, as another writer of the store can
    make it (it reaches the port): the sender's own plan with w0's and w1's names swapped, posted
    under its own id. The sender goes on with the plan it posted."""
    import backends.engines.pipeline as pipeline
    from backends.engines.control import ControlStore, plan_id, reference

    sender, forged = new_engine(name, timeout_s=TIMEOUT_S), []
    publish = sender._link.publish  # type: ignore[attr-defined]

    def forging(control: ControlStore, raw: bytes) -> str:
        swapped = raw.replace(b'"w0"', b'"tmp"').replace(b'"w1"', b'"w0"').replace(b'"tmp"', b'"w1"')
        assert swapped != raw
        control.plans.set(plan_id(swapped), swapped)
        forged.append(plan_id(swapped))
        return publish(control, raw)

    sender._link.publish = forging  # type: ignore[attr-defined]
    monkeypatch.setattr(pipeline, "reference", lambda ident: reference(forged[-1]))
    return sender


@pytest.mark.parametrize("name", TRANSPORTS)
def test_a_receiver_that_accepted_another_plan_than_the_sender_posted_is_refused_naming_it(
        name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both sides reported success while the rollout served w0's values as w1 and w1's as w0:
    the sender never asked which plan a receiver took. An acceptance names its plan now."""
    rollout = old_rollout()
    run = sync_threads(_forged(name, monkeypatch), _engines(name, 1), _TWINS, [rollout])
    assert run.seconds < HANG_GUARD_S
    assert isinstance(run.error, EngineError), run.error
    assert re.match(rf"{name} engine: rank 1 accepted '[0-9a-f]{{32}}', not the plan [0-9a-f]{{32}} of weights v1 "
                    r"this sender posted \(someone else wrote the sync's 'plan'\); nothing was sent", str(run.error))
    assert isinstance(run.errors[0], EngineError), run.errors[0]
    assert_kept_old_weights(rollout)


@pytest.mark.parametrize("name", TRANSPORTS)
def test_buckets_checked_against_another_plan_than_they_were_sent_under_fail_their_checksum(
        name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Should a forger also get past the check above (say, by forging the acceptance), every
    bucket's checksum is keyed by the plan's id: the bytes, the same, fail it."""
    import backends.engines.pipeline as pipeline

    sender = _forged(name, monkeypatch)
    monkeypatch.setattr(pipeline, "echoed", lambda raw, key: sender._plan)  # type: ignore[attr-defined]
    rollout = old_rollout()
    run = sync_threads(sender, _engines(name, 1), _TWINS, [rollout])
    assert run.seconds < HANG_GUARD_S
    assert isinstance(run.errors[0], EngineError), run.errors[0]
    assert re.match(rf"{name} engine: bucket 0 of 1 failed its checksum", str(run.errors[0])), str(run.errors[0])
    assert isinstance(run.error, EngineError) and "rank 1: " in str(run.error), run.error
    assert_kept_old_weights(rollout)
