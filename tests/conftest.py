from __future__ import annotations

import importlib.util
import os
import signal
import sys
import time
import uuid
from collections.abc import Iterator

import pytest
import torch

RUN_MARK = "TRAINER_LIFECYCLE_TEST_RUN"
"""Set in this pytest's environment: every process the run starts inherits it (ranks, their
grandchildren, Ray's processes), including the ones re-parented to init when their parent died."""
LEFTOVER_GRACE_S = 15.0
"""How long processes may take to end on their own after the last test (Ray's, after `ray.shutdown()`)."""
ENDS_WITH_PYTEST = ("multiprocessing.resource_tracker", "multiprocessing.forkserver")
"""Children of pytest itself that end when pytest does (once no leftover holds their pipe)."""


def pytest_configure(config: pytest.Config) -> None:
    os.environ[RUN_MARK] = f"{os.getpid()}-{uuid.uuid4().hex}"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `gpu` need CUDA; without it they are skipped, never run half-way."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (gpu marker)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _started_by_this_run() -> dict[int, str]:
    """pid -> description of every live process this run started, other than the ones that end with pytest."""
    import psutil

    me = psutil.Process()
    mark = os.environ.get(RUN_MARK)
    found: dict[int, psutil.Process] = {p.pid: p for p in me.children(recursive=True)}
    for proc in psutil.process_iter():
        if proc.pid == me.pid or proc.pid in found:
            continue
        try:
            if mark and proc.environ().get(RUN_MARK) == mark:
                found[proc.pid] = proc
        except psutil.Error:
            continue  # gone, a zombie, or not ours to read
    out: dict[int, str] = {}
    for pid, proc in found.items():
        try:
            if proc.status() == psutil.STATUS_ZOMBIE:
                continue
            cmd = " ".join(proc.cmdline())
            if proc.ppid() == me.pid and any(helper in cmd for helper in ENDS_WITH_PYTEST):
                continue
            try:
                test = proc.environ().get("PYTEST_CURRENT_TEST", "?")
            except psutil.Error:
                test = "?"
            age = time.time() - proc.create_time()
            out[pid] = (f"pid {pid} (ppid {proc.ppid()}, pgid {os.getpgid(pid)}, {age:.0f}s old, started during "
                        f"{test}): {cmd[:200]}")
        except (psutil.Error, ProcessLookupError):
            continue
    return out


def _say(pytestconfig: pytest.Config, text: str) -> None:
    """A line on the terminal from a fixture's teardown, which output capture would swallow."""
    reporter = pytestconfig.pluginmanager.get_plugin("terminalreporter")
    capture = pytestconfig.pluginmanager.get_plugin("capturemanager")
    if reporter is None or capture is None:
        return
    with capture.global_and_fixture_disabled():
        reporter.write_line(f"\n{text}")


@pytest.fixture(scope="session", autouse=True)
def _no_process_outlives_the_run(pytestconfig: pytest.Config) -> Iterator[None]:
    """After the last test, no process the run started may be left: the ones still there after a grace
    period (Ray's take a moment to end after `ray.shutdown()`) are killed, and the run fails naming them."""
    yield
    if sys.platform == "win32":
        return
    if importlib.util.find_spec("psutil") is None:
        _say(pytestconfig, "leftover-process check skipped: psutil is not installed (it comes with the megatron "
                           "extra: pip install 'trainer-lifecycle[megatron]')")
        return
    started = time.monotonic()
    left = first = _started_by_this_run()
    while left and time.monotonic() - started < LEFTOVER_GRACE_S:
        time.sleep(0.5)
        left = _started_by_this_run()
    if first and not left:
        _say(pytestconfig, f"{len(first)} process(es) started by the run ended by themselves "
                           f"{time.monotonic() - started:.1f}s after the last test")
        return
    if not left:
        return
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    listing = "\n".join(left.values())
    pytest.fail(f"{len(left)} process(es) started by this test run were still alive {LEFTOVER_GRACE_S:.0f}s after "
                f"the last test; killed now:\n{listing}", pytrace=False)


@pytest.fixture(autouse=True)
def _end_children() -> Iterator[None]:
    """The children a test registered in `tests.children.STARTED` end with it, however it ends."""
    yield
    from tests.children import end_started

    end_started()
