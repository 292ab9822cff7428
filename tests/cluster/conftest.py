"""A real multi-node Ray cluster on this machine, and helpers to build Tandem clusters on it.

One ``ray.cluster_utils.Cluster`` per test session: a head, a node offering the ``prefill``
resource and one offering ``decode``, all on 127.0.0.1 (see docs/cluster.md). Tandem clusters
(SchedulerActor + workers) are built per module and checked for leaks after every test.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ray = pytest.importorskip("ray")

from cluster.control.launch import ray_env_defaults  # noqa: E402

OBJECT_STORE_BYTES = 96 << 20


@dataclass
class RayCluster:
    cluster: Any
    prefill_node_id: str
    decode_node_id: str
    head_node_id: str


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[RayCluster]:
    from ray.cluster_utils import Cluster

    ray_env_defaults()
    # Ray's socket paths must stay short: a fresh directory directly under the temp root.
    tmp = tempfile.mkdtemp(prefix="tandem-ray-")
    os.environ["RAY_TMPDIR"] = tmp
    node = {"node_ip_address": "127.0.0.1", "object_store_memory": OBJECT_STORE_BYTES}
    cluster = Cluster(
        initialize_head=True,
        head_node_args={**node, "num_cpus": 2, "include_dashboard": False},
    )
    try:
        prefill = cluster.add_node(num_cpus=1, resources={"prefill": 1}, **node)
        decode = cluster.add_node(num_cpus=1, resources={"decode": 1}, **node)
        ray.init(
            address=cluster.address,
            _node_ip_address="127.0.0.1",
            namespace="tandem-tests",
            log_to_driver=False,
        )
        yield RayCluster(cluster, prefill.node_id, decode.node_id, cluster.head_node.node_id)
    finally:
        ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.actors.conftest import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("tiny-llama-cluster"), "llama")


def plasma_objects() -> int:
    """Objects in the object stores of all nodes."""
    from ray._private.internal_api import memory_summary

    summary = memory_summary(stats_only=True)
    for line in summary.splitlines():
        if "Plasma memory usage" in line:
            return int(line.split(",")[1].split()[0])
    raise AssertionError(f"no object store stats in:\n{summary}")


# Copies that outlive a dead owner: after a process that put an object dies while another
# node is pulling it, Ray can keep that node's copy with no owner and no reference left (see
# docs/cluster.md, faults). Fault tests accept them explicitly; later tests check against it.
_orphans = 0


def accept_orphaned_objects(settle_s: float = 3.0) -> int:
    """After a fault (and after ``assert_clean(..., objects=False)``): the objects still in
    the stores once Ray has freed what it frees on its own become the floor for every later
    leak check. Returns how many there are."""
    global _orphans
    time.sleep(settle_s)
    _orphans = max(_orphans, plasma_objects())
    return _orphans


def wait_until(predicate: Any, timeout_s: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.02)


def assert_clean(handle: Any, timeout_s: float = 10.0, objects: bool = True) -> None:
    """Nothing left anywhere: no request in any scheduler or in flight, every block free,
    no connector state, consistent schedulers, and (``objects``) no KV object in the object
    store."""

    keys = ("num_requests", "num_pending", "kv_cache_usage", "num_free_blocks", "num_blocks")
    keys += ("connector_pending", "num_awaiting_hand_off", "alive")
    last: dict[str, Any] = {}

    def idle() -> bool:
        stats = ray.get(handle.stats.remote())
        last["flights"] = stats["num_flights"]
        last["instances"] = {
            iid: {k: i.get(k) for k in keys} for iid, i in stats["instances"].items()
        }
        if stats["num_flights"]:
            return False
        return all(
            i["num_requests"] == 0
            and i["num_pending"] == 0
            and i["kv_cache_usage"] == 0.0
            and i["num_free_blocks"] == i["num_blocks"]
            and i["connector_pending"] == 0
            and i.get("num_awaiting_hand_off", 0) == 0  # (engine actors)
            for i in stats["instances"].values()
        )

    try:
        wait_until(idle, timeout_s, "every instance to be idle with all blocks free")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; last seen: {last}") from None
    ray.get(handle.check_integrity.remote())
    if objects:
        try:
            wait_until(
                lambda: plasma_objects() <= _orphans,
                timeout_s,
                f"the object stores to be empty (but for {_orphans} accepted orphans)",
            )
        except AssertionError as e:
            from ray._private.internal_api import memory_summary

            raise AssertionError(
                f"{e}; what is left:\n{memory_summary(stats_only=False)}"
            ) from None


# -- the Serve app (tests/cluster/test_serve_*.py) ---------------------------------------------
API_KEY = "tandem-test-key"
ADMIN_KEY = "tandem-test-admin-key"
MAX_BODY_BYTES = 256 * 1024


@dataclass
class ServeApp:
    url: str  # http://127.0.0.1:PORT
    grpc_target: str  # 127.0.0.1:PORT
    model: str  # the served model name
    model_dir: Path
    lora_path: str  # adapter "a", served from the start
    spare_lora_path: str  # another adapter, for load_lora_adapter
    config: Any
    traces: Any = None  # the OTLP receiver the app exports its spans to

    @property
    def scheduler(self) -> Any:
        from ray import serve

        cluster = serve.get_deployment_handle("TandemCluster", "tandem-test")
        return cluster.scheduler.remote().result()

    @property
    def scheduler_info(self) -> dict[str, Any]:
        info: dict[str, Any] = ray.get(self.scheduler.model_info.remote())
        return info

    def openai(self, **kwargs: Any) -> Any:
        import openai

        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=API_KEY, max_retries=0, **kwargs)


@contextmanager
def own_ray_env(prefix: str) -> Iterator[dict[str, str]]:
    """The environment of a subprocess that starts a Ray of its own (not the session's test
    cluster, which ``ray.init`` exported as RAY_ADDRESS), in a temporary folder removed after."""
    ray_dir = tempfile.mkdtemp(prefix=prefix)
    try:
        yield {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"RAY_TMPDIR": ray_dir}
    finally:
        shutil.rmtree(ray_dir, ignore_errors=True)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def make_adapter(base_dir: Path, path: Path, seed: int) -> str:
    import peft
    import torch
    import transformers

    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    torch.manual_seed(seed)
    config = peft.LoraConfig(
        r=8, lora_alpha=16, init_lora_weights=False, target_modules=["q_proj", "v_proj", "up_proj"]
    )
    peft.get_peft_model(base, config).save_pretrained(path)
    return str(path)


# The spans of one disaggregated request: the central actor's, both engines', and the workers'
# KV save and load (from other processes, each with its own export batch).
PD_SPAN_NAMES = frozenset(
    {
        "tandem.request",
        "tandem.queue",
        "tandem.prefill",
        "tandem.kv_transfer",
        "tandem.decode",
        "tandem.kv_save",
        "tandem.kv_load",
    }
)

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


class OTLPReceiver:
    """An OTLP/gRPC trace receiver on 127.0.0.1 (the collector's TraceService from
    ``opentelemetry-proto``): keeps every span it is sent, with its resource attributes."""

    def __init__(self) -> None:
        import threading
        from concurrent import futures

        import grpc
        from opentelemetry.proto.collector.trace.v1 import (
            trace_service_pb2,
            trace_service_pb2_grpc,
        )

        receiver = self
        self.spans: list[tuple[dict[str, Any], Any]] = []  # (resource attributes, span)
        self._lock = threading.Lock()

        class Service(trace_service_pb2_grpc.TraceServiceServicer):  # type: ignore[misc]
            def Export(self, request: Any, context: Any) -> Any:
                with receiver._lock:
                    for rs in request.resource_spans:
                        resource = {a.key: _any_value(a.value) for a in rs.resource.attributes}
                        for ss in rs.scope_spans:
                            receiver.spans.extend((resource, span) for span in ss.spans)
                return trace_service_pb2.ExportTraceServiceResponse()

        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def trace(self, trace_id: bytes) -> list[tuple[dict[str, Any], Any]]:
        with self._lock:
            return [(r, s) for r, s in self.spans if s.trace_id == trace_id]

    def stop(self) -> None:
        self.server.stop(0)


def _any_value(value: Any) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_any_value(v) for v in value.array_value.values]
    return getattr(value, kind) if kind else None


def span_attributes(span: Any) -> dict[str, Any]:
    return {a.key: _any_value(a.value) for a in span.attributes}


@pytest.fixture(scope="session")
def serve_app(
    ray_cluster: RayCluster, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServeApp]:
    """The Serve app on the test cluster: a tiny model with a chat template, a prefill and a
    decode instance on their nodes, an API key and an admin key (runtime LoRA loading from
    below the fixture's folder and pool scaling on), adapter "a", a misconfigured adapter
    "broken", a bound of 6 waiting requests, a body limit of 256 KiB, and a client timeout of
    5 s (the tests that kill an ingress replica wait it out)."""
    import json

    from ray import serve
    from ray.serve.config import HTTPOptions, gRPCOptions

    from cluster.config import ClusterConfig
    from cluster.serving.app import GRPC_SERVICER, build_app_from_config

    root = tmp_path_factory.mktemp("serve")
    model_dir = root / "tiny-chat"
    shutil.copytree(tiny_model, model_dir)
    (model_dir / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))
    # A longer context than the checkpoint's 512 (its KV cache then bounds it: 640 tokens):
    # the byte tokenizer spends a token per character, and tool prompts are long.
    model_config = json.loads((model_dir / "config.json").read_text())
    model_config["max_position_embeddings"] = 1024
    (model_dir / "config.json").write_text(json.dumps(model_config))
    lora = make_adapter(model_dir, root / "a", seed=3)
    receiver = OTLPReceiver()
    spare = make_adapter(model_dir, root / "b", seed=4)
    pool = {"num_blocks": 160, "scheduler": {"max_num_seqs": 8}}
    config = ClusterConfig.model_validate(
        {
            "model": str(model_dir),
            "block_size": 4,
            "pools": [
                {"name": "p", "role": "prefill", "resources": {"prefill": 0.01}, **pool},
                {"name": "d", "role": "decode", "resources": {"decode": 0.01}, **pool},
            ],
            "router": {"disaggregation": "always"},
            "lora": {"max_loras": 2, "max_lora_rank": 16},
            # A dead ingress replica's requests are aborted after this much silence (the
            # default, 10 s, was most of each dead-replica test); its keep-alives come every
            # second from a thread, so a busy replica is still far from it.
            "client_timeout_s": 5.0,
            "serve": {
                "api_key": API_KEY,
                "admin_api_key": ADMIN_KEY,
                "allow_runtime_lora_updates": True,
                "lora_adapter_root": str(root),
                "allow_runtime_scaling": True,
                "max_request_body_bytes": MAX_BODY_BYTES,
                "lora_modules": {"a": lora, "broken": str(root / "missing-adapter")},
                "max_waiting_requests": 6,
                "retry_after_s": 2,
                "ingress_replicas": 2,
            },
            "tracing": {
                "enabled": True,
                "otlp_endpoint": receiver.endpoint,
                "export_delay_ms": 100,
            },
        }
    )
    http_port, grpc_port = free_port(), free_port()
    serve.start(
        proxy_location="HeadOnly",
        http_options=HTTPOptions(host="127.0.0.1", port=http_port),
        grpc_options=gRPCOptions(port=grpc_port, grpc_servicer_functions=[GRPC_SERVICER]),
    )
    try:
        serve.run(build_app_from_config(config), name="tandem-test", route_prefix="/")
        yield ServeApp(
            f"http://127.0.0.1:{http_port}",
            f"127.0.0.1:{grpc_port}",
            "tiny-chat",
            model_dir,
            lora,
            spare,
            config,
            receiver,
        )
    finally:
        serve.shutdown()
        receiver.stop()
