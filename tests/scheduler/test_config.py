"""Config validation (SchedulerConfig, CacheConfig, LoRAConfig, SamplingParams, LoRARequest)
and the errors the Scheduler raises at construction and in ``add_request``."""

from __future__ import annotations

from typing import Any

import pytest

from scheduler import (
    CacheConfig,
    LoRAConfig,
    LoRARequest,
    Request,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
)
from tests.scheduler.helpers import InMemoryConnector, lora, make_request, make_scheduler

# -- SchedulerConfig ---------------------------------------------------------------------------


def test_scheduler_config_defaults_match_vllm() -> None:
    cfg = SchedulerConfig()
    assert cfg.max_num_seqs == 128
    assert cfg.max_num_batched_tokens == 2048
    assert cfg.enable_chunked_prefill is True
    assert cfg.long_prefill_token_threshold == 0
    assert cfg.policy == "fcfs"
    assert cfg.scheduler_reserve_full_isl is True
    assert cfg.watermark == 0.0


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_num_seqs": 4, "max_num_batched_tokens": 4, "max_model_len": 64},
        # Chunked prefill off is fine when one step can hold a whole max_model_len prompt.
        {
            "enable_chunked_prefill": False,
            "max_num_batched_tokens": 64,
            "max_model_len": 64,
            "max_num_seqs": 8,
        },
        {"long_prefill_token_threshold": 64, "max_model_len": 64, "max_num_batched_tokens": 128},
        {"watermark": 0.99, "policy": "priority", "num_lookahead_slots": 3},
        {"strict_fcfs": True, "max_skip_steps": 0, "kv_load_failure_policy": "fail"},
    ],
)
def test_scheduler_config_valid(kwargs: dict[str, Any]) -> None:
    cfg = SchedulerConfig(**kwargs)
    for key, value in kwargs.items():
        assert getattr(cfg, key) == value


@pytest.mark.parametrize(
    ("kwargs", "fields"),
    [
        (
            {"enable_chunked_prefill": False, "max_num_batched_tokens": 63, "max_model_len": 64},
            ("max_num_batched_tokens", "max_model_len", "enable_chunked_prefill"),
        ),
        (
            {"max_num_seqs": 16, "max_num_batched_tokens": 15},
            ("max_num_batched_tokens", "max_num_seqs"),
        ),
        (
            {"long_prefill_token_threshold": 65, "max_model_len": 64},
            ("long_prefill_token_threshold", "max_model_len"),
        ),
        (
            {
                "long_prefill_token_threshold": 8,
                "enable_chunked_prefill": False,
                "max_num_batched_tokens": 8192,
            },
            ("long_prefill_token_threshold", "enable_chunked_prefill"),
        ),
    ],
)
def test_scheduler_config_cross_field_errors_name_fields(
    kwargs: dict[str, Any], fields: tuple[str, ...]
) -> None:
    with pytest.raises(ValueError) as info:
        SchedulerConfig(**kwargs)
    for name in fields:
        assert name in str(info.value)


def test_chunked_prefill_off_grows_an_unset_budget_like_vllm() -> None:
    # Unset budget: it grows to hold a whole prompt, max(max_model_len, 2048).
    assert SchedulerConfig(enable_chunked_prefill=False).max_num_batched_tokens == 8192
    off_short = SchedulerConfig(enable_chunked_prefill=False, max_model_len=1024)
    assert off_short.max_num_batched_tokens == 2048
    assert SchedulerConfig().max_num_batched_tokens == 2048  # chunked prefill on: unchanged
    # An explicit budget below max_model_len is still an error: a max-length prompt could
    # never be scheduled in one step.
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        SchedulerConfig(enable_chunked_prefill=False, max_num_batched_tokens=2048)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_num_seqs", 0),
        ("max_num_batched_tokens", 0),
        ("max_model_len", 1),
        ("long_prefill_token_threshold", -1),
        ("watermark", 1.0),
        ("watermark", -0.1),
        ("num_lookahead_slots", -1),
        ("max_skip_steps", -1),
        ("policy", "lifo"),
        ("kv_load_failure_policy", "retry"),
    ],
)
def test_scheduler_config_single_field_out_of_range(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        SchedulerConfig(**{field: value})


def test_scheduler_config_is_immutable_and_rebuilt_with_validation() -> None:
    cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8)
    with pytest.raises(ValueError, match="frozen"):
        cfg.max_num_seqs = 16  # type: ignore[misc]
    assert cfg.max_num_seqs == 4  # a refused change leaves no trace
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        SchedulerConfig(**{**cfg.model_dump(), "max_num_seqs": 16})
    bigger = SchedulerConfig(**{**cfg.model_dump(), "max_num_seqs": 8})
    assert bigger.max_num_seqs == 8 and cfg.max_num_seqs == 4


