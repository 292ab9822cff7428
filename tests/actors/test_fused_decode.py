"""Every decoder layer in one C call for decode steps (``actors.model.fused_decode``): the same
bits as the layer-by-layer path on the steps it takes (int4 and int8 weights, 2 and 4 layers,
pipeline stages); the layer-by-layer path for the steps it does not (prefill rows, batches
past the dense switch, LoRA, caches whose layers are not at one stride, float32, biases);
copies and re-quantized weights get tables of their own."""

from __future__ import annotations

import copy
import pickle
from pathlib import Path
from typing import Any

import gguf
import pytest
import torch

from actors.model.attention import AttentionMetadata, TorchAttention
from actors.model.fused_decode import DecodeLayers, decode_kernel
from actors.model.llama import LlamaForCausalLM
from actors.model.loader import load_model
from actors.model.quant_gemm import quant_gemm
from kv_transfer.blocks import allocate_kv_caches
from tests.actors.conftest import make_checkpoint
from tests.actors.paged import PagedRunner
from tests.actors.test_gguf import _tiny_model, _write_tiny

pytestmark = pytest.mark.skipif(
    quant_gemm() is None, reason="no C compiler, kernels off, or no AVX-512 BF16 on this CPU"
)
QT = gguf.GGMLQuantizationType


@pytest.fixture(scope="module")
def tiny_q4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny llama GGUF as llama.cpp quantizes one (Q4_1 projections, Q8_0 embeddings):
    bfloat16 with ``quantization="auto"`` runs its projections on our int4 kernel."""
    path = tmp_path_factory.mktemp("fused") / "tiny-q4_1.gguf"
    _write_tiny(path, "llama", _tiny_model("llama"), weight_type=QT.Q4_1, embed_type=QT.Q8_0)
    return path


@pytest.fixture(scope="module")
def four_layers(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("four-layers"), "llama", num_hidden_layers=4)


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The row count of every one-call step from now on (the library's entry point wrapped:
    every table built meanwhile calls the wrapper)."""
    kernel = decode_kernel()
    assert kernel is not None
    inner, rows = kernel.fn, []

    def fn(*args: Any) -> int:
        rows.append(args[6])  # m
        return int(inner(*args))

    monkeypatch.setattr(kernel, "fn", fn)
    return rows


def _model(path: Path, fused: bool, quantization: str = "auto", **kw: Any) -> LlamaForCausalLM:
    model = load_model(path, "bfloat16", progress=False, quantization=quantization, **kw)
    if not fused:
        model.decode_layers = False  # the layer-by-layer path
    return model


def _generate(runner: PagedRunner, lengths: list[int], steps: int) -> list[torch.Tensor]:
    """Prefill one sequence per length (one mixed step), then ``steps`` greedy decode steps
    of all of them; every step's logits."""
    seqs = {f"s{i}": [(7 * i + 3 * j) % 120 + 2 for j in range(n)] for i, n in enumerate(lengths)}
    out = runner.step([(s, toks, 0) for s, toks in seqs.items()])
    logits = list(out)
    pos = {s: len(t) for s, t in seqs.items()}
    last = {s: int(o[-1].argmax()) for s, o in zip(seqs, out, strict=True)}
    for _ in range(steps):
        batch = [(s, [last[s]], pos[s]) for s in seqs]
        out = runner.step(batch)
        logits.extend(out)
        for (s, _, _), row in zip(batch, out, strict=True):
            last[s], pos[s] = int(row[-1].argmax()), pos[s] + 1
    return logits


def _same(got: list[torch.Tensor], want: list[torch.Tensor]) -> bool:
    return len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def _pair(path: Path, quantization: str = "auto", **kw: Any) -> tuple[PagedRunner, PagedRunner]:
    """A runner on the one-call model and one on the layer-by-layer model."""
    return (
        PagedRunner(_model(path, True, quantization), **kw),
        PagedRunner(_model(path, False, quantization), **kw),
    )


@pytest.mark.parametrize("threads", [1, 2])
def test_one_call_gives_the_layer_by_layer_bits(
    tiny_q4: Path, calls: list[int], threads: int
) -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        fused, ref = _pair(tiny_q4, block_size=4, num_blocks=64)
        lengths = [9, 1, 23, 5, 16]  # blocks of 4: block boundaries crossed while decoding
        got, want = _generate(fused, lengths, 7), _generate(ref, lengths, 7)
    finally:
        torch.set_num_threads(before)
    assert calls == [5] * 7  # every decode step, not the prefill
    assert len(got) == 5 * 8 and _same(got, want)


