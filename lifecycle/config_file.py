"""A config file read into plain data, every failure a `ConfigError` naming the file.

The file is read through the filesystem boundary (a FIFO or device at the path is refused, not
waited on; a huge file is not read) and parsed as safe YAML with a nesting limit, so neither a
wrong path nor hostile text gets past here as anything but a typed error. What the data means
is `lifecycle.config`'s business.

The same limits hold for config data a caller gives (`lifecycle.config_rules` applies them):
`path_problem` for every path key, `check_free_form` for a free-form option (no value that
holds itself, nests or expands past a file's limits), `read_items` for a mapping or list that
fails as it is read.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import yaml

from lifecycle.boundary import path_problem as boundary_path_problem
from lifecycle.boundary import read_bytes
from lifecycle.errors import CheckpointError, ConfigError, shorten

CONFIG_FILE_LIMIT: int = 1 << 20
"""Bytes a YAML config file may hold: a real one is a few KiB, and a wrong path (a log, a device
file) is refused instead of read whole."""


_NULL_WORDS = frozenset({"None", "none", "NONE", "null", "Null", "NULL", "~"})
"""Strings that read as 'no value': YAML 1.1 reads only null, Null, NULL and ~ so (unquoted),
and `None` is Python's; as a path each would silently name a folder `./None`."""


def path_problem(path: str) -> str | None:
    """Why `path` cannot name a file or folder on any system this runs on, or None."""
    if not path:
        return "an empty path would mean the current folder; give a folder or leave the key unset"
    if path in _NULL_WORDS:
        return (f"{path!r} is text, not a null; write null or leave the key out for no path "
                f"(or ./{path} for a folder of that name)")
    return boundary_path_problem(path)


def read_items(items: Callable[[], Any], key: str, what: str) -> list[Any]:
    """`items()` as a list: a container from another tool may fail as it is read, with any exception."""
    try:
        return list(items())
    except Exception as exc:  # noqa: BLE001 - a foreign container's reads may raise anything
        raise ConfigError(key, f"cannot read {what}: {type(exc).__name__}: {shorten(str(exc))}") from None


def read_sequence(value: Sequence[Any], key: str, what: str, limit: int) -> list[Any] | None:
    """The items of `value`, read by index (a sequence's own `iter` stops on IndexError only, so
    another tool's that fails otherwise would escape); None, with none read, when it holds more
    than `limit`, so a `range(10**9)` given from code is refused before its list is built."""
    count = read_items(lambda: [len(value)], key, what)[0]
    return None if count > limit else read_items(lambda: [value[i] for i in range(count)], key, what)


YAML_DEPTH_LIMIT = 32
"""Levels of nesting a config file, or a free-form value, may have; the tree itself is four deep."""
FREE_FORM_LIMIT = 1_000_000
"""Values a free-form option (or a list key) may hold, YAML aliases written out as `to_dict` does."""


@dataclass(slots=True)
class _FreeForm:
    """One walk over a free-form (`Any`) value, each container walked once (`done`: its depth and
    size by id, None while inside it), with a budget of values `left`, charged as the walk goes:
    a container longer than what is left is refused before its items are read."""

    key: str
    where: str
    left: int = FREE_FORM_LIMIT
    done: dict[int, tuple[int, int] | None] = field(default_factory=dict)

    def walk(self, value: object, depth: int) -> tuple[int, int]:
        """Depth and size of `value`; a `ConfigError` for one that holds itself (a YAML anchor
        used inside itself) or passes the limits above, on which `to_dict` would not end."""
        if isinstance(value, (str, bytes, bytearray)) or not isinstance(value, (Mapping, Sequence)):
            self._charge(1)
            return 0, 1
        if id(value) in self.done and self.done[id(value)] is None:
            raise ConfigError(self.key, f"{self.where}holds itself (a YAML anchor used inside itself); it must end")
        deepest, size = self.done.get(id(value)) or (1, 1)  # met before, through an alias: its depth counts from here
        if depth + deepest > YAML_DEPTH_LIMIT:
            raise ConfigError(self.key, f"{self.where}nested deeper than {YAML_DEPTH_LIMIT} levels")
        if id(value) in self.done:
            self._charge(size)  # written out again where the alias is
            return deepest, size
        self.done[id(value)] = None
        self._charge(1)
        for item in self._items(value):
            below, count = self.walk(item, depth + 1)
            deepest, size = max(deepest, below + 1), size + count
        self.done[id(value)] = (deepest, size)
        return deepest, size

    def _items(self, value: Mapping[Any, Any] | Sequence[Any]) -> list[Any]:
        """The values of a mapping or the items of a sequence, none read when there are more than are left."""
        if isinstance(value, Mapping):
            if read_items(lambda: [len(value)], self.key, "the value")[0] > self.left:
                self._refuse()
            return read_items(value.values, self.key, "the value")
        items = read_sequence(value, self.key, "the value", self.left)
        return self._refuse() if items is None else items

    def _charge(self, size: int) -> None:
        self.left -= size
        if self.left < 0:
            self._refuse()

    def _refuse(self) -> NoReturn:
        raise ConfigError(self.key, f"{self.where}holds more than {FREE_FORM_LIMIT} values with its YAML aliases "
                                    "written out")


