"""Ray Serve LLM's builders on Tandem: its config shapes (``llm_configs``, ``prefill_config``
+ ``decode_config`` with ``model_loading_config``, ``engine_kwargs``, ``deployment_config``)
become a ClusterConfig, what does not map is refused naming it, and a Serve config written for
``ray.serve.llm`` builds a Tandem app by changing its import path (no Ray needed)."""

from __future__ import annotations

import importlib
from typing import Any

import pytest
import yaml

from cluster.serving.serve_llm import build_openai_app, build_pd_openai_app, cluster_config


def _llm(**extra: Any) -> dict[str, Any]:
    return {
        "model_loading_config": {"model_id": "qwen", "model_source": "/models/qwen"},
        "engine_kwargs": {"max_model_len": 4096, "max_num_seqs": 32},
        **extra,
    }


def test_a_pd_config_becomes_a_prefill_and_a_decode_pool() -> None:
    prefill = _llm(
        deployment_config={"autoscaling_config": {"min_replicas": 2, "max_replicas": 2}},
        engine_kwargs={
            "max_model_len": 4096,
            "max_num_batched_tokens": 8192,
            "kv_transfer_config": {"kv_connector": "NixlConnector", "kv_role": "kv_both"},
            "enable_prefix_caching": False,
        },
    )
    decode = _llm(
        deployment_config={"num_replicas": 3},
        engine_kwargs={"max_model_len": 4096, "max_num_seqs": 64, "pipeline_parallel_size": 2},
    )
    config = cluster_config({"prefill": prefill, "decode": decode})
    assert config.model == "/models/qwen" and config.serve.served_model_name == "qwen"
    assert config.max_model_len == 4096
    p, d = config.pools
    assert (p.role, p.replicas, d.role, d.replicas) == ("prefill", 2, "decode", 3)
    # vLLM's default async scheduling where a pool has one stage; pipelined pools none.
    assert p.scheduler == {"max_num_batched_tokens": 8192, "async_scheduling": True}
    assert p.cache == {"enable_prefix_caching": False}
    assert d.scheduler == {"max_num_seqs": 64} and d.pp_size == 2


def test_one_model_colocated_with_lora_and_an_accelerator() -> None:
    llm = _llm(
        engine_kwargs={
            "dtype": "bfloat16",
            "enforce_eager": True,
            "enable_lora": True,
            "max_loras": 2,
            "enable_auto_tool_choice": True,
            "tool_call_parser": "hermes",
            "generation_config": "vllm",
        },
        accelerator_type="A10G",
    )
    config = cluster_config({"both": llm})
    assert config.serve.tool_call_parser == "hermes"
    assert config.serve.generation_config == "vllm"
    assert config.serve.served_model_name == "qwen"
    (pool,) = config.pools
    assert pool.role == "both" and pool.replicas == 1
    assert pool.device == "cuda" and pool.num_gpus == 1.0
    assert pool.resources == {"accelerator_type:A10G": 0.001}
    assert config.dtype == "bfloat16" and config.enforce_eager
    # ... and every worker of the pool is told (vLLM's name; CUDA graphs off).
    from cluster.control.placement import worker_kwargs

    assert worker_kwargs(config, pool)["enforce_eager"] is True
    assert worker_kwargs(cluster_config({"both": _llm()}), pool)["enforce_eager"] is False
    assert config.lora is not None and config.lora.max_loras == 2


@pytest.mark.parametrize(
    ("llm", "named"),
    [
        (_llm(runtime_env={"pip": ["x"]}), "runtime_env"),
        (_llm(engine_kwargs={"quantization": "awq"}), "quantization"),
        (_llm(engine_kwargs={"tensor_parallel_size": 2}), "tensor_parallel_size"),
        (_llm(deployment_config={"ray_actor_options": {}}), "ray_actor_options"),
        (
            {"model_loading_config": {"model_id": "m", "model_source": {"bucket_uri": "s3://x"}}},
            "model_source",
        ),
        (_llm(lora_config={"dynamic_lora_loading_path": "s3://x"}), "lora_config"),
    ],
)
def test_what_does_not_map_is_refused_by_name(llm: dict[str, Any], named: str) -> None:
    with pytest.raises(ValueError, match=named):
        cluster_config({"both": llm})


def test_builders_check_their_arguments() -> None:
    with pytest.raises(ValueError, match="one base model per application"):
        build_openai_app({"llm_configs": [_llm(), _llm()]})
    with pytest.raises(ValueError, match="decode_config"):
        build_pd_openai_app({"prefill_config": _llm()})
    other = _llm(model_loading_config={"model_id": "x", "model_source": "/models/x"})
    with pytest.raises(ValueError, match="same model"):
        build_pd_openai_app({"prefill_config": _llm(), "decode_config": other})


