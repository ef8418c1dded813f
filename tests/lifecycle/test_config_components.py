"""A component's own options composed into the config, against careless plugins and config writers:
every case is right or a `ConfigError` naming the key, at construction, never mid-run.

The plugin classes live here and are selected by import path (`tests.lifecycle.
test_config_components:Name`), as an uninstalled package's would be.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, ClassVar

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from backends.base import PLAIN_TORCH, FormatBackend, FormatCapabilities
from backends.engines.naive import NaiveEngine
from backends.engines.options import EngineOptions
from lifecycle import LifecycleConfig
from lifecycle.errors import ConfigError

HERE = __name__
CAPABILITIES = FormatCapabilities(family=PLAIN_TORCH, contents=frozenset({"model"}))


class Level(str, Enum):
    LOW = "low"
    HIGH = "high"


class Ply(Enum):
    ONE = 1
    TWO = 2


@dataclass(kw_only=True)
class GoodOptions:
    level: Level = Level.LOW
    """An enum option."""
    tags: list[str] = field(default_factory=list, metadata={"unique": True})
    """A list option."""
    depth: int = field(default=1, metadata={"ge": 1, "le": 9})
    """A bounded option."""


def _format(name: str, options: Any, **attributes: Any) -> type[FormatBackend]:
    cls = type(name, (FormatBackend,), {"__module__": HERE, "capabilities": CAPABILITIES, "Options": options,
                                        **attributes})
    globals()[name] = cls
    return cls


def _options(name: str, annotations: dict[str, Any], base: type = object, **defaults: Any) -> type:
    return dataclass(kw_only=True)(type(name, (base,), {"__module__": HERE, "__annotations__": annotations,
                                                        **defaults}))


Good = _format("Good", GoodOptions)
Bare = _format("Bare", None)
Clashing = {key: _format(f"Clash_{key}", _options(f"ClashOptions_{key}", {key: "int"}, **{key: 0}))
            for key in ("format", "contents", "async_", "options")}
NotADataclass = _format("NotADataclass", type("Plain", (), {}))
NotAClass = _format("NotAClass", 3)
Unresolved = _format("Unresolved", _options("UnresolvedOptions", {"x": "NoSuchType"}, x=1))
Required = _format("Required", _options("RequiredOptions", {"x": "int"}))
Union = _format("Union", _options("UnionOptions", {"x": "int | str"}, x=1))
Nested = _format("Nested", _options("NestedOptions", {"x": "GoodOptions"}, x=field(default_factory=GoodOptions)))
BadMetadata = {
    meta: _format(f"Bad_{meta}", _options(f"BadOptions_{meta}", {"x": "str"}, x=field(default="a", metadata=value)))
    for meta, value in {
        "ge": {"ge": "1"}, "choices": {"choices": "abc"}, "pattern": {"pattern": "("}, "key": {"key": "y"},
        "problem": {"problem": 3}, "extras": {"extras": True},
    }.items()
}


@dataclass(kw_only=True)
class PickyOptions:
    a: int = 0
    b: int = 0

    def __post_init__(self) -> None:
        if self.a > self.b:
            raise ValueError("a must not exceed b")


Picky = _format("Picky", PickyOptions)
Raising = _format("Raising", _options("RaisingOptions", {"x": "str"},
                                      x=field(default="a", metadata={"problem": lambda value: 1 // 0})))
Typed = _format("Typed", _options("TypedOptions", {"ply": "Ply", "limits": "dict[str, int]"},
                                  ply=Ply.ONE, limits=field(default_factory=dict)))
Jax = _format("Jax", None, capabilities=FormatCapabilities(family="jax"))
LooseCapabilities = _format("LooseCapabilities", None, capabilities={"family": PLAIN_TORCH})


class NoCapabilities(FormatBackend):
    """Declares no `capabilities`: the base class has none to inherit."""


@dataclass(kw_only=True, slots=True)
class EngineOwn(EngineOptions):
    clone: bool = True
    """The engine's own key."""

    def problem(self) -> tuple[str, str] | None:
        if not self.clone and not self.verify:
            return "clone", "clone false needs verify true"
        return EngineOptions.problem(self)


class OwnEngine(NaiveEngine):
    Options: ClassVar[type[EngineOptions]] = EngineOwn


@dataclass(kw_only=True, slots=True)
class Redefined(EngineOptions):
    bucket_bytes: int = 4096


class RedefiningEngine(NaiveEngine):
    Options: ClassVar[type[EngineOptions]] = Redefined


