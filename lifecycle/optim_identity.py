"""Which optimizer and lr scheduler a checkpoint's state belongs to: the classes it records and
each parameter's name, so a resume gives every parameter its own state whatever order the
model declares its modules in, and refuses the state of another class (see `optim_state` for
the checks of the state itself)."""

from __future__ import annotations

from typing import Any

from lifecycle.errors import CheckpointError, shorten


OPTIM_JSON = "optimizer.json"
"""The file in which every built-in format keeps the optimizer's and the lr scheduler's structure
(hyper-parameters, parameter names, classes); their tensors go in the format's own files."""
STANDS_FOR = "lifecycle_stands_for"
"""The attribute in which a copy standing in for an optimizer or lr scheduler (an async save's
host copy) names the class of the live one, which `class_name` records in its place."""


def class_name(obj: Any) -> str:
    """The qualified class name a checkpoint records for its optimizer and lr scheduler."""
    named = getattr(obj, STANDS_FOR, None)
    if isinstance(named, str):
        return named
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def check_class(what: str, running: Any, saved: Any, where: str) -> None:
    """Refuse state another class saved: AdamW's groups loaded into Adam make it AdamW
    (`decoupled_weight_decay`), a StepLR's keys become attributes of a CosineAnnealingLR. The
    module is not compared: a class moved to another module, or defined in a script run as
    `__main__`, is still the same class. A checkpoint that predates the record (`saved` None)
    is not judged."""
    if running is None or saved is None:
        return
    qualname = type(running).__qualname__
    if isinstance(saved, str) and (saved == qualname or saved.endswith("." + qualname)):
        return
    raise CheckpointError(f"{where}: the {what} state was saved by {shorten(saved, 200)}, the running {what} is "
                          f"{class_name(running)!r}; build the {what} the checkpoint was saved with")


def parameter_names(model: Any, optimizer: Any) -> list[str] | None:
    """The model's name for each parameter of `optimizer`, in the order `optimizer.state_dict()`
    numbers them, matched by identity; of a tied parameter's names the first in sorted order, so
    the order modules are declared in does not change it. None without a model, or when a
    parameter is not the model's: such a state can only be matched by position."""
    named = getattr(model, "named_parameters", None)
    if not callable(named):
        return None
    try:  # every name of a tied parameter; a model's own named_parameters may not take the argument
        pairs = list(named(remove_duplicate=False))
    except TypeError:
        pairs = list(named())
    names: dict[int, str] = {}
    for name, param in pairs:
        names[id(param)] = min(names.get(id(param), name), name)
    found = [names.get(id(p)) for group in optimizer.param_groups for p in group["params"]]
    return None if None in found else [name for name in found if name is not None]


def by_name(saved: Any, saved_names: Any, running_names: list[str], optimizer: Any, where: str) -> Any:
    """`saved` (`optimizer.state_dict()`'s, numbers by position) with its groups, and the
    parameter numbers in each, put in the running optimizer's order by parameter name, so that
    `load_state_dict`, which pairs them by position, gives each parameter its own state, and each
    group its own hyper-parameters. Names that do not match one to one are refused, naming one.
    Groups that are not lists of numbers are returned as they are, for `check_optimizer_state`."""
    groups = saved.get("param_groups") if isinstance(saved, dict) else None
    lists = isinstance(groups, list) and all(isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups)
    numbers = [n for g in groups for n in g["params"]] if lists else []
    if not lists or not all(type(n) is int for n in numbers):
        return saved
    if (not isinstance(saved_names, list) or len(saved_names) != len(numbers)
            or len(set(saved_names)) != len(saved_names) or not all(isinstance(n, str) for n in saved_names)):
        raise CheckpointError(f"{where}: param_names must list {len(numbers)} distinct parameter names, one for "
                              f"each saved parameter, found {shorten(saved_names, 120)}")
    number_of = dict(zip(saved_names, numbers))
    group_of: dict[str, int] = {}
    start = 0
    for g, group in enumerate(groups):
        group_of.update((name, g) for name in saved_names[start:start + len(group["params"])])
        start += len(group["params"])
    extra = [n for n in saved_names if n not in set(running_names)]
    lost = [n for n in running_names if n not in number_of]
    found = [f"holds parameter(s) {shorten(extra, 200)}, which the running optimizer does not step"] if extra else []
    found += [f"lacks the running optimizer's parameter(s) {shorten(lost, 200)}"] if lost else []
    if found:
        raise CheckpointError(f"{where}: the checkpoint {' and '.join(found)}")
    out: list[dict[str, Any]] = []
    start = 0
    for r, group in enumerate(optimizer.param_groups):
        names = running_names[start:start + len(group["params"])]
        start += len(names)
        own = groups[_saved_group(names, r, group_of, len(groups), where)]
        new = {**own, "params": [number_of[n] for n in names]}
        if isinstance(own.get("param_names"), list) and len(own["param_names"]) == len(own["params"]):
            named = dict(zip(own["params"], own["param_names"]))
            new["param_names"] = [named.get(number_of[n]) for n in names]
        out.append(new)
    return {**saved, "param_groups": out}


def _saved_group(names: list[str], r: int, group_of: dict[str, int], count: int, where: str) -> int:
    """The saved group holding exactly the parameters `names` of running group `r` (an empty
    running group: the saved group at its position, empty too); else refused naming a parameter
    that is in one and not the other."""
    s = group_of[names[0]] if names else r
    holds = [n for n, g in group_of.items() if g == s]
    if s < count and sorted(holds) == sorted(names):
        return s
    here = f"{where}: param_groups[{r}] of the running optimizer"
    if not names:
        raise CheckpointError(f"{here} is empty, and the saved group at its position is not (or there is none)")
    if moved := next((n for n in names if n not in holds), None):
        raise CheckpointError(f"{here} holds {shorten(moved)}, which was saved in another group than "
                              f"{shorten(names[0])}: a parameter moved to another group")
    moved = next(n for n in holds if n not in names)
    raise CheckpointError(f"{here} lacks {shorten(moved)}, which was saved in one group with {shorten(names[0])}: "
                          "a parameter moved to another group")


def classes(optimizer: Any, lr_scheduler: Any) -> dict[str, str | None]:
    """What an optimizer.json records of the classes it was saved by, for `check_classes`."""
    return {"optimizer_class": class_name(optimizer),
            "lr_scheduler_class": None if lr_scheduler is None else class_name(lr_scheduler)}


def check_classes(optimizer: Any, lr_scheduler: Any, doc: Any, where: str) -> None:
    """`check_class` of the optimizer and the lr scheduler against what `classes` recorded."""
    recorded = doc if isinstance(doc, dict) else {}
    check_class("optimizer", optimizer, recorded.get("optimizer_class"), where)
    check_class("lr_scheduler", lr_scheduler, recorded.get("lr_scheduler_class"), where)