@pytest.mark.parametrize("model", [SchedulerConfig, CacheConfig, LoRAConfig, SamplingParams])
def test_unknown_field_is_rejected(model: type[Any]) -> None:
    with pytest.raises(ValueError, match="max_num_seq_typo"):
        model(max_num_seq_typo=1)


def test_lora_request_unknown_field_is_rejected() -> None:
    with pytest.raises(ValueError, match="rank"):
        LoRARequest(lora_name="a", lora_int_id=1, lora_path="/a", rank=8)  # type: ignore[call-arg]


# -- CacheConfig -------------------------------------------------------------------------------


def test_cache_config_valid_and_defaults() -> None:
    assert CacheConfig().num_blocks is None
    cfg = CacheConfig(block_size=4, num_blocks=16)
    assert (cfg.block_size, cfg.num_blocks, cfg.enable_prefix_caching) == (4, 16, True)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("block_size", 0),
        ("block_size", 2048),
        ("num_blocks", 0),
        ("cache_dtype", "bfloat16"),  # not offered (vLLM's name): refused, not ignored
        ("gpu_memory_utilization", 0.5),
    ],
)
def test_cache_config_out_of_range(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        CacheConfig(**{field: value})


# -- LoRAConfig --------------------------------------------------------------------------------


def test_lora_config_max_cpu_loras_defaults_to_max_loras() -> None:
    assert LoRAConfig().max_cpu_loras == 1
    assert LoRAConfig(max_loras=3).max_cpu_loras == 3
    assert LoRAConfig(max_loras=3, max_cpu_loras=None).max_cpu_loras == 3
    assert LoRAConfig(max_loras=3, max_cpu_loras=5).max_cpu_loras == 5
    assert LoRAConfig(max_loras=2).model_dump()["max_cpu_loras"] == 2


def test_lora_config_max_cpu_loras_below_max_loras() -> None:
    with pytest.raises(ValueError) as info:
        LoRAConfig(max_loras=4, max_cpu_loras=3)
    assert "max_cpu_loras" in str(info.value)
    assert "max_loras" in str(info.value)


@pytest.mark.parametrize("rank", [1, 8, 16, 32, 64, 128, 256, 320, 512])
def test_lora_config_allowed_ranks(rank: int) -> None:
    assert LoRAConfig(max_lora_rank=rank).max_lora_rank == rank


@pytest.mark.parametrize("rank", [0, 2, 4, 24, 1024])
def test_lora_config_rank_not_allowed(rank: int) -> None:
    with pytest.raises(ValueError, match="max_lora_rank"):
        LoRAConfig(max_lora_rank=rank)


def test_lora_config_max_loras_zero() -> None:
    with pytest.raises(ValueError, match="max_loras"):
        LoRAConfig(max_loras=0)


# -- SamplingParams / LoRARequest --------------------------------------------------------------


def test_sampling_params_valid() -> None:
    sp = SamplingParams(max_tokens=4, min_tokens=4, stop_token_ids=(5, 6), top_p=0.5, top_k=-1)
    assert sp.all_stop_token_ids == frozenset({5, 6})
    assert SamplingParams(max_tokens=None, min_tokens=1000).max_tokens is None


def test_sampling_params_min_tokens_above_max_tokens() -> None:
    with pytest.raises(ValueError) as info:
        SamplingParams(max_tokens=3, min_tokens=4)
    assert "min_tokens" in str(info.value)
    assert "max_tokens" in str(info.value)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("top_p", 0.0),
        ("top_p", 1.1),
        ("n", 0),
        ("max_tokens", 0),
        ("min_tokens", -1),
        ("temperature", -0.5),
        ("top_k", -2),
        ("logprobs", 21),
        ("repetition_penalty", 0.0),
    ],
)
def test_sampling_params_out_of_range(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_sampling_params_is_frozen() -> None:
    sp = SamplingParams()
    with pytest.raises(ValueError, match="frozen"):
        sp.max_tokens = 3  # type: ignore[misc]


@pytest.mark.parametrize(
    ("field", "value"), [("lora_name", ""), ("lora_int_id", 0), ("lora_path", "")]
)
def test_lora_request_invalid(field: str, value: object) -> None:
    kwargs: dict[str, Any] = {"lora_name": "a", "lora_int_id": 1, "lora_path": "/a"}
    kwargs[field] = value
    with pytest.raises(ValueError, match=field):
        LoRARequest(**kwargs)


def test_lora_request_equality_and_hash_use_name() -> None:
    a = LoRARequest(lora_name="a", lora_int_id=1, lora_path="/a")
    same_name = LoRARequest(lora_name="a", lora_int_id=2, lora_path="/elsewhere")
    other = LoRARequest(lora_name="b", lora_int_id=1, lora_path="/a")
    assert a == same_name
    assert hash(a) == hash(same_name)
    assert a != other
    assert len({a, same_name, other}) == 2


# -- Scheduler construction --------------------------------------------------------------------


def test_scheduler_needs_num_blocks() -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        Scheduler(SchedulerConfig(max_model_len=64), CacheConfig(block_size=4))


def test_scheduler_max_model_len_must_fit_in_cache() -> None:
    cfg = SchedulerConfig(max_model_len=65, max_num_batched_tokens=64, max_num_seqs=4)
    with pytest.raises(ValueError) as info:
        Scheduler(cfg, CacheConfig(block_size=4, num_blocks=16))
    msg = str(info.value)
    assert "max_model_len (65)" in msg
    assert "17" in msg
    assert "num_blocks is 16" in msg
    # Exactly num_blocks * block_size tokens fits.
    ok = SchedulerConfig(max_model_len=64, max_num_batched_tokens=64, max_num_seqs=4)
    s = Scheduler(ok, CacheConfig(block_size=4, num_blocks=16))
    assert s.kv_cache_manager.block_pool.num_free_blocks == 16


# -- Scheduler.add_request ---------------------------------------------------------------------


def _assert_rejected(s: Scheduler, request: Request, match: str) -> None:
    """``add_request`` raises and leaves the scheduler untouched."""
    before = (dict(s.requests), list(s.waiting))
    with pytest.raises(ValueError, match=match):
        s.add_request(request)
    assert (dict(s.requests), list(s.waiting)) == before
    assert request.request_id not in s.requests


def test_add_request_empty_prompt() -> None:
    s = make_scheduler()
    req = make_request([])
    _assert_rejected(s, req, "prompt_token_ids")


def test_add_request_prompt_too_long_names_both_lengths() -> None:
    s = make_scheduler(max_model_len=32, max_num_batched_tokens=32)
    for length in (32, 40):
        req = make_request(length)
        with pytest.raises(ValueError) as info:
            s.add_request(req)
        assert str(length) in str(info.value)
        assert "32" in str(info.value)
    assert not s.requests
    assert len(s.waiting) == 0


def test_add_request_longest_prompt_resolves_max_tokens() -> None:
    s = make_scheduler(max_model_len=32, max_num_batched_tokens=32)
    req = make_request(31, max_tokens=None)
    s.add_request(req)
    assert req.max_tokens == 1
    short = make_request(10, max_tokens=None)
    s.add_request(short)
    assert short.max_tokens == 22
    explicit = make_request(10, max_tokens=5)
    s.add_request(explicit)
    assert explicit.max_tokens == 5
    assert list(s.waiting) == [req, short, explicit]


def test_add_request_duplicate_id() -> None:
    s = make_scheduler()
    first = make_request(4, req_id="dup")
    s.add_request(first)
    second = make_request(8, req_id="dup")
    with pytest.raises(ValueError, match="dup"):
        s.add_request(second)
    assert s.requests["dup"] is first
    assert len(s.waiting) == 1


def test_add_request_n_must_be_one() -> None:
    s = make_scheduler()
    req = make_request(4, n=2)
    _assert_rejected(s, req, "n must be 1")


def test_add_request_lora_without_lora_config() -> None:
    s = make_scheduler()
    req = make_request(4, lora=lora(1))
    _assert_rejected(s, req, "lora")
    with_lora = make_scheduler(lora=LoRAConfig(max_loras=1))
    with_lora.add_request(req)
    assert with_lora.requests[req.request_id] is req


def test_add_request_remote_prefill_without_connector() -> None:
    s = make_scheduler()
    req = make_request(4, kv_transfer_params={"do_remote_prefill": True})
    _assert_rejected(s, req, "do_remote_prefill")
    with_connector = make_scheduler(connector=InMemoryConnector())
    with_connector.add_request(req)
    assert len(with_connector.waiting) == 1
    # Not a remote prefill: no connector needed.
    plain = make_request(4, kv_transfer_params={"do_remote_prefill": False})
    s.add_request(plain)
    assert len(s.waiting) == 1
