"""Load a PEFT LoRA adapter (``adapter_config.json`` + ``adapter_model.safetensors``) into the
layout ``actors.lora`` applies: per fused projection, stacked A matrices and per-part B.

How one adapter's q/k/v land in the fused ``qkv_proj`` (gate/up in ``gate_up_proj`` alike)::

    out columns (fused rows)   [ q: H*D        | k: KV*D   | v: KV*D   ]
    stacked A  [r_q+r_k+r_v, in] = [A_q ; A_k ; A_v]   -> h = x[rows] @ A.T   (one matmul)
    per part:  out[rows, cols_p] += h[:, ranks_p] @ bt_p,   bt_p = (scale_p * B_p).T

The scale (alpha / r, or alpha / sqrt(r) with rsLoRA) is folded into B at load time, in float32.
"""

from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from actors.model.config import ModelConfig

logger = logging.getLogger(__name__)

# PEFT module name -> (our fused projection, position of its part in that projection).
FUSED_TARGETS: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "o_proj": ("o_proj", 0),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", 0),
}
_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn"}
_PARENT |= {"o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}

# adapter_config.json keys whose truthy value changes the math in ways we do not implement.
_UNSUPPORTED = {
    "use_dora": "DoRA (use_dora)",
    "lora_bias": "a bias on lora_B (lora_bias)",
    "modules_to_save": "fully trained extra modules (modules_to_save)",
    "trainable_token_indices": "trainable token embeddings (trainable_token_indices)",
    "layer_replication": "layer replication (layer_replication)",
    "target_parameters": "parameter targets (target_parameters)",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
    "use_qalora": "QA-LoRA (use_qalora)",
    "use_bdlora": "block-diagonal LoRA (use_bdlora)",
    "velora_config": "VeLoRA (velora_config)",
    "monteclora_config": "MonteCLoRA (monteclora_config)",
    "arrow_config": "Arrow routing (arrow_config)",
    "kasa_config": "KaSA (kasa_config)",
}

# ``base_model.model.model.layers.3.self_attn.q_proj.lora_A[.default].weight``
_TENSOR_NAME = re.compile(
    r"^(?:base_model\.model\.)?(?P<key>(?:.*\.)?layers\.(?P<layer>\d+)\.(?:self_attn|mlp)\."
    r"(?P<module>[a-z_]+))\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight$"
)


@dataclass(frozen=True)
class _Part:
    """One PEFT module inside a fused projection."""

    cols: slice  # its columns of the fused projection's output
    ranks: slice  # its rows of the stacked A (columns of h = x @ A.T)
    bt: torch.Tensor  # [rank, cols] contiguous: B transposed, scale folded in


@dataclass(frozen=True)
class FusedLoRA:
    """An adapter's weights for one fused projection of one layer."""

    a: torch.Tensor  # [sum of the parts' ranks, in_features]
    parts: tuple[_Part, ...]

    def to(self, device: torch.device) -> FusedLoRA:
        parts = tuple(_Part(p.cols, p.ranks, p.bt.to(device)) for p in self.parts)
        return FusedLoRA(self.a.to(device), parts)


AdapterWeights = dict[tuple[int, str], FusedLoRA]  # (layer, fused module) -> weights


def adapter_nbytes(weights: AdapterWeights) -> int:
    total = 0
    for f in weights.values():
        total += f.a.nbytes + sum(p.bt.nbytes for p in f.parts)
    return total


def _module_geometry(cfg: ModelConfig) -> dict[str, tuple[int, slice]]:
    """PEFT module -> (in_features, its columns in the fused output)."""
    h, q, kv, inter = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    return {
        "q_proj": (h, slice(0, q)),
        "k_proj": (h, slice(q, q + kv)),
        "v_proj": (h, slice(q + kv, q + 2 * kv)),
        "o_proj": (q, slice(0, h)),
        "gate_proj": (h, slice(0, inter)),
        "up_proj": (h, slice(inter, 2 * inter)),
        "down_proj": (inter, slice(0, h)),
    }


def _check_config(config: dict[str, Any], where: str, max_rank: int) -> None:
    """Refuse adapter configs we would silently get wrong."""
    peft_type = str(config.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise ValueError(f"{where}: peft_type {peft_type!r} is not supported (only LORA)")
    for key, feature in _UNSUPPORTED.items():
        if config.get(key):
            raise ValueError(f"{where}: {feature} is not supported")
    bias = config.get("bias", "none")
    if bias != "none":
        raise ValueError(f"{where}: bias={bias!r} is not supported (only 'none')")
    ranks = [
        int(config.get("r", 8)),
        *(int(r) for r in (config.get("rank_pattern") or {}).values()),
    ]
    if max(ranks) > max_rank:
        raise ValueError(
            f"{where}: adapter rank {max(ranks)} exceeds max_lora_rank={max_rank}; "
            "raise LoRAConfig.max_lora_rank or use a smaller adapter"
        )
    init = config.get("init_lora_weights")
    if isinstance(init, str) and init.lower() != "gaussian":
        # PiSSA/OLoRA/LoftQ/CorDA... also change the base weights unless the adapter was
        # converted when saved (PEFT's path_initial_model_for_weight_conversion).
        logger.warning("%s: init_lora_weights=%r assumes a modified base model", where, init)
    if config.get("fan_in_fan_out"):
        # PEFT itself resets it to False for nn.Linear targets (all of ours); lora_A/lora_B
        # are stored [r, in] / [out, r] either way, which the shape checks enforce.
        logger.warning(
            "%s: fan_in_fan_out=True ignored for nn.Linear targets (as PEFT does)", where
        )


def _pattern_value(patterns: dict[str, Any], key: str, default: float) -> float:
    """PEFT's ``rank_pattern`` / ``alpha_pattern`` look-up: first pattern matching a suffix."""
    for pattern, value in patterns.items():
        if re.match(rf"(.*\.)?({pattern})$", key):
            return float(value)
    return default


def _is_targeted(config: dict[str, Any], key: str) -> bool:
    """PEFT's rule for whether module ``key`` (``model.layers.0.self_attn.q_proj``) gets LoRA."""
    exclude = config.get("exclude_modules")
    if isinstance(exclude, str) and re.fullmatch(exclude, key):
        return False
    if isinstance(exclude, list) and (
        key in exclude or any(key.endswith(f".{e}") for e in exclude)
    ):
        return False
    targets = config.get("target_modules")
    if targets is None or targets == "all-linear":
        return True
    if isinstance(targets, str):
        return re.fullmatch(targets, key) is not None
    if key in targets:
        return True
    if not any(key.endswith(f".{t}") for t in targets):
        return False
    layers = config.get("layers_to_transform")
    if layers is None or layers == []:
        return True
    patterns = config.get("layers_pattern") or []
    patterns = [patterns] if isinstance(patterns, str) else patterns
    match = None
    if not patterns:
        match = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", key)
    for pattern in patterns:
        match = re.match(rf"(?:^|.*?\.){pattern}\.(?P<idx>\d+)\.", key)
        if match is not None:
            break
    if match is None:
        return False
    index = int(match.group("idx"))
    return index == layers if isinstance(layers, int) else index in layers


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    st = path / "adapter_model.safetensors"
    if st.is_file():
        from safetensors.torch import load_file

        return load_file(str(st))
    pt = path / "adapter_model.bin"
    if pt.is_file():
        tensors: dict[str, torch.Tensor] = torch.load(pt, map_location="cpu", weights_only=True)
        return tensors
    raise FileNotFoundError(f"{path}: no adapter_model.safetensors (or adapter_model.bin)")


def _collect_pairs(
    tensors: dict[str, torch.Tensor], cfg: ModelConfig, where: str
) -> dict[tuple[int, str], tuple[str, dict[str, tuple[str, torch.Tensor]]]]:
    """(layer, PEFT module) -> (PEFT module key, {"A"/"B": (tensor name, tensor)})."""
    found: dict[tuple[int, str], tuple[str, dict[str, tuple[str, torch.Tensor]]]] = {}
    for name, tensor in tensors.items():
        m = _TENSOR_NAME.match(name)
        if m is None or m["module"] not in FUSED_TARGETS:
            raise ValueError(
                f"{where}: tensor {name} is not supported (only lora_A/lora_B of the decoder "
                f"layers' {', '.join(FUSED_TARGETS)})"
            )
        layer = int(m["layer"])
        if layer >= cfg.num_hidden_layers:
            raise ValueError(
                f"{where}: tensor {name} is for layer {layer}; the model has "
                f"{cfg.num_hidden_layers} layers"
            )
        found.setdefault((layer, m["module"]), (m["key"], {}))[1][m["ab"]] = (name, tensor)
    return found


def _stack(parts: list[tuple[int, torch.Tensor, torch.Tensor, slice]]) -> FusedLoRA:
    """One fused projection's parts (index, A, scaled B, columns) -> stacked A + row ranges."""
    parts.sort(key=lambda p: p[0])
    built, offset = [], 0
    for _, a, b, cols in parts:
        built.append(_Part(cols, slice(offset, offset + a.shape[0]), b.t().contiguous()))
        offset += a.shape[0]
    return FusedLoRA(torch.cat([a for _, a, _, _ in parts]).contiguous(), tuple(built))


def load_adapter(path: Path, cfg: ModelConfig, max_rank: int, dtype: torch.dtype) -> AdapterWeights:
    """Read a PEFT LoRA directory into per-(layer, fused module) weights on the CPU in ``dtype``.
    Raises ``ValueError`` naming the field or tensor for anything unsupported or misshapen."""
    if not (path / "adapter_config.json").is_file():
        raise FileNotFoundError(f"LoRA adapter {path}: no adapter_config.json there")
    config: dict[str, Any] = json.loads((path / "adapter_config.json").read_text())
    where = f"LoRA adapter {path}"
    _check_config(config, where, max_rank)
    r0, alpha0 = float(config.get("r", 8)), float(config.get("lora_alpha", 8))
    rank_pattern = config.get("rank_pattern") or {}
    alpha_pattern = config.get("alpha_pattern") or {}
    rslora = bool(config.get("use_rslora", False))
    try:
        tensors = _read_tensors(path)
    except (OSError, ValueError):
        raise
    except Exception as exc:  # a damaged file: safetensors' own error, the unpickler's
        raise ValueError(
            f"{where}: its weights could not be read ({type(exc).__name__}: {exc})"
        ) from exc
    found = _collect_pairs(tensors, cfg, where)

    geometry = _module_geometry(cfg)
    grouped: dict[tuple[int, str], list[tuple[int, torch.Tensor, torch.Tensor, slice]]] = {}
    for layer in range(cfg.num_hidden_layers):
        for module, (fused, part) in FUSED_TARGETS.items():
            default_key = f"model.layers.{layer}.{_PARENT[module]}.{module}"
            key, pair = found.get((layer, module), (default_key, {}))
            if not _is_targeted(config, key):
                if pair:
                    logger.warning("%s: %s is not in target_modules; ignored (as PEFT)", where, key)
                continue
            if not pair and config.get("target_modules") is None:
                continue  # no target list: the file alone says what is adapted
            if "A" not in pair or "B" not in pair:
                raise ValueError(
                    f"{where}: adapter_config.json targets {key} but the weights "
                    f"have {sorted('lora_' + ab for ab in pair) or 'nothing'} for it"
                )
            rank = int(_pattern_value(rank_pattern, key, r0))
            alpha = _pattern_value(alpha_pattern, key, alpha0)
            in_features, cols = geometry[module]
            expected = {"A": (rank, in_features), "B": (cols.stop - cols.start, rank)}
            for ab, (name, tensor) in pair.items():
                if tuple(tensor.shape) != expected[ab]:
                    raise ValueError(
                        f"{where}: tensor {name} has shape {tuple(tensor.shape)}, expected "
                        f"{expected[ab]} (rank {rank}, {module} of this model)"
                    )
            scale = alpha / (math.sqrt(rank) if rslora else rank)
            b = (pair["B"][1].float() * scale).to(dtype)  # fold the scale in float32
            grouped.setdefault((layer, fused), []).append((part, pair["A"][1].to(dtype), b, cols))
    if not grouped:
        raise ValueError(f"{where}: no LoRA weights for any supported module")
    return {key: _stack(parts) for key, parts in grouped.items()}
