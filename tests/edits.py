"""Hand edits of checkpoint files, as damage, a broken tool or an attacker would make them."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any


def nested(depth: int) -> dict[str, Any]:
    """`{"a": {"a": ... {}}}`, `depth` levels deep."""
    value: dict[str, Any] = {}
    for _ in range(depth):
        value = {"a": value}
    return value


def edit_json(path: Path, edit: Callable[[Any], None]) -> Path:
    """Parse the JSON file, let `edit` change the document in place, write it back."""
    doc = json.loads(path.read_text())
    edit(doc)
    path.write_text(json.dumps(doc))
    return path


def swap_strings(path: Path, a: str, b: str) -> None:
    """Swap two quoted strings in a text file: in an optimizer.json, the tensors two state
    entries point at (`optimizer.state[0].exp_avg` and `optimizer.state[1].exp_avg`)."""
    text = path.read_text().replace(f'"{a}"', '"SWAP"').replace(f'"{b}"', f'"{a}"').replace('"SWAP"', f'"{b}"')
    path.write_text(text)


def write_raw(path: Path, header: Any, data: bytes = b"") -> None:
    """A safetensors file with exactly this header, however wrong, followed by `data`."""
    encoded = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + data)


def edit_header(path: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    """Rewrite a safetensors file's header, its tensors' bytes unchanged."""
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + length])
    edit(header)
    write_raw(path, header, raw[8 + length:])
