"""The Serve config and the ``tandem serve`` flags (no Ray needed)."""

from __future__ import annotations

import argparse
import importlib
from pathlib import Path

import pytest
import yaml

from cluster.config import ClusterConfig
from cluster.tools.serve_args import add_serve_arguments
from cluster.tools.serve_cli import serve_config

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


def test_the_ready_message_says_the_grpc_proxy_listens_on_every_interface() -> None:
    """Serve's plaintext gRPC proxy binds [::]:PORT whatever --host says: the ready message
    said "on 127.0.0.1:9000" for an API open to the network (no key by default)."""
    from cluster.config import ServeConfig
    from cluster.tools.serve_listen import grpc_banner

    open_ = grpc_banner(ServeConfig())
    assert "127.0.0.1" not in open_ and "every interface" in open_ and "--no-grpc" in open_
    keyed = grpc_banner(ServeConfig(api_key="k" * 20))
    assert "every interface" in keyed and "--no-grpc" not in keyed
    tls = ServeConfig(ssl_keyfile="/k.pem", ssl_certfile="/c.pem")
    assert grpc_banner(tls) == "gRPC tandem.v1.Generate on 127.0.0.1:9000 (TLS)\n"
    assert grpc_banner(ServeConfig(grpc_port=None)) == ""
    own = ServeConfig(grpc_server="ingress")
    assert grpc_banner(own) == "gRPC tandem.v1.Generate on 127.0.0.1:9000\n"


def test_tandem_serve_on_a_loopback_host_serves_grpc_from_the_ingress() -> None:
    """Where Serve's plaintext proxy (every interface) gives way to the ingress replicas on
    the host: a loopback host on a Ray of its own, unless the config names the proxy."""
    from cluster.tools.serve_listen import grpc_where_it_binds

    def server(address: str | None = None, **serve: object) -> str:
        config = serve_config(_args())
        config = config.model_copy(update={"serve": config.serve.model_validate(serve)})
        chosen = grpc_where_it_binds(config, address)
        assert grpc_where_it_binds(chosen, address) == chosen  # (start_serve applies it again)
        return str(chosen.serve.grpc_server or "proxy")  # (unset: the proxy)

    assert server() == "ingress"  # the default: 127.0.0.1
    assert server(host="::1") == "ingress" and server(host="localhost") == "ingress"
    assert server(host="0.0.0.0") == "proxy" and server(host="10.1.2.3") == "proxy"
    assert server("127.0.0.1:6379") == "proxy"  # a joined Ray: replicas on other nodes
    assert server(grpc_server="proxy") == "proxy"  # named in the config
    assert server(grpc_port=None) == "proxy"
    assert server(ssl_keyfile="/k.pem", ssl_certfile="/c.pem") == "proxy"  # (TLS: its own)


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


def test_vllm_flags_and_pool_sizes(tmp_path: Path) -> None:
    """``tandem serve MODEL`` with vLLM's engine flags, onto every pool; Tandem's pool sizes;
    a .yaml in MODEL's place is the config, and the flags override it."""
    config = serve_config(
        _args(
            "/models/m",
            "--dtype",
            "float32",
            "--max-model-len",
            "4096",
            "--max-num-seqs",
            "32",
            "--max-num-batched-tokens",
            "1024",
            "--block-size",
            "32",
            "--no-enable-prefix-caching",
            "-pp",
            "2",
            "--kv-transport",
            "grpc",
            "--decode-instances",
            "3",
            "-q",
            "int8",
            "--enforce-eager",
        )
    )
    assert config.model == "/models/m" and config.dtype == "float32"
    assert config.quantization == "int8" and config.enforce_eager
    assert config.max_model_len == 4096 and config.block_size == 32
    assert config.kv_transfer.transport == "grpc"
    assert [(p.name, p.role, p.replicas) for p in config.pools] == [
        ("prefill", "prefill", 1),
        ("decode", "decode", 3),
    ]
    for pool in config.pools:
        assert pool.scheduler == {"max_num_seqs": 32, "max_num_batched_tokens": 1024}
        assert pool.cache == {"enable_prefix_caching": False} and pool.pp_size == 2
        assert pool.num_threads == "auto"  # the default pools' other settings stay
    colocated = serve_config(_args("--prefill-instances", "0", "--decode-instances", "2"))
    assert not colocated.enforce_eager  # CUDA graphs by default, as vLLM
    assert [(p.name, p.role, p.replicas) for p in colocated.pools] == [("colocated", "both", 2)]
    # The default config schedules asynchronously; -pp 2 drops that (the stages pipeline
    # already), --no-async-scheduling turns it off, and asking for both is refused.
    assert all(p.scheduler == {"async_scheduling": True} for p in colocated.pools)
    sync = serve_config(_args("--no-async-scheduling"))
    assert all(p.scheduler == {"async_scheduling": False} for p in sync.pools)
    with pytest.raises(ValueError, match="async_scheduling needs pp_size 1"):
        serve_config(_args("-pp", "2", "--async-scheduling"))
    file = tmp_path / "c.yaml"
    file.write_text("block_size: 8\npools: [{name: c, role: both, replicas: 1}]\n")
    from_file = serve_config(_args(str(file), "--prefill-instances", "2"))
    assert from_file.block_size == 8 and from_file.model is None
    assert [(p.name, p.role, p.replicas) for p in from_file.pools] == [
        ("prefill", "prefill", 2),
        ("decode", "decode", 1),
    ]
    both = serve_config(_args("/models/m", "--config", str(file), "--block-size", "16"))
    assert both.model == "/models/m" and both.block_size == 16
    # Two decode pools: which would the flags resize? Refused (the second was dropped).
    two = tmp_path / "two.yaml"
    two.write_text(
        "pools: [{name: p, role: prefill}, {name: d1, role: decode}, {name: d2, role: decode}]\n"
    )
    with pytest.raises(ValueError, match="it has 3 \\(p, d1, d2\\)"):
        serve_config(_args(str(two), "--decode-instances", "2"))
    assert [p.name for p in serve_config(_args(str(two))).pools] == ["p", "d1", "d2"]
    three = tmp_path / "three.yaml"  # a colocated pool beside the P/D pair: the same
    three.write_text(
        "pools: [{name: p, role: prefill}, {name: d, role: decode}, {name: c, role: both}]\n"
    )
    with pytest.raises(ValueError, match="it has 3 \\(p, d, c\\)"):
        serve_config(_args(str(three), "--decode-instances", "2"))


