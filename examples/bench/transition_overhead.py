"""Microseconds per full lifecycle transition against one bare `transitions` trigger.

A full transition is begin + done with the undo stack, contextvars, the history entry and
one `lifecycle.transition` record rendered as JSON to a null sink. Run:

    python examples/bench/transition_overhead.py [--n 20000]
"""

from __future__ import annotations

import argparse
import enum
import os
import time
from collections.abc import Sequence
from typing import Callable

from record import Figure, add_write_docs, at_least, positive_int, write_docs
from transitions import Machine

from lifecycle import Lifecycle
from lifecycle.logging import configure
from lifecycle.testing import MemoryCheckpointer


class _Bare(enum.Enum):
    A = 1
    B = 2


def _bare_trigger() -> Callable[[int], float]:
    class Model:
        pass

    model = Model()
    Machine(model=model, states=_Bare, initial=_Bare.A, auto_transitions=False,
            transitions=[{"trigger": "go", "source": _Bare.A, "dest": _Bare.B},
                         {"trigger": "back", "source": _Bare.B, "dest": _Bare.A}])

    def run(n: int) -> float:
        t0 = time.perf_counter()
        for _ in range(n // 2):
            model.go()
            model.back()
        return (time.perf_counter() - t0) / (2 * (n // 2))

    return run


def _full_transition() -> Callable[[int], float]:
    lc = Lifecycle(role="bench", checkpointer=MemoryCheckpointer(), history_limit=1000)
    lc.init_load()

    def run(n: int) -> float:
        t0 = time.perf_counter()
        for step in range(n):
            with lc.train_step(step):
                pass
        return (time.perf_counter() - t0) / n

    return run


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--n", type=at_least(2), default=20_000,
                        help="transitions per round (at least 2: the bare machine goes there and back)")
    parser.add_argument("--rounds", type=positive_int, default=7)
    add_write_docs(parser)
    args = parser.parse_args(argv)
    with open(os.devnull, "w") as sink:
        configure(json=True, file=sink)
        bare, full = _bare_trigger(), _full_transition()
        bare(2000), full(2000)
        rounds = [(bare(args.n), full(args.n)) for _ in range(args.rounds)]
    bare_us = min(b for b, _ in rounds) * 1e6
    full_us = min(f for _, f in rounds) * 1e6
    ratio = full_us / bare_us
    print(f"{args.rounds} interleaved rounds of {args.n}; best round of each (least disturbed by other load)")
    print(f"bare transitions trigger : {bare_us:7.2f} us")
    print(f"full lifecycle transition: {full_us:7.2f} us  (begin + done, JSON record to a null sink)")
    print(f"ratio                    : {ratio:7.2f}x  (target <= 3x and < 50 us: "
          f"{'met' if ratio <= 3 and full_us < 50 else 'NOT met'})")
    write_docs(args, "transition_overhead.py", [Figure(
        "one full transition (begin + done, undo stack, contextvars, history entry, JSON record to a null "
        "sink) against one bare `transitions` trigger", f"{full_us:.1f} us", f"{bare_us:.1f} us", f"{ratio:.2f}x",
        "<= 3x and < 50 us")])


if __name__ == "__main__":
    main()
