"""An installed distribution for tests: a `*.dist-info` folder with entry points on sys.path,
found by `importlib.metadata` exactly as one `pip install` leaves."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest


def install(root: Path, monkeypatch: pytest.MonkeyPatch, name: str, entry_points: str, version: str = "0.1") -> Path:
    """Declare `entry_points` (the text of `entry_points.txt`) as distribution `name` in a
    site folder under `root`, put on sys.path until the test ends; returns the site folder."""
    site = root / "site-packages"
    dist = site / f"{name.replace('-', '_')}-{version}.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n", encoding="utf-8")
    (dist / "entry_points.txt").write_text(entry_points, encoding="utf-8")
    if str(site) not in sys.path:
        monkeypatch.syspath_prepend(str(site))
    importlib.invalidate_caches()
    return site
