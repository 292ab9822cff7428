"""Every decoder layer in one C call for decode steps (``actors.model.fused_decode``): the same
bits as the layer-by-layer path, on the steps it takes; the layer-by-layer path for the steps
it does not (prefill rows, batches past the dense switch, LoRA, caches of a tensor per layer,
float32); pipeline stages; copies."""

from __future__ import annotations

import copy
import pickle
from pathlib import Path
from typing import Any

import gguf
import pytest
import torch

from actors.model.attention import AttentionMetadata, TorchAttention
from actors.model.fused_decode import DecodeLayers
from actors.model.llama import LlamaForCausalLM
from actors.model.loader import load_model
from actors.model.quant_gemm import quant_gemm
from kv_transfer.blocks import allocate_kv_caches
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


def _model(path: Path, fused: bool, **kwargs: Any) -> LlamaForCausalLM:
    model = load_model(path, "bfloat16", progress=False, quantization="auto", **kwargs)
    if not fused:
        model.decode_layers = False  # the layer-by-layer path
    return model


class _Counting:
    """Wraps a built ``DecodeLayers``' C function: how many steps ran as one call."""

    def __init__(self, model: LlamaForCausalLM) -> None:
        self.calls = 0
        layers = DecodeLayers.build(model)
        assert layers is not None
        inner = layers.fn

        def fn(*args: Any) -> int:
            self.calls += 1
            return int(inner(*args))

        layers.fn = fn
        model.decode_layers = layers
        self.layers = layers


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


@pytest.mark.parametrize("threads", [1, 2])
def test_one_call_gives_the_layer_by_layer_bits(tiny_q4: Path, threads: int) -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        fused = _model(tiny_q4, True)
        counter = _Counting(fused)
        lengths = [9, 1, 23, 5, 16]  # blocks of 4: block boundaries crossed while decoding
        got = _generate(PagedRunner(fused, block_size=4, num_blocks=64), lengths, 7)
        ref = _generate(
            PagedRunner(_model(tiny_q4, False), block_size=4, num_blocks=64), lengths, 7
        )
    finally:
        torch.set_num_threads(before)
    assert counter.calls == 7  # every decode step, not the prefill
    assert len(got) == len(ref) == 5 * 8
    for a, b in zip(got, ref, strict=True):
        assert torch.equal(a, b)


def test_steps_it_does_not_take_run_layer_by_layer(tiny_q4: Path) -> None:
    model = _model(tiny_q4, True)
    counter = _Counting(model)
    assert counter.layers.max_rows == 16  # the int4 kernel's switch to the dense copy
    runner = PagedRunner(model, block_size=4, num_blocks=128)
    ref_runner = PagedRunner(_model(tiny_q4, False), block_size=4, num_blocks=128)
    # A decode beside a prefill chunk: one mixed step.
    for r in (runner, ref_runner):
        r.step([("a", [5, 6, 7], 0)])
    mixed = [("a", [9], 3), ("b", [4, 5, 6, 7, 8], 0)]
    for a, b in zip(runner.step(mixed), ref_runner.step(mixed), strict=True):
        assert torch.equal(a, b)
    assert counter.calls == 0
    # Sixteen decodes: past the switch, the projections run on their dense copies.
    many = [(f"d{i}", [i + 2], 0) for i in range(16)]
    for a, b in zip(runner.step(many), ref_runner.step(many), strict=True):
        assert torch.equal(a, b)
    assert counter.calls == 0
    runner.step(many[:15])  # fifteen: one call
    assert counter.calls == 1


def _padded(cache: torch.Tensor) -> torch.Tensor:
    """The same blocks in a buffer of its own whose blocks are a row longer (another block
    stride: still a valid cache for the layer-by-layer kernels)."""
    two, n, bs, kvh, d = cache.shape
    view = torch.zeros(two, n, bs + 1, kvh, d, dtype=cache.dtype)[:, :, :bs]
    view.copy_(cache)
    return view


