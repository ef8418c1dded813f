"""`temporarily` on objects that do not hold what they show: a wrapper forwarding reads to the
object it wraps (peft's PeftModel, torch.compile's module), a lazy property with no deleter, and
several attributes whose restore fails at once."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lifecycle import DELETE, LifecycleError
from lifecycle.phase import temporarily
from lifecycle.temporary import Temporary


class _Inner:
    lr = None


class _Wrapper:
    """Forwards every read it cannot answer to the object it wraps, as peft's PeftModel does."""

    def __init__(self, inner: Any) -> None:
        self.__dict__["inner"] = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["inner"], name)


def test_a_change_of_a_forwarded_attribute_pins_nothing_on_the_wrapper_and_follows_the_wrapped_object_after() -> None:
    inner = _Inner()
    inner.lr = 1.0
    wrapper = _Wrapper(inner)
    with temporarily(wrapper, lr=5.0):
        assert wrapper.lr == 5.0
    assert sorted(vars(wrapper)) == ["inner"]
    inner.lr = 2.0  # the wrapped object moves on (a scheduler step)
    assert wrapper.lr == 2.0


def test_deleting_a_forwarded_attribute_is_refused_with_lifecycle_error_naming_wrapper_and_attribute() -> None:
    inner = _Inner()
    inner.lr = 1.0
    wrapper = _Wrapper(inner)
    with pytest.raises(LifecycleError, match=r"_Wrapper, lr=DELETE.*'lr' is read through _Wrapper's __getattr__"):
        temporarily(wrapper, lr=DELETE)
    assert sorted(vars(wrapper)) == ["inner"] and wrapper.lr == 1.0


def test_a_submodule_a_module_reads_through_its_getattr_is_still_replaced_deleted_and_put_back() -> None:
    model = torch.nn.Sequential()
    model.add_module("lin", torch.nn.Linear(2, 2))
    original = model.lin
    with temporarily(model, lin=torch.nn.Linear(3, 3)):
        assert model.lin is not original
    assert model.lin is original and "lin" not in vars(model)
    with temporarily(model, lin=DELETE):
        assert not hasattr(model, "lin")
    assert model.lin is original


def test_a_lazy_property_without_a_deleter_is_refused_up_front_and_left_unset() -> None:
    class Lazy:
        @property
        def x(self) -> int:
            try:
                return self._x  # type: ignore[no-any-return,attr-defined]
            except AttributeError:
                raise AttributeError("x not set yet") from None

        @x.setter
        def x(self, value: int) -> None:
            self._x = value

    lazy = Lazy()
    with pytest.raises(LifecycleError, match=r"Lazy, x=.*'x' has no value to put back.*cannot be deleted"):
        Temporary(lazy, {"x": 5})
    assert not hasattr(lazy, "x")


def test_a_lazy_attribute_that_can_be_deleted_is_still_set_and_removed_again() -> None:
    class Plain:
        pass

    plain = Plain()
    with Temporary(plain, {"fresh": 1}):
        assert plain.fresh == 1  # type: ignore[attr-defined]
    assert vars(plain) == {}


class _Two:
    __slots__ = ("a", "b", "fail")

    def __setattr__(self, name: str, value: Any) -> None:
        if getattr(self, "fail", False) and name in ("a", "b"):
            raise RuntimeError(f"cannot set {name}")
        object.__setattr__(self, name, value)


def test_a_restore_failing_for_two_attributes_names_both_with_each_error_in_its_notes() -> None:
    two = _Two()
    two.a, two.b, two.fail = 1, 2, False
    change = Temporary(two, {"a": 10, "b": 20})
    two.fail = True
    with pytest.raises(LifecycleError, match=r"_Two\.\{a, b\}.*cannot set a.*cannot set b") as info:
        change.restore()
    assert isinstance(info.value.__cause__, RuntimeError)
    assert info.value.__notes__ == ["a: RuntimeError: cannot set a", "b: RuntimeError: cannot set b"]
    assert (two.a, two.b) == (10, 20)


def test_a_restore_failing_for_one_attribute_of_two_puts_the_other_back_and_names_only_the_failed_one() -> None:
    class Half:
        def __init__(self) -> None:
            self.__dict__.update(a="orig-a", b="orig-b", locked=False)

        def __setattr__(self, name: str, value: Any) -> None:
            if self.locked and name == "b":
                raise RuntimeError("b is locked")
            self.__dict__[name] = value

    half = Half()
    change = Temporary(half, {"a": "tmp-a", "b": "tmp-b"})
    half.__dict__["locked"] = True
    with pytest.raises(LifecycleError, match=r"Half\.\{b\} failed for b \(RuntimeError: b is locked\)"):
        change.restore()
    assert half.a == "orig-a" and half.b == "tmp-b"