class BrokenProblem(EngineOwn):
    def problem(self) -> tuple[str, str] | None:
        raise RuntimeError("problem broke")


class BrokenProblemEngine(NaiveEngine):
    Options: ClassVar[type[EngineOptions]] = BrokenProblem


ENGINE_CLASHES = {key: type(f"EngineClash_{key}", (NaiveEngine,), {
    "__module__": HERE, "Options": _options(f"EngineClashOptions_{key}", {key: "int"}, EngineOptions, **{key: 0})})
    for key in ("backend", "options")}
globals().update({cls.__name__: cls for cls in ENGINE_CLASHES.values()})


def _save(fmt: str, **keys: Any) -> dict[str, Any]:
    return {"checkpoint": {"save": {"format": fmt, "contents": ["model"], **keys}}}


def _refused(data: dict[str, Any], key: str, *said: str) -> str:
    with pytest.raises(ConfigError) as info:
        LifecycleConfig.from_dict(data)
    assert info.value.key == key, str(info.value)
    assert all(part in str(info.value) for part in said), str(info.value)
    assert len(str(info.value)) < 600
    return str(info.value)


# --- an options class the config cannot compose: refused when the component is selected -----------


@pytest.mark.parametrize("key", sorted(Clashing))
def test_a_format_option_named_like_a_key_of_the_section_is_refused_even_unset(key: str) -> None:
    """One of the two could never be set, and a dump would overwrite one with the other."""
    _refused(_save(f"{HERE}:Clash_{key}"), "checkpoint.save.format",
             f"its option {key!r} is also a key of checkpoint.save itself; rename the option")


@pytest.mark.parametrize("key", sorted(ENGINE_CLASHES))
def test_an_engine_option_named_like_a_key_of_the_engine_section_is_refused(key: str) -> None:
    _refused({"engine": {"backend": f"{HERE}:EngineClash_{key}"}}, "engine.backend",
             f"its option {key!r} is also a key of engine itself")


@pytest.mark.parametrize(("name", "said"), [
    ("NotADataclass", "its Options is <class 'tests.lifecycle.test_config_components.Plain'>, not a dataclass"),
    ("NotAClass", "its Options is 3, not a dataclass"),
    ("Unresolved", "the types of its Options fields cannot be resolved: NameError"),
    *((f"Bad_{meta}", said) for meta, said in {
        "ge": "option 'x': the bounds ge, gt and le must be numbers",
        "choices": "option 'x': choices must be a list of strings, got 'abc'",
        "pattern": "option 'x': pattern '(' is not a regular expression",
        "key": "option 'x': the metadata key, extras and deprecated are the config's own",
        "extras": "option 'x': the metadata key, extras and deprecated are the config's own",
        "problem": "option 'x': problem must be a function",
    }.items()),
])
def test_a_format_whose_options_the_config_cannot_compose_is_refused_on_its_format_key(name: str, said: str) -> None:
    _refused(_save(f"{HERE}:{name}"), "checkpoint.save.format", f"format '{HERE}:{name}': {said}")


def test_an_engine_redefining_a_common_option_is_refused_since_the_section_s_value_would_win() -> None:
    _refused({"engine": {"backend": f"{HERE}:RedefiningEngine"}}, "engine.backend",
             "redefines 'bucket_bytes' of EngineOptions, whose value the section sets")


@pytest.mark.parametrize("capabilities", ["LooseCapabilities", "NoCapabilities"])
def test_a_format_s_capabilities_of_the_wrong_type_or_missing_are_refused(capabilities: str) -> None:
    _refused(_save(f"{HERE}:{capabilities}"), "checkpoint.save.format", "declares no FormatCapabilities")


def test_a_format_of_a_family_of_its_own_is_never_mixed_with_another_family() -> None:
    jax = f"{HERE}:Jax"
    assert LifecycleConfig.from_dict(_save(jax)).checkpoint.pre_load_format == jax  # no built-in reads HF into it
    _refused({"checkpoint": {"save": {"format": jax}, "load": {"format": "hf"}}}, "checkpoint.load.format",
             f"'hf' is a plain-torch format but checkpoint.save.format '{jax}' is a jax format")
    _refused({"checkpoint": {"save": {"format": "torch_dcp"}, "pre_load": {"format": jax}}},
             "checkpoint.pre_load.format", "is a jax format but checkpoint.save.format 'torch_dcp' is a plain-torch")


# --- values checked by the component's own rules, now rather than mid-run ---------------------------


