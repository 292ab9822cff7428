"""The GGUF container, read by our own parser: its metadata and each tensor's raw bytes (no
torch: the API server reads a GGUF file's tokenizer with it; ``gguf_loader`` builds the model's
tensors from it).

``gguf.GGUFReader`` needs ~5 s for the 98 MB SmolLM2 file because it wraps every vocabulary
string in a numpy array; our parser takes ~0.2 s.

Layout of a GGUF v2/v3 file (all little endian)::

    magic "GGUF" | version u32 | n_tensors u64 | n_kv u64
    n_kv x (key: str, value_type: u32, value)          str = len u64 + utf-8 bytes
    n_tensors x (name: str, n_dims u32, dims u64[n_dims] (ggml order: fastest first),
                 ggml_type u32, offset u64)             offset relative to the data section
    padding to ``general.alignment`` (default 32) | data section
"""

from __future__ import annotations

import math
import mmap
import os
import struct
from dataclasses import dataclass, field
from typing import Any, TypeAlias

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

Source: TypeAlias = "GGUFFile | str | os.PathLike[str]"

# ---------------------------------------------------------------------------------------------
# Container parsing
# ---------------------------------------------------------------------------------------------

_SCALAR_FMT: dict[int, str] = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}


@dataclass(frozen=True)
class TensorInfo:
    """One tensor's directory entry; ``shape`` is in torch order (slowest dimension first)."""

    name: str
    ggml_type: GGMLQuantizationType
    shape: tuple[int, ...]
    offset: int  # absolute byte offset in the file
    nbytes: int


@dataclass
class GGUFFile:
    """A parsed GGUF file: metadata, tensor directory and a read-only memory map of the data.

    Cheap to keep around; pass it instead of a path to the functions below to avoid re-parsing.
    Arrays returned by :meth:`raw` are read-only views into the map (no copy).
    """

    path: str
    metadata: dict[str, Any]
    tensors: dict[str, TensorInfo]
    _buf: mmap.mmap = field(repr=False)

    @property
    def arch(self) -> str:
        """``general.architecture`` (e.g. "llama")."""
        return str(self.metadata.get("general.architecture", ""))

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as a flat read-only uint8 array."""
        info = self.tensors[name]
        return np.frombuffer(self._buf, dtype=np.uint8, count=info.nbytes, offset=info.offset)


class _Cursor:
    """Sequential little-endian reader over a buffer."""

    def __init__(self, buf: mmap.mmap) -> None:
        self.buf = buf
        self.pos = 0

    def unpack(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = int(self.unpack("<Q"))
        raw = self.buf[self.pos : self.pos + n]
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def value(self, vtype: int) -> Any:
        if vtype == GGUFValueType.STRING:
            return self.string()
        if vtype == GGUFValueType.ARRAY:
            item_type, count = self.unpack("<I"), int(self.unpack("<Q"))
            if item_type in _SCALAR_FMT and item_type != GGUFValueType.BOOL:
                # Numeric arrays (token types, scores) in one go instead of per item.
                dtype = np.dtype(_SCALAR_FMT[item_type])
                arr = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos)
                self.pos += arr.nbytes
                return arr.tolist()
            return [self.value(item_type) for _ in range(count)]
        if vtype == GGUFValueType.FLOAT32:
            # Shortest repr of the float32 (1e-05, not 9.999999747378752e-06).
            return float(str(np.float32(self.unpack("<f"))))
        if vtype in _SCALAR_FMT:
            return self.unpack(_SCALAR_FMT[vtype])
        raise ValueError(f"unknown GGUF value type {vtype} at byte {self.pos}")


def open_gguf(path: str | os.PathLike[str]) -> GGUFFile:
    """Parse ``path``'s header, metadata and tensor directory; map the data read-only."""
    with open(path, "rb") as f:
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    cur = _Cursor(buf)
    if buf[:4] != b"GGUF":
        raise ValueError(f"{path}: not a GGUF file (magic {buf[:4]!r})")
    cur.pos = 4
    version = cur.unpack("<I")
    if version not in (2, 3):
        raise ValueError(f"{path}: unsupported GGUF version {version} (big-endian files too)")
    n_tensors, n_kv = cur.unpack("<Q"), cur.unpack("<Q")
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string()
        metadata[key] = cur.value(cur.unpack("<I"))
    entries = []
    for _ in range(n_tensors):
        name = cur.string()
        dims = [cur.unpack("<Q") for _ in range(cur.unpack("<I"))]
        ggml_type = GGMLQuantizationType(cur.unpack("<I"))
        entries.append((name, tuple(reversed(dims)), ggml_type, int(cur.unpack("<Q"))))
    align = int(metadata.get("general.alignment", 32))
    data_start = (cur.pos + align - 1) // align * align
    tensors: dict[str, TensorInfo] = {}
    for name, shape, ggml_type, offset in entries:
        block_size, type_size = GGML_QUANT_SIZES[ggml_type]
        nbytes = math.prod(shape) // block_size * type_size
        tensors[name] = TensorInfo(name, ggml_type, shape, data_start + offset, nbytes)
        if data_start + offset + nbytes > len(buf):
            raise ValueError(f"{path}: tensor {name} extends past the end of the file")
    return GGUFFile(os.fspath(path), metadata, tensors, buf)


def _as_file(src: Source) -> GGUFFile:
    return src if isinstance(src, GGUFFile) else open_gguf(src)