def test_an_interrupt_while_restoring_is_raised_as_itself_after_every_attribute_had_its_turn() -> None:
    class Stops:
        def __init__(self) -> None:
            self.__dict__.update(a="orig-a", b="orig-b", stop=False)

        def __setattr__(self, name: str, value: Any) -> None:
            if self.stop and name == "b":
                raise KeyboardInterrupt
            self.__dict__[name] = value

    obj = Stops()
    change = Temporary(obj, {"a": "tmp-a", "b": "tmp-b"})
    obj.__dict__["stop"] = True
    with pytest.raises(KeyboardInterrupt):
        change.restore()
    assert obj.a == "orig-a"


def test_a_parameter_deleted_then_assigned_a_plain_tensor_comes_back_as_the_same_parameter_in_state_dict() -> None:
    lin = torch.nn.Linear(2, 2)
    weight = lin.weight
    change = Temporary(lin, {"weight": DELETE})
    lin.weight = torch.zeros(2, 2)  # no longer a parameter: a plain attribute on the module
    change.restore()
    assert lin.weight is weight and lin.state_dict(keep_vars=True)["weight"] is weight
    assert list(lin.state_dict()) == ["weight", "bias"] and "weight" not in vars(lin)


def test_a_deleted_parameter_comes_back_at_its_place_so_parameters_and_state_dict_keep_their_order() -> None:
    lin = torch.nn.Linear(2, 2)
    before = list(lin.parameters())
    with temporarily(lin, weight=DELETE):
        assert list(lin.state_dict()) == ["bias"]
    after = list(lin.parameters())
    assert len(after) == 2 and all(a is b for a, b in zip(after, before))
    assert list(lin.state_dict()) == ["weight", "bias"]


def test_a_deleted_persistent_buffer_comes_back_registered_persistent_as_the_same_tensor() -> None:
    bn = torch.nn.BatchNorm1d(3)
    mean = bn.running_mean
    with temporarily(bn, running_mean=DELETE):
        assert "running_mean" not in bn.state_dict()
    assert bn.running_mean is mean and bn._buffers["running_mean"] is mean and "running_mean" not in vars(bn)
    assert list(bn.state_dict()) == ["weight", "bias", "running_mean", "running_var", "num_batches_tracked"]
    assert bn.state_dict(keep_vars=True)["running_mean"] is mean


def test_a_deleted_non_persistent_buffer_comes_back_registered_and_still_left_out_of_state_dict() -> None:
    module = torch.nn.Module()
    table = torch.arange(3.0)
    module.register_buffer("table", table, persistent=False)
    module.register_buffer("kept", torch.ones(1))
    with temporarily(module, table=DELETE):
        assert not hasattr(module, "table")
    assert module.table is table and list(module._buffers) == ["table", "kept"]
    assert "table" in module._non_persistent_buffers_set and list(module.state_dict()) == ["kept"]
    assert [name for name, _ in module.named_buffers()] == ["table", "kept"]


def test_a_buffer_replaced_by_a_parameter_during_the_change_comes_back_a_buffer_and_the_parameter_is_gone() -> None:
    bn = torch.nn.BatchNorm1d(3)
    mean = bn.running_mean
    change = Temporary(bn, {"running_mean": torch.zeros(3)})
    bn.running_mean = torch.nn.Parameter(torch.ones(3))  # torch moves the name to _parameters
    change.restore()
    assert bn.running_mean is mean and "running_mean" not in bn._parameters
    assert bn._buffers["running_mean"] is mean and "running_mean" in bn.state_dict()


def test_a_deleted_submodule_of_a_sequential_comes_back_in_its_place_so_forward_runs_in_order() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.ReLU(), torch.nn.Linear(3, 1))
    first = model[0]
    x = torch.randn(4, 2)
    expected = model(x)
    with Temporary(model, {"0": DELETE}):
        assert list(model._modules) == ["1", "2"]
    assert list(model._modules) == ["0", "1", "2"] and model[0] is first
    assert torch.equal(model(x), expected)


class _InterruptWithoutNotes(KeyboardInterrupt):
    """An interrupt as Python 3.10 (which pyproject allows) makes it: no `add_note`."""

    @property
    def add_note(self) -> Any:
        raise AttributeError("add_note")


def test_an_interrupt_without_add_note_as_on_python_3_10_still_carries_the_other_attributes_errors_in_its_notes() -> None:
    class Fails:
        def __init__(self) -> None:
            self.__dict__.update(a="orig-a", b="orig-b", stop=False)

        def __setattr__(self, name: str, value: Any) -> None:
            if self.stop and name == "a":
                raise RuntimeError("a is locked")
            if self.stop and name == "b":
                raise _InterruptWithoutNotes
            self.__dict__[name] = value

    obj = Fails()
    change = Temporary(obj, {"a": "tmp-a", "b": "tmp-b"})
    obj.__dict__["stop"] = True
    with pytest.raises(_InterruptWithoutNotes) as info:
        change.restore()
    assert info.value.__notes__ == ["a: RuntimeError: a is locked"]
