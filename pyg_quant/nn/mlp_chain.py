r"""The chain of modules a GIN layer's ``nn`` applies, when it is linear layers and ReLUs: what the fused MLP paths
(:func:`pyg_quant.nn.quant_linear.fused_mlp_plan`, the layers' one-op eval paths) run as one kernel call.

Two containers qualify: a ``torch.nn.Sequential`` (its children in order), and PyG's
:class:`torch_geometric.nn.models.MLP` in ``eval()`` without normalization (``norm=None``, what PyG's ``GIN`` model
builds by default): its forward is ``lins[0], act, lins[1], act, ..., lins[-1]`` (an ``act`` after the last too
without ``plain_last``), its norms ``Identity``, its dropout a no-op in ``eval()`` and its activation a ReLU or none.
"""
from typing import NamedTuple, Optional

import torch
from torch_geometric.nn.models import MLP


class ChainView(NamedTuple):
    """A container's chain and what a kept plan of it checks."""
    steps: tuple  # the modules applied in order
    modules: tuple  # every module the result depends on (a fused call skips their forward hooks)
    entries: tuple  # (dict, key, module): where each of them sits in its parent, checked by identity
    values: tuple  # (dict, key, value): the flags the chain depends on, checked by equality
    sizes: tuple  # (dict, length): the containers' sizes


def chain_view(module) -> Optional[ChainView]:
    """The :class:`ChainView` of ``module`` (a Sequential, or a PyG ``MLP`` as the module docstring says), else
    None."""
    if type(module) is torch.nn.Sequential:
        return module_view(module, tuple(module._modules.values()))
    if type(module) is MLP:
        return _mlp_view(module)
    return None


def module_view(module, steps: Optional[tuple] = None) -> ChainView:
    """``module`` and its direct children as a :class:`ChainView` of ``steps`` (default: ``module`` alone, e.g. one
    linear layer)."""
    children = module._modules
    return ChainView((module,) if steps is None else steps, (module, *children.values()),
                     tuple((children, name, child) for name, child in children.items()), (),
                     ((children, len(children)),))


def linear_relu_pairs(steps: tuple, is_linear) -> Optional[tuple]:
    """``(linears, relus)`` of a chain's ``steps`` when they are linear layers (``is_linear(module)``), each
    optionally followed by a ``torch.nn.ReLU`` (``relus[i]``: one follows ``linears[i]``); None otherwise."""
    linears, relus, i = [], [], 0
    while i < len(steps):
        if not is_linear(steps[i]):
            return None
        relu = i + 1 < len(steps) and type(steps[i + 1]) is torch.nn.ReLU
        linears.append(steps[i])
        relus.append(relu)
        i += 2 if relu else 1
    return (tuple(linears), tuple(relus)) if linears else None


def _mlp_view(mlp: MLP) -> Optional[ChainView]:
    parts = mlp._modules
    lins, norms, act = parts.get("lins"), parts.get("norms"), parts.get("act")
    if mlp.training or lins is None or norms is None or len(lins) == 0:
        return None  # (in training its dropout draws)
    if act is not None and type(act) is not torch.nn.ReLU:
        return None
    # MLP.forward zips lins with norms (an activation after each), then runs the last linear layer alone when
    # plain_last: one norm fewer than lins then.
    with_act = len(lins) - 1 if mlp.plain_last else len(lins)
    if len(norms) != with_act or any(type(norm) is not torch.nn.Identity for norm in norms):
        return None
    steps = []
    for i, lin in enumerate(lins):
        steps.append(lin)
        if i < with_act and act is not None:
            steps.append(act)
    entries = ((parts, "lins", lins), (parts, "norms", norms), (parts, "act", act))
    entries += tuple((lins._modules, name, lin) for name, lin in lins._modules.items())
    entries += tuple((norms._modules, name, norm) for name, norm in norms._modules.items())
    values = ((mlp.__dict__, "training", False), (mlp.__dict__, "plain_last", mlp.plain_last))
    modules = (mlp, lins, norms, *lins, *norms) + (() if act is None else (act,))
    return ChainView(tuple(steps), modules, entries, values,
                     ((lins._modules, len(lins)), (norms._modules, len(norms))))


__all__ = ["ChainView", "chain_view", "module_view", "linear_relu_pairs"]
