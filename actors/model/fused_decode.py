"""A step of decodes through every decoder layer of a stage in one C call
(``csrc/decode_layers.c``), for bfloat16 models whose projections run on our quantized kernels.

The layer is the one ``llama.DecoderLayer`` runs op by op, with the same kernels in the same
order (the same bits); what goes is the Python between them. At batch 1 that Python, about
eight calls a layer of a few microseconds each, was a sixth of a decode step on one core.

``DecodeLayers.build`` checks what does not change (dtype, every projection packed for our
kernel with the config's shapes, no biases, the norms); ``run`` checks the step (decodes only,
fewer rows than the smallest switch to a dense copy among the stage's projections, the head
shape, the caches' layout) and returns None when the step must take the layer-by-layer path."""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable
from functools import cache
from typing import TYPE_CHECKING, Any

import torch

from actors.model.cpu_kernels import bind_library
from actors.model.linear import Linear

if TYPE_CHECKING:
    from actors.model.attention import AttentionMetadata, TorchAttention

_P, _I, _I64, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
_PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")  # csrc's order


class _Layer(ctypes.Structure):
    _fields_ = (
        ("input_norm", _P),
        ("post_norm", _P),
        ("codes", _P * 4),
        ("scales", _P * 4),
        ("bits", ctypes.c_int32 * 4),
    )


class DecodeKernel:
    """The library's ``decode_layers_bf16``."""

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        return (decode_kernel, ())

    def __init__(self, lib: ctypes.CDLL) -> None:
        fn = lib.decode_layers_bf16
        fn.argtypes = [_P, _I, _P, _P, _P, _P, _I64, _I64, _I64, _F, _P, _P, _P, _P, _I64]
        fn.argtypes += [_I64, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I64, _F, _I]
        fn.restype = ctypes.c_int
        self.fn = fn


@cache
def decode_kernel() -> DecodeKernel | None:
    return bind_library(DecodeKernel)


