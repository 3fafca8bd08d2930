r"""prepare / convert: float model → quantization-aware model → frozen inference model on the bit kernels.

``prepare`` swaps, keeping the weights (the same values; fp32 masters):

* :class:`torch_geometric.nn.GCNConv` (or a :class:`~pyg_quant.QGCNConv`) → :class:`QATGCNConv`;
* :class:`torch_geometric.nn.GINConv` (or a :class:`~pyg_quant.QGINConv`) → :class:`QATGINConv`
  (the Linears of its ``nn`` become :class:`QATLinear`);
* ``torch.nn.Linear`` / PyG ``Linear`` → :class:`QATLinear`.

Layers are the outermost such modules, in registration order (``model.named_modules()``);
the Linears inside a convolution belong to it.  With ``skip_last`` the last layer stays
fp32 (TANGO's rule: the layer before the softmax is the most sensitive); ``skip`` names
more modules to leave alone.

``convert`` freezes every quantizer's range (observers off), packs the weight codes once,
turns gradients off and puts the model in ``eval()``; its outputs equal those of the QAT
model in ``eval()``.
"""
import copy
import warnings
from typing import Iterable, List, Optional, Tuple

import torch
from torch_geometric.nn import GCNConv, GINConv
from torch_geometric.nn.dense.linear import Linear as PyGLinear

from ..nn import QGCNConv, QGINConv
from .conv import QATGCNConv, QATGINConv
from .fake_quantize import FakeQuantize
from .linear import QATLinear
from .qconfig import QConfig

QAT_TYPES = (QATGCNConv, QATGINConv, QATLinear)
_UNSET = object()


def _layer_kind(module: torch.nn.Module) -> Optional[str]:
    if isinstance(module, QAT_TYPES):
        return "qat"
    if isinstance(module, (GCNConv, QGCNConv)):
        return "gcn"
    if isinstance(module, (GINConv, QGINConv)):
        return "gin"
    if isinstance(module, (torch.nn.Linear, PyGLinear)):
        return "linear"
    return None


def quantizable_layers(model: torch.nn.Module) -> List[Tuple[str, torch.nn.Module]]:
    """``(name, module)`` of the outermost layers ``prepare`` would swap (or has swapped), in order."""
    found: List[Tuple[str, torch.nn.Module]] = []

    def walk(prefix: str, module: torch.nn.Module):
        for name, child in module.named_children():
            full = f"{prefix}.{name}" if prefix else name
            if _layer_kind(child) is not None:
                found.append((full, child))
            else:
                walk(full, child)

    if _layer_kind(model) is not None:
        return [("", model)]
    walk("", model)
    return found


def _set_submodule(model: torch.nn.Module, name: str, module: torch.nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, module)


def _resolve_bits(bits, weight_bits, act_bits) -> Tuple[Optional[int], Optional[int]]:
    if bits is not None and (weight_bits is not _UNSET or act_bits is not _UNSET):
        raise ValueError("give either bits or weight_bits/act_bits, not both")
    weight_bits = bits if weight_bits is _UNSET else weight_bits
    act_bits = bits if act_bits is _UNSET else act_bits
    if weight_bits is None and act_bits is None:
        raise ValueError("prepare needs bits, or weight_bits and/or act_bits (1..8)")
    return weight_bits, act_bits