@pytest.mark.parametrize("quantization", ["int4", "int8"])
def test_four_layers_of_int4_or_int8(
    four_layers: Path, calls: list[int], quantization: str
) -> None:
    """A float checkpoint quantized on load; int8 projections switch to their dense copy at 8
    rows (int4 at 16)."""
    fused, ref = _pair(four_layers, quantization, block_size=4, num_blocks=64)
    assert fused.model.quantization["layers.3.down_proj"] == quantization
    got, want = _generate(fused, [3, 11, 6], 4), _generate(ref, [3, 11, 6], 4)
    assert calls == [3] * 4 and _same(got, want)
    assert isinstance(fused.model.decode_layers, DecodeLayers)
    assert fused.model.decode_layers.max_rows == (16 if quantization == "int4" else 8)


def test_steps_it_does_not_take_run_layer_by_layer(tiny_q4: Path, calls: list[int]) -> None:
    runner, ref = _pair(tiny_q4, block_size=4, num_blocks=128)
    for r in (runner, ref):
        r.step([("a", [5, 6, 7], 0)])  # a prefill: no call
    mixed = [("a", [9], 3), ("b", [4, 5, 6, 7, 8], 0)]  # a decode beside a prefill chunk
    assert _same(runner.step(mixed), ref.step(mixed))
    assert isinstance(runner.model.decode_layers, DecodeLayers)
    assert runner.model.decode_layers.max_rows == 16  # the int4 kernel's dense switch
    many = [(f"d{i}", [i + 2], 0) for i in range(16)]  # sixteen decodes: the dense copies
    assert _same(runner.step(many), ref.step(many))
    assert calls == []
    assert _same(runner.step(many[:15]), ref.step(many[:15]))  # fifteen: one call
    assert calls == [15]


def _padded(cache: torch.Tensor) -> torch.Tensor:
    """The same blocks in a buffer of its own whose blocks are a row longer (another block
    stride: still a valid cache for the layer-by-layer kernels)."""
    two, n, bs, kvh, d = cache.shape
    view = torch.zeros(two, n, bs + 1, kvh, d, dtype=cache.dtype)[:, :, :bs]
    view.copy_(cache)
    return view


def test_caches_not_at_one_stride_run_layer_by_layer(four_layers: Path, calls: list[int]) -> None:
    runner, ref = _pair(four_layers, "int4", block_size=4, num_blocks=32)
    # Layer 2 elsewhere: layers 0, 1 and 3 keep the pool's stride, 2 breaks it.
    for r in (runner, ref):
        r.kv[2] = r.kv[2].contiguous()
    assert _same(_generate(runner, [6, 3], 3), _generate(ref, [6, 3], 3))
    # Layer 1 with another block stride.
    for r in (runner, ref):
        r.kv = [r.kv[0], _padded(r.kv[1]), r.kv[2], r.kv[3]]
        r.tables.clear()
    assert _same(_generate(runner, [2, 5], 2), _generate(ref, [2, 5], 2))
    assert calls == []
    # Four separate tensors of one layout, one stride apart: one call per step.
    pool = torch.zeros(4, *runner.kv[0].shape, dtype=torch.bfloat16)
    for r in (runner, ref):
        r.kv = [pool[i].clone() for i in range(4)]  # (fresh buffers for the reference)
        r.tables.clear()
    runner.kv = list(pool.unbind(0))
    assert _same(_generate(runner, [5, 2], 2), _generate(ref, [5, 2], 2))
    assert calls == [2, 2]


