"""ClusterConfig: YAML loading and the errors a misconfigured deployment gets at load time."""

from __future__ import annotations

import errno
import pickle
from pathlib import Path

import pytest
from pydantic import ValidationError

from cluster.config import ClusterConfig, KVTransferConfig
from cluster.control.placement import worker_kwargs

PD = """
model: null
block_size: 16
pools:
  - {name: prefill, role: prefill, replicas: 2, resources: {prefill: 0.01}}
  - name: decode
    role: decode
    resources: {decode: 0.01}
    num_blocks: 512
    scheduler: {max_num_seqs: 64, enable_chunked_prefill: true}
    cache: {enable_prefix_caching: true}
router: {disaggregation: 128, prefix_affinity: true}
kv_transfer: {transport: grpc, timeout_s: 3, failure_policy: fail}
lora: {max_loras: 2, max_lora_rank: 16}
"""


def test_pd_yaml_loads(tmp_path: Path) -> None:
    cfg = ClusterConfig.from_yaml(PD)
    assert [p.name for p in cfg.pools_with_role("prefill")] == ["prefill"]
    decode = cfg.pools_with_role("decode", "both")[0]
    assert decode.num_blocks == 512 and decode.resources == {"decode": 0.01}
    assert decode.scheduler_config(max_model_len=4096).max_num_seqs == 64
    assert cfg.router.disaggregation == 128
    assert cfg.kv_transfer.transport == "grpc" and cfg.kv_transfer.failure_policy == "fail"
    assert cfg.lora is not None and cfg.lora.max_loras == 2
    assert cfg.block_size == 16 and cfg.disaggregated
    path = tmp_path / "cluster.yaml"
    path.write_text(PD)
    assert ClusterConfig.from_yaml(path) == cfg == ClusterConfig.from_yaml(str(path))


