"""Stable wire codes for torch dtypes.

The code table is part of the protocol (docs/protocol.md, "Dtypes"): codes are never reused or
renumbered. Dtypes a torch build lacks are skipped at import, so an older torch still speaks the
protocol for the dtypes it has. Quantized dtypes (qint8, quint8, ...) carry scale/zero-point state
outside their bytes and are refused rather than silently sent without it.
"""

from __future__ import annotations

import torch

from tensorwire.errors import InvalidTensor

# code -> torch attribute name. Append only.
_WIRE_NAMES: dict[int, str] = {
    1: "bool",
    2: "uint8",
    3: "int8",
    4: "int16",
    5: "int32",
    6: "int64",
    7: "float16",
    8: "bfloat16",
    9: "float32",
    10: "float64",
    11: "complex32",
    12: "complex64",
    13: "complex128",
    14: "float8_e4m3fn",
    15: "float8_e5m2",
    16: "float8_e4m3fnuz",
    17: "float8_e5m2fnuz",
    18: "float8_e8m0fnu",
    19: "uint16",
    20: "uint32",
    21: "uint64",
    22: "float4_e2m1fn_x2",
    23: "bits8",
    24: "bits16",
    25: "bits1x8",
    26: "bits2x4",
    27: "bits4x2",
}

CODE_TO_DTYPE: dict[int, torch.dtype] = {
    code: getattr(torch, name) for code, name in _WIRE_NAMES.items() if hasattr(torch, name)
}
DTYPE_TO_CODE: dict[torch.dtype, int] = {dtype: code for code, dtype in CODE_TO_DTYPE.items()}
SUPPORTED_DTYPES: tuple[torch.dtype, ...] = tuple(CODE_TO_DTYPE.values())


def dtype_code(dtype: torch.dtype) -> int:
    """The wire code of ``dtype``; InvalidTensor for dtypes the protocol cannot carry."""
    try:
        return DTYPE_TO_CODE[dtype]
    except KeyError:
        raise InvalidTensor(f"dtype {dtype} cannot be sent: quantized or unknown to the protocol") from None


def dtype_from_code(code: int) -> torch.dtype:
    """The torch dtype for a wire code; InvalidTensor for a code this build does not know."""
    try:
        return CODE_TO_DTYPE[code]
    except KeyError:
        raise InvalidTensor(f"unknown dtype code {code}") from None


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    """``"float32"`` or ``"torch.float32"`` -> ``torch.float32``; InvalidTensor if unsupported."""
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype) or dtype not in DTYPE_TO_CODE:
        raise InvalidTensor(f"unsupported dtype name {name!r}")
    return dtype
