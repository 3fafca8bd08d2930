r"""prepare / convert: float model → quantization-aware model → frozen inference model on the bit kernels.

``prepare`` swaps, keeping the weights (the same values; fp32 masters):

* :class:`torch_geometric.nn.GCNConv` (or a :class:`~pyg_quant.QGCNConv`) → :class:`QATGCNConv`;
* :class:`torch_geometric.nn.GINConv` (or a :class:`~pyg_quant.QGINConv`) → :class:`QATGINConv`
  (the Linears of its ``nn`` become :class:`QATLinear`);
* ``torch.nn.Linear`` / PyG ``Linear`` → :class:`QATLinear`.

Layers are the outermost such modules, in registration order (``model.named_modules()``);
the Linears inside a convolution belong to it.  With ``skip_last`` the last layer stays
fp32 (TANGO's rule: the layer before the softmax is the most sensitive); ``skip`` names
more layers to keep fp32.  A skipped PyG ``GCNConv`` / ``GINConv`` becomes
``QGCNConv(..., bits=None)`` / ``QGINConv(..., bits=None)`` sharing its parameters: the
same fp32 computation (PyG's, up to float32 rounding) and the same state dict keys, but a
layer that reads every adjacency the quantized ones read, a :class:`~pyg_quant.BitAdjacency`
(``QuantClusterLoader``'s ``batch.adj``) included, and BitTensor features (as the floats
they hold), so the prepared model runs on the inputs its quantized layers take.  Skipped
Linears and pyg_quant layers are left as they are.

``convert`` freezes every quantizer's range (observers off), turns gradients off and puts
the model in ``eval()``; each weight's codes are then packed once, on first use.  Its outputs
equal those of the QAT model in ``eval()``.  It works under ``torch.no_grad()`` and
``torch.inference_mode()`` alike.
"""
import copy
import warnings
from typing import Iterable, List, Optional, Tuple

import torch
from torch_geometric.nn import GCNConv, GINConv
from torch_geometric.nn.dense.linear import Linear as PyGLinear

from ..nn import QGCNConv, QGINConv, QuantLinear
from ..quantization.bits import UNSET, resolve_bits
from .conv import QATGCNConv, QATGINConv
from ..quantization.fake_quantize import FakeQuantize
from .linear import QATLinear
from .qconfig import QConfig

QAT_TYPES = (QATGCNConv, QATGINConv, QATLinear)


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


def _float_twin(layer: torch.nn.Module) -> torch.nn.Module:
    """A skipped PyG GCNConv / GINConv as ``QGCNConv`` / ``QGINConv`` with ``bits=None``, sharing its parameters.

    Anything else (a Linear, a pyg_quant layer, a convolution with an aggregation other
    than a sum, which the pyg_quant layers do not implement) is returned as it is.
    """
    if isinstance(layer, (QGCNConv, QGINConv)) or getattr(layer, "aggr", None) not in ("add", "sum"):
        return layer
    if isinstance(layer, GCNConv):
        twin = QGCNConv(layer.in_channels, layer.out_channels, layer.improved, layer.cached, layer.add_self_loops,
                        layer.normalize, layer.bias is not None, bits=None, aggr=layer.aggr, flow=layer.flow,
                        node_dim=layer.node_dim)
        twin.lin = QuantLinear.from_linear(layer.lin)  # the same weight Parameter (float: bits=None)
        if layer.bias is not None:
            twin.bias = layer.bias
    elif isinstance(layer, GINConv):
        # Built around a placeholder so that the constructor's reset_parameters cannot reach
        # layer.nn; then nn and eps (a Parameter with train_eps, else a buffer) are the layer's own.
        train_eps = isinstance(layer.eps, torch.nn.Parameter)
        twin = QGINConv(torch.nn.Identity(), float(layer.initial_eps), train_eps, bits=None, aggr=layer.aggr,
                        flow=layer.flow, node_dim=layer.node_dim)
        twin.nn = layer.nn
        twin.eps = layer.eps
    else:
        return layer
    return twin.train(layer.training)


def _set_submodule(model: torch.nn.Module, name: str, module: torch.nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, module)


