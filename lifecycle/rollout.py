"""`RolloutWeights`: the receiving side of a weight sync, as a machine (`lifecycle.machine.ROLLOUT_TABLE`).

A rollout may generate only from weights it received whole, of a version it knows. Plain
`stale` / `paused` / `weights_version` fields leave that to every caller's discipline; here
the table decides it: generation starts from SERVING only, a receive that fails or ends early
lands in STALE with the old version, and the version changes on one edge, RECEIVING -> SERVING,
nowhere else. Each receive and each generation is a phase (`phase.Phase`, through
`stateful.Stateful`): one `lifecycle.transition` record, a watchdog budget
(`watchdog.receive_weights_s`, `watchdog.generate_s`), a history, observers, trace events.

`backends.engines.receive_into(engine, weights, ...)` drives it as it drives any rollout:
`types.updating` sees `receiving()` and lets the machine bracket the update.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from lifecycle.errors import EngineError, LifecycleError, check_callable, shorten
from lifecycle.machine import ROLLOUT, RolloutState
from lifecycle.phase import Observer, Phase
from lifecycle.records import guarded
from lifecycle.stateful import Stateful
from lifecycle.types import MAX_VERSION, is_version
from lifecycle.watchdog import Emit, Watchdog

Loader = Callable[[Iterable[tuple[str, Any]]], None]
"""Copies each named tensor into the rollout's model as it comes (see `RolloutTarget.load_weights`)."""

_WHOLE = frozenset({RolloutState.SERVING, RolloutState.GENERATING})


class RolloutWeights(Stateful[RolloutState]):
    """Which weights a rollout holds and whether it may serve them.

    `load` copies tensors into the model (the rollout's own code); `rank` is the rollout's index,
    which its errors name (`rollout 1: ...`); `budget` gives a trigger's watchdog budget (a worker
    passes `config.watchdog.budget`), None watches nothing; `on_overdue` takes the watchdog's
    reports of its phases (see `stateful.Stateful`).
    """

    def __init__(self, load: Loader, *, role: str = "rollout", rank: int = 0,
                 budget: Callable[[str], float | None] | None = None, observers: Iterable[Observer] = (),
                 history_limit: int = 10_000, watchdog: Watchdog | None = None,
                 on_overdue: Emit | None = None) -> None:
        super().__init__(ROLLOUT, role=role, rank=rank, observers=observers, history_limit=history_limit,
                         watchdog=watchdog, on_overdue=on_overdue)
        check_callable("load", load, "load(named_tensors)", optional=False)
        check_callable("budget", budget, "budget(trigger) -> seconds or None")
        self._load = load
        self._budgets = budget
        self._version = 0
        self._landed: int | None = None
        self._receiver: int | None = None
        """The thread running the receive, set and cleared with the moves in and out of RECEIVING."""

    @property
    def weights_version(self) -> int:
        """The version of the whole weights held; changes only on the edge into SERVING."""
        return self._version

    @property
    def stale(self) -> bool:
        """True unless it holds whole weights (SERVING, GENERATING): nothing landed yet, one is
        landing, or the last one failed part-way."""
        return self.state not in _WHOLE

    @property
    def serves(self) -> bool:
        """Whether `generating()` may start now (the table's sources of `generate`)."""
        return self.state.serves

    def load_weights(self, named_tensors: Iterable[tuple[str, Any]]) -> None:
        """Called by the engine inside `receiving()`; refused outside it."""
        if self.state is not RolloutState.RECEIVING:
            raise LifecycleError(f"rollout {self.rank}: load_weights outside a receive (state "
                                 f"{self.state.name}): weights land through receiving() only")
        self._load(named_tensors)

    @contextmanager
    def receiving(self) -> Iterator[Callable[[int], None]]:
        """One update, as the `receive_weights` phase: -> RECEIVING -> SERVING, or STALE.

        Yields `landed(version)`, to call once the last tensor is in, from the thread that
        receives. The version is taken on the edge into SERVING; one lower than the version held
        is taken too (a resumed policy may go back) and logged (`rollout.version_backwards`). A
        block that raises, or ends without calling `landed`, leaves the rollout STALE with the
        version it had.
        """
        with Phase(self, "receive_weights", None) as phase:
            phase.figures["version"] = self._version
            yield self._land
            if self._landed is None:
                raise EngineError(f"rollout {self.rank}: the update ended before its last tensor landed; it holds "
                                  f"a partial update of v{self._version}")
            phase.figures["version"] = self._landed

    def generating(self, step: int | None = None) -> Phase:
        """SERVING -> GENERATING -> SERVING around the caller's generation; refused from any other state.

        A generation that raises leaves the weights as they were: it ends in SERVING too. A `step`
        is an int as a train step's (`Stateful._step`), refused before the machine moves.
        """
        return _Generation(self, None if step is None else self._step("generating", step))

    def mark_stale(self) -> None:
        """-> STALE: the weights held must not be served (the next receive repairs them)."""
        with Phase(self, "mark_stale", None) as phase:
            phase.figures["version"] = self._version

    def close(self) -> None:
        with Phase(self, "close", None):
            pass

    def _land(self, version: int) -> None:
        if not is_version(version):
            raise EngineError(f"rollout {self.rank}: landed({shorten(version)}): a weights version is an int in "
                              f"0..{MAX_VERSION}")
        version = int(version)
        if self.state is not RolloutState.RECEIVING:
            raise LifecycleError(f"rollout {self.rank}: landed(v{version}) outside its receive (state "
                                 f"{self.state.name})")
        if threading.get_ident() != self._receiver:
            raise LifecycleError(f"rollout {self.rank}: landed(v{version}) from thread "
                                 f"{threading.current_thread().name!r} during another thread's receive: only the "
                                 "thread that runs a receive lands it")
        if version < self._version:
            guarded(self._log.warning, "rollout.version_backwards", role=self.role, rank=self.rank,
                    old=self._version, new=version)  # a failing log sink costs the line, not the receive
        self._landed = version

    def _budget(self, trigger: str) -> float | None:
        return None if self._budgets is None else self._budgets(trigger)

    def _moved(self, src: RolloutState, dst: RolloutState) -> None:
        if dst is RolloutState.RECEIVING:
            self._landed, self._receiver = None, threading.get_ident()
        elif src is RolloutState.RECEIVING:
            if dst is RolloutState.SERVING and self._landed is not None:
                self._version = self._landed
            self._landed, self._receiver = None, None


class _Generation(Phase):
    """The `generate` phase; its version figure is read once the machine is in GENERATING,
    where no receive can change it until the phase ends."""

    __slots__ = ("_weights",)

    def __init__(self, weights: RolloutWeights, step: int | None) -> None:
        super().__init__(weights, "generate", step)
        self._weights = weights

    def _begun(self) -> None:  # inside the begin's `try`: an interrupt here fails the phase, never leaves it running
        self.figures["version"] = self._weights.weights_version


__all__ = ["Loader", "RolloutWeights"]
