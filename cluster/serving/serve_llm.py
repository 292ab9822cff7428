"""Ray Serve LLM's builders on Tandem: ``build_openai_app`` and ``build_pd_openai_app`` take
Ray Serve LLM's config shapes, so a ``serve run`` config written for ``ray.serve.llm`` runs on
Tandem by changing its ``import_path``::

    applications:
    - import_path: cluster.serving.serve_llm:build_pd_openai_app     # was ray.serve.llm:...
      args:
        prefill_config: {model_loading_config: {model_id: m, model_source: /models/m},
                         engine_kwargs: {max_model_len: 4096}, deployment_config: {...}}
        decode_config: {...}

What maps onto Tandem is translated into a ``ClusterConfig`` (docs/serve.md has the table);
anything else is refused with a ``ValueError`` naming it, never silently dropped:

- ``model_loading_config``: ``model_source`` (a local path or a built-in name; without it,
  ``model_id``, as in Ray Serve LLM) is the model, ``model_id`` the served name;
- ``engine_kwargs``: vLLM's engine arguments Tandem has (``dtype``, ``quantization`` --
  Tandem's values: auto, none, int8, int4 --, ``max_model_len``,
  ``max_num_seqs``, ``max_num_batched_tokens``, ``block_size``, ``enable_prefix_caching``,
  ``async_scheduling`` -- on by default with one pipeline stage, as in vLLM --,
  ``pipeline_parallel_size``, ``tensor_parallel_size: 1``, ``enable_lora``, ``max_loras``,
  ``max_lora_rank``); ``kv_transfer_config`` (vLLM's connector for P/D) is accepted -- Tandem
  moves KV with its own transport (``kv_transfer.transport``);
- ``deployment_config``: ``num_replicas``, or ``autoscaling_config``: the pool starts at its
  ``initial_replicas`` (else ``min_replicas``) and, with a ``max_replicas`` above its
  ``min_replicas``, autoscales (``InstancePool.autoscaling``, the same names:
  ``target_ongoing_requests``, ``upscale_delay_s``, ``downscale_delay_s``;
  ``metrics_interval_s`` is its ``interval_s``, ``look_back_period_s`` its ``window_s``; the
  smoothing factors are logged as unused; ``min_replicas`` 0 is 1: a pool keeps one);
- ``accelerator_type``: the pool's workers ask Ray for that accelerator and a GPU (without
  it the pool runs on CPU workers, Tandem's default, which is logged -- Ray Serve LLM would
  take a GPU).

One base model per application (``llm_configs`` with one entry): Tandem's app serves one model
and its LoRA adapters.
"""

from __future__ import annotations

import logging
from typing import Any

from cluster.config import ClusterConfig

logger = logging.getLogger(__name__)

# ClusterConfig fields
_ENGINE_TOP = ("dtype", "quantization", "max_model_len", "block_size", "enforce_eager")
_ENGINE_SCHEDULER = ("max_num_seqs", "max_num_batched_tokens", "async_scheduling")
_ENGINE_LORA = ("max_loras", "max_lora_rank")
_ENGINE_ACCEPTED = (
    "kv_transfer_config",
    "enable_lora",
    "tensor_parallel_size",
    "enable_auto_tool_choice",  # tool_choice auto is always on
)
_ENGINE_KWARGS = (
    *_ENGINE_TOP,
    *_ENGINE_SCHEDULER,
    *_ENGINE_LORA,
    *_ENGINE_ACCEPTED,
    "enable_prefix_caching",
    "pipeline_parallel_size",
    "tool_call_parser",
    "generation_config",
)
_LLM_CONFIG_KEYS = (
    "model_loading_config",
    "engine_kwargs",
    "deployment_config",
    "accelerator_type",
    "log_engine_metrics",
)


def build_openai_app(args: dict[str, Any]) -> Any:
    """Ray Serve LLM's ``build_openai_app``: ``{"llm_configs": [one LLMConfig]}`` (its
    ``LLMServingArgs``), served colocated (every instance runs whole requests)."""
    configs = args.get("llm_configs")
    if not isinstance(configs, list) or len(configs) != 1:
        raise ValueError(
            "llm_configs: Tandem serves one base model per application (with its LoRA "
            "adapters); give one LLMConfig, and deploy another application per model"
        )
    _refuse_keys(args, ("llm_configs",), "build_openai_app args")
    data = _translate({"both": configs[0]})
    return _build(data)