def test_a_config_file_that_cannot_be_looked_at_is_read_not_taken_for_yaml(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stat that fails with EACCES (a folder without search permission; root here, so the
    stat is made to fail) made the name YAML text: "no such file". The name is a path."""
    path = tmp_path / "cluster.conf"
    path.write_text("kv_transfer: {transport: grpc}")

    is_file = Path.is_file

    def refused(self: Path) -> bool:
        if self == path:
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        return is_file(self)

    monkeypatch.setattr(Path, "is_file", refused)
    assert ClusterConfig.from_yaml(str(path)).kv_transfer.transport == "grpc"
    assert ClusterConfig.from_yaml("{block_size: 32}").block_size == 32  # YAML text still is
    long_text = "{" + ", ".join(["block_size: 32"] * 40) + "}"  # (a name too long: text)
    assert ClusterConfig.from_yaml(long_text).block_size == 32


def test_defaults_are_one_colocated_instance() -> None:
    cfg = ClusterConfig.from_yaml("")
    assert [(p.name, p.role, p.replicas) for p in cfg.pools] == [("default", "both", 1)]
    assert cfg.kv_transfer.transport == "auto" and cfg.kv_transfer.timeout_s == 5.0
    assert cfg.kv_transfer.failure_policy == "recompute"


@pytest.mark.parametrize(
    ("yaml_text", "message"),
    [
        ("pools: [{name: a, role: prefill}]", "needs a decode"),
        ("pools: [{name: a}, {name: a}]", "repeated: a"),
        ("router: {disaggregation: always}", "needs a pool with role 'prefill'"),
        (
            "router: {disaggregation: never}\n"
            "pools: [{name: p, role: prefill}, {name: d, role: decode}]",
            "routes no request to a prefill pool: p",
        ),
        ("router: {disaggregation: -1}", "must be >= 0"),
        # YAML's off/on are booleans: "off" passed as the threshold 0 (disaggregate all)
        ("router: {disaggregation: off}", "not the boolean False"),
        ("router: {disaggregation: on}", "not the boolean True"),
        ("pools: [{name: a, replicas: 0}]", "replicas"),
        ("pools: [{name: a, num_blocks: 8, kv_cache_memory_bytes: 8}]", "at most one"),
        ("pools: [{name: a, scheduler: {max_num_seqs: 0}}]", "max_num_seqs"),
        ("pools: [{name: a, scheduler: {max_num_sequences: 4}}]", "max_num_sequences"),
        ("pools: [{name: a, cache: {num_blocks: 4}}]", "not in cache"),
        ("kv_transfer: {transport: nccl}", "transport"),
        ("kv_transfer: {timeout_s: 0}", "timeout_s"),
        ("pools: [{name: 'bad name'}]", "name"),
        # What Ray refused only when the first worker was placed.
        ("pools: [{name: a, resources: {GPU: 1}}]", r"resources\.GPU: set num_gpus"),
        ("pools: [{name: a, resources: {p: -1}}]", r"resources\.p is -1"),
        ("pools: [{name: a, resources: {p: 0.00001}}]", r"resources\.p is 1e-05: give 0"),
        ("pools: [{name: a, resources: {p: .nan}}]", r"resources\.p is nan"),
        ("pools: [{name: a, resources: {p: .inf}}]", r"resources\.p is inf"),
        ("pools: [{name: a, pp_size: 2, stage_resources: [{}, {CPU: 1}]}]", r"\[1\]\.CPU"),
        ("pools: [{name: a, num_gpus: 0.00001}]", "num_gpus is 1e-05"),
        ("pools: [{name: a, num_cpus: .inf}]", "num_cpus"),
        ("modle: x", "modle"),
        ("- 1\n- 2", "mapping"),
    ],
)
def test_bad_configs_name_the_field(yaml_text: str, message: str) -> None:
    with pytest.raises((ValidationError, ValueError), match=message):
        ClusterConfig.from_yaml(yaml_text)


def test_block_size_is_cluster_wide() -> None:
    with pytest.raises(ValidationError, match="block_size is cluster-wide"):
        ClusterConfig.model_validate(
            {"pools": [{"name": "a", "role": "both", "cache": {"block_size": 32}}]}
        )
    assert not ClusterConfig().disaggregated


@pytest.mark.parametrize(
    ("pool", "message"),
    [
        (
            {"pp_size": 2, "scheduler": {"async_scheduling": True}},
            "async_scheduling needs pp_size 1",
        ),
        ({"pp_size": 2, "stage_resources": [{"a": 1}]}, "needs one per pipeline stage"),
        ({"scheduler": {"max_model_len": 512}}, "max_model_len is cluster-wide"),
        # parsed and then overridden by kv_transfer.failure_policy: refused instead
        ({"scheduler": {"kv_load_failure_policy": "fail"}}, "set kv_transfer.failure_policy"),
        # vLLM's names, which nothing here implements: refused instead of ignored
        ({"cache": {"gpu_memory_utilization": 0.5}}, "gpu_memory_utilization .* not supported"),
        ({"cache": {"cache_dtype": "float16"}}, "cache_dtype .* not supported"),
    ],
)
def test_pool_settings_not_supported_per_pool(pool: dict[str, object], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        ClusterConfig.model_validate({"pools": [{"name": "a", **pool}]})


def test_pool_schedulers_are_checked_against_the_clusters_max_model_len() -> None:
    """A pool's scheduler knobs are checked against the top-level max_model_len (a pool
    cannot set its own), not the scheduler's default of 8192."""
    no_chunks = {"enable_chunked_prefill": False, "max_num_batched_tokens": 4096}
    config = ClusterConfig.model_validate(
        {"max_model_len": 4096, "pools": [{"name": "a", "scheduler": no_chunks}]}
    )
    assert config.pools[0].scheduler_config(4096).max_num_batched_tokens == 4096
    with pytest.raises(ValidationError, match=r"smaller than max_model_len \(16384\)"):
        ClusterConfig.model_validate(
            {"max_model_len": 16384, "pools": [{"name": "a", "scheduler": no_chunks}]}
        )
    with pytest.raises(ValidationError, match=r"<= max_model_len \(1024\)"):
        ClusterConfig.model_validate(
            {
                "max_model_len": 1024,
                "pools": [{"name": "a", "scheduler": {"long_prefill_token_threshold": 2000}}],
            }
        )
    # A threshold the scheduler's config reads as an int is checked as that int.
    for threshold in ("512", 512.0):
        scheduler = {"long_prefill_token_threshold": threshold}
        ClusterConfig.model_validate({"pools": [{"name": "a", "scheduler": scheduler}]})
    # The workers size their step's activations with the budget the engine will use.
    no_budget = {"enable_chunked_prefill": False}
    config = ClusterConfig.model_validate(
        {"max_model_len": 16384, "pools": [{"name": "a", "scheduler": no_budget}]}
    )
    assert worker_kwargs(config, config.pools[0])["max_num_batched_tokens"] == 16384
    # Without a cluster max_model_len, the worker sizes for its model's whole context.
    for scheduler in (no_budget, {**no_budget, "max_num_batched_tokens": None}):
        config = ClusterConfig.model_validate({"pools": [{"name": "a", "scheduler": scheduler}]})
        assert worker_kwargs(config, config.pools[0])["max_num_batched_tokens"] is None