class DecodeLayers:
    """One model stage's layers as a table for ``decode_layers_bf16`` (the weights' addresses:
    built on first use, again after a projection is re-quantized), and the call."""

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        # ctypes tables of this process's pointers: a copy builds its own on first use.
        return (_unbuilt, ())

    def __init__(self, model: Any, kernel: DecodeKernel) -> None:
        # ``model``: a ``LlamaForCausalLM`` (stage); untyped here, as llama.py imports this.
        cfg = model.config
        self.fn = kernel.fn
        self.generation = Linear.weights_generation  # stale once any weight is re-quantized
        self.table = (_Layer * len(model.layers))()
        self.owners: list[torch.Tensor] = []  # what the table points into
        self.max_rows: float = float("inf")  # steps of this many rows take the dense copies
        for row, layer in zip(self.table, _layers(model), strict=True):
            norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
            row.input_norm, row.post_norm = (w.data_ptr() for w in norms)
            self.owners.extend(norms)
            for i, name in enumerate(_PROJECTIONS):
                linear = getattr(layer, name)
                quant = linear.quant
                assert quant is not None and quant.blocked
                row.codes[i], row.scales[i] = quant.q.data_ptr(), quant.scales.data_ptr()
                row.bits[i] = 8 if quant.method == "int8" else 4
                self.owners.extend((quant.q, quant.scales))
                if linear.dense_min_rows > 0:
                    self.max_rows = min(self.max_rows, linear.dense_min_rows)
        self.num_layers = len(model.layers)
        self.hidden, self.inter = cfg.hidden_size, cfg.intermediate_size
        self.q_size, self.kv_size = cfg.q_size, cfg.kv_size
        self.eps = float(cfg.rms_norm_eps)
        # The caches' layout, checked once per set of caches: (every layer's address, shape,
        # strides) -> (layer stride, V offset, block stride) in elements, or None. Plain ints:
        # holding a cache tensor here would keep a replaced pool alive.
        self._kv: tuple[tuple[Any, ...], tuple[int, int, int] | None] | None = None

    @classmethod
    def build(cls, model: Any) -> DecodeLayers | None:
        """The table, or None when this model's layers cannot run as one call."""
        if os.environ.get("TANDEM_FUSED_DECODE", "1") == "0":  # layer by layer, for comparing
            return None
        kernel = decode_kernel()
        if kernel is None or model.dtype != torch.bfloat16 or not model.layers:
            return None
        cfg = model.config
        hidden, inter = cfg.hidden_size, cfg.intermediate_size
        shapes = {  # what the C side multiplies: [N, K] per projection
            "qkv_proj": (cfg.q_size + 2 * cfg.kv_size, hidden),
            "o_proj": (hidden, cfg.q_size),
            "gate_up_proj": (2 * inter, hidden),
            "down_proj": (hidden, inter),
        }
        for layer in _layers(model):
            for name in _PROJECTIONS:
                linear = getattr(layer, name)
                quant = linear.quant
                if quant is None or not quant.blocked or quant.kernel is None:
                    return None  # torch's kernels, or a dense weight
                if linear.bias is not None or quant.dtype != torch.bfloat16:
                    return None
                if tuple(quant.shape) != shapes[name]:
                    return None
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                weight = norm.weight
                if weight.dtype != torch.bfloat16 or not weight.is_contiguous():
                    return None
                if weight.numel() != hidden or norm.eps != cfg.rms_norm_eps:
                    return None
        return cls(model, kernel)

    def _cache_layout(self, kv_caches: list[torch.Tensor]) -> tuple[int, int, int] | None:
        """(layer stride, V offset, block stride), in elements, when every layer's K and V
        caches sit at one stride from the last (the block-first pool), else None."""
        first = kv_caches[0]
        key = (tuple(c.data_ptr() for c in kv_caches), first.shape, first.stride(), first.dtype)
        if self._kv is not None and self._kv[0] == key:
            return self._kv[1]
        self._kv = (key, None)
        if len(kv_caches) != self.num_layers or first.dtype != torch.bfloat16:
            return None
        elem = first.element_size()
        k0 = first[0]
        step = (kv_caches[1].data_ptr() - first.data_ptr()) // elem if len(kv_caches) > 1 else 0
        v_offset = (first[1].data_ptr() - k0.data_ptr()) // elem
        for i, layer in enumerate(kv_caches):
            if layer.stride() != first.stride() or layer.shape != first.shape:
                return None
            if layer.dtype != first.dtype or layer.device != first.device:
                return None
            if (layer.data_ptr() - first.data_ptr()) != i * step * elem:
                return None
        kvh, d = k0.shape[2], k0.shape[3]
        if k0.stride()[1:] != (kvh * d, d, 1) or kvh * d != self.kv_size:
            return None
        layout = (step, v_offset, k0.stride(0))
        self._kv = (key, layout)
        return layout

    def run(
        self,
        x: torch.Tensor,  # [T, hidden] bfloat16
        kv_caches: list[torch.Tensor],
        positions: torch.Tensor,  # [T] int64
        rotary_tables: tuple[torch.Tensor, torch.Tensor],
        attn: TorchAttention,
        meta: AttentionMetadata,
        hook: Callable[[], None] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(the last layer's MLP output, the residual stream before it), as the layer loop
        returns them; None when this step must take that loop. ``hook``: the model's
        ``between_layers``, called once, just before the call (the layers are one call)."""
        rows = x.shape[0]
        kernel = attn.kernel
        if rows == 0 or rows >= self.max_rows or meta.num_decodes != rows or kernel is None:
            return None
        if x.dtype != torch.bfloat16 or not x.is_contiguous() or x.shape[1] != self.hidden:
            return None
        h, kvh, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
        if not kernel.supports(x.dtype, h, kvh, d) or h * d != self.q_size:
            return None
        cos, sin = rotary_tables
        for t in (cos, sin):
            if t.dtype != x.dtype or not t.is_contiguous() or t.shape[1] != d:
                return None
        layout = self._cache_layout(kv_caches)
        if layout is None or tuple(kv_caches[0].shape[3:]) != (kvh, d):
            return None
        layer_stride, v_offset, block_stride = layout
        table, lens = meta.decode_block_table, meta.decode_seq_lens
        blocks, offsets = meta.slot_blocks, meta.slot_offsets
        for t in (positions, table, lens, blocks, offsets):
            if t.dtype != torch.int64 or not t.is_contiguous():
                return None
        if not (positions.numel() == lens.numel() == table.shape[0] == blocks.numel() == rows):
            raise ValueError("decode layers: one position, length, slot and table per row")
        if hook is not None:
            hook()
        out = torch.empty_like(x)
        residual = torch.empty_like(x)
        base = kv_caches[0]
        rc = self.fn(
            self.table, self.num_layers, x.data_ptr(), None, out.data_ptr(),
            residual.data_ptr(), rows, self.hidden, self.inter, self.eps, positions.data_ptr(),
            cos.data_ptr(), sin.data_ptr(), base.data_ptr(), layer_stride, v_offset,
            blocks.data_ptr(), offsets.data_ptr(), table.data_ptr(), lens.data_ptr(), h, kvh, d,
            base.shape[2], table.shape[1], block_stride, attn.scale, torch.get_num_threads(),
        )  # fmt: skip
        if rc != 0:
            raise RuntimeError(f"decode_layers failed (code {rc})")
        return out, residual


def _layers(model: Any) -> list[Any]:
    """The stage's ``DecoderLayer``s (untyped: ``nn.Module.__getattr__`` hides their parts)."""
    return list(model.layers)


def _unbuilt() -> None:
    return None