def build_pd_openai_app(args: dict[str, Any]) -> Any:
    """Ray Serve LLM's ``build_pd_openai_app``: ``{"prefill_config": LLMConfig,
    "decode_config": LLMConfig}``, one prefill and one decode pool."""
    missing = [k for k in ("prefill_config", "decode_config") if k not in args]
    if missing:
        raise ValueError(f"build_pd_openai_app needs {' and '.join(missing)}")
    _refuse_keys(args, ("prefill_config", "decode_config"), "build_pd_openai_app args")
    data = _translate({"prefill": args["prefill_config"], "decode": args["decode_config"]})
    return _build(data)


def cluster_config(llm_configs: dict[str, dict[str, Any]]) -> ClusterConfig:
    """The ClusterConfig for LLMConfigs by role (``both``, or ``prefill`` and ``decode``)."""
    return ClusterConfig.model_validate(_translate(llm_configs))


def _build(data: dict[str, Any]) -> Any:
    from cluster.serving.app import build_app_from_config

    return build_app_from_config(ClusterConfig.model_validate(data))


def _translate(by_role: dict[str, Any]) -> dict[str, Any]:
    data: dict[str, Any] = {"pools": []}
    models: set[tuple[str | None, str | None]] = set()
    for role, llm in by_role.items():
        where = f"{role}_config" if role != "both" else "llm_configs[0]"
        if not isinstance(llm, dict):
            raise ValueError(f"{where}: expected an LLMConfig mapping, got {type(llm).__name__}")
        _refuse_keys(llm, _LLM_CONFIG_KEYS, where)
        loading = llm.get("model_loading_config") or {}
        _refuse_keys(loading, ("model_id", "model_source"), f"{where}.model_loading_config")
        # Ray Serve LLM: without a model_source, model_id is where the model comes from.
        source = loading.get("model_source", loading.get("model_id"))
        if source is None:
            raise ValueError(f"{where}.model_loading_config: model_id (or model_source) is needed")
        if not isinstance(source, str):
            raise ValueError(
                f"{where}.model_loading_config.model_source: a local path or a built-in name "
                "(Tandem downloads nothing: mirror the model to a path first)"
            )
        models.add((source, loading.get("model_id")))
        pool: dict[str, Any] = {"name": role if role != "both" else "colocated", "role": role}
        pool["replicas"], scaling = _replicas(llm.get("deployment_config") or {}, where)
        if scaling is not None:
            pool["autoscaling"] = scaling
        engine = dict(llm.get("engine_kwargs") or {})
        _engine(engine, data, pool, where)
        accelerator = llm.get("accelerator_type")
        if accelerator is not None:
            pool.update(
                device="cuda", num_gpus=1.0, resources={f"accelerator_type:{accelerator}": 0.001}
            )
        else:  # Ray Serve LLM would take a GPU; Tandem's pools default to the CPU
            logger.warning(
                "%s: no accelerator_type: the pool runs on CPU workers (give accelerator_type "
                "for a GPU)",
                where,
            )
        data["pools"].append(pool)
    if len(models) != 1:
        raise ValueError(
            "prefill_config and decode_config must load the same model (model_loading_config)"
        )
    ((source, model_id),) = models
    data["model"] = source
    if model_id is not None:
        data.setdefault("serve", {})["served_model_name"] = model_id
    return data


def _engine(engine: dict[str, Any], data: dict[str, Any], pool: dict[str, Any], where: str) -> None:
    _refuse_keys(engine, _ENGINE_KWARGS, f"{where}.engine_kwargs")
    if "quantization" in engine and engine["quantization"] in (None, "gguf"):
        engine["quantization"] = "auto"  # vLLM's default, and its name for a GGUF's own form
    for key in _ENGINE_TOP:
        if key in engine:
            if key in data and data[key] != engine[key]:
                raise ValueError(f"engine_kwargs.{key} differs between the configs")
            data[key] = engine[key]
    pool["scheduler"] = {k: engine[k] for k in _ENGINE_SCHEDULER if k in engine}
    if "enable_prefix_caching" in engine:
        pool["cache"] = {"enable_prefix_caching": bool(engine["enable_prefix_caching"])}
    if "pipeline_parallel_size" in engine:
        pool["pp_size"] = engine["pipeline_parallel_size"]
    if pool.get("pp_size", 1) == 1:
        # vLLM schedules asynchronously by default; Tandem's stages pipeline instead.
        pool["scheduler"].setdefault("async_scheduling", True)
    tp = engine.get("tensor_parallel_size", 1)
    if tp != 1:
        raise ValueError(
            f"{where}.engine_kwargs.tensor_parallel_size: {tp} is not supported (Tandem splits "
            "a model by pipeline stages: pipeline_parallel_size)"
        )
    lora = {k: engine[k] for k in _ENGINE_LORA if k in engine}
    if engine.get("enable_lora") or lora:
        before = data.get("lora", {})
        clash = [k for k in lora if k in before and before[k] != lora[k]]
        if clash:
            raise ValueError(f"engine_kwargs.{clash[0]} differs between the configs")
        data["lora"] = {**before, **lora}
    for key in ("tool_call_parser", "generation_config"):  # (the API's, not the engine's)
        if key in engine:
            serve = data.setdefault("serve", {})
            if serve.get(key, engine[key]) != engine[key]:
                raise ValueError(f"engine_kwargs.{key} differs between the configs")
            serve[key] = engine[key]
    if "kv_transfer_config" in engine:
        logger.info(
            "%s: engine_kwargs.kv_transfer_config is vLLM's connector; Tandem moves the KV "
            "with its own transport (kv_transfer.transport)",
            where,
        )


