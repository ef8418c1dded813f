"""A careless or hostile plugin against `Registry[T]`: every way in is right or a `ConfigError`
naming the config key, never a raw exception, a hijacked name or a choice made by install order.

Plugins are real modules written under `tmp_path` and real distributions (a dist-info with
entry points on sys.path), found by `importlib.metadata` as an installed package would be.
"""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import backends.registry as registry_module
from backends.base import FORMATS, FormatBackend, FormatCapabilities, backend_class
from backends.engines import CheckpointEngine, CheckpointEngineRegistry
from backends.engines.naive import NaiveEngine
from backends.engines.options import EngineCapabilities
from backends.engines.registry import ENGINES
from backends.hf import HFBackend
from lifecycle import LifecycleConfig
from lifecycle.errors import ConfigError
from tests.plugins.distribution import install

PLUGIN = '''
from backends.base import PLAIN_TORCH, FormatBackend, FormatCapabilities
from backends.engines.naive import NaiveEngine

class Format(FormatBackend):
    capabilities = FormatCapabilities(family=PLAIN_TORCH)

class Other(FormatBackend):
    capabilities = FormatCapabilities(family=PLAIN_TORCH)

class Engine(NaiveEngine):
    pass

class NotAFormat:
    pass

NOT_A_CLASS = 3
'''
FAILING_IMPORTS = {
    "raises": "raise RuntimeError('plugin broke')",
    "syntax": "def broken(:",
    "exits": "import sys; sys.exit(3)",
    "recurses": "def f():\n    return f()\nf()",
    "needs": "import no_such_dependency_of_the_plugin",
    "bad_capabilities": ("from backends.base import FormatBackend, FormatCapabilities\n"
                         "class F(FormatBackend):\n"
                         "    capabilities = FormatCapabilities(family='x', contents={'weights'})"),
    "getattr": "def __getattr__(name):\n    raise ValueError(name)",
}
MESSAGE_LIMIT = 700


