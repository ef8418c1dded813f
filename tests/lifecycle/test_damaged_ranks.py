"""Across the ranks of a role, the verdict on a step is agreed: when one rank finds damage that
the others do not see (its own read failed), every rank falls back to the same older step,
and the damaged step is set aside once. Two gloo ranks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.backends.dist_util import run_ranks
from tests.lifecycle.hostile import ROLE, fill, has_weights_of, lifecycle_at


def _saved_steps_1_and_2(root: Path) -> Any:
    """A lifecycle over `root` that saved steps 1 and 2, each with weights filled by its step."""
    lc = lifecycle_at(root)
    lc.init_load()
    for step in (1, 2):
        fill(lc.parts.model, step)
        lc.save(step)
    return lc


def _one_rank_sees_damage(rank: int, world_size: int, tmp_path: Path) -> dict[str, Any]:
    import lifecycle.resumer as resumer

    root = tmp_path / "ckpt"
    lc = _saved_steps_1_and_2(root)
    lc.close()
    if rank == 1:
        check_folder = resumer.check_folder

        def sees_damage(folder: Path, **kwargs: Any) -> list[str]:
            problems = check_folder(folder, **kwargs)
            return problems + ([f"{folder}: unreadable on rank 1 (injected)"] if "global_step_2" in str(folder)
                               else [])

        resumer.check_folder = sees_damage  # type: ignore[assignment]
    again = lifecycle_at(root)
    step = again.resume()
    return {"step": step, "exact": has_weights_of(again.parts.model, step),
            "aside": sorted(p.name.split(".damaged-")[0] for p in root.glob("*.damaged-*"))}


def test_ranks_agree_to_fall_back_when_one_rank_finds_damage(tmp_path: Path) -> None:
    ranks = run_ranks(_one_rank_sees_damage, tmp_path, world_size=2, timeout_s=120)
    assert [r["step"] for r in ranks] == [1, 1] and all(r["exact"] for r in ranks)
    assert ranks[0]["aside"] == ["global_step_2"]
    assert not (tmp_path / "ckpt" / "global_step_2").exists()
    assert (tmp_path / "ckpt" / "global_step_1" / ROLE / "manifest.json").is_file()


def _rank0_commit_fails_over_an_existing_folder(rank: int, world_size: int, tmp_path: Path) -> dict[str, Any]:
    """Step 2 is committed, then saved again; rank 0's second commit fails after the old folder
    was there all along, which a peer looking for a manifest would take for success."""
    import lifecycle.store as store

    root = tmp_path / "ckpt"
    lc = _saved_steps_1_and_2(root)
    if rank == 0:
        def full_disk(*args: Any, **kwargs: Any) -> None:
            raise OSError(28, "No space left on device")

        store.build_manifest = full_disk  # type: ignore[assignment]
    fill(lc.parts.model, 3)
    try:
        lc.save(2)
        error = None
    except Exception as exc:  # noqa: BLE001 - reported to the test
        error = f"{type(exc).__name__}: {exc}"
    lc.close()
    again = lifecycle_at(root)
    step = again.resume()
    return {"error": error, "step": step, "exact": has_weights_of(again.parts.model, 2)}


def test_peers_learn_that_rank0_could_not_commit_even_over_an_existing_step(tmp_path: Path) -> None:
    failing, peer = run_ranks(_rank0_commit_fails_over_an_existing_folder, tmp_path, world_size=2, timeout_s=120)
    assert "No space left on device" in failing["error"]
    assert peer["error"] is not None and "rank 0 did not commit step 2" in peer["error"]
    assert failing["step"] == peer["step"] == 2 and failing["exact"] and peer["exact"]
