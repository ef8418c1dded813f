"""What unpickling a DCP `.metadata` may allocate, bounded from its opcodes before any is run.

A pickle is a program, and a few of its instructions make far more memory than they take:
EMPTY_SET (one byte) builds a 216-byte set, LONG_BINPUT (five bytes) makes the C unpickler
allocate a memo table twice the index it names (2 GiB for 2**27), and a container memoized once
can be handed to a call or to a BUILD any number of times, copied each time. A bound on the
file's size is therefore no bound on memory. `check_budget` walks the opcodes first, as
`pickletools.genops` does but without decoding their arguments, refuses every opcode DCP and
Megatron-Core metadata never hold (the text opcodes of protocols 0 and 1, extensions,
out-of-band buffers, stack manipulation), and sums what the unpickler would allocate: each
opcode's object, the stack, the memo table, and for every opcode that fills or copies a
container, that container's items, known by simulating the stack and the memo with the length
of each value. A file whose sum passes `FACTOR` times its size is refused.

Time is bounded too, where the unpickler hashes: a dict or set whose keys all hash alike takes
quadratic time to build (60000 ints that are multiples of 2**61 - 1 took 80 s). DCP metadata
keys are strings (whose hash is salted per process) and objects given their attributes by BUILD
(MetadataIndex, which `backends.dcp_keys.stand_ins` hashes by identity while loading, its real hashes
counted after), so a key or set item that is neither (an int, float, tuple, frozenset, None, a bool,
a torch.Size) is refused, and so is an integer wider than 64 bits (no DCP value is).

Measured on metadata written by torch 2.13's DCP (4000 tensors and their AdamW state) and by
Megatron-Core 0.16 (TP2): the sum is 22 to 30 times the file's size, what `tracemalloc` sees
unpickling it 9 to 14 times; the walk takes about as long as `pickletools.genops`.
"""

from __future__ import annotations

import pickletools
from collections.abc import Callable
from pathlib import Path


from lifecycle.errors import CheckpointError

FACTOR = 64
"""Bytes of unpickled objects one byte of metadata may make: twice what real metadata sums to."""
SLACK = 1024 * 1024
"""Bytes any metadata may make whatever its size, so that a small file is never refused for its ratio."""

# Bytes of CPython 3.11 objects on 64 bits, rounded up; per item, the most `tracemalloc` measured
# while a container grows from 1 to 10**5 items (old and new table both alive during a resize).
_PUSH, _MARK, _MEMO = 16, 16, 16  # a pointer on a stack or in a table that doubles as it grows
_INT, _FLOAT, _STR, _BYTES, _TUPLE = 32, 24, 64, 40, 40
_OBJECT, _ARG, _COPY = 64, 64, 8  # an instance, an argument stored in its dict, an item a call copies
_LIST, _DICT, _SET = 56, 64, 216  # empty containers
_LIST_ITEM, _DICT_ITEM, _SET_ITEM = 16, 64, 128  # an item added


class _Value:
    """A value on the simulated stack: its length (items, or bytes of a string) and the sum of
    its items' lengths; shared between stack and memo as the unpickler shares the object."""

    __slots__ = ("is_tuple", "keyable", "n", "sub")

    def __init__(self, n: int = 0, sub: int = 0, is_tuple: bool = False, keyable: bool = False) -> None:
        self.n, self.sub, self.is_tuple, self.keyable = n, sub, is_tuple, keyable


_SCALAR = _Value()
"""Every value nothing copies (None, an int, a global): shared, its length 0."""


class _Damaged(Exception):
    """The opcodes cannot be a pickle: the unpickler would fail on them too. (An empty stack or
    no mark where one is needed surfaces as the IndexError of the list popped.)"""


class _Over(Exception):
    """The sum passed the budget."""


class _Refused(Exception):
    """A value DCP metadata never holds where the unpickler would spend time on it."""


LONG_BYTES = 8
"""The widest integer (LONG1) accepted: int64, as every DCP offset, length and size is."""


class _Walk:
    """The simulated unpickler: a stack of `_Value`s, marks, a memo."""

    __slots__ = ("budget", "marks", "memo", "memo_len", "stack")

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.stack: list[_Value] = []
        self.marks: list[int] = []
        self.memo: list[_Value | None] = []
        self.memo_len = 0

    def pop_mark(self) -> list[_Value]:
        at = self.marks.pop()
        items, self.stack[at:] = self.stack[at:], []
        return items


# Each opcode's effect on the walk, returning the bytes it allocates.
_Run = Callable[[_Walk, int], int]


def _scalar(cost: int) -> _Run:
    def run(walk: _Walk, _: int) -> int:
        walk.stack.append(_SCALAR)
        return _PUSH + cost
    return run


def _sized(base: int, per_byte: int) -> _Run:
    """A string or bytes of `n` bytes: hashed with the process's salt, so they may be keys."""
    def run(walk: _Walk, n: int) -> int:
        walk.stack.append(_Value(n, keyable=True))
        return _PUSH + base + per_byte * n
    return run