@pytest.fixture
def plugins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Package `hostile_plugins` (module `ok` and one module per entry of `FAILING_IMPORTS`)
    importable; forgotten again, with any name it registered, after the test."""
    package = tmp_path / "src" / "hostile_plugins"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("", encoding="utf-8")
    (package / "ok.py").write_text(PLUGIN, encoding="utf-8")
    for module, text in FAILING_IMPORTS.items():
        (package / f"{module}.py").write_text(textwrap.dedent(text) + "\n", encoding="utf-8")
    monkeypatch.syspath_prepend(str(package.parent))
    monkeypatch.setattr(FORMATS, "_registered", dict(FORMATS._registered))
    monkeypatch.setattr(ENGINES, "_registered", dict(ENGINES._registered))
    yield package
    for name in [m for m in sys.modules if m.partition(".")[0] == "hostile_plugins"]:
        del sys.modules[name]


def _refused(call: Any, *args: Any, key: str = "checkpoint.save.format") -> str:
    with pytest.raises(ConfigError) as info:
        call(*args)
    assert info.value.key == key and len(str(info.value)) < MESSAGE_LIMIT
    return str(info.value)


# --- modules that fail on import, targets that are not what they should be -------------------------


@pytest.mark.parametrize(("module", "said"), [
    ("raises", "importing 'hostile_plugins.raises' failed: RuntimeError: 'plugin broke'"),
    ("syntax", "importing 'hostile_plugins.syntax' failed: SyntaxError"),
    ("exits", "importing 'hostile_plugins.exits' failed: SystemExit: '3'"),
    ("recurses", "importing 'hostile_plugins.recurses' failed: RecursionError"),
    ("needs", "needs the package 'no_such_dependency_of_the_plugin', which is not installed"),
    ("bad_capabilities", "importing 'hostile_plugins.bad_capabilities' failed: ConfigError"),
    ("getattr", "reading 'hostile_plugins.getattr:F' failed: ValueError: 'F'"),
])
def test_a_plugin_module_that_raises_anything_on_import_is_a_config_error(
    plugins: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, module: str, said: str
) -> None:
    with pytest.raises(ConfigError) as info:
        backend_class(f"hostile_plugins.{module}:F", "checkpoint.load.format")
    assert info.value.key == "checkpoint.load.format" and said in str(info.value)
    install(tmp_path, monkeypatch, "hostile", f"[trainer_lifecycle.formats]\nbroken = hostile_plugins.{module}:F\n")
    assert said in _refused(LifecycleConfig.from_dict, {"checkpoint": {"save": {"format": "broken"}}})


def test_ctrl_c_during_a_plugin_import_is_not_turned_into_a_config_error(plugins: Path) -> None:
    (plugins / "interrupted.py").write_text("raise KeyboardInterrupt\n", encoding="utf-8")
    with pytest.raises(KeyboardInterrupt):
        backend_class("hostile_plugins.interrupted:F")


@pytest.mark.parametrize(("target", "said"), [
    ("hostile_plugins.ok:Missing", "module 'hostile_plugins.ok' has no 'Missing'"),
    ("hostile_plugins.ok:NOT_A_CLASS", "is 3, not a subclass of backends.base.FormatBackend"),
    ("hostile_plugins.ok:NotAFormat", "hostile_plugins.ok.NotAFormat'>, not a subclass of backends.base.Format"),
    ("hostile_plugins.ok", "is <module 'hostile_plugins.ok'"),
    ("backends.base:FormatBackend", "is the base class itself"),
    ("hostile_plugins.ok:Format.attr", "has no 'Format.attr'"),
    ("!!!", "names '!!!', not 'module:attr'"),
    ("hostile_plugins.ok:", "names 'hostile_plugins.ok:', not 'module:attr'"),
])
def test_an_entry_point_to_anything_but_a_format_class_is_refused_naming_it(
    plugins: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, target: str, said: str
) -> None:
    install(tmp_path, monkeypatch, "hostile", f"[trainer_lifecycle.formats]\nodd = {target}\n")
    assert "odd" in FORMATS.names()
    assert said in _refused(LifecycleConfig.from_dict, {"checkpoint": {"save": {"format": "odd"}}})


def test_an_import_path_to_a_callable_is_looked_at_never_called() -> None:
    assert "<built-in function system>, not a subclass" in _refused(backend_class, "os:system")
    assert "<class 'subprocess.Popen'>, not a subclass" in _refused(backend_class, "subprocess:Popen")


# --- names that belong to someone else ------------------------------------------------------------


def test_two_installed_packages_declaring_one_name_differently_are_refused_not_settled_by_install_order(
    plugins: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    install(tmp_path / "a", monkeypatch, "plugin-a", "[trainer_lifecycle.formats]\ntwin = hostile_plugins.ok:Format\n")
    install(tmp_path / "b", monkeypatch, "plugin-b", "[trainer_lifecycle.formats]\ntwin = hostile_plugins.ok:Other\n")
    message = _refused(LifecycleConfig.from_dict, {"checkpoint": {"save": {"format": "twin"}}})
    assert "format 'twin' is declared by 2 installed packages" in message
    assert "plugin-a 0.1: 'hostile_plugins.ok:Format'" in message
    assert "plugin-b 0.1: 'hostile_plugins.ok:Other'" in message
    assert FORMATS.problem("twin") is not None and "twin" in FORMATS.names()
    config = LifecycleConfig(checkpoint={"save": {"format": "hostile_plugins.ok:Other"}})
    assert config.checkpoint.save.format == "hostile_plugins.ok:Other"


def test_two_packages_declaring_the_same_class_under_one_name_agree(
    plugins: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for dist in ("plugin-a", "plugin-b"):
        install(tmp_path / dist, monkeypatch, dist, "[trainer_lifecycle.formats]\nsame = hostile_plugins.ok:Format\n")
    assert backend_class("same").name == "same"


def test_an_entry_point_named_like_a_builtin_never_hijacks_it(
    plugins: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    install(tmp_path, monkeypatch, "hijack", "[trainer_lifecycle.formats]\nhf = hostile_plugins.ok:Format\n"
                                             "[trainer_lifecycle.checkpoint_engines]\n"
                                             "gloo = hostile_plugins.ok:Engine\nauto = hostile_plugins.ok:Engine\n")
    assert backend_class("hf") is HFBackend and HFBackend.name == "hf"
    assert CheckpointEngineRegistry.get("gloo").__module__ == "backends.engines.gloo"
    assert FORMATS.names().count("hf") == 1 and "auto" not in CheckpointEngineRegistry.names()
    assert LifecycleConfig(engine={"backend": "auto"}).engine.backend == "auto"
    assert "unknown checkpoint engine 'auto'" in _refused(ENGINES.get, "auto", key="engine.backend")
    assert "hostile_plugins" not in "".join(sys.modules)


def test_a_decorator_cannot_take_a_builtin_s_name_even_with_a_look_alike_class(plugins: Path) -> None:
    look_alike = type("HFBackend", (HFBackend,), {"__module__": "backends.hf", "__qualname__": "HFBackend"})
    FORMATS.register("hf")(look_alike)
    assert backend_class("hf") is HFBackend and FORMATS.builtin("hf") is not None
    with pytest.raises(ConfigError, match="'hf': the name belongs to the built-in backends.hf:HFBackend"):
        FORMATS.register("hf")(type("Mine", (HFBackend,), {}))


def test_one_name_registered_by_two_classes_is_refused_and_a_reload_is_not(plugins: Path) -> None:
    from hostile_plugins.ok import Format, Other

    FORMATS.register("mine")(Format)
    message = _refused(FORMATS.register("mine"), Other)
    assert "cannot register hostile_plugins.ok:Other as format 'mine': " \
           "hostile_plugins.ok:Format is registered" in message
    del sys.modules["hostile_plugins.ok"]
    from hostile_plugins.ok import Format as Reloaded

    assert Reloaded is not Format and FORMATS.register("mine")(Reloaded) is Reloaded
    assert backend_class("mine") is Reloaded


def test_a_class_answers_to_one_name(plugins: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A second name would flip the name its manifests record to whichever was asked for last."""
    from hostile_plugins.ok import Format

    assert "already format 'hf'" in _refused(FORMATS.register("my_hf"), HFBackend)
    FORMATS.register("first")(Format)
    assert "hostile_plugins.ok:Format is already format 'first'" in _refused(FORMATS.register("second"), Format)
    install(tmp_path, monkeypatch, "alias", "[trainer_lifecycle.formats]\nalias = backends.hf:HFBackend\n"
                                            "one = hostile_plugins.ok:Other\ntwo = hostile_plugins.ok:Other\n")
    assert "backends.hf:HFBackend is already format 'hf'" in _refused(backend_class, "alias")
    assert backend_class("one").name == "one"
    assert "is already format 'one'" in _refused(backend_class, "two")
    assert HFBackend.name == "hf" and Format.name == "first"