def test_pipeline_stages_add_their_resources_to_the_pools() -> None:
    config = ClusterConfig.model_validate(
        {
            "pools": [
                {
                    "name": "p",
                    "pp_size": 2,
                    "resources": {"prefill": 0.5},
                    "stage_resources": [{"prefill": 0.25}, {"gpu_node": 1}],
                }
            ]
        }
    )
    pool = config.pools[0]
    assert pool.resources_of_stage(0) == {"prefill": 0.75}
    assert pool.resources_of_stage(1) == {"prefill": 0.5, "gpu_node": 1}


# -- kv_transfer: the grpc transport's options ----------------------------------------------------
def test_grpc_options_reach_the_connector() -> None:
    cfg = ClusterConfig.from_yaml(
        "kv_transfer: {transport: grpc, timeout_s: 2, lease_s: 9, bind_host: 0.0.0.0, "
        "advertise_host: kv-node-1, chunk_size_bytes: 65536, auth_token: a-token-of-16-chars}"
    )
    options = cfg.kv_transfer.connector_options()
    assert options["auth_token"].get_secret_value() == "a-token-of-16-chars"
    assert {k: v for k, v in options.items() if k != "auth_token"} == {
        "lease_s": 9.0,
        "bind_host": "0.0.0.0",
        "advertise_host": "kv-node-1",
        "chunk_size_bytes": 65536,
        "tls": None,
    }
    assert (
        ClusterConfig.from_yaml("kv_transfer: {transport: ray}").kv_transfer.connector_options()
        == {}
    )


def test_grpc_lease_outlives_the_transfer_deadline_by_default() -> None:
    for timeout_s, lease_s in [(1.0, 2.0), (5.0, 7.5), (60.0, 90.0)]:
        kv = KVTransferConfig(transport="grpc", timeout_s=timeout_s)
        assert kv.effective_lease_s == lease_s == kv.connector_options()["lease_s"]


def test_auto_picks_nixl_where_it_imports_else_ray(monkeypatch: pytest.MonkeyPatch) -> None:
    import kv_transfer.nixl_package as nixl

    cfg = ClusterConfig.from_yaml("pools: [{name: p, role: prefill}, {name: d, role: decode}]")
    assert cfg.kv_transfer.auto
    monkeypatch.setattr(nixl, "nixl_available", lambda: True)
    chosen = cfg.kv_transfer.resolved()
    assert chosen.transport == "nixl" and not chosen.auto
    assert chosen.connector_options() == {"lease_s": 7.5, "safety_margin_s": 1.0}
    monkeypatch.setattr(nixl, "nixl_available", lambda: False)
    assert cfg.kv_transfer.resolved().transport == "ray"
    assert cfg.with_kv_transport("grpc").kv_transfer.transport == "grpc"
    assert cfg.kv_transfer.transport == "auto"  # copies: the loaded config is unchanged
    explicit = KVTransferConfig(transport="ray")
    assert explicit.resolved() is explicit


@pytest.mark.parametrize("transport", ["nixl", "auto"])
def test_a_nixl_lease_must_outlast_its_safety_margin(transport: str) -> None:
    with pytest.raises(ValueError, match="safety margin"):
        KVTransferConfig(transport=transport, lease_s=0.5)
    assert KVTransferConfig(transport="ray", lease_s=0.5).lease_s == 0.5  # no such reads


def test_a_generated_cluster_token_is_shared_by_every_copy_and_never_shown() -> None:
    cfg = ClusterConfig.from_yaml("kv_transfer: {transport: grpc}")
    token = cfg.kv_transfer.cluster_token.get_secret_value()
    assert len(token) >= 32
    # Every worker gets the config's token: pickled to the actors, or copied.
    assert pickle.loads(pickle.dumps(cfg)).kv_transfer.cluster_token.get_secret_value() == token
    assert (
        cfg.model_copy(update={"block_size": 8}).kv_transfer.cluster_token
        == cfg.kv_transfer.cluster_token
    )
    assert cfg.kv_transfer.connector_options()["auth_token"].get_secret_value() == token
    # Another config gets another token, yet loading one file twice gives equal configs.
    other = ClusterConfig.from_yaml("kv_transfer: {transport: grpc}")
    assert other.kv_transfer.cluster_token.get_secret_value() != token
    assert other == cfg
    options = cfg.kv_transfer.connector_options()
    for text in (repr(cfg), str(cfg), cfg.model_dump_json(), repr(options), str(cfg.model_dump())):
        assert token not in text


