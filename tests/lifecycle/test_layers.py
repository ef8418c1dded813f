"""The package's layers as a user meets them: what `import lifecycle` loads, the old paths of the
Ray application, the record's names. The import contracts themselves run in CI (`lint-imports`)."""

from __future__ import annotations

import importlib
import subprocess
import sys
import warnings
from importlib import metadata
from pathlib import Path

import pytest
import transitions

import lifecycle
from lifecycle.phase import TransitionRecord
from lifecycle.version import __version__

MOVED = {
    "lifecycle.driver": "lifecycle.ray.driver",
    "lifecycle.workers": "lifecycle.ray.workers",
    "lifecycle.run_report": "lifecycle.ray.run_report",
}
PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def _loaded_after(code: str) -> set[str]:
    """Modules a fresh interpreter holds after running `code`."""
    out = subprocess.run([sys.executable, "-c", f"{code}\nimport sys\nprint('\\n'.join(sys.modules))"],
                         capture_output=True, text=True, check=True, timeout=120)
    return set(out.stdout.split())


def test_importing_lifecycle_imports_neither_ray_nor_the_ray_application() -> None:
    loaded = _loaded_after("import lifecycle, lifecycle.testing")
    assert "ray" not in loaded
    assert not {m for m in loaded if m == "lifecycle.ray" or m.startswith("lifecycle.ray.")}


def test_the_ray_application_imports_ray_only_when_a_driver_starts() -> None:
    loaded = _loaded_after("import lifecycle.ray")
    assert "lifecycle.ray.driver" in loaded
    assert "ray" not in loaded


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_path_warns_and_hands_out_the_very_objects_of_the_new_one(old: str) -> None:
    new = importlib.import_module(MOVED[old])
    shim = importlib.import_module(old)
    assert shim.__all__ == new.__all__
    for name in new.__all__:
        with pytest.warns(DeprecationWarning, match=rf"{old} is deprecated: import {name} from {MOVED[old]}"):
            value = getattr(shim, name)
        assert value is getattr(new, name)


def test_the_deprecation_points_at_the_importing_line() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        from lifecycle.driver import Driver  # noqa: F401 - the import is the test
    assert [(w.category, w.filename) for w in caught] == [(DeprecationWarning, __file__)]


def test_an_old_path_refuses_a_name_the_new_module_lacks() -> None:
    import lifecycle.driver

    with pytest.raises(AttributeError, match="lifecycle.ray.driver"):
        lifecycle.driver.NoSuchThing  # noqa: B018
    with pytest.raises(ImportError):
        from lifecycle.workers import NoSuchThing  # noqa: F401


def test_the_history_record_does_not_shadow_the_machines_transition() -> None:
    assert lifecycle.TransitionRecord is TransitionRecord
    assert lifecycle.Transition is TransitionRecord  # the earlier name, still importable
    assert TransitionRecord is not transitions.Transition


def test_the_version_is_written_once() -> None:
    assert lifecycle.__version__ == __version__
    try:
        installed = metadata.version("trainer-lifecycle")
    except metadata.PackageNotFoundError:
        pytest.skip("trainer-lifecycle is not installed, so there is no packaged version to compare")
    assert installed == __version__


def test_the_import_contracts_agree_on_the_leaf_modules() -> None:
    tomllib = pytest.importorskip("tomllib")
    config = tomllib.loads(PYPROJECT.read_text(encoding="utf-8"))["tool"]["importlinter"]
    contracts = {c["type"]: c for c in config["contracts"] if c["type"] != "forbidden"}
    forbidden = [c for c in config["contracts"] if c["type"] == "forbidden"]
    backends_may_import = {rule.split(" -> ")[1] for c in forbidden if c["source_modules"] == ["backends"]
                           for rule in c["ignore_imports"]}
    import_nothing_from_backends = {m for c in forbidden if c["forbidden_modules"] == ["backends"]
                                    for m in c["source_modules"]}
    bottom_layer = {f"lifecycle.{m.strip()}" for m in contracts["layers"]["layers"][-1].split(":")}
    assert backends_may_import == import_nothing_from_backends == bottom_layer
