"""torch.Tensor <-> k3.v1.Tensor: exact round trips and precise errors for malformed messages."""

from __future__ import annotations

import pytest
import torch

from k3.protos.v1 import common_pb2
from k3.services.common import tensors
from k3.services.common.errors import InvalidArgument


@pytest.mark.parametrize("name", sorted(tensors.ITEMSIZE))
def test_round_trip_every_wire_dtype(name):
    dtype = getattr(torch, name)
    source = (torch.randn(3, 5) * 4).to(dtype)
    msg = tensors.to_proto(source)
    assert msg.dtype == name and list(msg.shape) == [3, 5]
    assert len(msg.data) == 15 * tensors.ITEMSIZE[name] == 15 * source.element_size()
    for copy in (True, False):
        back = tensors.from_proto(msg, copy=copy)
        assert back.dtype == dtype and back.shape == source.shape
        # Bitwise equality (NaN-safe, works for every dtype).
        assert torch.equal(back.view(torch.uint8), source.view(torch.uint8))


def test_bytes_are_little_endian_row_major():
    msg = tensors.to_proto(torch.tensor([[1, 2], [3, 258]], dtype=torch.int16))
    assert msg.data == bytes([1, 0, 2, 0, 3, 0, 2, 1])


def test_non_contiguous_scalar_empty_and_bfloat16_values():
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    view = base.t()[1:, ::2]
    assert torch.equal(tensors.from_proto(tensors.to_proto(view)), view)
    scalar = torch.tensor(2.5, dtype=torch.bfloat16)
    back = tensors.from_proto(tensors.to_proto(scalar))
    assert back.shape == () and back.item() == 2.5 and back.dtype == torch.bfloat16
    empty = tensors.from_proto(tensors.to_proto(torch.zeros(0, 7, dtype=torch.int64)))
    assert empty.shape == (0, 7) and empty.dtype == torch.int64


def test_copy_gives_a_writable_tensor_independent_of_the_message():
    msg = tensors.to_proto(torch.ones(4))
    out = tensors.from_proto(msg)
    out += 1
    assert torch.equal(tensors.from_proto(msg), torch.ones(4))


def test_unsupported_dtype_on_encode():
    with pytest.raises(ValueError, match=r"dtype torch.complex64 is not supported on the wire"):
        tensors.to_proto(torch.zeros(2, dtype=torch.complex64))


@pytest.mark.parametrize(
    ("msg", "field", "message", "reason"),
    [
        (
            common_pb2.Tensor(dtype="complex64", shape=[1], data=b"\0" * 8),
            "block.tensors[0].dtype",
            "unsupported dtype 'complex64' (expected one of float64, float32,",
            "UNSUPPORTED_DTYPE",
        ),
        (
            common_pb2.Tensor(dtype="float32", shape=[2, -1], data=b""),
            "block.tensors[0].shape",
            "dimension 1 is negative (-1)",
            "BAD_SHAPE",
        ),
        (
            common_pb2.Tensor(dtype="bfloat16", shape=[2, 3], data=b"\0" * 11),
            "block.tensors[0].data",
            "has 11 bytes, expected 12 for shape [2, 3] of dtype bfloat16",
            "BAD_LENGTH",
        ),
    ],
)
def test_malformed_messages_name_the_field(msg, field, message, reason):
    with pytest.raises(InvalidArgument) as info:
        tensors.from_proto(msg, "block.tensors[0]")
    assert info.value.field == field
    assert info.value.message.startswith(message)
    assert info.value.reason == reason
    with pytest.raises(InvalidArgument):
        tensors.validate(msg, "block.tensors[0]")


def test_validate_returns_byte_length():
    assert tensors.validate(common_pb2.Tensor(dtype="int32", shape=[2, 2], data=b"\0" * 16)) == 16
    assert tensors.validate(common_pb2.Tensor(dtype="float32", shape=[], data=b"\0" * 4)) == 4
