"""The three transition tables, as data: the trainer's lifecycle, a rollout's weights, the Ray driver's run.

Each table is the whole contract of its machine; `lifecycle.table.Table` derives the
`transitions` machine, the allowed triggers and the Mermaid diagram from it, the same way for
all three (`python -m lifecycle diagram --machine trainer|rollout|driver`). The machines that
run them: `lifecycle.Lifecycle` (trainer), `lifecycle.rollout.RolloutWeights` (rollout) and
`lifecycle.ray.Driver` (driver), all through `lifecycle.stateful.Stateful` and `phase.Phase`.
"""

from __future__ import annotations

from enum import Enum

from transitions import Machine

from lifecycle.errors import LifecycleError
from lifecycle.table import DONE, FAIL, Row, Table
from lifecycle.table import MachineModel as _Model


class State(Enum):
    """A trainer worker's lifecycle state; `working` states are the ones a phase runs in."""

    CREATED = "created"
    LOADING = "loading"
    READY = "ready"
    TRAINING = "training"
    SAVING = "saving"
    SYNCING = "syncing"
    RESUMING = "resuming"
    FAILED = "failed"
    CLOSED = "closed"

    @property
    def working(self) -> bool:
        return self in WORKING

    @property
    def terminal(self) -> bool:
        return self in TRAINER.terminal


S = State
TABLE: tuple[Row[State], ...] = (
    Row("init_load", (S.CREATED,), S.LOADING, S.READY, S.FAILED),
    Row("train_step", (S.READY,), S.TRAINING, S.READY, S.FAILED),
    Row("save", (S.READY,), S.SAVING, S.READY, S.FAILED),
    Row("sync_weights", (S.READY,), S.SYNCING, S.READY, S.FAILED),
    Row("resume", (S.CREATED, S.FAILED), S.RESUMING, S.READY, S.FAILED),
    Row("close", (S.CREATED, S.READY, S.FAILED), None, S.CLOSED, None),
)
"""The trainer's whole contract. The machine, `allowed_triggers` and the Mermaid diagram read it."""


class MachineModel(_Model):
    """The object `transitions` drives for a trainer; the stubs let type checkers see the triggers."""

    state: State

    def init_load(self) -> bool: raise NotImplementedError  # noqa: E704
    def train_step(self) -> bool: raise NotImplementedError  # noqa: E704
    def save(self) -> bool: raise NotImplementedError  # noqa: E704
    def sync_weights(self) -> bool: raise NotImplementedError  # noqa: E704
    def resume(self) -> bool: raise NotImplementedError  # noqa: E704
    def close(self) -> bool: raise NotImplementedError  # noqa: E704


TRAINER: Table[State] = Table("trainer", State, TABLE, initial=State.CREATED, model=MachineModel)
ROWS: dict[str, Row[State]] = TRAINER.by_trigger
WORKING: frozenset[State] = TRAINER.working
NAMES: dict[State, str] = TRAINER.names


class RolloutState(Enum):
    """A rollout's weights: whether it holds whole weights of one version, and may serve them."""

    EMPTY = "empty"
    """No policy weights received yet: it must be synced before it generates."""
    RECEIVING = "receiving"
    """A sync is landing: paused, the weights are half old, half new until it ends."""
    SERVING = "serving"
    """Whole weights of `weights_version`: the only state generation starts from."""
    GENERATING = "generating"
    """Generating from the weights it serves; no sync may land meanwhile."""
    STALE = "stale"
    """A sync failed part-way (or the rollout was marked stale): refuses to serve until one lands."""
    CLOSED = "closed"

    @property
    def serves(self) -> bool:
        return ROLLOUT.allows("generate", self)

    @property
    def terminal(self) -> bool:
        return self in ROLLOUT.terminal


R = RolloutState
ROLLOUT_TABLE: tuple[Row[RolloutState], ...] = (
    Row("receive_weights", (R.EMPTY, R.SERVING, R.STALE), R.RECEIVING, R.SERVING, R.STALE),
    Row("generate", (R.SERVING,), R.GENERATING, R.SERVING, R.SERVING),
    Row("mark_stale", (R.EMPTY, R.SERVING, R.STALE), None, R.STALE, None),
    Row("close", (R.EMPTY, R.SERVING, R.STALE), None, R.CLOSED, None),
)
"""The rollout's contract: the version changes only on `receive_weights`' done edge into SERVING;
a receive that fails lands in STALE with the old version; a failed generate leaves the weights
as they were (SERVING)."""


