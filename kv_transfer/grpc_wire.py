"""The ``grpc`` KV transport's messages on the wire (``grpc_transport.py``): a pull's stream
read into one buffer and checked (``receive``), and ``PullChunk.data`` framed by hand."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kv_transfer.blocks import KVPayload
from kv_transfer.proto import kv_transfer_pb2 as pb

DTYPES: dict[torch.dtype, tuple[int, np.dtype[Any]]] = {
    torch.float32: (pb.DTYPE_FLOAT32, np.dtype(np.float32)),
    torch.float16: (pb.DTYPE_FLOAT16, np.dtype(np.float16)),
    torch.bfloat16: (pb.DTYPE_BFLOAT16, np.dtype(np.int16)),  # bit patterns, as everywhere
}
NUMPY_DTYPES: dict[int, np.dtype[Any]] = {code: dtype for code, dtype in DTYPES.values()}

# The key of PullChunk.data on the wire: field 2, length-delimited.
DATA_KEY = bytes([2 << 3 | 2])


@dataclass(frozen=True)
class GrpcLease:
    """A ``KVSegment.handle`` of this transport: where a lease is served. Small and picklable;
    it travels in ``kv_transfer_params``. Holds no secret: pulls need the cluster token too."""

    address: str  # host:port of the source worker's KV server
    lease_id: str
    first_layer: int  # the model layers [first_layer, last_layer) the lease covers
    last_layer: int
    num_blocks: int


def receive(call: Iterator[bytes], handle: GrpcLease, layers: range) -> KVPayload:
    """Read a pull's stream into one buffer; check it against the handle and the request
    before anything is allocated or kept."""
    first = next(call, None)
    message = None if first is None else pb.PullChunk.FromString(first)
    if message is None or message.WhichOneof("kind") != "header":
        raise ValueError("the KV stream did not start with a header")
    h = message.header
    dtype = NUMPY_DTYPES.get(h.dtype)
    shape = (h.num_layers, 2, h.num_blocks, h.block_size, h.kv_heads, h.head_dim)
    if dtype is None:
        raise ValueError(f"the KV stream has an unknown dtype ({h.dtype})")
    expected = (layers.start, len(layers), handle.num_blocks)
    if (h.first_layer, h.num_layers, h.num_blocks) != expected:
        raise ValueError(
            f"the KV stream holds layers [{h.first_layer}, +{h.num_layers}) x {h.num_blocks} "
            f"blocks; asked for {layers} x {handle.num_blocks}"
        )
    if h.total_bytes != int(np.prod(shape)) * dtype.itemsize:
        raise ValueError(f"the KV stream's size ({h.total_bytes} B) does not match its shape")
    buffer = np.empty(h.total_bytes, dtype=np.uint8)
    filled = 0
    for raw in call:
        start, size = unframe(raw)
        if filled + size > h.total_bytes:
            raise ValueError("the KV stream sent more than its header announced")
        buffer[filled : filled + size] = np.frombuffer(raw, np.uint8, size, start)
        filled += size
    if filled != h.total_bytes:
        raise ValueError(f"the KV stream ended after {filled} of {h.total_bytes} bytes")
    data = buffer.view(dtype).reshape(shape)
    pieces = [data[i, kv] for i, kv in itertools.product(range(h.num_layers), (0, 1))]
    return KVPayload(
        runs=[h.num_blocks],
        pieces=pieces,
        num_layers=h.num_layers,
        bfloat16=h.dtype == pb.DTYPE_BFLOAT16,
        first_layer=h.first_layer,
    )


# -- PullChunk.data on the wire ---------------------------------------------------------------
# A data message is built and read by hand: protobuf would copy each payload three more times
# (into the message, out to the wire, out of the parsed message), which costs more than the
# network on one machine. The bytes are a valid PullChunk all the same:
#
#     0x12  varint(len(data))  data          (field 2, length-delimited)
def frame(parts: list[memoryview], size: int) -> bytes:
    """The encoded ``PullChunk(data=b"".join(parts))``, in one copy."""
    return b"".join([DATA_KEY, varint(size), *parts])


def unframe(message: bytes) -> tuple[int, int]:
    """(offset, length) of the data in an encoded ``PullChunk``; ``ValueError`` if it is not
    a data message (or is malformed)."""
    if message[:1] != DATA_KEY:
        raise ValueError("the KV stream sent something other than data after its header")
    size, shift, i = 0, 0, 1
    while True:
        if i >= len(message) or shift > 63:
            raise ValueError("the KV stream sent a malformed data message")
        byte = message[i]
        size |= (byte & 0x7F) << shift
        i, shift = i + 1, shift + 7
        if not byte & 0x80:
            break
    if i + size != len(message):
        raise ValueError("the KV stream sent a malformed data message")
    return i, size


def varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def as_is(data: bytes) -> bytes:
    return data