def test_caches_not_at_one_stride_run_layer_by_layer(tiny_q4: Path) -> None:
    model = _model(tiny_q4, True)
    counter = _Counting(model)
    runner = PagedRunner(model, block_size=4, num_blocks=32)
    ref = PagedRunner(_model(tiny_q4, False), block_size=4, num_blocks=32)
    for r in (runner, ref):
        r.kv = [r.kv[0], _padded(r.kv[1])]
    got, want = _generate(runner, [6, 3], 3), _generate(ref, [6, 3], 3)
    assert counter.calls == 0
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    # Separate tensors of one layout are fine wherever they lie: one call per step.
    for r in (runner, ref):
        r.kv = [r.kv[0].contiguous(), r.kv[1].contiguous()]  # (padding dropped: one layout)
        r.tables.clear()
    got, want = _generate(runner, [5, 2], 2), _generate(ref, [5, 2], 2)
    assert counter.calls == 2
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_only_bf16_models_on_our_kernels_build(
    tiny_q4: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert DecodeLayers.build(_model(tiny_q4, True)) is not None
    f32 = load_model(tiny_q4, "float32", progress=False, quantization="int4")
    assert DecodeLayers.build(f32) is None  # float32: torch's layout
    dense = load_model(tiny_q4, "bfloat16", progress=False, quantization="none")
    assert DecodeLayers.build(dense) is None
    monkeypatch.setenv("TANDEM_FUSED_DECODE", "0")
    assert DecodeLayers.build(_model(tiny_q4, True)) is None


def test_lora_steps_run_layer_by_layer(tiny_q4: Path) -> None:
    model = _model(tiny_q4, True)
    counter = _Counting(model)
    seen: list[str] = []

    class Hook:
        def apply(self, layer: int, module: str, x: torch.Tensor, out: torch.Tensor) -> None:
            seen.append(module)

    runner = PagedRunner(model, block_size=4, num_blocks=32)
    runner.step([("a", [5, 6, 7], 0)])
    runner.step([("a", [9], 3)], lora=Hook())
    assert counter.calls == 0 and "down_proj" in seen


def test_a_pipeline_stage_runs_its_layers_in_one_call(tiny_q4: Path) -> None:
    """Stage 1 of 2 (no embedding: the previous stage's hidden states, no residual yet) and
    stage 0 (no final norm: returns the output plus the residual)."""
    hidden: dict[bool, list[torch.Tensor]] = {}
    calls = 0
    for fused in (True, False):
        stages = [_model(tiny_q4, fused, pp_rank=r, pp_size=2) for r in range(2)]
        counters = [_Counting(s) for s in stages] if fused else []
        cfg = stages[0].config
        kv = []
        for stage in stages:
            stage.pack_for_cpu()
            kv.append(
                allocate_kv_caches(
                    len(stage.layers), 8, 4, cfg.num_key_value_heads, cfg.head_dim, torch.bfloat16
                )
            )
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
        calls = sum(c.calls for c in counters) if fused else calls
    assert calls == 4  # two decode steps, two stages
    for a, b in zip(hidden[True], hidden[False], strict=True):
        assert torch.equal(a, b)


def test_a_copy_builds_its_own_table(tiny_q4: Path) -> None:
    model = _model(tiny_q4, True)
    runner = PagedRunner(model, block_size=4, num_blocks=32)
    _generate(runner, [4], 1)
    assert isinstance(model.decode_layers, DecodeLayers)
    assert pickle.loads(pickle.dumps(model.decode_layers)) is None
    twin = copy.deepcopy(model)
    assert twin.decode_layers is None  # built again, on the copy's own weights, on first use
    got = _generate(PagedRunner(twin, block_size=4, num_blocks=32), [4, 7], 2)
    assert isinstance(twin.decode_layers, DecodeLayers)
    assert twin.decode_layers.owners[0].data_ptr() != model.decode_layers.owners[0].data_ptr()
    want = _generate(PagedRunner(_model(tiny_q4, False), block_size=4, num_blocks=32), [4, 7], 2)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
