"""A rank whose part of a save fails (its write, or creating the staging folder) stops its
peers at once, instead of leaving them in a barrier until the process group's timeout;
nothing is committed, the previous step stays the newest. Two gloo ranks; `hf` writes the
weights from rank 0 alone, so a rank-0 failure is the case that used to leave rank 1 waiting.
"""

from __future__ import annotations

import time
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from lifecycle.store import CheckpointStore
from tests.backends.dist_util import run_ranks
from tests.lifecycle.test_crash import ROLE, fill, lifecycle_at

PG_TIMEOUT_S = 30.0
"""What `run_ranks` gives the group (half its deadline): a rank left in a barrier waits this long."""


def _rank0_write_fails(rank: int, world_size: int, tmp_path: Path, *, mode: str, where: str) -> dict[str, Any]:
    import torch.distributed as dist

    from backends.hf import HFBackend

    lc, model = lifecycle_at(tmp_path / "ckpt", save={"async": mode == "async"})
    lc.init_load()
    fill(model, 1)
    _saved(lc.save(1))
    if rank == 0 and where == "write":
        def disk_full(self: HFBackend, model: Any, folder: Path) -> None:
            raise OSError("No space left on device (injected)")

        HFBackend.save_model = disk_full  # type: ignore[method-assign]
    if rank == 0 and where == "staging":
        mkdir = Path.mkdir

        def refused(self: Path, *args: Any, **kwargs: Any) -> None:
            if self.name.startswith(".staging-"):
                raise PermissionError(f"[Errno 13] Permission denied (injected): {self}")
            mkdir(self, *args, **kwargs)

        Path.mkdir = refused  # type: ignore[method-assign]
    fill(model, 2)
    started = time.monotonic()
    error = None
    try:
        _saved(lc.save(2))
    except Exception as exc:  # noqa: BLE001 - reported to the test
        error = f"{type(exc).__name__}: {exc}"
    seconds = time.monotonic() - started
    dist.barrier()  # both ranks go on, as a training loop would: a rank that exited would unblock its peer
    return {"error": error, "seconds": seconds, "state": lc.state.name,
            "newest": CheckpointStore(tmp_path / "ckpt").newest_complete([ROLE])}


def _saved(info: Any) -> None:
    """An async save returns a `PendingSave`: wait for its commit (or its failure)."""
    if hasattr(info, "wait"):
        info.wait(PG_TIMEOUT_S)


@pytest.mark.parametrize(("mode", "where"), [("sync", "write"), ("async", "write"), ("sync", "staging"),
                                             ("async", "staging")])
def test_a_rank_whose_write_fails_stops_its_peers_before_the_commit(mode: str, where: str, tmp_path: Path) -> None:
    rank_fn = partial(_rank0_write_fails, mode=mode, where=where)
    failing, peer = run_ranks(rank_fn, tmp_path, world_size=2, timeout_s=2 * PG_TIMEOUT_S)
    injected = "No space left on device (injected)" if where == "write" else "Permission denied (injected)"
    assert injected in failing["error"]
    told = "1 other rank(s)" if where == "write" else "rank 0 could not prepare the staging folder"
    assert peer["error"].startswith("CheckpointError: ") and told in peer["error"]
    assert "step 2" in peer["error"]
    for rank in (failing, peer):
        assert rank["seconds"] < PG_TIMEOUT_S / 3 and rank["newest"] == 1
    failed_in_the_background = mode == "async" and where == "write"
    assert failing["state"] == peer["state"] == ("READY" if failed_in_the_background else "FAILED")
