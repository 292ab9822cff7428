"""The decoder's projections: ``nn.Linear`` with a pre-packed CPU GEMM (oneDNN) and a
weight-only quantized form (``actors.model.quant``), chosen per call by the batch's row count."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from actors.model.quant import GroupQuant, Method, QuantizedWeight, dense_crossover


class Linear(nn.Linear):
    """``nn.Linear`` that can switch to a pre-packed CPU GEMM (see ``pack_for_cpu``) and to a
    weight-only quantized kernel (see ``quantize``).

    oneDNN re-lays the weight once into its blocked format, which makes the small-M products
    of decoding about 1.2-2x faster than ``F.linear``. The packed copy sits next to the
    original weight, which stays the source of truth (loading, LoRA, the tests' references).

    Quantized, batches of fewer than ``dense_min_rows`` rows run on the quantized bytes; larger
    ones on the dense copy, which is dropped when ``dense_min_rows`` is 0 (every batch then
    runs quantized)."""

    _packed: Callable[[torch.Tensor], torch.Tensor] | None = None
    quant: QuantizedWeight | None = None
    dense_min_rows = 0
    # Counts ``quantize`` calls in this process: tables of the quantized weights' addresses
    # (``fused_decode``) built before a change are rebuilt.
    weights_generation = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Parameters read from ``_parameters``: ``nn.Module.__getattr__`` is slow on a hot path.
        q = self.quant
        if q is not None and (self.dense_min_rows <= 0 or x.shape[0] < self.dense_min_rows):
            out = q.matmul(x)
            bias = self._parameters["bias"]
            return out if bias is None else out + bias
        packed = self._packed
        if packed is not None:
            return packed(x)
        return F.linear(x, self._parameters["weight"], self._parameters["bias"])  # type: ignore[arg-type]

    @property
    def has_dense(self) -> bool:
        return self.weight.numel() > 0

    def pack_for_cpu(self, batch_hint: int = 64) -> bool:
        """Pack the weight for this CPU's GEMM library; False when not applicable."""
        if not self.has_dense:
            return True  # quantized only: nothing dense to pack
        packed = pack_linear(self.weight, self.bias, batch_hint)
        self._packed = packed
        return packed is not None

    @torch.no_grad()
    def quantize(
        self, method: Method, source: GroupQuant | None, dense_min_rows: int | None
    ) -> None:
        """Hold the weight quantized: from the checkpoint's own codes when given (``source``),
        else rounded from the dense weight. ``dense_min_rows`` None: where the kernel stops
        winning (``dense_crossover``)."""
        dtype = self.weight.dtype
        if source is not None:
            self.quant = QuantizedWeight.from_group_quant(source, method, dtype)
        else:
            self.quant = QuantizedWeight.from_float(self.weight, method, dtype)
        if dense_min_rows is None:
            dense_min_rows = dense_crossover(self.quant)
        self.dense_min_rows = dense_min_rows
        self._packed = None
        dense = self.quant.take_dense()  # (taken in any case: not kept past construction)
        if dense_min_rows <= 0:
            self.weight = nn.Parameter(self.weight.new_empty(0), requires_grad=False)
        else:
            # The dense copy holds the quantized weights, so that a request's result does not
            # depend on how many rows its step has (up to rounding the weights to ``dtype``).
            self.weight.copy_(dense.to(dtype))
        Linear.weights_generation += 1  # (last: a table built before this is stale)

    def weight_bytes(self) -> int:
        """Dense, packed and quantized bytes held."""
        dense = self.weight.numel() * self.weight.element_size()
        total = dense * (2 if self._packed is not None else 1)
        return total + (self.quant.nbytes if self.quant is not None else 0)


def pack_linear(
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    batch_hint: int = 64,
    min_rows: int | None = None,
) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """A ``x @ weight.T + bias`` on a oneDNN-packed weight (CPU float32 / bfloat16), or None.

    The batch size is only a hint: any number of rows works. A single float32 row goes to
    ``F.linear`` instead, which is faster there (a GEMV), unless ``min_rows`` says otherwise
    (the wide output head is faster packed even for one row); bfloat16 is faster packed at
    every size. MKL's own packed GEMM (``torch.ops.mkl``) is not used: it silently falls back to
    ``mm`` unless the row count equals the hint."""
    if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16):
        return None
    if not torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
        return None
    w = weight.detach()
    b = None if bias is None else bias.detach()
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(w, batch_hint)
    except (RuntimeError, AttributeError):  # an op missing from this torch build
        return None
    if min_rows is None:
        min_rows = 2 if w.dtype == torch.float32 else 1

    def onednn(x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] < min_rows:
            return F.linear(x, w, b)
        return torch.ops.mkldnn._linear_pointwise(x, packed, b, "none", [], "")

    return onednn