def prepare(model: torch.nn.Module, bits: Optional[int] = None, *, weight_bits=UNSET, act_bits=UNSET,
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
            Skipped PyG ``GCNConv`` / ``GINConv`` layers become ``QGCNConv`` / ``QGINConv``
            with ``bits=None`` (fp32, and they read a ``BitAdjacency``), keeping their weights.
        inplace (bool): swap inside ``model`` instead of a deep copy.
        qconfig (QConfig, optional): all quantizer settings at once (then ``bits``,
            ``weight_bits``, ``act_bits``, ``stochastic`` and ``qconfig_kwargs`` must be left out).
        **qconfig_kwargs: more :class:`QConfig` fields: ``weight_observer``,
            ``input_observer``, ``agg_observer`` (``"dynamic"``, ``"minmax"``, ``"ema"``,
            ``"percentile"``, ``"mse"``, ``"dynamic_mse"``; ``"learned"`` for weights),
            ``keep_zeros``, ``agg_granularity``, ``momentum``, ``percentile``, ``seed``, ``degree_quant``.

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
        if bits is not None or weight_bits is not UNSET or act_bits is not UNSET or qconfig_kwargs:
            raise ValueError("give either qconfig or bits/weight_bits/act_bits/... keywords, not both")
    else:
        weight_bits, act_bits = resolve_bits(bits, weight_bits, act_bits)
        if weight_bits is None and act_bits is None:
            raise ValueError("prepare needs bits, or weight_bits and/or act_bits (1..8)")
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
        if kind == "qat":
            continue
        if name in skip:
            twin = _float_twin(layer)
            if twin is not layer:
                if name == "":
                    return twin
                _set_submodule(model, name, twin)
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


def _drop_inference_tensors(model: torch.nn.Module) -> None:
    """Replaces every parameter or buffer of ``model`` that is an inference tensor by an ordinary copy.

    To be called outside inference mode (where ``clone`` makes ordinary tensors).
    """
    copies = {}  # a tensor shared by several modules stays shared
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is not None and param.is_inference():
                if id(param) not in copies:
                    copies[id(param)] = torch.nn.Parameter(param.clone(), requires_grad=False)
                module._parameters[name] = copies[id(param)]
        for name, buf in list(module._buffers.items()):
            if buf is not None and buf.is_inference():
                module._buffers[name] = copies.setdefault(id(buf), buf.clone())
        if isinstance(module, QATLinear):
            module._packed = None  # its codes may have been keyed on a replaced weight


def convert(model: torch.nn.Module, inplace: bool = False) -> torch.nn.Module:
    r"""The inference model of a QAT model: ranges frozen, bit kernels, no gradients.

    Every :class:`FakeQuantize` stops observing (its range, and so its scale, is frozen;
    dynamic ranges, such as per-node ones, stay per input by design), every :class:`QATLinear` packs its
    weight codes once on first use, parameters stop requiring gradients, and the model is
    put in ``eval()``.  Called under ``torch.no_grad()`` or ``torch.inference_mode()`` (or
    neither: no tensor asks for a gradient any more) the QAT layers run their bit kernels;
    the outputs equal those of the QAT model in ``eval()``.

    ``convert`` may itself run under ``torch.inference_mode()`` (as Lightning's test and
    predict hooks do): the copy is made outside it, and parameters or buffers that are
    inference tensors are replaced by ordinary copies, so the converted model's weight
    codes and ranges keep the version counters their caches check.

    Args:
        model (torch.nn.Module): a model returned by :func:`prepare` (and trained).
        inplace (bool): freeze ``model`` itself instead of a deep copy.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    quantizers = fake_quantizers(model)
    if not quantizers:
        raise ValueError("model holds no FakeQuantize modules; call pyg_quant.qat.prepare (and train) first")
    # Tensors made under inference mode keep no version counter, which the caches of the
    # packed weights and input codes check: copy (and repair) outside it.
    with torch.inference_mode(False):
        if not inplace:
            model = copy.deepcopy(model)
            quantizers = fake_quantizers(model)
        _drop_inference_tensors(model)
    unobserved = [name for name, fq in quantizers if not fq.dynamic and not fq.observer.initialized]
    if unobserved:
        warnings.warn(f"quantizers {unobserved} have observed no data (train the prepared model first); "
                      "until they do they quantize each input over its own range", UserWarning, stacklevel=2)
    for _, fq in quantizers:
        fq.disable_observer()
    for param in model.parameters():
        param.requires_grad_(False)
    return model.eval()
