"""The rope built on the meta device (the loader's model, before it has storage) holds only
its tables' shapes: computing them there runs meta ops whose kernels are Python references
(torch._dynamo, about a second of every worker's start)."""

from __future__ import annotations

import pytest
import torch

import actors.model.rope as rope


@pytest.mark.parametrize("default_device_sees_the_context", [True, False])
def test_a_rope_built_on_meta_computes_no_tables(
    monkeypatch: pytest.MonkeyPatch, default_device_sees_the_context: bool
) -> None:
    """Also where ``torch.get_default_device()`` answers "cpu" inside ``with
    torch.device("meta")``, as it does before torch 2.8 (pytorch/pytorch#148621)."""
    if not default_device_sees_the_context:
        monkeypatch.setattr(torch, "get_default_device", lambda: torch.device("cpu"))

    def computed(*_: object) -> None:
        raise AssertionError("the rope computed its tables on the meta device")

    monkeypatch.setattr(rope, "_inv_freq", computed)
    with torch.device("meta"):
        built = rope.RotaryEmbedding(8, 16, 10000.0, None, torch.bfloat16)
    for table in (built.cos_table, built.signed_sin_table):
        assert table.is_meta and table.shape == (16, 8) and table.dtype == torch.bfloat16


def test_a_rope_built_on_a_real_device_has_its_tables() -> None:
    built = rope.RotaryEmbedding(8, 16, 10000.0, None, torch.float32)
    assert not built.cos_table.is_meta
    assert torch.equal(built.cos_table[0], torch.ones(8))
