r"""Degree-Quant's protective masking (Tailor et al., ICLR 2021).

High in-degree nodes aggregate many messages, so their aggregates span the
widest ranges and suffer most from quantization noise.  In training, each node
is left in float with probability

.. math::
    p_i = p_{min} + (p_{max} - p_{min}) \cdot \frac{r_i}{N - 1},

``r_i`` its rank by in-degree (0 for the lowest; ties broken by index), so the
gradient keeps seeing the hubs unquantized while every node is quantized in
evaluation.
"""
from typing import Callable, Tuple

import torch


def protection_probability(degree: torch.Tensor, p_range: Tuple[float, float]) -> torch.Tensor:
    """``p_i`` per node (float32 ``[N]``) from the degrees ``[N]``."""
    if degree.dim() != 1:
        raise ValueError(f"degree must be 1-D [num_nodes], got shape {tuple(degree.shape)}")
    n = degree.numel()
    order = torch.argsort(degree.detach().to(torch.float32), stable=True)
    rank = torch.empty(n, dtype=torch.float32, device=degree.device)
    rank[order] = torch.arange(n, dtype=torch.float32, device=degree.device)
    p_min, p_max = p_range
    return p_min + (p_max - p_min) * rank / max(n - 1, 1)


def protect_mask(degree: torch.Tensor, p_range: Tuple[float, float],
                 noise: Callable[[tuple, torch.device], torch.Tensor]) -> torch.Tensor:
    """A bool ``[N]`` draw of the protected nodes; ``noise(shape, device)`` gives ``U[0, 1)``."""
    p = protection_probability(degree, p_range)
    return noise((p.numel(),), p.device) < p
