"""Our quantized projections (``csrc/quant_gemm.c``, bfloat16 activations on AVX-512 BF16):
the blocked layout holds the same codes, scales and zeros, and a product equals the
dequantized weights' product rounded once to bfloat16 but for rare one-ulp ties, at every row
count (the rows are taken four at a time), every row tail (blocks of 16) and thread count."""

from __future__ import annotations

import pytest
import torch

from actors.model.quant import (
    QuantizedWeight,
    pack_blocked_int4,
    pack_blocked_int8,
    unpack_blocked,
)
from actors.model.quant_gemm import quant_gemm

needs_kernel = pytest.mark.skipif(
    quant_gemm() is None, reason="no C compiler, kernels off, or no AVX-512 BF16 on this CPU"
)


def _int4(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=gen)
    scale = torch.rand(n, k // 32, generator=gen) * 0.02
    zero = torch.randn(n, k // 32, generator=gen) * 0.05
    return q, scale, zero


def _x(rows: int, k: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, k, generator=gen) * scale).to(torch.bfloat16)


def _biased4(scale: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """|w| + 144 scale: the largest biased code times its group's scale."""
    return w.abs() + 144 * scale.double().repeat_interleave(32, dim=1)


def _dequantized4(
    q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    n, k = q.shape
    s, z = scale.to(dtype).double(), zero.to(dtype).double()  # as stored: in the activations' dtype
    w = (q.double() - 8).view(n, k // 32, 32) * s[..., None] + z[..., None]
    return w.view(n, k)


def _check(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, biased: torch.Tensor) -> None:
    """Within one bfloat16 ulp of the exact product, plus float32 rounding of the kernel's own
    sums (``biased``: the weights' magnitudes as the kernel sums them, the 128 offset of every
    code included), and equal to the exact product rounded nearly always."""
    exact = x.double() @ w.T
    rounded = exact.to(torch.bfloat16)
    ulp = rounded.double().abs() * 2.0**-7
    sums = 2.0**-20 * (x.double().abs() @ biased.T)
    assert got.dtype == torch.bfloat16 and got.shape == exact.shape
    assert ((got.double() - exact).abs() <= ulp + sums).all()
    assert (got == rounded).double().mean() >= 0.98


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9])
@pytest.mark.parametrize("threads", [1, 2])
def test_int4_equals_the_dequantized_product(rows: int, threads: int) -> None:
    n, k = 200, 576  # 200 rows: a partial last block of 8
    q, scale, zero = _int4(n, k, seed=rows)
    weight = QuantizedWeight._pack_int4(q.to(torch.int32), scale, zero, 32, torch.bfloat16)
    assert weight.kernel is not None  # bf16 activations take our kernel here
    x = _x(rows, k, seed=rows)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = weight.matmul(x)
    finally:
        torch.set_num_threads(before)
    w = _dequantized4(q, scale, zero)
    _check(got, x, w, _biased4(scale, w))


@needs_kernel
@pytest.mark.parametrize("rows", [1, 4, 6])
def test_int8_equals_the_dequantized_product(rows: int) -> None:
    torch.manual_seed(rows)
    n, k = 300, 96
    dense = torch.randn(n, k)
    weight = QuantizedWeight.from_float(dense, "int8", torch.bfloat16)
    assert weight.kernel is not None and weight.method == "int8"
    w = weight.dequantize().double()
    biased = w.abs() + 2304 * weight.scales[:n].double()[:, None]  # both nibbles' offsets
    x = _x(rows, k, seed=rows)
    _check(weight.matmul(x), x, w, biased)
    # Large activations: 16 x stays exact, the offsets come off per group of 32.
    x = _x(rows, k, seed=rows + 10, scale=300.0)
    _check(weight.matmul(x), x, w, biased)


@needs_kernel
def test_rows_of_a_strided_view_and_a_wide_output() -> None:
    q, scale, zero = _int4(4096, 64, seed=7)
    weight = QuantizedWeight._pack_int4(q.to(torch.int32), scale, zero, 32, torch.bfloat16)
    x = _x(3, 100, seed=5)[:, 7:71]  # rows 100 apart, 2-byte aligned
    w = _dequantized4(q, scale, zero)
    _check(weight.matmul(x), x.contiguous(), w, _biased4(scale, w))


@needs_kernel
def test_the_blocked_layout_holds_the_same_weights() -> None:
    q, scale, zero = _int4(37, 64, seed=3)
    codes, sz = pack_blocked_int4(q, scale, zero, torch.bfloat16)
    assert codes.numel() == 48 * 64 // 2 and sz.numel() == 48 * 2 * 2  # 3 blocks of 16 rows
    w4 = QuantizedWeight("int4", codes, sz, 32, (37, 64), torch.bfloat16)
    torch.testing.assert_close(unpack_blocked(w4).double(), _dequantized4(q, scale, zero))
    v = torch.randint(-127, 128, (37, 64), dtype=torch.int8)
    s8 = torch.rand(37) * 0.01
    codes, scales = pack_blocked_int8(v, s8, torch.bfloat16)
    w8 = QuantizedWeight("int8", codes, scales, 0, (37, 64), torch.bfloat16)
    s8 = s8.to(torch.bfloat16).float()
    torch.testing.assert_close(unpack_blocked(w8), v.float() * s8[:, None])


def test_float32_and_odd_widths_keep_torchs_kernels() -> None:
    """(Runs on any CPU.)"""
    q, scale, zero = _int4(32, 64, seed=4)
    w32 = QuantizedWeight._pack_int4(q.to(torch.int32), scale, zero, 32, torch.float32)
    assert w32.kernel is None  # no float32 path of ours: torch's layout and kernel
    w64 = QuantizedWeight._pack_int4(
        q.to(torch.int32), scale[:, :1], zero[:, :1], 64, torch.bfloat16
    )
    assert w64.kernel is None  # groups of 64: torch's
    x = torch.randn(2, 64)
    ref = x.double() @ _dequantized4(q, scale, zero, torch.float32).T
    assert (w32.matmul(x).double() - ref).abs().max() <= 1e-4 * ref.abs().max()


def test_without_the_kernel_bf16_weights_keep_torchs_layout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """(Runs on any CPU.)"""
    import actors.model.quant as quant

    monkeypatch.setattr(quant, "_blocked_kernel", lambda dtype, k: None)
    q, scale, zero = _int4(48, 64, seed=8)
    weight = QuantizedWeight._pack_int4(q.to(torch.int32), scale, zero, 32, torch.bfloat16)
    assert not weight.blocked and weight.kernel is None
    x = _x(3, 64, seed=8)
    w = _dequantized4(q, scale, zero)
    exact = x.double() @ w.T
    assert (weight.matmul(x).double() - exact).abs().max() <= 2e-2 * exact.abs().max()


@needs_kernel
@pytest.mark.parametrize("method", ["int4", "int8"])
def test_a_copy_binds_its_own_bytes(method: str) -> None:
    import copy

    torch.manual_seed(9)
    weight = QuantizedWeight.from_float(torch.randn(48, 64), method, torch.bfloat16)  # type: ignore[arg-type]
    x = _x(2, 64, seed=9)
    expected = weight.matmul(x)  # bound to the original's bytes
    twin = copy.deepcopy(weight)
    assert twin._gemm is None  # not the original's closure
    weight.q.zero_()
    weight.scales.zero_()  # the original's bytes are gone: the twin must read its own
    assert torch.equal(twin.matmul(x), expected)
    with pytest.raises(ValueError, match="rows of 32"):
        twin.matmul(_x(2, 32, seed=9))  # the wrong width: refused, not read past the end


@pytest.mark.parametrize(("method", "rows"), [("int4", 48), ("int8", 48), ("int8", 40)])
def test_a_blocked_weight_copied_where_the_kernel_is_missing_is_relaid(
    method: str, rows: int
) -> None:
    """(Runs on any CPU: the blocked layout is made by hand.) A weight unpickled in a
    process without our kernel runs on torch's layout and kernels, the same weights."""
    import pickle

    torch.manual_seed(rows)
    if method == "int4":
        q, scale, zero = _int4(rows, 64, seed=rows)
        codes, scales = pack_blocked_int4(q, scale, zero, torch.bfloat16)
        exact_w = _dequantized4(q, scale, zero)
    else:
        v = torch.randint(-127, 128, (rows, 64), dtype=torch.int8)
        s8 = torch.rand(rows) * 0.01
        codes, scales = pack_blocked_int8(v, s8, torch.bfloat16)
        exact_w = v.double() * s8.to(torch.bfloat16).double()[:, None]
    weight = QuantizedWeight(method, codes, scales, 32, (rows, 64), torch.bfloat16)  # type: ignore[arg-type]
    weight.blocked = True  # as packed for our kernel; no kernel attached: as if it were missing
    moved = pickle.loads(pickle.dumps(weight))
    assert not moved.blocked and moved.kernel is None
    # (torch's layout reads back through its kernel: rounded to bf16 once)
    torch.testing.assert_close(moved.dequantize().double(), exact_w, rtol=2**-8, atol=1e-6)
    x = _x(3, 64, seed=rows)
    exact = x.double() @ exact_w.T
    assert (moved.matmul(x).double() - exact).abs().max() <= 2e-2 * exact.abs().max()


def test_an_int4_weight_of_odd_rows_cannot_be_relaid() -> None:
    import pickle

    q, scale, zero = _int4(40, 64, seed=1)
    codes, scales = pack_blocked_int4(q, scale, zero, torch.bfloat16)
    weight = QuantizedWeight("int4", codes, scales, 32, (40, 64), torch.bfloat16)
    weight.blocked = True
    with pytest.raises(RuntimeError, match="40 rows needs the quantized kernel"):
        pickle.loads(pickle.dumps(weight))


def test_each_weight_runs_dense_from_where_its_kernel_stops_winning() -> None:
    """(Runs on any CPU.) The default (None): int4 on our kernel up to 16 rows, int8 and
    torch's kernels up to 8; a number given applies to every weight."""
    from actors.model.linear import Linear

    def quantized(method: str, dtype: torch.dtype, rows: int | None) -> Linear:
        torch.manual_seed(0)
        linear = Linear(64, 48, bias=False).to(dtype)
        linear.quantize(method, None, rows)  # type: ignore[arg-type]
        return linear

    ours = quant_gemm() is not None
    assert quantized("int4", torch.bfloat16, None).dense_min_rows == (16 if ours else 8)
    assert quantized("int8", torch.bfloat16, None).dense_min_rows == 8
    assert quantized("int4", torch.float32, None).dense_min_rows == 8  # torch's kernel
    assert quantized("int4", torch.bfloat16, 12).dense_min_rows == 12
    assert not quantized("int4", torch.bfloat16, 0).has_dense
