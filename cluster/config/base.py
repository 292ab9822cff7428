"""The base of every cluster config model."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class _Config(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