class RolloutModel(_Model):
    state: RolloutState

    def receive_weights(self) -> bool: raise NotImplementedError  # noqa: E704
    def generate(self) -> bool: raise NotImplementedError  # noqa: E704
    def mark_stale(self) -> bool: raise NotImplementedError  # noqa: E704
    def close(self) -> bool: raise NotImplementedError  # noqa: E704


ROLLOUT: Table[RolloutState] = Table("rollout", RolloutState, ROLLOUT_TABLE, initial=R.EMPTY, model=RolloutModel)


class DriverState(Enum):
    """The Ray driver's run, in the shape of Ray Train v2's controller states."""

    CREATED = "created"
    INITIALIZING = "initializing"
    """Ray up, the first worker group built, resumed and synced (restarts here as the policy allows)."""
    RUNNING = "running"
    """Steps: generate, score, train, sync, save."""
    RECOVERING = "recovering"
    """After a failure the policy retries: the group torn down, rebuilt, resumed and synced."""
    FINISHING = "finishing"
    """The last step ran: every trainer closes (pending async saves commit)."""
    FINISHED = "finished"
    ERRORED = "errored"

    @property
    def terminal(self) -> bool:
        return self in DRIVER.terminal


D = DriverState
DRIVER_TABLE: tuple[Row[DriverState], ...] = (
    Row("start", (D.CREATED,), D.INITIALIZING, D.RUNNING, D.ERRORED),
    Row("recover", (D.RUNNING,), D.RECOVERING, D.RUNNING, D.ERRORED),
    Row("finish", (D.RUNNING,), D.FINISHING, D.FINISHED, D.ERRORED),
    Row("give_up", (D.RUNNING,), None, D.ERRORED, None),
)
"""The driver's contract: a failure in RUNNING is `recover` when the `FailurePolicy` retries it
and `give_up` when it does not; one while initializing or recovering is retried inside that
phase or fails it (ERRORED)."""


class DriverModel(_Model):
    state: DriverState

    def start(self) -> bool: raise NotImplementedError  # noqa: E704
    def recover(self) -> bool: raise NotImplementedError  # noqa: E704
    def finish(self) -> bool: raise NotImplementedError  # noqa: E704
    def give_up(self) -> bool: raise NotImplementedError  # noqa: E704


DRIVER: Table[DriverState] = Table("driver", DriverState, DRIVER_TABLE, initial=D.CREATED, model=DriverModel)

MACHINES: dict[str, Table] = {"trainer": TRAINER, "rollout": ROLLOUT, "driver": DRIVER}  # type: ignore[type-arg]
"""Every table by name, for `python -m lifecycle diagram --machine NAME`."""


def machine_transitions() -> list[dict[str, object]]:
    """The trainer's table in `transitions` form."""
    return TRAINER.transitions()


def build_machine(model: MachineModel, initial: State = State.CREATED) -> Machine:
    return TRAINER.build(model, initial)


def allowed_triggers(state: State) -> list[str]:
    """The trainer's triggers that may fire from `state` (the internal done/fail are not listed)."""
    return TRAINER.allowed(state)


def mermaid(machine: str = "trainer") -> str:
    """A machine (trainer, rollout or driver) as a Mermaid state diagram, generated from its table."""
    if machine not in MACHINES:
        raise LifecycleError(f"mermaid({machine!r}): no such machine; there are {', '.join(sorted(MACHINES))}")
    return MACHINES[machine].mermaid()


__all__ = [
    "DONE", "DRIVER", "DRIVER_TABLE", "FAIL", "MACHINES", "NAMES", "ROLLOUT", "ROLLOUT_TABLE", "ROWS", "TABLE",
    "TRAINER", "WORKING", "DriverModel", "DriverState", "MachineModel", "RolloutModel", "RolloutState", "Row",
    "State", "allowed_triggers", "build_machine", "machine_transitions", "mermaid",
]
