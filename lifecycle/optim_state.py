"""Checks of a saved optimizer's param groups against the running optimizer, for every format.

`optimizer.load_state_dict` takes the saved groups as they are: a group too few, a parameter
list of the wrong length, or a learning rate that is NaN, a string or missing loads without an
error, and the first step then fails or trains on garbage. Each backend decodes its own file
(hf and torch_dcp: `optimizer.json` with its tensors; dist_ckpt: the hyper-parameters next to
its shards) and hands the groups here before anything is loaded into the optimizer.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from lifecycle.errors import CheckpointError, shorten

_MISSING = object()
_NOT_HYPER = ("params", "param_names")
"""Keys of a param group that name its parameters rather than configure its steps."""


def check_param_groups(optimizer: Any, saved_groups: Any, where: str, *, ids: type | None = int) -> list[list[Any]]:
    """The saved groups' parameter ids, group by group, once each fits the running group at the
    same position (as `load_state_dict` pairs them): a mapping whose hyper-parameters are finite
    numbers where the running group's are, listing as many distinct ids of type `ids` (int for
    `optimizer.state_dict()`, str for the names `get_optimizer_state_dict` uses) as the running
    group has parameters, no id in two groups. `ids=None`: a format that keeps no ids (each
    group gets the running group's parameters), so none are read."""
    groups = optimizer.param_groups
    if not isinstance(saved_groups, list) or len(saved_groups) != len(groups):
        raise CheckpointError(f"{where}: optimizer.param_groups must list {len(groups)} group(s) like the "
                              f"running optimizer's, found {shorten(saved_groups, 120)}")
    defaults = getattr(optimizer, "defaults", None)  # torch.optim's own hyper-parameters
    seen: set[Any] = set()
    out: list[list[Any]] = []
    for g, (group, saved_group) in enumerate(zip(groups, saved_groups)):
        group_where = f"{where}: param_groups[{g}]"
        if not isinstance(saved_group, dict):
            raise CheckpointError(f"{group_where} must be a mapping, found {shorten(saved_group, 120)}")
        for key, value in group.items():
            if key in _NOT_HYPER:
                continue
            own = defaults is None or key in defaults
            if problem := _hyper_problem(value, saved_group.get(key, _MISSING), own):
                raise CheckpointError(f"{group_where}.{key}: {problem}")
        numbers = [] if ids is None else _ids(group, saved_group.get("params"), ids, group_where)
        if again := seen.intersection(numbers):
            raise CheckpointError(f"{group_where}.params: parameter {shorten(min(again, key=str))} is also in "
                                  "an earlier group")
        seen.update(numbers)
        out.append(numbers)
    return out


PARAM_SHAPED_STATE = frozenset({"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "square_avg",
                                "acc_delta", "exp_inf", "ax"})
"""Per-parameter buffers of torch.optim's optimizers (the Adam family, SGD, RMSprop, Adadelta,
Adamax, ASGD) that always have their parameter's shape."""
SCALAR_STATE = frozenset({"step"})
"""Per-parameter state that is one number, however it is stored."""


def check_optimizer_state(optimizer: Any, saved: Any, path: Path) -> None:
    """Refuse an optimizer state (`optimizer.state_dict()`'s, ids by position) that
    `load_state_dict` takes but the first step fails on, or trains on silently: groups that do
    not fit the running ones, a state lacking a key the step of one of torch's optimizers reads
    (`state_keys`), a buffer of another parameter's
    shape (two swapped), one tensor given for two buffers, a step that is not a finite number
    >= 0. Nothing runs the optimizer (a zero-lr step moves the weights of an optimizer whose
    update does not scale with lr).

    Tensors are compared with the running optimizer's state where it has one; else by generic
    rules: a known buffer (`PARAM_SHAPED_STATE`) has its parameter's shape, any other tensor of
    more than one element too, up to dimensions of 1 (factored moments, as Adafactor keeps), or
    is flat over the whole group (as LBFGS keeps). Dtypes are not compared: `load_state_dict`
    casts state to its parameter's."""
    where = f"{path}: does not fit the optimizer"
    params = _saved_params(optimizer, saved, where)
    state = saved.get("state")
    if not isinstance(state, dict):
        raise CheckpointError(f"{where}: optimizer.state must be a mapping of parameter number to state")
    seen: dict[int, str] = {}
    groups = {n: saved_group for saved_group in saved["param_groups"] for n in saved_group["params"]}
    for number, entry in state.items():
        if number not in params:
            raise CheckpointError(f"{where}: optimizer.state holds parameter {shorten(number)}, which no "
                                  "param_group lists")
        if not isinstance(entry, dict):
            raise CheckpointError(f"{where}: state of parameter {number} must be a mapping, "
                                  f"found {shorten(entry, 120)}")
        param, group_numel = params[number]
        if missing := sorted(state_keys(optimizer, groups[number]) - entry.keys()):
            raise CheckpointError(f"{where}: state of parameter {number} lacks {shorten(missing, 120)}, which "
                                  "its optimizer's step reads")
        current = optimizer.state.get(param, {})
        for key, value in entry.items():
            place = f"state of parameter {number}, key {shorten(key)}"
            problem = _state_problem(key, value, param, group_numel, current.get(key))
            if problem is None and isinstance(value, torch.Tensor):
                if (other := seen.setdefault(id(value), place)) != place:
                    problem = f"is the very tensor given for the {other}"
            if problem:
                raise CheckpointError(f"{where}: {place}: {problem}")


_STATE_KEYS: tuple[tuple[type, frozenset[str], tuple[tuple[str, str], ...]], ...] = (
    (torch.optim.NAdam, frozenset({"step", "mu_product", "exp_avg", "exp_avg_sq"}), ()),
    (torch.optim.Adam, frozenset({"step", "exp_avg", "exp_avg_sq"}), (("amsgrad", "max_exp_avg_sq"),)),
    (torch.optim.AdamW, frozenset({"step", "exp_avg", "exp_avg_sq"}), (("amsgrad", "max_exp_avg_sq"),)),
    (torch.optim.RAdam, frozenset({"step", "exp_avg", "exp_avg_sq"}), ()),
    (torch.optim.Adamax, frozenset({"step", "exp_avg", "exp_inf"}), ()),
    (torch.optim.RMSprop, frozenset({"step", "square_avg"}), (("momentum", "momentum_buffer"), ("centered", "grad_avg"))),
    (torch.optim.Adagrad, frozenset({"step", "sum"}), ()),
    (torch.optim.Adadelta, frozenset({"step", "square_avg", "acc_delta"}), ()),
    (torch.optim.ASGD, frozenset({"step", "eta", "mu", "ax"}), ()),
    (torch.optim.Rprop, frozenset({"step", "prev", "step_size"}), ()),
)
"""What the step of each of torch's optimizers reads of a parameter's state, and the keys a
group's setting adds when it is truthy (Adam's `amsgrad`: `max_exp_avg_sq`); a subclass's too."""


def state_keys(optimizer: Any, saved_group: Any) -> frozenset[str]:
    """The keys a parameter's saved state must have for `optimizer`'s step, by the saved group's
    settings (which `load_state_dict` takes); none for an optimizer torch does not ship."""
    for cls, keys, extra in _STATE_KEYS:
        if isinstance(optimizer, cls):
            group = saved_group if isinstance(saved_group, dict) else {}
            return keys | {key for setting, key in extra if group.get(setting)}
    return frozenset()


def step_problem(value: Any, reference: Any = None) -> str | None:
    """Why a saved `step` (`SCALAR_STATE`) cannot be one: a NaN step made every weight NaN after
    one Adam step, a negative one divided by zero, a uint8 255 (whose dtype `load_state_dict`
    keeps) wrapped to 0. A tensor step is floating point unless the running one (`reference`)
    has its dtype."""
    if not (_is_number(value) and _finite(value) and float(value) >= 0):
        return f"must be one finite number >= 0, found {shorten(value, 120)}"
    wraps = isinstance(value, torch.Tensor) and not value.is_floating_point()
    if wraps and getattr(reference, "dtype", None) != value.dtype:
        return f"is a tensor of dtype {value.dtype}, which wraps around; a step tensor is floating point"
    return None


def _saved_params(optimizer: Any, saved: Any, where: str) -> dict[int, tuple[torch.Tensor, int]]:
    """Saved parameter number -> (running parameter, elements in its group), matched by order
    as `load_state_dict` matches them, once the groups fit the running ones."""
    saved_groups = saved.get("param_groups") if isinstance(saved, dict) else None
    numbers = check_param_groups(optimizer, saved_groups, where)
    params: dict[int, tuple[torch.Tensor, int]] = {}
    for group, group_numbers in zip(optimizer.param_groups, numbers):
        group_numel = sum(p.numel() for p in group["params"])
        params.update((n, (p, group_numel)) for n, p in zip(group_numbers, group["params"]))
    return params


def _state_problem(key: str, value: Any, param: torch.Tensor, group_numel: int, reference: Any) -> str | None:
    if key in SCALAR_STATE:
        return step_problem(value, reference)
    if not isinstance(value, torch.Tensor):
        if isinstance(reference, torch.Tensor):
            return f"must be a tensor like the running optimizer's, found {shorten(value, 120)}"
        if key in PARAM_SHAPED_STATE and not (value is None and key == "momentum_buffer"):  # SGD without momentum
            return f"must be a tensor of its parameter's shape, found {shorten(value, 120)}"
        return None
    if value.dtype == torch.bool or value.is_complex():
        if not (isinstance(reference, torch.Tensor) and reference.dtype == value.dtype):
            return f"has dtype {value.dtype}, which no optimizer step takes for {param.dtype} parameters"
    shape = list(value.shape)
    if isinstance(reference, torch.Tensor):
        same = value.shape == reference.shape
        return None if same else f"has shape {shape}, the running optimizer's has {list(reference.shape)}"
    if value.shape == param.shape or (key not in PARAM_SHAPED_STATE and value.numel() <= 1):
        return None
    factored = value.dim() == param.dim() and all(v in (1, p) for v, p in zip(value.shape, param.shape))
    flat = value.dim() == 1 and value.numel() == group_numel
    if key not in PARAM_SHAPED_STATE and (factored or flat):
        return None
    return f"has shape {shape}, its parameter has {list(param.shape)}"


def check_scheduler_state(lr_scheduler: Any, saved: Any, where: str) -> None:
    """Refuse (`CheckpointError`) a saved lr-scheduler state that does not fit the running
    scheduler before anything is loaded: `load_state_dict` copies every key into the scheduler's
    attributes, so a key naming an attribute its state leaves out (its `optimizer`) or a value
    of another kind (a string step size) would break the first training step, not the load.
    Where the running state has a number, a flag, a string or a list, the saved one has the
    same kind (a list as long), an integer an integer (a `last_epoch` of 2.5 never decays the lr
    again); None is not judged, nor a key one torch version has and another lacks (`_is_initial`).
    Nested states, which `load_state_dict` loads in place, are held to the same rules against
    their running objects: SequentialLR's `_schedulers[i]`, a LambdaLR's callable object's
    `__dict__` (`lr_lambdas[i]`)."""
    if lr_scheduler is not None:
        _check_state(lr_scheduler, lr_scheduler.state_dict(), saved, f"{where}: lr_scheduler")


_FRACTIONAL = frozenset({"T_cur"})
"""Integers that take fractional epochs (`CosineAnnealingWarmRestarts.step(epoch)`)."""


def _check_state(owner: Any, current: dict[str, Any], saved: Any, where: str) -> None:
    if not isinstance(saved, dict):
        raise CheckpointError(f"{where} must be a mapping, found {shorten(saved, 120)}")
    foreign = [key for key in saved if key not in current
               and (not isinstance(key, str) or key.startswith("__") or hasattr(owner, key))]
    if foreign:
        raise CheckpointError(f"{where} holds {shorten(sorted(map(str, foreign)), 120)}, which the running "
                              "scheduler keeps out of its state: loading would replace its own")
    for key, value in ((k, v) for k, v in current.items() if k in saved):
        problem = _kind_problem(value, saved[key], depth=0)
        if problem is None and type(value) is int and type(saved[key]) is not int and key not in _FRACTIONAL:
            problem = f"must be an integer like the running {value!r}, found {shorten(saved[key], 120)}"
        if problem:
            raise CheckpointError(f"{where}.{key}: {problem}")
        parts = getattr(owner, key, None)  # the objects whose states a list holds (not plain mappings)
        if isinstance(value, list) and isinstance(parts, (list, tuple)) and len(parts) == len(value):
            for i, (part, state) in enumerate(zip(parts, value)):
                kept = saved[key][i] is None and not hasattr(part, "load_state_dict")  # LambdaLR skips a None
                if isinstance(state, dict) and not isinstance(part, dict) and not kept:
                    _check_state(part, state, saved[key][i], f"{where}.{key}[{i}]")


def _kind_problem(current: Any, saved: Any, depth: int) -> str | None:
    """Whether `saved` is a value of the kind `current` is (see `check_scheduler_state`)."""
    if current is None or depth > 3:
        return None
    if _is_number(current):
        fits = _is_number(saved) and (_finite(saved) or not _finite(current))
        return None if fits else f"must be a finite number like the running {current!r}, found {shorten(saved, 120)}"
    for kind, name in ((bool, "true or false"), (str, "a string")):
        if isinstance(current, kind):
            return None if isinstance(saved, kind) else f"must be {name}, found {shorten(saved, 120)}"
    if isinstance(current, (list, tuple)):
        if not isinstance(saved, (list, tuple)) or len(saved) != len(current):
            return f"must be a list of {len(current)} like the running one, found {shorten(saved, 120)}"
        for k, (c, v) in enumerate(zip(current, saved)):
            if problem := _kind_problem(c, v, depth + 1):
                return f"[{k}] {problem}"
    return None


def _ids(group: dict[str, Any], numbers: Any, ids: type, where: str) -> list[Any]:
    want = len(group["params"])
    if (not isinstance(numbers, list) or len(numbers) != want
            or not all(type(n) is ids for n in numbers) or len(set(numbers)) != len(numbers)):
        what = "parameter numbers" if ids is int else f"parameter ids ({ids.__name__})"
        raise CheckpointError(f"{where}.params must list {want} distinct {what} like the running optimizer's "
                              f"group, found {shorten(numbers, 120)}")
    return numbers


def _hyper_problem(current: Any, saved: Any, own: bool) -> str | None:
    """Where the running group has a number (or numbers, as Adam's betas), the saved group must
    have finite ones (unless the running one is not finite either). A key the saved group lacks
    is refused only when it is one of the optimizer's own hyper-parameters (`defaults`), which
    its step reads: keys others add to the running groups (a scheduler built since the save
    adds `initial_lr`) are not in an older save, and `load_state_dict` takes it without them."""
    if saved is _MISSING and not own:
        return None
    if _is_number(current):
        if saved is _MISSING:
            return f"missing; the running optimizer has {current!r}"
        if _is_number(saved) and (_finite(saved) or not _finite(current)):
            return None
        return f"must be a finite number like the running optimizer's {current!r}, found {shorten(saved, 120)}"
    if isinstance(current, (tuple, list)) and current and all(_is_number(c) for c in current):
        fits = (isinstance(saved, (tuple, list)) and len(saved) == len(current)
                and all(_is_number(s) and (_finite(s) or not _finite(c)) for s, c in zip(saved, current)))
        found = None if saved is _MISSING else saved
        return None if fits else (f"must be {len(current)} finite numbers like the running optimizer's "
                                  f"{current!r}, found {shorten(found, 120)}")
    if isinstance(current, bool) and saved is not _MISSING and not isinstance(saved, (bool, type(None))):
        return f"must be true or false like the running optimizer's {current!r}, found {shorten(saved, 120)}"
    return None


def _is_number(value: Any) -> bool:
    """A real number: int or float (not bool), or a tensor of one element (a tensor lr)."""
    if isinstance(value, torch.Tensor):
        return value.numel() == 1 and not value.is_complex() and value.dtype != torch.bool
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _finite(value: Any) -> bool:
    try:
        return math.isfinite(float(value))
    except OverflowError:  # an integer beyond a float's range
        return False