def test_a_required_option_must_be_given() -> None:
    _refused(_save(f"{HERE}:Required"), "checkpoint.save.x", f"format '{HERE}:Required' requires this key")
    assert LifecycleConfig.from_dict(_save(f"{HERE}:Required", x=3)).checkpoint.save.options == {"x": 3}


def test_the_options_own_post_init_runs_when_the_config_is_built() -> None:
    _refused(_save(f"{HERE}:Picky", a=2, b=1), "checkpoint.save.format",
             f"format '{HERE}:Picky' refuses its options {{'a': 2, 'b': 1}}: ValueError: 'a must not exceed b'")
    assert LifecycleConfig.from_dict(_save(f"{HERE}:Picky", a=1, b=2)).checkpoint.save.options == {"a": 1, "b": 2}


def test_an_engine_s_own_problem_is_asked_when_the_config_is_built() -> None:
    _refused({"engine": {"backend": f"{HERE}:OwnEngine", "clone": False, "verify": False}}, "engine.clone",
             "clone false needs verify true")
    _refused({"engine": {"backend": f"{HERE}:BrokenProblemEngine"}}, "engine.backend",
             "checking its options failed: RuntimeError: 'problem broke'")
    config = LifecycleConfig(engine={"backend": f"{HERE}:OwnEngine", "clone": False})
    assert config.engine.options_for(EngineOwn).clone is False


@pytest.mark.parametrize(("name", "value"), [("Union", 1), ("Nested", {"depth": 2})])
def test_an_option_of_a_type_the_config_cannot_coerce_is_refused_on_its_key(name: str, value: Any) -> None:
    """A union could mean either member and a plain dataclass has no rules: neither is guessed."""
    _refused(_save(f"{HERE}:{name}", x=value), "checkpoint.save.x", "no coercion for field type")


def test_an_option_rule_that_raises_is_a_config_error_naming_the_key() -> None:
    _refused(_save(f"{HERE}:Raising", x="b"), "checkpoint.save.x", "checking the value failed: ZeroDivisionError")


def test_an_enum_of_ints_and_a_typed_mapping_are_coerced_by_their_types() -> None:
    options = LifecycleConfig.from_dict(_save(f"{HERE}:Typed", ply=2, limits={"a": 1})).checkpoint.save.options
    assert options == {"ply": Ply.TWO, "limits": {"a": 1}}
    _refused(_save(f"{HERE}:Typed", ply=True), "checkpoint.save.ply", "expected one of 1, 2, got True (bool)")
    _refused(_save(f"{HERE}:Typed", ply="TWO"), "checkpoint.save.ply", "expected one of 1, 2, got 'TWO' (str)")
    _refused(_save(f"{HERE}:Typed", limits={"a": "x"}), "checkpoint.save.limits",
             "key 'a': expected an integer, got 'x' (str)")
    config = LifecycleConfig.from_dict(_save(f"{HERE}:Typed", ply=2))
    assert LifecycleConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config


# --- keys given where they do not belong ----------------------------------------------------------


def test_options_of_a_format_without_any_are_refused_saying_so() -> None:
    _refused(_save(f"{HERE}:Bare", depth=2), "checkpoint.save.depth",
             "unknown key; valid keys: async, contents, format", f"format '{HERE}:Bare' takes no keys of its own")


def test_options_of_one_format_given_while_another_is_selected_are_refused_listing_the_selected_one_s() -> None:
    _refused(_save(f"{HERE}:Good", max_shard_bytes=64), "checkpoint.save.max_shard_bytes",
             "valid keys: async, contents, depth, format, level, tags")
    _refused(_save("hf", depth=2), "checkpoint.save.depth", "valid keys: async, contents, format, max_shard_bytes")


def test_an_engine_s_own_key_with_backend_auto_is_refused_asking_for_the_engine() -> None:
    _refused({"engine": {"clone": False}}, "engine.clone",
             "backend 'auto', which picks the engine by device, takes no keys of its own")
    assert LifecycleConfig(engine={"backend": f"{HERE}:OwnEngine", "clone": False}).engine.options == {"clone": False}


