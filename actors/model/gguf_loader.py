"""Load GGUF checkpoints: metadata as an HF-style config and dequantized tensors (the tokenizer
is rebuilt from the metadata in ``gguf_tokenizer``).

We parse the container ourselves (``gguf.GGUFReader`` needs ~5 s for the 98 MB SmolLM2 file
because it wraps every vocabulary string in a numpy array; our parser takes ~0.2 s) and
dequantize with vectorized numpy kernels, bit-exact against ``gguf.quants`` (~0.4-1 s for the
whole file instead of ~3.3 s).

Layout of a GGUF v2/v3 file (all little endian)::

    magic "GGUF" | version u32 | n_tensors u64 | n_kv u64
    n_kv x (key: str, value_type: u32, value)          str = len u64 + utf-8 bytes
    n_tensors x (name: str, n_dims u32, dims u64[n_dims] (ggml order: fastest first),
                 ggml_type u32, offset u64)             offset relative to the data section
    padding to ``general.alignment`` (default 32) | data section
"""

from __future__ import annotations

import logging
import math
import mmap
import os
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeAlias

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from actors.model.gguf_dequant import dequantize, group_quant
from actors.model.quant import GroupQuant

__all__ = [
    "GGUFFile",
    "TensorInfo",
    "count_gguf_tensors",
    "dequantize",
    "iter_gguf_group_quants",
    "iter_gguf_tensors",
    "open_gguf",
    "read_gguf_config",
]

logger = logging.getLogger(__name__)

QT = GGMLQuantizationType
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


# ---------------------------------------------------------------------------------------------
# Config and tensor names
# ---------------------------------------------------------------------------------------------

# GGUF architecture -> (HF model_type, HF class, Q/K rows permuted by llama.cpp's converter).
_ARCHS: dict[str, tuple[str, str, bool]] = {
    "llama": ("llama", "LlamaForCausalLM", True),
    "mistral": ("llama", "LlamaForCausalLM", True),
    "qwen2": ("qwen2", "Qwen2ForCausalLM", False),
}

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Tensors with no HF counterpart: rope_freqs.weight is read into the config (freq_factors).
_SKIPPED = {"rope_freqs.weight"}


def _arch_info(f: GGUFFile) -> tuple[str, str, bool]:
    if f.arch not in _ARCHS:
        raise ValueError(
            f"unsupported GGUF architecture {f.arch!r} (supported: {', '.join(sorted(_ARCHS))})"
        )
    return _ARCHS[f.arch]


def _hf_name(gguf_name: str) -> str | None:
    """HF parameter name for a GGUF tensor name, or None when it has no counterpart."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    return None


def _meta(f: GGUFFile, key: str, default: Any = None, *, required: bool = False) -> Any:
    full = f"{f.arch}.{key}"
    if full not in f.metadata:
        if required:
            raise ValueError(f"{f.path}: GGUF metadata key {full!r} is missing")
        return default
    value = f.metadata[full]
    return value[0] if isinstance(value, list) else value  # per-layer arrays: take layer 0


def _weight_dtype(f: GGUFFile) -> str:
    types = {t.ggml_type for t in f.tensors.values() if len(t.shape) == 2}
    if types <= {QT.F32}:
        return "float32"
    for ggml_type, name in ((QT.F16, "float16"), (QT.BF16, "bfloat16")):
        if types <= {ggml_type, QT.F32}:
            return name
    return "quantized"


def _rope_scaling_with_freqs(f: GGUFFile) -> dict[str, Any] | None:
    """The file's rope scaling, and its per-frequency divisors (``rope_freqs.weight``: how
    llama.cpp's converter stores Llama 3.1+'s llama3-style scaling) as ``freq_factors``."""
    scaling = _rope_scaling(f)
    info = f.tensors.get("rope_freqs.weight")
    if info is None:
        return scaling
    factors = dequantize(f.raw("rope_freqs.weight"), info.ggml_type, info.shape).flatten()
    return {**(scaling or {"rope_type": "default"}), "freq_factors": factors.tolist()}


def _rope_scaling(f: GGUFFile) -> dict[str, Any] | None:
    kind = _meta(f, "rope.scaling.type")
    factor = _meta(f, "rope.scaling.factor")
    if kind in (None, "none") or factor is None:
        return None
    scaling: dict[str, Any] = {"rope_type": kind, "factor": float(factor)}
    original = _meta(f, "rope.scaling.original_context_length")
    if original is not None:
        scaling["original_max_position_embeddings"] = int(original)
    return scaling


def read_gguf_config(src: Source) -> dict[str, Any]:
    """An HF ``config.json``-style dict for the model in ``src``.

    Raises ValueError for an unsupported architecture or a missing required metadata key.
    ``torch_dtype`` is "float32"/"float16"/"bfloat16" when every 2-D weight has that type
    (F32 allowed alongside), else "quantized".
    """
    f = _as_file(src)
    model_type, hf_class, _ = _arch_info(f)
    hidden = int(_meta(f, "embedding_length", required=True))
    heads = int(_meta(f, "attention.head_count", required=True))
    embd = f.tensors.get("token_embd.weight")
    vocab = embd.shape[0] if embd else _meta(f, "vocab_size")
    if vocab is None:
        vocab = len(f.metadata.get("tokenizer.ggml.tokens", []))
    return {
        "model_type": model_type,
        "architectures": [hf_class],
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(_meta(f, "feed_forward_length", required=True)),
        "num_hidden_layers": int(_meta(f, "block_count", required=True)),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_meta(f, "attention.head_count_kv", heads)),
        "head_dim": int(_meta(f, "attention.key_length", hidden // heads)),
        "hidden_act": "silu",
        "rms_norm_eps": float(_meta(f, "attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(_meta(f, "rope.freq_base", 10000.0)),
        "rope_scaling": _rope_scaling_with_freqs(f),
        "max_position_embeddings": int(_meta(f, "context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in f.tensors,
        "attention_bias": model_type == "qwen2" or "blk.0.attn_q.bias" in f.tensors,
        "bos_token_id": f.metadata.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": f.metadata.get("tokenizer.ggml.eos_token_id"),
        "torch_dtype": _weight_dtype(f),
    }


def _unpermute_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation (interleaved rotary -> HF rotate-half).

    Per head, HF rows are [x_0 .. x_{h/2-1} | y_0 .. y_{h/2-1}] (the two rotary halves); the
    converter stores them interleaved [x_0, y_0, x_1, y_1, ...]. Viewing each head's rows as
    (h/2, 2) and transposing to (2, h/2) restores the halves. Works for weights and biases.
    """
    rows = w.shape[0]
    half = rows // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def count_gguf_tensors(src: Source) -> int:
    """How many tensors :func:`iter_gguf_tensors` will yield (for a progress bar)."""
    f = _as_file(src)
    return sum(1 for name in f.tensors if _hf_name(name) is not None)