@pytest.mark.parametrize(
    ("kv_transfer", "message"),
    [
        ({"auth_token": "short"}, "at least 16"),
        ({"auth_token": "*" * 20}, "masked secret"),
        ({"lease_s": 0}, "lease_s"),
        ({"chunk_size_bytes": 100}, "chunk_size_bytes"),
        ({"bind_host": ""}, "bind_host"),
    ],
)
def test_bad_grpc_options_name_the_field(kv_transfer: dict[str, object], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        ClusterConfig.model_validate({"kv_transfer": {"transport": "grpc", **kv_transfer}})


def test_a_config_that_is_not_yaml_is_a_value_error_naming_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "cluster.yaml"
    bad.write_text("pools: [{name: p\n")
    with pytest.raises(ValueError, match=r"cluster\.yaml: not valid YAML"):
        ClusterConfig.from_yaml(bad)


def test_a_config_file_named_otherwise_than_yaml_is_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--config cluster.json`` (or .conf): its text was not read -- the name was taken for
    YAML text, and the error said "must be a YAML mapping"."""
    as_json = tmp_path / "cluster.json"
    as_json.write_text('{"block_size": 32}')
    assert ClusterConfig.from_yaml(str(as_json)).block_size == 32
    monkeypatch.chdir(tmp_path)
    assert ClusterConfig.from_yaml("cluster.json").block_size == 32  # (a relative name)
    with pytest.raises(FileNotFoundError, match=r"cluster\.conf: no such file"):
        ClusterConfig.from_yaml("cluster.conf")
    assert ClusterConfig.from_yaml("{block_size: 64}").block_size == 64  # YAML text still
    long_line = "{" + ", ".join(["block_size: 64"] * 40) + "}"  # (no name that long)
    assert ClusterConfig.from_yaml(long_line).block_size == 64


def test_a_running_cluster_is_reused_only_with_its_settings() -> None:
    """``tandem serve`` / a Serve redeploy reuses the running cluster when only the ingress's
    part of ``serve`` changed; any other difference is named."""
    from cluster.control.launch import settings_changed

    running = ClusterConfig.from_yaml("serve: {ingress_replicas: 2, api_key: an-api-key-1}")
    ingress_only = running.model_copy(
        update={
            "serve": running.serve.model_copy(
                update={
                    "ingress_replicas": 1,
                    "port": 8001,
                    "api_key": None,
                    "generation_config": "auto",  # the API's defaults, read by the ingress
                    "tool_call_parser": "hermes",
                }
            )
        }
    )
    assert settings_changed(running.cluster_settings(), ingress_only) == []
    bound = running.model_copy(
        update={"serve": running.serve.model_copy(update={"max_waiting_requests": 3})}
    )
    assert settings_changed(running.cluster_settings(), bound) == ["serve.max_waiting_requests"]
    other = ClusterConfig.from_yaml("block_size: 8\npools: [{name: p, role: both}]")
    assert settings_changed(running.cluster_settings(), other) == ["block_size", "pools"]


def test_a_pools_device_and_the_dtype_are_checked_when_read() -> None:
    """A device or dtype torch does not know failed only when the workers started (a
    traceback from each): now the config names the field."""
    pools = [{"name": "c", "role": "both"}]
    ClusterConfig.model_validate({"pools": [{**pools[0], "device": "cuda:1"}], "dtype": "bf16"})
    with pytest.raises(ValidationError, match=r"pools\.0\.device"):
        ClusterConfig.model_validate({"pools": [{**pools[0], "device": "gpu0"}]})
    with pytest.raises(ValidationError, match="dtype"):
        ClusterConfig.model_validate({"pools": pools, "dtype": "float64"})


def test_the_dtype_flags_accept_what_the_config_accepts() -> None:
    """``tandem generate/serve --dtype`` take the config's names (bf16 was refused)."""
    import typing

    from cluster.tools.serve_args import DTYPES

    assert set(DTYPES) == set(typing.get_args(ClusterConfig.model_fields["dtype"].annotation))
