"""Across the ranks of a role, the verdict on a step is agreed: when one rank finds damage that
the others do not see (its own read failed), every rank falls back to the same older step,
and the damaged step is set aside once. Two gloo ranks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.backends.dist_util import run_ranks
from tests.lifecycle.hostile import ROLE, fill, has_weights_of, lifecycle_at


def _one_rank_sees_damage(rank: int, world_size: int, tmp_path: Path) -> dict[str, Any]:
    import lifecycle.resumer as resumer

    root = tmp_path / "ckpt"
    lc = lifecycle_at(root)
    lc.init_load()
    for step in (1, 2):
        fill(lc.parts.model, step)
        lc.save(step)
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
