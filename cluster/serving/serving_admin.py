"""The routes of the OpenAI-compatible API besides generation (``openai_serving.py``): the
models and LoRA adapters served (vLLM's ``/v1/models``, ``/v1/load_lora_adapter``,
``/v1/unload_lora_adapter``), health, metrics and pool resizes."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from cluster.engine.protocol import EngineClient
from cluster.errors import UnknownModelError
from cluster.serving.errors import APIError, api_error
from cluster.serving.openai_protocol import (
    LoadLoRAAdapterRequest,
    ScalePoolRequest,
    UnloadLoRAAdapterRequest,
)
from scheduler import LoRARequest

logger = logging.getLogger(__name__)


class ModelsAndOperations:
    """``OpenAIServing``'s models, adapters and operations (its state is set up there)."""

    engine: EngineClient
    model_name: str
    max_model_len: int
    created: int
    lora_adapter_root: str | None

    # -- models and adapters ----------------------------------------------------------------
    async def models(self) -> dict[str, Any]:
        def card(name: str, parent: str | None, root: str) -> dict[str, Any]:
            return {
                "id": name,
                "object": "model",
                "created": self.created,
                "owned_by": "tandem",
                "root": root,
                "parent": parent,
                "max_model_len": self.max_model_len,
            }

        cards = [card(self.model_name, None, self.model_name)]
        for name, lora in sorted((await self._adapters()).items()):
            cards.append(card(name, self.model_name, lora.lora_path))
        return {"object": "list", "data": cards}

    async def _adapters(self) -> dict[str, LoRARequest]:
        """The adapters served, by name."""
        try:
            return await self.engine.lora_adapters()
        except Exception as exc:  # the cluster is away: 503, not the catch-all's 500
            raise api_error(exc) from None

    async def resolve(self, model: str | None) -> LoRARequest | None:
        """The adapter a model name stands for (None: the base model); 404 if unknown."""
        if model is None or model == self.model_name:
            return None
        lora = (await self._adapters()).get(model)
        if lora is None:
            raise api_error(UnknownModelError(model))
        return lora

    def adapter_path(self, lora_path: str) -> str:
        """The adapter's path, resolved (symlinks followed, relative paths taken from the
        adapter root); 403 if it lies outside the root."""
        root = self.lora_adapter_root
        if root is None:
            return lora_path
        try:
            base = Path(root).resolve(strict=True)
        except OSError:
            logger.error("serve.lora_adapter_root %s does not exist on this ingress node", root)
            raise APIError(503, "the adapter root is not available on this replica") from None
        try:
            path = (base / lora_path).resolve()
        except (ValueError, OSError, RuntimeError):  # a NUL byte, a symlink loop
            raise APIError(400, "lora_path is not a usable path", "lora_path") from None
        if not path.is_relative_to(base):
            raise APIError(
                403, "lora_path is outside the adapter root (serve.lora_adapter_root)", "lora_path"
            )
        return str(path)

    async def load_lora_adapter(self, body: LoadLoRAAdapterRequest) -> str:
        if body.lora_name == self.model_name:
            raise APIError(400, "lora_name is the base model's name", param="lora_name")
        if body.lora_name in await self._adapters():
            raise APIError(
                400,
                f"The lora adapter '{body.lora_name}' has already been loaded.",
                param="lora_name",
            )
        path = self.adapter_path(body.lora_path)
        try:
            await self.engine.load_lora_adapter(body.lora_name, path)
        except Exception as exc:
            raise api_error(exc, param="lora_path") from None
        return f"Success: LoRA adapter '{body.lora_name}' added successfully."

    async def unload_lora_adapter(self, body: UnloadLoRAAdapterRequest) -> str:
        try:
            await self.engine.unload_lora_adapter(body.lora_name)
        except KeyError:  # (the cluster's, through Ray, is a KeyError too)
            raise APIError(
                404, f"The lora adapter '{body.lora_name}' cannot be found.", param="lora_name"
            ) from None
        except Exception as exc:  # the cluster is away (503), a bug (500): not a 404
            raise api_error(exc) from None
        return f"Success: LoRA adapter '{body.lora_name}' removed successfully."

    # -- operations --------------------------------------------------------------------------
    async def health(self) -> tuple[int, dict[str, Any]]:
        """(status, body): 200 when every instance's workers answer; 503 naming the ones
        that do not, or saying why the engine cannot be asked."""
        try:
            instances = await self.engine.check_health()
        except Exception as exc:
            # An open route: a remote task's error carries its traceback (files, lines), an
            # actor's its node IP address and process id. Logged, not answered.
            logger.warning("health: the workers could not be asked: %r", exc)
            why = "timed out" if isinstance(exc, TimeoutError) else type(exc).__name__
            error = f"the workers could not be asked ({why})"
            return 503, {"status": "unavailable", "error": error}
        down = sorted(i for i, ok in instances.items() if not ok)
        if down:
            return 503, {"status": "unavailable", "down": down}
        return 200, {"status": "ok", "instances": sorted(instances)}

    async def metrics(self) -> str:
        """The cluster's exposition; 503 while its central scheduler is away (a failed
        scrape, not a 500 with a traceback logged at every scrape)."""
        try:
            return await self.engine.metrics_text()
        except Exception as exc:
            raise api_error(exc) from None

    async def scale_pool(self, body: ScalePoolRequest) -> dict[str, Any]:
        """Resize a pool; 400 naming the problem (unknown pool, an engine without pools)."""
        try:
            return await self.engine.scale_pool(body.pool, body.replicas)
        except ValueError as exc:
            raise APIError(400, str(exc), param="pool") from None
        except TimeoutError as exc:  # the new workers could not be placed or loaded in time
            raise APIError(503, str(exc)) from None
        except Exception as exc:  # the central scheduler away or rebuilding: 503
            raise api_error(exc) from None