def iter_gguf_tensors(src: Source) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, float32 tensor)`` pairs in file order, dequantized one at a time.

    Names follow HF Llama/Qwen2 (``model.layers.{i}.self_attn.q_proj.weight`` ...). For
    llama-arch files the Q/K projections are un-permuted back to HF's rotate-half layout.
    ``rope_freqs.weight`` is skipped (the config has it); any other unknown tensor raises
    ValueError.
    """
    f = _as_file(src)
    permuted_heads = _permuted_heads(f)
    for gguf_name, info in f.tensors.items():
        hf_name = _hf_name(gguf_name)
        if hf_name is None:
            if gguf_name in _SKIPPED:
                continue
            raise ValueError(f"{f.path}: unexpected tensor {gguf_name!r} for arch {f.arch!r}")
        tensor = dequantize(f.raw(gguf_name), info.ggml_type, info.shape)
        heads = permuted_heads(hf_name)
        if heads:
            tensor = _unpermute_rows(tensor, heads)
        yield hf_name, tensor


def _permuted_heads(f: GGUFFile) -> Callable[[str], int]:
    """For a tensor's HF name: the head count its rows are permuted by (llama-arch Q and K
    projections), else 0."""
    _, _, permuted = _arch_info(f)
    heads = int(_meta(f, "attention.head_count", required=True))
    kv_heads = int(_meta(f, "attention.head_count_kv", heads))

    def of(hf_name: str) -> int:
        if permuted and ".self_attn.q_proj." in hf_name:
            return heads
        if permuted and ".self_attn.k_proj." in hf_name:
            return kv_heads
        return 0

    return of


def iter_gguf_group_quants(src: Source) -> Iterator[tuple[str, GroupQuant]]:
    """Yield ``(hf_name, GroupQuant)`` for each 2-D weight stored as Q4_0, Q4_1 or Q8_0: its
    codes and block scales as the file holds them, Q/K rows un-permuted as in
    :func:`iter_gguf_tensors` (rows move with their scales)."""
    f = _as_file(src)
    permuted_heads = _permuted_heads(f)
    for gguf_name, info in f.tensors.items():
        hf_name = _hf_name(gguf_name)
        if hf_name is None:
            continue
        gq = group_quant(f.raw(gguf_name), info.ggml_type, info.shape)
        if gq is None:
            continue
        n = permuted_heads(hf_name)
        if n:
            gq = GroupQuant(
                _unpermute_rows(gq.codes, n),
                _unpermute_rows(gq.scale, n),
                None if gq.offset is None else _unpermute_rows(gq.offset, n),
                gq.group_size,
                gq.bits,
            )
        yield hf_name, gq
