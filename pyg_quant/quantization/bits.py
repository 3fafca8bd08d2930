r"""Bit-width arguments: ``None`` (that operand stays in float) or an int in 1..8.

One width is checked by :func:`pyg_quant.layout.check_bits` (the layout fixes the widths it holds, and
:mod:`pyg_quant.bit_tensor`, below this package, checks with it too).  The layers and
:func:`pyg_quant.qat.prepare` take ``bits`` as shorthand for ``weight_bits = act_bits = bits``; ``weight_bits`` and
``act_bits`` default to :data:`UNSET` ("take ``bits``"), so that ``None`` can be given for either.
"""
from typing import Optional, Tuple

from ..layout import check_bits


def check_optional_bits(bits, name: str) -> Optional[int]:
    """``None`` (no quantization) or :func:`~pyg_quant.layout.check_bits` ``(bits, name)``."""
    return None if bits is None else check_bits(bits, name)


class _SameAsBits:
    """The default of ``weight_bits`` / ``act_bits``: "take ``bits``" (a sentinel, so that ``None``, float, can be
    given explicitly); its repr is what ``help()`` and ``inspect.signature`` show."""
    __slots__ = ()

    def __repr__(self) -> str:
        return "<same as bits>"

    def __reduce__(self) -> str:
        return "UNSET"  # copies and pickles are the one module-level instance, which `is` checks rely on


UNSET = _SameAsBits()


def resolve_bits(bits, weight_bits=UNSET, act_bits=UNSET) -> Tuple[Optional[int], Optional[int]]:
    """``(weight_bits, act_bits)``: each the one given, else ``bits``; each ``None`` or 1..8 (errors name ``bits``
    when it was given).  Giving ``bits`` and either of the others is ambiguous: a ValueError."""
    if bits is not None and (weight_bits is not UNSET or act_bits is not UNSET):
        raise ValueError("give either bits or weight_bits/act_bits, not both")
    weight_bits = bits if weight_bits is UNSET else weight_bits
    act_bits = bits if act_bits is UNSET else act_bits
    return check_optional_bits(weight_bits, "weight_bits" if bits is None else "bits"), \
        check_optional_bits(act_bits, "act_bits" if bits is None else "bits")