def test_a_ray_serve_llm_config_runs_by_changing_the_import_path() -> None:
    doc = yaml.safe_load(
        """
applications:
- name: llm
  route_prefix: /
  import_path: ray.serve.llm:build_pd_openai_app
  args:
    prefill_config:
      model_loading_config: {model_id: smollm, model_source: smollm2}
      engine_kwargs: {max_model_len: 2048, kv_transfer_config: {kv_connector: NixlConnector}}
    decode_config:
      model_loading_config: {model_id: smollm, model_source: smollm2}
      engine_kwargs: {max_model_len: 2048, kv_transfer_config: {kv_connector: NixlConnector}}
      deployment_config: {autoscaling_config: {min_replicas: 1, max_replicas: 1}}
"""
    )
    (app,) = doc["applications"]
    path = app["import_path"].replace("ray.serve.llm:", "cluster.serving.serve_llm:")
    module, _, name = path.partition(":")
    builder = getattr(importlib.import_module(module), name)
    from ray.serve import Application

    from cluster.config import ClusterConfig

    built = builder(app["args"])
    assert isinstance(built, Application)
    # What Serve would run: the ingress bound to the cluster config the args became (a
    # builder that dropped or mistranslated them still returned an Application).
    config = built._bound_deployment.init_args[-1]
    assert isinstance(config, ClusterConfig)
    assert config.model == "smollm2" and config.serve.served_model_name == "smollm"
    assert config.max_model_len == 2048
    pools = [(p.role, p.replicas, p.autoscaling) for p in config.pools]
    assert pools == [("prefill", 1, None), ("decode", 1, None)]


@pytest.mark.parametrize(
    ("scaling", "named"),
    [
        # (max_replicas below min_replicas was taken: the pool stayed at min_replicas, fixed)
        ({"min_replicas": 3, "max_replicas": 2}, r"max_replicas \(2\) is below min_replicas"),
        ({"min_replicas": 1, "max_replicas": 3, "initial_replicas": 4}, r"\.initial_replicas: 4"),
        ({"min_replicas": 2, "max_replicas": 3, "initial_replicas": 1}, r"\.initial_replicas: 1"),
        ({"min_replicas": "two"}, r"autoscaling_config\.min_replicas: 'two'"),
        ({"max_replicas": 2.5}, r"autoscaling_config\.max_replicas: 2\.5"),
        ({"min_replicas": -1}, r"autoscaling_config\.min_replicas: -1"),
        ({"max_replicas": True}, r"autoscaling_config\.max_replicas: True"),
    ],
)
def test_ray_serve_llm_bad_replica_counts_name_the_field(
    scaling: dict[str, object], named: str
) -> None:
    """A replica range Ray Serve would refuse is refused, naming the field (a max_replicas
    below min_replicas, a string or a fraction were taken or failed inside ``int``)."""
    with pytest.raises(ValueError, match=named):
        cluster_config({"both": _llm(deployment_config={"autoscaling_config": scaling})})


def test_ray_serve_llm_defaults_and_autoscaling_knobs() -> None:
    """Without model_source the model comes from model_id (Ray Serve LLM's rule); Ray
    Serve's autoscaling_config makes the pool start at min_replicas and autoscale between
    min_replicas and max_replicas, its knobs under their names (they were logged as unused:
    the pool stayed at min_replicas); differing LoRA limits between prefill and decode are
    refused."""
    config = cluster_config({"both": {"model_loading_config": {"model_id": "/models/m"}}})
    assert config.model == "/models/m" and config.serve.served_model_name == "/models/m"
    scaling = {"min_replicas": 2, "max_replicas": 4, "upscale_delay_s": 5, "smoothing_factor": 1}
    config = cluster_config({"both": _llm(deployment_config={"autoscaling_config": scaling})})
    assert config.pools[0].replicas == 2
    autoscaling = config.pools[0].autoscaling
    assert autoscaling is not None and autoscaling.min_replicas == 2
    assert autoscaling.max_replicas == 4 and autoscaling.upscale_delay_s == 5
    serve_names = {
        "min_replicas": 0,  # (a pool keeps one instance)
        "initial_replicas": 2,
        "max_replicas": 3,
        "metrics_interval_s": 0.5,
        "look_back_period_s": 20,
        "target_ongoing_requests": 8,
    }
    config = cluster_config({"both": _llm(deployment_config={"autoscaling_config": serve_names})})
    pool = config.pools[0]
    assert pool.replicas == 2 and pool.autoscaling is not None
    assert (pool.autoscaling.min_replicas, pool.autoscaling.max_replicas) == (1, 3)
    assert pool.autoscaling.interval_s == 0.5 and pool.autoscaling.window_s == 20
    assert pool.autoscaling.target_ongoing_requests == 8
    fixed = {"min_replicas": 2, "max_replicas": 2}
    config = cluster_config({"both": _llm(deployment_config={"autoscaling_config": fixed})})
    assert config.pools[0].replicas == 2 and config.pools[0].autoscaling is None
    with pytest.raises(ValueError, match="num_replicas"):
        cluster_config({"both": _llm(deployment_config={"num_replicas": "auto"})})
    prefill = _llm(engine_kwargs={"max_loras": 2})
    decode = _llm(engine_kwargs={"max_loras": 3})
    with pytest.raises(ValueError, match="max_loras differs"):
        cluster_config({"prefill": prefill, "decode": decode})