def prepare(model: torch.nn.Module, bits: Optional[int] = None, *, weight_bits=_UNSET, act_bits=_UNSET,
            stochastic: bool = True, skip_last: bool = True, skip: Iterable[str] = (), inplace: bool = False,
            qconfig: Optional[QConfig] = None, **qconfig_kwargs) -> torch.nn.Module:
    r"""A quantization-aware copy of ``model`` (see the module docstring).

    Args:
        model (torch.nn.Module): a float model (or a single layer).
        bits (int, optional): 1..8 for weights and activations alike.
        weight_bits, act_bits (int, optional): separate widths instead of ``bits``
            (``None`` keeps that kind of tensor in float).
        stochastic (bool): stochastic rounding in training (TANGO); nearest in evaluation.
        skip_last (bool): keep the last layer fp32 (TANGO's rule before the softmax).
        skip (iterable of str): names (as in ``named_modules``) of more layers to keep fp32.
        inplace (bool): swap inside ``model`` instead of a deep copy.
        qconfig (QConfig, optional): all quantizer settings at once (then ``bits``,
            ``weight_bits``, ``act_bits``, ``stochastic`` and ``qconfig_kwargs`` must be left out).
        **qconfig_kwargs: more :class:`QConfig` fields: ``weight_observer``,
            ``input_observer``, ``agg_observer`` (``"dynamic"``, ``"minmax"``, ``"ema"``,
            ``"percentile"``, ``"mse"``, ``"dynamic_mse"``), ``momentum``, ``percentile``, ``seed``, ``degree_quant``.

    Returns the prepared model, in the training mode ``model`` was in.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(skip_last, bool):
        raise TypeError(f"skip_last must be a bool, got {type(skip_last).__name__}")
    if isinstance(skip, str):
        skip = (skip,)
    skip = set(skip)
    if qconfig is not None:
        if not isinstance(qconfig, QConfig):
            raise TypeError(f"qconfig must be a pyg_quant.qat.QConfig, got {type(qconfig).__name__}")
        if bits is not None or weight_bits is not _UNSET or act_bits is not _UNSET or qconfig_kwargs:
            raise ValueError("give either qconfig or bits/weight_bits/act_bits/... keywords, not both")
    else:
        weight_bits, act_bits = _resolve_bits(bits, weight_bits, act_bits)
        qconfig = QConfig(weight_bits=weight_bits, act_bits=act_bits, stochastic=stochastic, **qconfig_kwargs)

    if not inplace:
        model = copy.deepcopy(model)
    layers = quantizable_layers(model)
    names = {name for name, _ in layers}
    unknown = skip - names
    if unknown:
        raise ValueError(f"skip names {sorted(unknown)} are not layers of the model; layers: {sorted(names)}")
    if skip_last and layers:
        skip.add(layers[-1][0])

    if not any(name not in skip or _layer_kind(layer) == "qat" for name, layer in layers):
        warnings.warn(f"prepare leaves every layer in float: layers {[name for name, _ in layers]}, skipped "
                      f"{sorted(skip)} (skip_last={skip_last} keeps the last one fp32)", UserWarning, stacklevel=2)
    counter = [0]
    for name, layer in layers:
        kind = _layer_kind(layer)
        if name in skip or kind == "qat":
            continue
        if kind == "gcn":
            new = QATGCNConv.from_float(layer, qconfig, counter)
        elif kind == "gin":
            new = QATGINConv.from_float(layer, qconfig, counter)
        else:
            new = QATLinear.from_linear(layer, qconfig, counter)
        device = next((t.device for t in layer.parameters()), None)
        if device is not None:
            new.to(device)
        new.train(layer.training)
        if name == "":
            return new
        _set_submodule(model, name, new)
    return model


def fake_quantizers(model: torch.nn.Module) -> List[Tuple[str, FakeQuantize]]:
    """``(name, FakeQuantize)`` of every quantizer in ``model``."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, FakeQuantize)]


def convert(model: torch.nn.Module, inplace: bool = False) -> torch.nn.Module:
    r"""The inference model of a QAT model: ranges frozen, bit kernels, no gradients.

    Every :class:`FakeQuantize` stops observing (its range, and so its scale, is frozen;
    dynamic ranges, such as per-node ones, stay per input by design), every :class:`QATLinear` packs its
    weight codes once on first use, parameters stop requiring gradients, and the model is
    put in ``eval()``.  Called under ``torch.no_grad()`` (or not: no tensor asks for a
    gradient any more) the QAT layers run their bit kernels; the outputs equal those of
    the QAT model in ``eval()``.

    Args:
        model (torch.nn.Module): a model returned by :func:`prepare` (and trained).
        inplace (bool): freeze ``model`` itself instead of a deep copy.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    quantizers = fake_quantizers(model)
    if not quantizers:
        raise ValueError("model holds no FakeQuantize modules; call pyg_quant.qat.prepare (and train) first")
    if not inplace:
        model = copy.deepcopy(model)
        quantizers = fake_quantizers(model)
    unobserved = [name for name, fq in quantizers if not fq.dynamic and not fq.observer.initialized]
    if unobserved:
        warnings.warn(f"quantizers {unobserved} have observed no data (train the prepared model first); "
                      "until they do they quantize each input over its own range", UserWarning, stacklevel=2)
    for _, fq in quantizers:
        fq.disable_observer()
    for param in model.parameters():
        param.requires_grad_(False)
    return model.eval()