def check_free_form(value: object, key: str, where: str = "") -> None:
    """A free-form (`Any`) config value, from a YAML file or a caller's dict, known to end."""
    _FreeForm(key, where).walk(value, 0)


def read_yaml(name: str) -> object:
    """The data in the YAML file `name`; None for an empty file."""
    return _parse_yaml(name, _read_config_file(name))


def _read_config_file(name: str) -> str:
    """The file's text through the filesystem boundary: a FIFO or device at the path is refused
    instead of blocking, a huge file unread. The path is resolved first, since a config file may
    be a symlink (Kubernetes mounts ConfigMaps so); only its target must be a regular file."""
    if problem := path_problem(name):
        raise ConfigError(name or repr(name), f"cannot read config file: {problem}")
    try:
        real = Path(name).resolve()
    except (OSError, RuntimeError, ValueError) as exc:
        raise ConfigError(name, f"cannot read config file: {exc}") from exc
    try:
        data = read_bytes(real, CONFIG_FILE_LIMIT, "the config file")
    except CheckpointError as exc:
        raise ConfigError(name, f"cannot read config file: {exc}") from exc
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(name, f"not UTF-8 text: cannot decode byte {exc.start} ({data[exc.start]:#04x})") from exc


class _ShallowLoader(yaml.SafeLoader):
    """`SafeLoader` that stops at `YAML_DEPTH_LIMIT` levels: PyYAML's composer recurses once per
    level, so deeper input would end in a `RecursionError` after seconds of work."""

    _depth = 0

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._flattened: set[int] = set()
        """Mappings whose merge keys are flattened: a mapping merged into several is done once."""
        self._flattening: set[int] = set()
        """Mappings being flattened: meeting one again means it merges itself."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        self._depth += 1
        try:
            if self._depth > YAML_DEPTH_LIMIT:
                mark = self.peek_event().start_mark
                raise yaml.composer.ComposerError(None, None, f"nested deeper than {YAML_DEPTH_LIMIT} levels", mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def flatten_mapping(self, node: Any) -> None:
        """Merge keys (`<<:`) flattened by the YAML spec's precedence, which PyYAML 6.0.4 breaks
        (it takes the last merged mapping's value for most keys, the first one's for one-letter
        keys): a key written in the mapping wins, then the first merged mapping that gives it.
        A key written twice in one mapping is refused, since PyYAML would silently keep the last.
        Each mapping is flattened once, even when merged into several others."""
        if id(node) in self._flattened:
            return
        if id(node) in self._flattening:
            raise yaml.constructor.ConstructorError(
                "while flattening merge keys", node.start_mark, "a mapping merges itself", node.start_mark)
        self._flattening.add(id(node))
        own: list[tuple[Any, Any]] = []
        sources: list[Any] = []
        for key_node, value_node in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                sources += self._merge_sources(node, value_node)
            else:
                if key_node.tag == "tag:yaml.org,2002:value":  # a plain `=`: safe_load reads the string
                    key_node.tag = "tag:yaml.org,2002:str"
                own.append((key_node, value_node))
        seen = self._first_of_each_key(node, own, refuse_repeats=True)
        merged: list[tuple[Any, Any]] = []
        for source in sources:
            merged += self._first_of_each_key(source, source.value, refuse_repeats=False, seen=seen).values()
        node.value = merged + own
        self._flattening.discard(id(node))
        self._flattened.add(id(node))

    def _merge_sources(self, node: Any, value_node: Any) -> list[Any]:
        """The mappings one `<<:` merges, in the order listed, each flattened first."""
        sources = value_node.value if isinstance(value_node, yaml.SequenceNode) else [value_node]
        for source in sources:
            if not isinstance(source, yaml.MappingNode):
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping", node.start_mark,
                    f"expected a mapping or a list of mappings for merging, but found {source.id}", source.start_mark)
            self.flatten_mapping(source)
        return list(sources)

    def _first_of_each_key(
        self, node: Any, pairs: list[tuple[Any, Any]], *, refuse_repeats: bool, seen: dict[Any, Any] | None = None,
    ) -> dict[Any, tuple[Any, Any]]:
        """The pairs whose key is not in `seen`, first of each key, keyed by the key (a key that
        cannot be hashed keeps its pair, for the constructor to refuse); `seen` takes their keys."""
        seen = {} if seen is None else seen
        kept: dict[Any, tuple[Any, Any]] = {}
        for key_node, value_node in pairs:
            key = self.construct_object(key_node, deep=True)
            if not isinstance(key, (str, int, float, bool)) and key is not None:
                kept[object()] = (key_node, value_node)
            elif key not in seen:
                seen[key] = key_node.start_mark
                kept[key] = (key_node, value_node)
            elif refuse_repeats:
                raise yaml.constructor.ConstructorError(
                    "while reading a mapping", node.start_mark,
                    f"key {key!r} is given twice (first {seen[key]})", key_node.start_mark)
        return kept

    def construct_yaml_float(self, node: Any) -> float:
        """YAML 1.1 reads `1:30.5` as 90.5; refused as ambiguous, like such an integer."""
        if ":" in str(node.value):
            raise yaml.constructor.ConstructorError(
                None, None, f"{node.value!r} is an ambiguous number (YAML 1.1 reads a colon as base 60); write "
                            "it plainly or quote it", node.start_mark)
        return float(super().construct_yaml_float(node))

    def construct_yaml_int(self, node: Any) -> int:
        """YAML 1.1 reads `010` as 8 and `1:30` as 90; both are refused as ambiguous."""
        text = str(node.value).replace("_", "").lstrip("+-")
        if ":" in text or (len(text) > 1 and text[0] == "0" and text[1].isdigit()):
            raise yaml.constructor.ConstructorError(
                None, None, f"{node.value!r} is an ambiguous integer (YAML 1.1 reads a leading 0 as octal and "
                            "a colon as base 60); write it plainly or quote it", node.start_mark)
        return int(super().construct_yaml_int(node))


_ShallowLoader.add_constructor("tag:yaml.org,2002:int", _ShallowLoader.construct_yaml_int)
_ShallowLoader.add_constructor("tag:yaml.org,2002:float", _ShallowLoader.construct_yaml_float)


def _parse_yaml(name: str, text: str) -> object:
    """Safe YAML, with the parser's own exceptions as `ConfigError`s naming the file: past
    `YAMLError`, PyYAML raises `ValueError` on values such as a date of month 13 or an integer of
    more than 4300 digits (and `RecursionError` if called with little stack left)."""
    try:
        return yaml.load(text, Loader=_ShallowLoader)  # noqa: S506 (a SafeLoader)
    except yaml.YAMLError as exc:
        raise ConfigError(name, f"not valid YAML: {exc}") from exc
    except RecursionError as exc:
        raise ConfigError(name, "not valid YAML: nested too deeply to parse") from exc
    except (ValueError, ArithmeticError) as exc:
        raise ConfigError(name, f"not valid YAML: a value cannot be read: {exc}") from exc
