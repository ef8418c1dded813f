"""Hang guards for tests: a call that blocks fails the test instead of the suite."""

from __future__ import annotations

import threading
from collections.abc import Callable


def within(seconds: float, work: Callable[[], object]) -> object:
    """Run `work` on a thread and return its value (or raise its error); fail the test when it
    has not finished after `seconds` (the thread is a daemon, left to the process's exit)."""
    box: dict[str, object] = {}

    def run() -> None:
        try:
            box["value"] = work()
        except BaseException as exc:  # noqa: BLE001  (handed to the test thread)
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"blocked for more than {seconds} s"
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box.get("value")