def test_only_bf16_models_on_our_kernels_build(
    tiny_q4: Path, tiny_qwen2: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert DecodeLayers.build(_model(tiny_q4, True)) is not None
    f32 = load_model(tiny_q4, "float32", progress=False, quantization="int4")
    assert DecodeLayers.build(f32) is None  # float32: torch's layout
    dense = load_model(tiny_q4, "bfloat16", progress=False, quantization="none")
    assert DecodeLayers.build(dense) is None
    qwen2 = load_model(tiny_qwen2, "bfloat16", progress=False, quantization="int4")
    assert qwen2.layers[0].qkv_proj.bias is not None
    assert DecodeLayers.build(qwen2) is None  # biases: layer by layer
    monkeypatch.setenv("TANDEM_FUSED_DECODE", "0")
    assert DecodeLayers.build(_model(tiny_q4, True)) is None


def test_lora_steps_run_layer_by_layer(tiny_q4: Path, calls: list[int]) -> None:
    seen: list[str] = []

    class Hook:
        def apply(self, layer: int, module: str, x: torch.Tensor, out: torch.Tensor) -> None:
            seen.append(module)

    runner = PagedRunner(_model(tiny_q4, True), block_size=4, num_blocks=32)
    runner.step([("a", [5, 6, 7], 0)])
    runner.step([("a", [9], 3)], lora=Hook())
    assert calls == [] and "down_proj" in seen


def test_the_between_layers_hook_runs_once_per_call(tiny_q4: Path, calls: list[int]) -> None:
    runner = PagedRunner(_model(tiny_q4, True), block_size=4, num_blocks=32)
    hooks: list[int] = []
    runner.model.between_layers = lambda: hooks.append(len(calls))
    runner.step([("a", [5, 6, 7], 0)])  # layer by layer: once per layer
    assert hooks == [0, 0]
    runner.step([("a", [9], 3)])  # one call: once, before it
    assert hooks == [0, 0, 0] and calls == [1]


def test_a_pipeline_stage_runs_its_layers_in_one_call(four_layers: Path, calls: list[int]) -> None:
    """Stage 1 of 2 (no embedding: the previous stage's hidden states, no residual yet) and
    stage 0 (no final norm: returns the output plus the residual), two layers each."""
    hidden: dict[bool, list[torch.Tensor]] = {}
    for fused in (True, False):
        stages = [_model(four_layers, fused, "int4", pp_rank=r, pp_size=2) for r in range(2)]
        cfg = stages[0].config
        kv = []
        for stage in stages:
            assert len(stage.layers) == 2
            stage.pack_for_cpu()
            kvh, d = cfg.num_key_value_heads, cfg.head_dim
            kv.append(allocate_kv_caches(2, 8, 4, kvh, d, torch.bfloat16))
        attn = TorchAttention(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, 4)
        outs = []
        for tokens, positions, query_lens, ctx_lens in (
            ([3, 4, 5, 6, 7, 8], [0, 1, 2, 0, 1, 2], [3, 3], [3, 3]),
            ([9, 10], [3, 3], [1, 1], [4, 4]),
            ([11, 12], [4, 4], [1, 1], [5, 5]),
        ):
            meta = AttentionMetadata.build(
                query_lens, ctx_lens, [[0, 1], [2, 3]], 4, torch.device("cpu")
            )
            ids, pos = torch.tensor(tokens), torch.tensor(positions)
            h = stages[0](ids, pos, kv[0], meta, attn)
            outs.append(h)
            outs.append(stages[1](ids, pos, kv[1], meta, attn, hidden_states=h))
        hidden[fused] = outs
    assert calls == [2, 2, 2, 2]  # two decode steps, two stages
    assert _same(hidden[True], hidden[False])


def test_copies_and_requantized_weights_get_tables_of_their_own(
    tiny_q4: Path, calls: list[int]
) -> None:
    model = _model(tiny_q4, True)
    runner = PagedRunner(model, block_size=4, num_blocks=32)
    _generate(runner, [4], 1)
    table = model.decode_layers
    assert isinstance(table, DecodeLayers)
    assert pickle.loads(pickle.dumps(table)) is None
    twin = copy.deepcopy(model)
    assert twin.decode_layers is None  # built again, on the copy's own weights, on first use
    got = _generate(PagedRunner(twin, block_size=4, num_blocks=32), [4, 7], 2)
    assert isinstance(twin.decode_layers, DecodeLayers)
    assert twin.decode_layers.owners[0].data_ptr() != table.owners[0].data_ptr()
    ref = PagedRunner(_model(tiny_q4, False), block_size=4, num_blocks=32)
    assert _same(got, _generate(ref, [4, 7], 2))
    assert calls == [1, 2, 2]
    # Re-quantized after the table was built (rounded from the dense copy, int8): rebuilt.
    linear = model.layers[1].down_proj
    linear.quantize("int8", None, 0)
    ref.model.layers[1].down_proj.quantize("int8", None, 0)
    got, want = _generate(runner, [3], 2), _generate(ref, [3], 2)
    assert model.decode_layers is not table and isinstance(model.decode_layers, DecodeLayers)
    assert model.decode_layers.table[1].bits[3] == 8
    assert _same(got, want)


def test_an_empty_step_takes_no_call(tiny_q4: Path, calls: list[int]) -> None:
    model = _model(tiny_q4, True)
    runner = PagedRunner(model, block_size=4, num_blocks=32)
    runner.step([("a", [5, 6, 7], 0)])
    meta = AttentionMetadata.build([], [], [], 4, torch.device("cpu"))
    empty = torch.zeros(0, dtype=torch.long)
    hidden = model(empty, empty, runner.kv, meta, runner.attn)
    assert hidden.shape == (0, model.config.hidden_size) and calls == []