@pytest.mark.parametrize(("data", "key"), [
    (_save(f"{HERE}:Good", good={"depth": 2}), "checkpoint.save.good"),
    (_save(f"{HERE}:Good", options={"depth": 2}), "checkpoint.save.options"),
    ({"engine": {"backend": f"{HERE}:OwnEngine", "own": {"clone": False}}}, "engine.own"),
    ({"engine": {"backend": f"{HERE}:OwnEngine", "options": {"clone": False}}}, "engine.options"),
])
def test_component_options_nested_one_level_too_deep_are_refused_saying_where_they_go(
    data: dict[str, Any], key: str
) -> None:
    section = key.rpartition(".")[0]
    _refused(data, key, f"a component's own keys sit directly in {section}, not in a mapping of their own")


def test_component_options_one_level_too_high_are_refused_naming_the_section() -> None:
    _refused({"checkpoint": {"depth": 2, "save": {"format": f"{HERE}:Good"}}}, "checkpoint.depth", "unknown key")
    _refused({"clone": False, "engine": {"backend": f"{HERE}:OwnEngine"}}, "clone", "unknown key")


# --- dumps ----------------------------------------------------------------------------------------


def test_component_options_survive_to_dict_json_and_yaml_unchanged(tmp_path: Path) -> None:
    data = {"checkpoint": {"save": {"format": f"{HERE}:Good", "contents": ["model"], "level": "high",
                                    "tags": ["a", "b"], "depth": 3}, "load": {"contents": ["model"]}},
            "engine": {"backend": f"{HERE}:OwnEngine", "clone": False, "bucket_bytes": 4096}}
    config = LifecycleConfig.from_dict(data)
    dumped = config.to_dict()
    assert dumped["checkpoint"]["save"]["level"] == "high" and dumped["engine"]["clone"] is False
    assert LifecycleConfig.from_dict(json.loads(json.dumps(dumped))) == config
    assert LifecycleConfig.coerce(config) is config and config.to_dict() == dumped  # checked again, unchanged
    path = tmp_path / "config.yaml"
    path.write_text(json.dumps(dumped), encoding="utf-8")  # JSON is YAML
    assert LifecycleConfig.from_yaml(path).to_dict() == dumped


@settings(max_examples=200, deadline=None)
@given(options=st.dictionaries(
    st.sampled_from(["level", "tags", "depth", "format", "extra", "async"]),
    st.one_of(st.none(), st.booleans(), st.integers(-5, 20), st.text(max_size=5),
              st.lists(st.text(max_size=3), max_size=3), st.sampled_from(["low", "high"])),
    max_size=4,
))
def test_any_options_are_a_config_that_round_trips_or_a_config_error(options: dict[str, Any]) -> None:
    data = {"checkpoint": {"save": {"contents": ["model"], **options, "format": f"{HERE}:Good"},
                           "load": {"contents": ["model"]}}}
    try:
        config = LifecycleConfig.from_dict(data)
    except ConfigError as exc:
        assert exc.key.startswith("checkpoint.save") and len(str(exc)) < 600
    else:
        assert LifecycleConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config


@pytest.mark.parametrize("flag", ["verify", "profile"])
def test_engine_options_built_outside_the_config_refuse_a_flag_that_is_not_a_bool(flag: str) -> None:
    """An engine built in code (or by an adapter from another framework's kwargs) gets no type
    coercion: a truthy string such as "no" is refused by the options' own check."""
    assert EngineOptions(**{flag: "no"}, profile_dir="/p").problem() == (flag, "must be true or false, got 'no'")
    assert EngineOptions(verify=False, profile=False).problem() is None


def test_an_apply_mode_the_named_engine_does_not_take_is_refused_when_the_lifecycle_is_built() -> None:
    """`engine.apply: flip` with `naive` was taken, then failed the first sync and left the worker FAILED."""
    from lifecycle import Lifecycle
    from lifecycle.testing import MemoryCheckpointer, MemoryEngine

    def build(backend: str, **kwargs: Any) -> Lifecycle:
        return Lifecycle({"engine": {"backend": backend, "apply": "flip"}}, checkpointer=MemoryCheckpointer(),
                         **kwargs)

    with pytest.raises(ConfigError) as info:
        build("naive")
    assert info.value.key == "engine.apply"
    assert "'naive'" in str(info.value) and "it takes 'atomic', 'streamed'" in str(info.value)
    assert NaiveEngine.applies() == ("atomic", "streamed"), "the class says, read without building one"
    build("gloo")  # an engine that flips
    build("auto", engine=MemoryEngine())  # an engine given: the config's is never built
    with pytest.raises(ConfigError, match="engine 'naive' does not take 'flip'"):
        LifecycleConfig.from_dict({"engine": {"backend": "naive", "apply": "flip"}})  # a named engine: the config says
