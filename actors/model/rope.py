"""Rotary position embeddings (rotate-half layout, as Hugging Face Llama/Qwen2 checkpoints use).

The cos/sin table is computed once for every position the model serves (``max_positions``) and
indexed by each token's absolute position, so a prefill chunk, a decode token and a resumed
request all rotate exactly as a full-sequence forward would.
"""

from __future__ import annotations

import math
from typing import Any

import torch


def _inv_freq(
    head_dim: int, theta: float, scaling: dict[str, Any] | None
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and the attention scaling factor for one rope variant.
    ``freq_factors`` in ``scaling`` (a GGUF file's ``rope_freqs.weight``: llama.cpp stores
    Llama 3.1's scaling that way, one divisor per frequency) divide the frequencies after
    the variant's own scaling."""
    inv, mscale = _scaled_inv_freq(head_dim, theta, scaling)
    factors = (scaling or {}).get("freq_factors")
    if factors is not None:
        divisors = torch.tensor([float(x) for x in factors], dtype=torch.float32)
        if divisors.shape != inv.shape:
            raise ValueError(
                f"rope freq_factors has {divisors.numel()} values; head_dim {head_dim} "
                f"needs {inv.numel()}"
            )
        inv = inv / divisors
    return inv, mscale


def _scaled_inv_freq(
    head_dim: int, theta: float, scaling: dict[str, Any] | None
) -> tuple[torch.Tensor, float]:
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv, 1.0
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    factor = float(scaling.get("factor", 1.0))
    if kind == "default":
        return inv, 1.0
    if kind == "linear":
        return inv / factor, 1.0
    if kind == "llama3":
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_ctx = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old_ctx / low, inv / factor, inv)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
        return torch.where(medium, smoothed, scaled), 1.0
    if kind == "yarn":
        return _yarn(inv, head_dim, theta, scaling)
    raise ValueError(
        f"unsupported rope_scaling type {kind!r}; supported: default, linear, llama3, yarn"
    )


def _yarn(
    inv: torch.Tensor, head_dim: int, theta: float, scaling: dict[str, Any]
) -> tuple[torch.Tensor, float]:
    factor = float(scaling["factor"])
    old_ctx = float(scaling["original_max_position_embeddings"])
    beta_fast = float(scaling.get("beta_fast", 32.0))
    beta_slow = float(scaling.get("beta_slow", 1.0))
    mscale = scaling.get("attention_factor") or (
        0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0
    )

    def dim_for(rotations: float) -> float:
        return (head_dim * math.log(old_ctx / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low = max(math.floor(dim_for(beta_fast)), 0)
    high = min(math.ceil(dim_for(beta_slow)), head_dim - 1)
    if low == high:
        high += 1  # avoid a zero-width ramp
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    inv = (inv / factor) * (1 - extrapolation) + inv * extrapolation
    return inv, float(mscale)


class RotaryEmbedding(torch.nn.Module):
    """Applies rotary embeddings to flattened q/k: ``[num_tokens, num_heads * head_dim]``."""

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        theta: float,
        scaling: dict[str, Any] | None,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.cos_table: torch.Tensor
        self.signed_sin_table: torch.Tensor
        # (asked of a factory, not ``torch.get_default_device()``: before torch 2.8 that
        # does not see ``with torch.device("meta")``, and the ``[cuda]`` extra pins an older
        # torch)
        if torch.empty(()).is_meta:
            # A model built on the meta device (the loader's, before its weights) gets only
            # the tables' shapes, and a real rope once it has a device: computing them on
            # meta tensors imports torch._dynamo (about a second of each worker's start).
            empty = torch.empty(max_position, head_dim, dtype=dtype)
            self.register_buffer("cos_table", empty, persistent=False)
            self.register_buffer("signed_sin_table", empty.clone(), persistent=False)
            return
        inv, mscale = _inv_freq(head_dim, theta, scaling)
        t = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(t, inv)
        emb = torch.cat((freqs, freqs), dim=-1)
        # Kept in the model's dtype: Hugging Face casts cos/sin to the activations' dtype too.
        sin = emb.sin() * mscale
        sin[:, : head_dim // 2] *= -1  # rotate_half's sign, folded in (see ``rotate``)
        self.register_buffer("cos_table", (emb.cos() * mscale).to(dtype), persistent=False)
        self.register_buffer("signed_sin_table", sin.to(dtype), persistent=False)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sign-folded sin rows for a step's positions, ``[T, 1, D]`` each; computed
        once per step and shared by every layer."""
        return (
            self.cos_table[positions].unsqueeze(1),
            self.signed_sin_table[positions].unsqueeze(1),
        )

    def rotate(self, qk: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
        """Rotate ``[T, n_heads * D]`` (q and k heads side by side are fine: same positions).

        rotate_half(x) = [-x2, x1] = roll(x, D/2) * [-1..., +1...]; the signs live in
        ``signed_sin``, so a rotation is one roll, two multiplies and an add."""
        t = qk.shape[0]
        x = qk.view(t, -1, self.head_dim)
        return (x * cos + x.roll(self.head_dim // 2, dims=-1) * signed_sin).view(t, -1)
