"""``torch.Tensor`` <-> ``k3.v1.Tensor``: raw little-endian bytes with dtype and shape, never pickle.

Design decisions:

- A fixed whitelist of dtypes (torch names without the ``torch.`` prefix) keeps the wire format explicit;
  anything else is rejected rather than guessed.
- Validation (``validate``) checks everything a peer controls (dtype, shape, byte length) without decoding
  and without torch, so services that only store or forward tensors (the cache store) never import torch.
  Errors are ``InvalidArgument`` naming the field (``block.tensors[2].data``), ready to become a status.
- Bytes are reinterpreted, not parsed: encoding is one copy (tensor memory -> protobuf bytes); decoding is
  one copy into a fresh writable buffer by default, while ``copy=False`` shares the message's bytes for
  read-only use (torch cannot mark a tensor read-only, so writing to such a tensor is the caller's bug).
- Only little-endian hosts are supported (the wire format is little-endian, as are all supported platforms).
"""

from __future__ import annotations

import math
import sys
import warnings
from typing import TYPE_CHECKING

from k3.protos.v1 import common_pb2
from k3.services.common.errors import InvalidArgument

if TYPE_CHECKING:
    import torch

# Wire dtype name -> bytes per element. Names are torch's, so the torch dtype is ``getattr(torch, name)``.
ITEMSIZE: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
}

if sys.byteorder != "little":  # pragma: no cover - no supported platform is big-endian
    raise ImportError("k3 tensors travel little-endian; big-endian hosts are not supported")


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``; ValueError for dtypes that have no wire form."""
    name = str(dtype).removeprefix("torch.")
    if name not in ITEMSIZE:
        raise ValueError(f"dtype {dtype} is not supported on the wire (supported: {', '.join(ITEMSIZE)})")
    return name


def to_proto(tensor: torch.Tensor) -> common_pb2.Tensor:
    """Encode a tensor (any device, any strides) as ``k3.v1.Tensor``."""
    import torch

    name = dtype_name(tensor.dtype)
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    data = flat.view(torch.uint8).numpy().tobytes()
    return common_pb2.Tensor(dtype=name, shape=list(tensor.shape), data=data)


def nbytes(msg: common_pb2.Tensor, field: str = "tensor") -> int:
    """The byte length ``msg`` must have for its dtype and shape (validating both)."""
    itemsize = ITEMSIZE.get(msg.dtype)
    if itemsize is None:
        raise InvalidArgument(
            f"{field}.dtype",
            f"unsupported dtype {msg.dtype!r} (expected one of {', '.join(ITEMSIZE)})",
            reason="UNSUPPORTED_DTYPE",
        )
    for i, dim in enumerate(msg.shape):
        if dim < 0:
            raise InvalidArgument(f"{field}.shape", f"dimension {i} is negative ({dim})", reason="BAD_SHAPE")
    return math.prod(msg.shape) * itemsize


def validate(msg: common_pb2.Tensor, field: str = "tensor") -> int:
    """Check that ``msg`` decodes (dtype, shape, byte length) without decoding it; returns its byte length."""
    expected = nbytes(msg, field)
    size = len(msg.data)
    if size != expected:
        raise InvalidArgument(
            f"{field}.data",
            f"has {size} bytes, expected {expected} for shape {list(msg.shape)} of dtype {msg.dtype}",
            reason="BAD_LENGTH",
        )
    return size


def from_proto(msg: common_pb2.Tensor, field: str = "tensor", *, copy: bool = True) -> torch.Tensor:
    """Decode ``k3.v1.Tensor``; raise ``InvalidArgument`` naming ``field`` if it is malformed."""
    import torch

    size = validate(msg, field)
    dtype = getattr(torch, msg.dtype)
    shape = tuple(msg.shape)
    if size == 0:
        return torch.empty(shape, dtype=dtype)
    data = msg.data
    if copy:
        flat = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    else:
        with warnings.catch_warnings():
            # frombuffer warns that bytes are not writable; with copy=False that is the documented contract.
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(data, dtype=torch.uint8)
    return flat.view(dtype).reshape(shape)