def test_lora_flags_and_refusals() -> None:
    config = serve_config(
        _args("--enable-lora", "--max-loras", "3", "--max-lora-rank", "32", "--api-key", "k" * 20)
    )
    assert config.lora is not None and config.lora.max_loras == 3
    assert config.lora.max_lora_rank == 32
    modules = serve_config(_args("--lora-modules", "a=/x", "b=/y", "--lora-module", "c=/z"))
    assert modules.serve.lora_modules == {"a": "/x", "b": "/y", "c": "/z"}
    assert modules.lora is not None
    assert serve_config(_args()).lora is None
    parser = serve_config(_args("--tool-call-parser", "llama3_json", "--enable-auto-tool-choice"))
    assert parser.serve.tool_call_parser == "llama3_json"
    assert serve_config(_args()).serve.tool_call_parser is None
    assert serve_config(_args()).serve.generation_config == "auto"  # (vLLM's default)
    assert serve_config(_args("--generation-config", "vllm")).serve.generation_config == "vllm"
    with pytest.raises(SystemExit):
        _args("--tool-call-parser", "mistral")
    with pytest.raises(ValueError, match="decode instances must be at least 1"):
        serve_config(_args("--decode-instances", "0"))
    with pytest.raises(SystemExit):
        _args("--dtype", "int3")


def test_help_groups_the_flags(capsys: pytest.CaptureFixture[str]) -> None:
    from cluster.tools.cli import main

    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = capsys.readouterr().out
    for group in ("engine (vLLM's flags", "LoRA (vLLM's flags)", "cluster (Tandem's)", "server"):
        assert group in text
    assert "--max-model-len" in text and "--prefill-instances" in text


def test_vllm_defaults_names_and_dtypes(tmp_path: Path) -> None:
    """As vllm serve: the served name is MODEL as given (unless the --config file names it),
    --dtype takes half / float, one --served-model-name; --max-loras over a file's lora
    section."""
    assert serve_config(_args("/models/X")).serve.served_model_name == "/models/X"
    named = serve_config(_args("/models/X", "--served-model-name", "x"))
    assert named.serve.served_model_name == "x"
    with pytest.raises(ValueError, match="one name"):
        serve_config(_args("/models/X", "--served-model-name", "x", "y"))
    named_in_file = tmp_path / "named.yaml"
    named_in_file.write_text("serve: {served_model_name: prod}\n")
    config = serve_config(_args("/models/X", "--config", str(named_in_file)))
    assert config.model == "/models/X" and config.serve.served_model_name == "prod"
    for dtype in ("half", "float", "bfloat16"):
        assert serve_config(_args("--dtype", dtype)).dtype == dtype
    file = tmp_path / "lora.yaml"
    file.write_text("lora: {max_loras: 1}\n")
    config = serve_config(_args("--config", str(file), "--max-loras", "4"))
    assert config.lora is not None and config.lora.max_loras == 4


def test_a_port_another_server_listens_on_is_refused_before_ray_starts() -> None:
    """Serve's proxy binds with SO_REUSEPORT: a second ``tandem serve`` on the same port
    started and said "ready" while the kernel split the connections between the two servers
    (two models, one of them maybe without the API key). The ports are probed first."""
    import socket

    from cluster.config import ServeConfig
    from cluster.tools.serve_listen import check_ports_free

    with socket.socket() as other:  # another server, as Serve's proxy binds its port
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        other.bind(("127.0.0.1", 0))
        other.listen()
        taken = other.getsockname()[1]
        with pytest.raises(OSError, match=f"port {taken} .*--port"):
            check_ports_free(ServeConfig(port=taken, grpc_port=None))
        with pytest.raises(OSError, match=f"port {taken} .*--grpc-port"):
            free = _free_port()
            check_ports_free(ServeConfig(host="127.0.0.1", port=free, grpc_port=taken))
    check_ports_free(ServeConfig(port=taken, grpc_port=None))  # closed: free again


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
