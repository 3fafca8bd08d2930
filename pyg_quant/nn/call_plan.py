r"""What a layer keeps between eval calls: the arguments of its op that depend on its modules alone.

The layers' short eval paths (:mod:`pyg_quant.nn._eval_path`, :mod:`pyg_quant.qat.eval_path`) pass their ops weight
codes, bit widths, stored ranges and such, which the checks that make them (the modules' types, flags, widths,
parameters, quantizers) cost more host time than the op's dispatch.  A :class:`CallPlan` keeps those arguments with
what they were made from, and :func:`plan_holds` tells, from identities, values and version counters alone, whether
the checks would give the same again: a changed module, flag, parameter or stored range (an optimizer step, a loaded
state, ``.to()``, a swapped submodule) makes the layer run its checks and keep a new plan.  :func:`kept` does the
same for one value made from one parameter or buffer (``1 + eps``, a detached bias).
"""
from typing import Callable, Iterable, NamedTuple, Optional, Tuple

import torch
from torch import Tensor

from .._utils import is_compiling, no_hooks


class CallPlan(NamedTuple):
    """A layer's op arguments with what they were made from."""
    objects: tuple  # (dict, key, object): modules, parameters and observers, by identity
    values: tuple  # (dict, key, value): flags and bit widths, by equality
    sizes: tuple  # (dict, length): containers' sizes (a module added to one)
    tensors: tuple  # (tensor, (data_ptr, version, dtype, shape)): parameters, buffers and stored ranges
    hooked: tuple  # the modules whose forward hooks a fused call would skip: checked at every call
    args: tuple  # what the op takes from the layer


def new_plan(objects: Iterable, values: Iterable, sizes: Iterable, tensors: Iterable[Optional[torch.Tensor]],
             hooked: Iterable, args: tuple) -> Optional[CallPlan]:
    """A :class:`CallPlan` of ``args``, or None where one of ``tensors`` is an inference tensor (no version counter
    to tell an edit by); None entries of ``tensors`` are skipped."""
    marks = []
    for tensor in tensors:
        if tensor is None:
            continue
        if tensor.is_inference():
            return None
        marks.append((tensor, (tensor.data_ptr(), tensor._version, tensor.dtype, tensor.shape)))
    return CallPlan(tuple(objects), tuple(values), tuple(sizes), tuple(marks), tuple(hooked), args)


def plan_holds(plan: CallPlan) -> bool:
    """Whether what ``plan`` was made from is unchanged and no forward hook would run (eager calls without a
    gradient: the callers check those, and ``torch.compile``, themselves)."""
    for table, key, obj in plan.objects:
        if table.get(key) is not obj:
            return False
    for table, key, value in plan.values:
        if table.get(key) != value:
            return False
    for table, size in plan.sizes:
        if len(table) != size:
            return False
    for tensor, mark in plan.tensors:
        if (tensor.data_ptr(), tensor._version, tensor.dtype, tensor.shape) != mark:
            return False
    return no_hooks(*plan.hooked)


def held_plan(module, name: str) -> Optional[CallPlan]:
    """The plan kept in ``module.__dict__`` under ``name`` if it still holds (:func:`plan_holds`), else None (always
    while ``torch.compile`` traces: a traced graph reads no version counters and makes its arguments itself)."""
    if is_compiling():
        return None
    plan = module.__dict__.get(name)
    return plan if plan is not None and plan_holds(plan) else None


def tensor_slot(module, name: str) -> Tuple[Optional[dict], object]:
    """``(the dict holding it, its value)`` for the parameter or buffer ``name`` of ``module``, read from the
    module's dicts (``nn.Module.__getattr__`` is most of an eval call's checks); ``(None, getattr(module, name))``
    for any other attribute."""
    for table in (module._parameters, module._buffers):
        if name in table:
            return table, table[name]
    return None, getattr(module, name)


def kept(module, name: str, tensor: Tensor, make: Callable[[Tensor], Tensor]) -> Tensor:
    """``make(tensor)`` for a parameter or buffer ``tensor`` of ``module``, kept in its ``__dict__`` under ``name``
    while it is the same tensor with the same storage (``.to()``, ``.data =``) and version (in-place edits, a loaded
    state); an inference tensor, which has no version counter, gets it made at every call, and so does a graph
    ``torch.compile`` traces (nothing kept)."""
    if is_compiling():
        return make(tensor)
    held = module.__dict__.get(name)
    if held is not None and held[0] is tensor and held[1] == tensor.data_ptr() and held[2] == tensor._version:
        return held[3]
    value = make(tensor)
    if not tensor.is_inference():
        module.__dict__[name] = (tensor, tensor.data_ptr(), tensor._version, value)
    return value


__all__ = ["CallPlan", "new_plan", "plan_holds", "held_plan", "tensor_slot", "kept"]
