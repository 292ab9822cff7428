"""The Serve config and the ``tandem serve`` flags (no Ray needed)."""

from __future__ import annotations

import argparse
import importlib
from pathlib import Path

import pytest
import yaml

from cluster.config import ClusterConfig
from cluster.tools.serve_cli import add_serve_arguments, serve_config

ROOT = Path(__file__).resolve().parents[3]


def test_deploy_serve_yaml_runs_build_app_with_a_valid_cluster_config() -> None:
    doc = yaml.safe_load((ROOT / "deploy" / "serve.yaml").read_text())
    [app] = doc["applications"]
    module, _, attr = app["import_path"].partition(":")
    assert callable(getattr(importlib.import_module(module), attr))
    config = ClusterConfig.model_validate(app["args"])
    assert {p.role for p in config.pools} == {"prefill", "decode"}
    servicer = doc["grpc_options"]["grpc_servicer_functions"][0]
    module, _, attr = servicer.rpartition(".")
    assert callable(getattr(importlib.import_module(module), attr))
    assert doc["http_options"]["host"] == "127.0.0.1"


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    return p.parse_args(list(argv))


def test_flags_override_the_config(tmp_path: Path) -> None:
    config = serve_config(
        _args("--port", "8100", "--api-key", "k" * 20, "--lora-module", "x=/a", "--no-grpc")
    )
    assert config.serve.port == 8100 and config.serve.grpc_port is None
    assert config.serve.api_key is not None and config.serve.api_key.get_secret_value() == "k" * 20
    assert config.serve.lora_modules == {"x": "/a"} and config.lora is not None
    file = tmp_path / "c.yaml"
    file.write_text("serve: {port: 8200, served_model_name: m}\n")
    from_file = serve_config(_args(str(file)))
    assert from_file.serve.port == 8200 and from_file.serve.served_model_name == "m"
    with pytest.raises(ValueError, match="NAME=PATH"):
        serve_config(_args("--lora-module", "nopath"))
    admin = serve_config(
        _args("--admin-api-key", "a" * 20, "--lora-adapter-root", "/srv/adapters")
    ).serve
    assert admin.admin_api_key is not None and admin.admin_api_key.get_secret_value() == "a" * 20
    assert admin.allow_runtime_lora_updates and admin.lora_adapter_root == "/srv/adapters"
    assert not admin.allow_runtime_scaling
    scaling = serve_config(_args("--allow-runtime-scaling", "--api-key", "k" * 20)).serve
    assert scaling.allow_runtime_scaling
    with pytest.raises(ValueError, match="need a key"):
        serve_config(_args("--allow-runtime-scaling"))


def test_serve_section_is_validated() -> None:
    with pytest.raises(ValueError, match="lora section"):
        ClusterConfig.model_validate({"serve": {"lora_modules": {"a": "/x"}}})
    with pytest.raises(ValueError, match="port"):
        ClusterConfig.model_validate({"serve": {"port": 0}})
    assert ClusterConfig().serve.host == "127.0.0.1"