def _long(walk: _Walk, n: int) -> int:
    """LONG1: within int64 at most 8 integers share a hash; beyond it, any number."""
    if n > LONG_BYTES:
        raise _Refused(f"holds an integer of {n} bytes, wider than the {LONG_BYTES} of any DCP value")
    walk.stack.append(_Value(n))
    return _PUSH + _INT + n


def _empty(cost: int) -> _Run:
    def run(walk: _Walk, _: int) -> int:
        walk.stack.append(_Value())
        return _PUSH + cost
    return run


def _nothing(walk: _Walk, _: int) -> int:
    return 0


def _mark(walk: _Walk, _: int) -> int:
    walk.marks.append(len(walk.stack))
    return _MARK


def _put(walk: _Walk, index: int) -> int:
    """The C unpickler grows its memo table to twice an index past its end: checked before the
    walk grows its own, so that a huge index is refused without allocating it here either."""
    memo = walk.memo
    if index >= len(memo):
        grown = index + 1 - len(memo)
        if _MEMO * grown > walk.budget:
            raise _Over()
        memo.extend([None] * grown)
    else:
        grown = 0
    if memo[index] is None:
        walk.memo_len += 1
    memo[index] = walk.stack[-1]
    return _MEMO * grown


def _memoize(walk: _Walk, _: int) -> int:
    memo = walk.memo
    if walk.memo_len != len(memo):
        return _put(walk, walk.memo_len)
    memo.append(walk.stack[-1])  # as protocol 4 writes it: the memo grows by one
    walk.memo_len += 1
    return _MEMO


def _get(walk: _Walk, index: int) -> int:
    found = walk.memo[index] if index < len(walk.memo) else None
    walk.stack.append(_SCALAR if found is None else found)
    return _PUSH


def _global(walk: _Walk, _: int) -> int:
    stack = walk.stack
    stack.pop()
    stack[-1] = _SCALAR
    return _PUSH


def _persistent(walk: _Walk, _: int) -> int:
    walk.stack[-1] = _SCALAR  # the unpickler refuses it, naming it
    return _PUSH


def _keys_only(keys: list[_Value]) -> None:
    if not all(key.keyable for key in keys):
        raise _Refused("holds a dict key or set item that is neither a string nor an object with attributes "
                       "(an int, float, tuple, None, a torch.Size): DCP metadata never does, and such keys can be "
                       "chosen to share one hash, making the dict take quadratic time to build")


def _added(walk: _Walk, items: list[_Value], rate: int, pairs: bool = False) -> int:
    """Items added to the container below them; a dict's keys and a set's items only of the
    kinds `_keys_only` allows."""
    if pairs or rate == _SET_ITEM:
        _keys_only(items[::2] if pairs else items)
    container = walk.stack[-1]
    count = len(items) // 2 if pairs else len(items)
    container.n += count
    container.sub += sum(item.n for item in items)
    return rate * count


def _append(walk: _Walk, _: int) -> int:
    return _added(walk, [walk.stack.pop()], _LIST_ITEM)


def _appends(walk: _Walk, _: int) -> int:
    return _added(walk, walk.pop_mark(), _LIST_ITEM)


def _setitem(walk: _Walk, _: int) -> int:
    value = walk.stack.pop()
    return _added(walk, [walk.stack.pop(), value], _DICT_ITEM, pairs=True)


def _setitems(walk: _Walk, _: int) -> int:
    return _added(walk, walk.pop_mark(), _DICT_ITEM, pairs=True)


def _additems(walk: _Walk, _: int) -> int:
    return _added(walk, walk.pop_mark(), _SET_ITEM)


def _frozenset(walk: _Walk, _: int) -> int:
    items = walk.pop_mark()
    _keys_only(items)
    walk.stack.append(_Value(len(items), sum(item.n for item in items)))
    return _PUSH + _SET + _SET_ITEM * len(items)


def _made_tuple(walk: _Walk, items: list[_Value]) -> int:
    walk.stack.append(_Value(len(items), sum(item.n for item in items), True))
    return _PUSH + _TUPLE + 8 * len(items)


def _tuple1(walk: _Walk, _: int) -> int:
    stack = walk.stack
    stack[-1] = _Value(1, stack[-1].n, True)
    return _PUSH + _TUPLE + 8


def _tuple_of(count: int) -> _Run:
    def run(walk: _Walk, _: int) -> int:
        stack = walk.stack
        if len(stack) < count:
            raise _Damaged("stack underflow")
        items = stack[-count:]
        del stack[-count:]
        return _made_tuple(walk, items)
    return run


def _tuple(walk: _Walk, _: int) -> int:
    return _made_tuple(walk, walk.pop_mark())


def _call(walk: _Walk, _: int) -> int:
    """REDUCE and NEWOBJ: an allowed class or function called with the arguments tuple; what it
    may copy (torch.Size of a list, a path joined from strings) is bounded by their lengths."""
    stack = walk.stack
    args = stack.pop()
    stack[-1] = _Value(args.sub)
    return _PUSH + _OBJECT + _ARG * args.n + _COPY * args.sub