# --- names as text -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["", " hf", "hf ", "two words", "a:b", "é" * 3, "x" * 201, "auto", "\x00", 3, None])
def test_a_name_that_could_not_be_selected_cannot_be_registered(name: Any) -> None:
    message = _refused(ENGINES.register, name, key="engine.backend")
    assert message.startswith("engine.backend: cannot register checkpoint engine ")


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=st.one_of(st.text(max_size=300), st.integers(), st.none(), st.binary(max_size=20)))
def test_any_name_asked_for_is_a_class_or_a_config_error(name: Any) -> None:
    for registry in (FORMATS, ENGINES):
        problem = registry.problem(name)
        assert problem is None or (isinstance(problem, str) and len(problem) < MESSAGE_LIMIT)
        try:
            registry.get(name)
        except ConfigError as exc:
            assert len(str(exc)) < MESSAGE_LIMIT
        else:
            assert problem is None


def test_unreadable_entry_point_metadata_is_a_reason_in_the_message_and_builtins_still_work(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(group: str) -> list[Any]:
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")

    monkeypatch.setattr(registry_module, "entry_points", broken)
    assert FORMATS.names() == ["dist_ckpt", "hf", "mbridge", "torch_dcp"]
    message = _refused(backend_class, "toy")
    assert "unknown format 'toy'" in message and "entry points cannot be read: UnicodeDecodeError" in message
    assert "entry points cannot be read" in str(FORMATS.problem("toy"))
    assert LifecycleConfig(checkpoint={"save": {"format": "torch_dcp"}}).checkpoint.save.format == "torch_dcp"


def test_a_message_lists_a_bounded_number_of_names(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    install(tmp_path, monkeypatch, "many", "[trainer_lifecycle.formats]\n" + "".join(
        f"name_{i:04d} = pkg:C\n" for i in range(2000)))
    message = str(FORMATS.problem("none_of_them"))
    assert "name_0000" in message and "more)" in message and len(message) < MESSAGE_LIMIT


# --- an engine's contract beyond subclassing --------------------------------------------------------


@pytest.mark.parametrize(("attributes", "said"), [
    ({"capabilities": {"in_process": True}}, "its `capabilities` is {'in_process': True}, not an EngineCapabilities"),
    ({"capabilities": None}, "its `capabilities` is None, not an EngineCapabilities"),
    ({"Options": dict}, "its `Options` is <class 'dict'>, not a subclass of EngineOptions"),
    ({"Options": 3}, "its `Options` is 3, not a subclass of EngineOptions"),
])
def test_an_engine_with_capabilities_or_options_of_the_wrong_type_is_refused_however_it_comes_in(
    attributes: dict[str, Any], said: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ENGINES, "_registered", dict(ENGINES._registered))
    careless = type("Careless", (NaiveEngine,), {"__module__": __name__, **attributes})
    assert said in _refused(ENGINES.register("careless"), careless, key="engine.backend")
    monkeypatch.setattr(sys.modules[__name__], "Careless", careless, raising=False)
    data = {"engine": {"backend": f"{__name__}:Careless"}}
    assert said in _refused(LifecycleConfig.from_dict, data, key="engine.backend")


def test_an_engine_whose_capabilities_are_right_is_registered() -> None:
    fine = type("Fine", (NaiveEngine,), {"capabilities": EngineCapabilities(in_process=True)})
    registry = registry_module.Registry("checkpoint engine", base=NaiveEngine, group="tests.none", key="k",
                                        check=ENGINES._check)
    assert registry.register("fine")(fine) is fine and registry.get("fine") is fine


# --- a format's contract beyond subclassing --------------------------------------------------------


@pytest.mark.parametrize("capabilities", [{"family": "plain-torch"}, None])
def test_a_format_with_capabilities_of_the_wrong_type_is_refused_when_registered(
    capabilities: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(FORMATS, "_registered", dict(FORMATS._registered))
    careless = type("CarelessFormat", (FormatBackend,), {"__module__": __name__, "capabilities": capabilities})
    said = "declares no FormatCapabilities as its `capabilities`"
    assert said in _refused(FORMATS.register("careless_format"), careless, key="checkpoint.save.format")
    assert "careless_format" not in FORMATS.names()


@pytest.mark.parametrize("family", ["", None, 3])
def test_capabilities_without_a_model_family_are_refused(family: Any) -> None:
    with pytest.raises(ConfigError, match=r"^capabilities\.family: a format names the model family"):
        FormatCapabilities(family=family)


def test_a_format_claiming_hf_model_without_a_way_to_write_it_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(FORMATS, "_registered", dict(FORMATS._registered))
    claims = type("Claims", (FormatBackend,), {"__module__": __name__, "capabilities": FormatCapabilities(
        family="plain-torch", contents=frozenset({"model", "hf_model"}))})
    said = "its capabilities hold hf_model, but it neither writes HF safetensors (native_hf) nor overrides export_hf"
    assert said in _refused(FORMATS.register("claims_hf"), claims, key="checkpoint.save.format")


def test_an_engine_nobody_named_answers_to_its_import_path_and_a_subclass_of_a_named_one_keeps_its_name() -> None:
    unnamed = type("Unnamed", (CheckpointEngine,), {"__module__": __name__})
    assert unnamed.name == f"{__name__}:Unnamed"
    assert type("Tweaked", (NaiveEngine,), {"__module__": __name__}).name == "naive"