def _replicas(deployment: dict[str, Any], where: str) -> tuple[int, dict[str, Any] | None]:
    """The pool's starting size and, for a range of sizes, its ``autoscaling`` section."""
    _refuse_keys(deployment, ("num_replicas", "autoscaling_config"), f"{where}.deployment_config")
    if "num_replicas" in deployment:
        replicas = deployment["num_replicas"]
        if not isinstance(replicas, int):
            raise ValueError(
                f"{where}.deployment_config.num_replicas: {replicas!r} -- a number (to "
                "autoscale, give autoscaling_config: min_replicas, max_replicas)"
            )
        return replicas, None
    scaling = deployment.get("autoscaling_config") or {}
    _refuse_keys(scaling, _AUTOSCALING_KEYS, f"{where}.deployment_config.autoscaling_config")
    named = f"{where}.deployment_config.autoscaling_config"
    least = _count(scaling, "min_replicas", named, 1)
    high = _count(scaling, "max_replicas", named, max(least, 1))
    if high < max(least, 1):
        raise ValueError(
            f"{named}: max_replicas ({high}) is below min_replicas ({least}) -- Ray Serve "
            "refuses it too"
        )
    replicas = _count(scaling, "initial_replicas", named, least)
    if not least <= replicas <= high:
        raise ValueError(
            f"{named}.initial_replicas: {replicas} -- between min_replicas ({least}) and "
            f"max_replicas ({high})"
        )
    low, replicas = max(least, 1), max(replicas, 1)  # (0: a pool keeps one instance)
    unused = sorted(set(scaling) - _REPLICA_KEYS - set(_AUTOSCALED))
    if unused:
        logger.warning(
            "%s.deployment_config.autoscaling_config: %s not used (Tandem's autoscaler reads "
            "the ongoing requests per instance, and TTFT/TPOT targets if given)",
            where,
            ", ".join(unused),
        )
    if high <= low:
        return replicas, None
    autoscaling = {"min_replicas": low, "max_replicas": high}
    for key, ours in _AUTOSCALED.items():
        if key in scaling:
            autoscaling[ours] = scaling[key]
    return replicas, autoscaling


def _count(scaling: dict[str, Any], key: str, where: str, default: int) -> int:
    """A replica count of ``autoscaling_config``: a whole number, 0 or more."""
    value = scaling.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{where}.{key}: {value!r} -- a whole number, 0 or more")
    return value


_REPLICA_KEYS = {"min_replicas", "max_replicas", "initial_replicas"}
# Ray Serve's autoscaling knobs that the pool's autoscaler takes (besides the replica counts):
# their names in ``AutoscalingConfig``.
_AUTOSCALED = {
    "target_ongoing_requests": "target_ongoing_requests",
    "upscale_delay_s": "upscale_delay_s",
    "downscale_delay_s": "downscale_delay_s",
    "metrics_interval_s": "interval_s",
    "look_back_period_s": "window_s",
}
# Ray Serve's autoscaling knobs: accepted (those not in _AUTOSCALED logged as unused).
_AUTOSCALING_KEYS = (
    *sorted(_REPLICA_KEYS),
    "target_ongoing_requests",
    "upscale_delay_s",
    "downscale_delay_s",
    "metrics_interval_s",
    "look_back_period_s",
    "smoothing_factor",
    "upscale_smoothing_factor",
    "downscale_smoothing_factor",
    "upscaling_factor",
    "downscaling_factor",
)


def _refuse_keys(mapping: dict[str, Any], known: tuple[str, ...], where: str) -> None:
    unknown = sorted(set(mapping) - set(known))
    if unknown:
        raise ValueError(
            f"{where}: {', '.join(unknown)} not supported by Tandem (supported: {', '.join(known)})"
        )
