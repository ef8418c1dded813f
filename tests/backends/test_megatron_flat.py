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
from tests.backends.megatron_util import make_hf_checkpoint

pytest.importorskip("megatron.core")
pytest.importorskip("mbridge")
pytestmark = pytest.mark.transformers


def _lifecycle(model: Any, optimizer: Any, tmp: Path, **checkpoint: Any) -> Any:
    from lifecycle import Lifecycle

    fmt = (tmp / "format").read_text()
    cfg = {"checkpoint": {"root": str(tmp / "ckpt"), "save": {"format": fmt}, **checkpoint}}
    return Lifecycle(cfg, role="actor", model=model, optimizer=optimizer)


def _state(model: Any, optimizer: Any) -> dict[str, torch.Tensor]:
    named = dict(model.chunks[0].named_parameters())
    state = {f"param/{n}": p.detach().clone() for n, p in named.items()}
    state.update({f"{k}/{n}": optimizer.state[p][k].clone() for n, p in named.items() for k in ("exp_avg", "exp_avg_sq")})
    return state


def _flat_train_save_resume(rank: int, world_size: int, tmp: Path) -> dict[str, Any]:
    from megatron.core import parallel_state

    from backends.engines import contiguous_layout, flatten_parameters
    from backends.megatron import build_model

    model = build_model(tmp / "hf", tp=2)
    flatten_parameters(model)
    optimizer = torch.optim.AdamW(list(model.parameters()), lr=0.01)
    lc = _lifecycle(model, optimizer, tmp, pre_load={"path": str(tmp / "hf")})
    lc.init_load()
    for step in (1, 2):
        with lc.train_step(step):
            for i, p in enumerate(model.parameters()):
                p.grad = torch.full_like(p, 0.01 * (i + 1)) + p.detach() * 0.1
            optimizer.step()
    lc.save(2)
    lc.close()
    saved = _state(model, optimizer)
    parallel_state.destroy_model_parallel()

    torch.manual_seed(99 + rank)
    fresh = build_model(tmp / "hf", tp=2)
    layout = flatten_parameters(fresh)
    fresh_opt = torch.optim.AdamW(list(fresh.parameters()), lr=0.01)
    step = _lifecycle(fresh, fresh_opt, tmp).resume()
    resumed = _state(fresh, fresh_opt)
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
