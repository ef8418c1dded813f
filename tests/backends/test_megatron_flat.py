"""A Megatron model flattened by `flatten_parameters` trains, saves and resumes through both
Megatron formats (mbridge and dist_ckpt) bit for bit, and stays flat: the resumed weights
land in the flat storage, not in tensors of their own. Two gloo ranks at TP=2 on CPU
(MEGATRON_ON_CPU.md); the plain torch formats are covered in engines/test_flat.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.backends.dist_util import run_ranks
from tests.backends.megatron_util import make_hf_checkpoint, train_steps, weights_and_moments

pytest.importorskip("megatron.core")
pytest.importorskip("mbridge")
pytestmark = pytest.mark.transformers


def _lifecycle(model: Any, optimizer: Any, tmp: Path, **checkpoint: Any) -> Any:
    from lifecycle import Lifecycle

    fmt = (tmp / "format").read_text()
    cfg = {"checkpoint": {"root": str(tmp / "ckpt"), "save": {"format": fmt}, **checkpoint}}
    return Lifecycle(cfg, role="actor", model=model, optimizer=optimizer)


def _flat_train_save_resume(rank: int, world_size: int, tmp: Path) -> dict[str, Any]:
    from megatron.core import parallel_state

    from backends.engines import contiguous_layout, flatten_parameters
    from backends.megatron import build_model

    model = build_model(tmp / "hf", tp=2)
    flatten_parameters(model)
    optimizer = torch.optim.AdamW(list(model.parameters()), lr=0.01)
    lc = _lifecycle(model, optimizer, tmp, pre_load={"path": str(tmp / "hf")})
    lc.init_load()
    train_steps(lc, model, optimizer)
    lc.save(2)
    lc.close()
    saved = weights_and_moments(model, optimizer)
    parallel_state.destroy_model_parallel()

    torch.manual_seed(99 + rank)
    fresh = build_model(tmp / "hf", tp=2)
    layout = flatten_parameters(fresh)
    fresh_opt = torch.optim.AdamW(list(fresh.parameters()), lr=0.01)
    step = _lifecycle(fresh, fresh_opt, tmp).resume()
    resumed = weights_and_moments(fresh, fresh_opt)
    return {"step": step, "differ": [key for key, want in saved.items() if not torch.equal(want, resumed[key])],
            "flat": layout.describes(fresh) and contiguous_layout(fresh) == layout,
            "storages": len({p.untyped_storage().data_ptr() for p in fresh.parameters()})}


@pytest.mark.parametrize("fmt", ["mbridge", "dist_ckpt"])
def test_a_flattened_megatron_model_resumes_bit_identical_and_stays_flat(tmp_path: Path, fmt: str) -> None:
    make_hf_checkpoint(tmp_path / "hf")
    (tmp_path / "format").write_text(fmt)
    for result in run_ranks(_flat_train_save_resume, tmp_path, timeout_s=150):
        assert result["step"] == 2
        assert result["differ"] == []
        assert result["flat"] and result["storages"] == 1