def _build(walk: _Walk, _: int) -> int:
    """BUILD: the state's items set in the instance's dict. A pair is (dict, slot dict), whose
    items are set; any other tuple goes to the class's own `__setstate__`, an item an attribute."""
    state = walk.stack.pop()
    if not walk.stack:
        raise _Damaged("BUILD with no object under its state")
    built = walk.stack[-1]
    if built is not _SCALAR and state is not _SCALAR and not state.is_tuple:
        built.keyable = True  # an object with a dict (a torch.Size, a tuple, an int have none): may be a key
    return _DICT + _DICT_ITEM * (state.n + (state.sub if state.is_tuple and state.n == 2 else 0))


_OPS: dict[str, tuple[int, bool, _Run]] = {
    # name: (bytes of the argument, or of its length prefix when counted; counted; effect)
    "PROTO": (1, False, _nothing), "FRAME": (8, False, _nothing), "MARK": (0, False, _mark),
    "MEMOIZE": (0, False, _memoize), "BINPUT": (1, False, _put), "LONG_BINPUT": (4, False, _put),
    "BINGET": (1, False, _get), "LONG_BINGET": (4, False, _get),
    "NONE": (0, False, _scalar(0)), "NEWTRUE": (0, False, _scalar(0)), "NEWFALSE": (0, False, _scalar(0)),
    "EMPTY_TUPLE": (0, False, _scalar(0)), "BININT1": (1, False, _scalar(0)),
    "BININT2": (2, False, _scalar(_INT)), "BININT": (4, False, _scalar(_INT)), "BINFLOAT": (8, False, _scalar(_FLOAT)),
    "LONG1": (1, True, _long),
    "SHORT_BINUNICODE": (1, True, _sized(_STR, 4)), "BINUNICODE": (4, True, _sized(_STR, 4)),
    "SHORT_BINBYTES": (1, True, _sized(_BYTES, 1)), "BINBYTES": (4, True, _sized(_BYTES, 1)),
    "EMPTY_LIST": (0, False, _empty(_LIST)), "EMPTY_DICT": (0, False, _empty(_DICT)),
    "EMPTY_SET": (0, False, _empty(_SET)),
    "APPEND": (0, False, _append), "APPENDS": (0, False, _appends), "SETITEM": (0, False, _setitem),
    "SETITEMS": (0, False, _setitems), "ADDITEMS": (0, False, _additems), "FROZENSET": (0, False, _frozenset),
    "TUPLE1": (0, False, _tuple1), "TUPLE2": (0, False, _tuple_of(2)), "TUPLE3": (0, False, _tuple_of(3)),
    "TUPLE": (0, False, _tuple), "STACK_GLOBAL": (0, False, _global), "REDUCE": (0, False, _call),
    "NEWOBJ": (0, False, _call), "BUILD": (0, False, _build), "BINPERSID": (0, False, _persistent),
}
_TABLE: list[tuple[int, bool, _Run] | None] = [None] * 256
for _op in pickletools.opcodes:
    if _op.name in _OPS:
        _TABLE[ord(_op.code)] = _OPS[_op.name]
_STOP = ord(".")


def check_budget(data: bytes, path: Path) -> None:
    """Refuse, as a `CheckpointError` naming `path`, metadata holding an opcode, a dict key or an
    integer DCP metadata never holds, or whose unpickling could allocate more than `FACTOR` times
    its size (plus `SLACK`).
    Bytes after STOP are never read by the unpickler, so they are not looked at here either."""
    budget = FACTOR * len(data) + SLACK
    try:
        _run(_Walk(budget), data, path)
    except _Over:
        raise CheckpointError(f"{path}: unpickling it could allocate more than {budget} bytes ({FACTOR} "
                              "times its size): not DCP metadata; nothing in it was unpickled") from None
    except _Refused as exc:
        raise CheckpointError(f"{path}: {exc}; nothing in it was unpickled") from None
    except (_Damaged, IndexError) as exc:
        raise CheckpointError(f"{path}: unreadable DCP metadata (truncated or damaged?): {exc}; "
                              "nothing in it was unpickled") from None


def _run(walk: _Walk, data: bytes, path: Path) -> int:
    """The bytes the opcodes allocate, walked up to STOP; `_Over` once past `walk.budget`."""
    pos, size, table, cost, budget = 0, len(data), _TABLE, 0, walk.budget
    while pos < size and (code := data[pos]) != _STOP:
        spec = table[code]
        if spec is None:
            known = pickletools.code2op.get(chr(code))
            raise CheckpointError(f"{path}: holds pickle opcode {known.name if known else hex(code)} at byte {pos}, "
                                  "which DCP metadata never does; nothing in it was unpickled")
        width, counted, run = spec
        end, arg = pos + 1 + width, 0
        if width:
            arg = data[pos + 1] if width == 1 and end <= size else int.from_bytes(data[pos + 1:end], "little")
            if counted:
                end += arg
            if end > size:
                raise _Damaged(f"opcode at byte {pos} runs past the end")
        cost += run(walk, arg)
        if cost > budget:
            raise _Over()
        pos = end
    if pos >= size:
        raise _Damaged("no STOP: truncated")
    return cost
