from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `gpu` need CUDA; without it they are skipped, never run half-way."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (gpu marker)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
