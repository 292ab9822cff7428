"""Errors of the API, in OpenAI's JSON shape with the right status; the gRPC service with the
same validation mapped to status codes; a client that leaves mid-stream frees its blocks."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Any

import pytest

from tests.cluster.conftest import (
    ADMIN_KEY,
    API_KEY,
    MAX_BODY_BYTES,
    ServeApp,
    assert_clean,
    wait_until,
)

requests = pytest.importorskip("requests")

PROMPT = "The quick brown fox"


def _post(app: ServeApp, path: str, body: Any, key: str | None = API_KEY, **kw: Any) -> Any:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    kw.setdefault("timeout", 60)
    return requests.post(f"{app.url}{path}", json=body, headers=headers, **kw)


def _error(response: Any, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error: dict[str, Any] = response.json()["error"]
    assert error["code"] == status and error["message"] and error["type"]
    return error


@pytest.fixture(autouse=True)
def _no_leaks(serve_app: ServeApp) -> Any:
    yield
    assert_clean(serve_app.scheduler, objects=False)


@pytest.mark.parametrize(
    ("field", "value", "allowed"),
    [
        ("temperature", 5, "2"),
        ("top_p", 0, "0"),
        ("n", 0, "1"),
        ("max_tokens", 0, "1"),
        ("presence_penalty", -3, "-2"),
        ("logprobs", 50, "20"),
        ("top_k", -5, "-1"),
    ],
)
def test_bad_parameters_are_400_naming_the_field_and_range(
    serve_app: ServeApp, field: str, value: Any, allowed: str
) -> None:
    body = {"model": serve_app.model, "prompt": PROMPT, field: value}
    error = _error(_post(serve_app, "/v1/completions", body), 400)
    assert error["param"] == field
    assert field in error["message"] and allowed in error["message"]


def test_malformed_bodies_are_400(serve_app: ServeApp) -> None:
    error = _error(_post(serve_app, "/v1/chat/completions", {"model": serve_app.model}), 400)
    assert "messages" in error["message"]
    r = requests.post(
        f"{serve_app.url}/v1/completions",
        data="{not json",
        headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"},
        timeout=30,
    )
    _error(r, 400)
    body = {
        "model": serve_app.model,
        "messages": [{"role": "user", "content": "x"}],
        "top_logprobs": 3,
    }
    error = _error(_post(serve_app, "/v1/chat/completions", body), 400)
    assert "logprobs" in error["message"] and error["param"] == "top_logprobs"  # not "body"
    body = {"model": serve_app.model, "prompt": PROMPT, "stream_options": {}}
    assert _error(_post(serve_app, "/v1/completions", body), 400)["param"] == "stream_options"
    body = {"model": serve_app.model, "prompt": [99999]}
    assert "vocabulary" in _error(_post(serve_app, "/v1/completions", body), 400)["message"]


def test_prompt_longer_than_the_context_is_400_with_both_lengths(serve_app: ServeApp) -> None:
    max_len = serve_app.scheduler_info["max_model_len"]
    body = {"model": serve_app.model, "prompt": [65] * (max_len + 5)}
    error = _error(_post(serve_app, "/v1/completions", body), 400)
    assert str(max_len) in error["message"] and str(max_len + 5) in error["message"]
    body = {"model": serve_app.model, "prompt": [65] * 10, "max_tokens": max_len}
    error = _error(_post(serve_app, "/v1/completions", body), 400)
    assert error["param"] == "max_tokens"
    assert (
        f"{max_len + 10} tokens (10 in the prompt, {max_len} in the completion)"
        in (error["message"])
    )


def test_unknown_model_is_404(serve_app: ServeApp) -> None:
    body = {"model": "no-such-model", "prompt": PROMPT}
    error = _error(_post(serve_app, "/v1/completions", body), 404)
    assert "no-such-model" in error["message"] and error["param"] == "model"


def test_missing_or_wrong_api_key_is_401(serve_app: ServeApp) -> None:
    body = {"model": serve_app.model, "prompt": PROMPT}
    _error(_post(serve_app, "/v1/completions", body, key=None), 401)
    _error(_post(serve_app, "/v1/completions", body, key="wrong"), 401)
    assert requests.get(f"{serve_app.url}/v1/models", timeout=30).status_code == 401
    assert requests.get(f"{serve_app.url}/health", timeout=30).status_code == 200  # open
    # Checked before the body: without the key, a bad body says nothing about its fields.
    bad = {"model": serve_app.model, "prompt": PROMPT, "temperature": "hot", "n": -1}
    assert _error(_post(serve_app, "/v1/completions", bad, key=None), 401)["param"] is None
    _error(_post(serve_app, "/tokenize", {"prompt": 5}, key=None), 401)
    _error(_post(serve_app, "/admin/scale_pool", {"pool": 5}, key=None), 401)


def test_unknown_routes_and_methods_are_openai_errors(serve_app: ServeApp) -> None:
    error = _error(_post(serve_app, "/v1/embeddings", {"model": serve_app.model}), 404)
    assert "/v1/embeddings" in error["message"]
    assert _error(_post(serve_app, "/health", {}), 405)["code"] == 405


def test_an_adapter_missing_on_its_instances_node_is_a_404_naming_it(serve_app: ServeApp) -> None:
    # "broken" is configured with an adapter path that does not exist on the workers' nodes:
    # as vLLM's "No adapter found", a 404 naming the adapter (it was a 500), never its path.
    # (A 500 says no more than "internal server error": test_serving_in_process.py, "a bug".)
    chat = {"model": "broken", "messages": [{"role": "user", "content": "x"}]}
    for path, body in (
        ("/v1/completions", {"model": "broken", "prompt": PROMPT, "max_tokens": 2}),
        ("/v1/completions", {"model": "broken", "prompt": PROMPT, "stream": True}),
        ("/v1/chat/completions", chat),
    ):
        r = _post(serve_app, path, body)
        error = _error(r, 404)
        assert "`broken`" in error["message"] and error["param"] == "model"
        assert "Traceback" not in r.text and "missing-adapter" not in r.text


def test_overload_is_429_with_retry_after(serve_app: ServeApp) -> None:
    scheduler = serve_app.scheduler
    import ray

    # Slow the prefill instance so that requests pile up in its waiting queue (bound: 6).
    ray.get(scheduler.set_fault_injection.remote("p-0", 0.0, 0.3))
    try:
        body = {"model": serve_app.model, "prompt": PROMPT, "max_tokens": 2}
        results: list[Any] = [None] * 24

        def send(i: int) -> None:
            results[i] = _post(serve_app, "/v1/completions", body)

        threads = [threading.Thread(target=send, args=(i,)) for i in range(24)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        codes = sorted(r.status_code for r in results)
        assert set(codes) <= {200, 429} and codes.count(200) >= 6 and 429 in codes, codes
        refused = next(r for r in results if r.status_code == 429)
        assert refused.headers["Retry-After"] == "2"
        assert "overloaded" in _error(refused, 429)["message"]
    finally:
        ray.get(scheduler.set_fault_injection.remote("p-0", 0.0, 0.0))


def test_n_above_the_waiting_bound_is_one_request(serve_app: ServeApp) -> None:
    # The bound (6) counts user requests: n = 8 samples on an idle cluster are served, not
    # refused with a 429 that retrying could never clear.
    body = {"model": serve_app.model, "prompt": PROMPT, "n": 8, "max_tokens": 3}
    r = _post(serve_app, "/v1/completions", body)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 8


def test_a_batch_of_prompts_above_the_waiting_bound_is_one_request(serve_app: ServeApp) -> None:
    # So is a batched completion: 8 prompts on an idle cluster are served, not refused for
    # ever (each prompt once counted as a request of its own).
    body = {"model": serve_app.model, "prompt": [PROMPT] * 8, "max_tokens": 3}
    r = _post(serve_app, "/v1/completions", body)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 8


def test_client_leaving_mid_stream_frees_the_blocks(serve_app: ServeApp) -> None:
    import ray

    scheduler = serve_app.scheduler
    ray.get(scheduler.set_fault_injection.remote("d-0", 0.0, 0.05))
    try:
        body = {
            "model": serve_app.model,
            "prompt": PROMPT,
            "max_tokens": 400,
            "stream": True,
            "ignore_eos": True,
        }
        with _post(serve_app, "/v1/completions", body, stream=True) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            data = [line for line in (next(lines) for _ in range(12)) if line]
            assert len(data) >= 4  # tokens are flowing

            def decoding() -> bool:
                stats = ray.get(scheduler.stats.remote())
                return stats["instances"]["d-0"]["num_running"] == 1

            wait_until(decoding, 20, "the request to decode")
        # The connection is closed: the request is aborted and its blocks return.
        start = time.monotonic()
        wait_until(lambda: ray.get(scheduler.stats.remote())["num_flights"] == 0, 20, "abort")
        assert time.monotonic() - start < 20
        stats = ray.get(scheduler.stats.remote())["instances"]["d-0"]
        assert stats["num_free_blocks"] == stats["num_blocks"]
        assert stats["num_output_tokens_computed"] > 0
    finally:
        ray.get(scheduler.set_fault_injection.remote("d-0", 0.0, 0.0))


# -- gRPC ------------------------------------------------------------------------------------
def _grpc_generate(app: ServeApp, key: str | None = API_KEY, **fields: Any) -> list[Any]:
    import grpc

    from cluster.proto import tandem_pb2, tandem_pb2_grpc

    async def run() -> list[Any]:
        async with grpc.aio.insecure_channel(app.grpc_target) as channel:
            stub = tandem_pb2_grpc.GenerateStub(channel)
            metadata = [("authorization", f"Bearer {key}")] if key else []
            request = tandem_pb2.GenerateRequest(**fields)
            return [r async for r in stub.Generate(request, metadata=metadata, timeout=60)]

    return asyncio.run(run())


def test_grpc_streams_what_http_returns(serve_app: ServeApp) -> None:
    body = {
        "model": serve_app.model,
        "prompt": PROMPT,
        "max_tokens": 10,
        "temperature": 0,
        "ignore_eos": True,
    }
    http = _post(serve_app, "/v1/completions", body).json()
    responses = _grpc_generate(
        serve_app,
        model=serve_app.model,
        prompt=PROMPT,
        max_tokens=10,
        temperature=0,
        ignore_eos=True,
    )
    assert len(responses) > 1  # streamed
    assert "".join(r.text for r in responses) == http["choices"][0]["text"]
    assert sum(len(r.token_ids) for r in responses) == 10
    last = responses[-1]
    assert last.finish_reason == "length" and last.usage.completion_tokens == 10
    assert last.usage.prompt_tokens == http["usage"]["prompt_tokens"]
    assert all(not r.finish_reason for r in responses[:-1])


def test_grpc_errors_are_status_codes(serve_app: ServeApp) -> None:
    import grpc

    cases = [
        (
            {"model": serve_app.model, "prompt": PROMPT, "temperature": 5.0},
            API_KEY,
            grpc.StatusCode.INVALID_ARGUMENT,
            "temperature",
        ),
        ({"model": "nope", "prompt": PROMPT}, API_KEY, grpc.StatusCode.NOT_FOUND, "nope"),
        (
            {"model": serve_app.model, "prompt": PROMPT},
            None,
            grpc.StatusCode.UNAUTHENTICATED,
            "API key",
        ),
        (
            {"model": serve_app.model, "prompt": ""},
            API_KEY,
            grpc.StatusCode.INVALID_ARGUMENT,
            "empty",
        ),
    ]
    for fields, key, code, text in cases:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            _grpc_generate(serve_app, key=key, **fields)
        assert info.value.code() == code, (fields, info.value)
        assert text in (info.value.details() or ""), info.value.details()


def test_client_leaving_a_whole_response_aborts_it(serve_app: ServeApp) -> None:
    import ray

    scheduler = serve_app.scheduler
    ray.get(scheduler.set_fault_injection.remote("d-0", 0.0, 0.05))
    try:
        body = {"model": serve_app.model, "prompt": PROMPT, "max_tokens": 400, "ignore_eos": True}
        with pytest.raises(requests.exceptions.ReadTimeout):
            _post(serve_app, "/v1/completions", body, timeout=2.0)  # gives up, closes
        wait_until(lambda: ray.get(scheduler.stats.remote())["num_flights"] == 0, 20, "abort")
        stats = ray.get(scheduler.stats.remote())["instances"]["d-0"]
        assert stats["num_free_blocks"] == stats["num_blocks"]
    finally:
        ray.get(scheduler.set_fault_injection.remote("d-0", 0.0, 0.0))


def test_the_scale_route_resizes_a_pool_behind_the_admin_key(serve_app: ServeApp) -> None:
    body = {"pool": "d", "replicas": 1}
    _error(_post(serve_app, "/admin/scale_pool", body, key=None), 401)
    _error(_post(serve_app, "/admin/scale_pool", body, key=API_KEY), 401)  # inference key

    def admin(body: dict[str, Any]) -> Any:
        return _post(serve_app, "/admin/scale_pool", body, key=ADMIN_KEY)

    unknown = _error(admin({"pool": "x", "replicas": 2}), 400)
    assert "no pool named 'x'" in unknown["message"] and unknown["param"] == "pool"
    zero = _error(admin({"pool": "d", "replicas": 0}), 400)
    assert zero["param"] == "replicas"
    same = admin(body)
    assert same.status_code == 200 and same.json() == {"pool": "d", "instances": ["d-0"]}


def test_runtime_adapters_load_only_with_the_admin_key_from_below_the_root(
    serve_app: ServeApp,
) -> None:
    root = serve_app.model_dir.parent  # the fixture's adapter root
    outside = root.parent / f"{root.name}-outside"
    outside.mkdir(exist_ok=True)
    (root / "escape").unlink(missing_ok=True)
    (root / "escape").symlink_to(outside)

    def load(path: str, key: str | None = ADMIN_KEY) -> Any:
        body = {"lora_name": "z", "lora_path": path}
        return _post(serve_app, "/v1/load_lora_adapter", body, key=key)

    _error(load(serve_app.spare_lora_path, key=None), 401)
    _error(load(serve_app.spare_lora_path, key=API_KEY), 401)  # the inference key is not enough
    for path in ("/etc", str(outside), "../" + outside.name, "b/../../" + outside.name, "escape"):
        error = _error(load(path), 403)
        assert error["param"] == "lora_path" and "adapter root" in error["message"], path
    _error(_post(serve_app, "/v1/unload_lora_adapter", {"lora_name": "a"}, key=API_KEY), 401)
    names = [
        m["id"]
        for m in requests.get(
            f"{serve_app.url}/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30
        ).json()["data"]
    ]
    assert "z" not in names and "a" in names


def test_a_body_over_the_limit_is_413_before_it_is_read(serve_app: ServeApp) -> None:
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    big = {"model": serve_app.model, "prompt": "x" * MAX_BODY_BYTES}
    error = _error(_post(serve_app, "/v1/completions", big), 413)
    assert str(MAX_BODY_BYTES) in error["message"]

    def chunks() -> Any:  # no Content-Length: the limit is found while reading
        yield b'{"model": "' + serve_app.model.encode() + b'", "prompt": "'
        for _ in range(MAX_BODY_BYTES // 16384 + 1):
            yield b"y" * 16384
        yield b'"}'

    url = f"{serve_app.url}/v1/chat/completions"
    _error(requests.post(url, data=chunks(), headers=headers, timeout=60), 413)
    ok = {"model": serve_app.model, "prompt": "x" * (MAX_BODY_BYTES // 2), "max_tokens": 1}
    assert "context length" in _error(_post(serve_app, "/v1/completions", ok), 400)["message"]


def test_a_huge_prompt_does_not_delay_a_small_request(serve_app: ServeApp) -> None:
    """A body just under the limit holding a prompt far longer than the context: refused by
    its length in characters, without tokenizing it, while small requests keep being served
    (the bound is generous: a margin, not a speed target; that tokenization itself stays off
    the event loop is tested in test_serving_in_process.py, where it can be made slow)."""
    small = {"model": serve_app.model, "prompt": PROMPT, "max_tokens": 2}

    def timed() -> float:
        start = time.monotonic()
        assert _post(serve_app, "/v1/completions", small).status_code == 200
        return time.monotonic() - start

    idle = min(timed() for _ in range(3))
    huge = {"model": serve_app.model, "prompt": "word " * (MAX_BODY_BYTES // 5 - 20)}
    statuses: list[int] = []

    def flood() -> None:
        for _ in range(6):
            statuses.append(_post(serve_app, "/v1/completions", huge).status_code)

    threads = [threading.Thread(target=flood) for _ in range(2)]
    for t in threads:
        t.start()
    loaded = [timed() for _ in range(4)]
    for t in threads:
        t.join()
    assert statuses == [400] * 12
    assert max(loaded) < 2 * idle + 1.0, (idle, loaded)


def test_fields_the_api_does_not_implement_are_400s_not_dropped(serve_app: ServeApp) -> None:
    """Through the official SDK, as an agent would ask: the deprecated functions are a 400
    naming the field (not a 200 with free text that ignored them); tools and JSON mode are
    served (a schema that does not compile: a 400 naming response_format); a logit bias is
    applied, and one on an id outside the vocabulary is a 400 naming it."""
    import openai

    client = serve_app.openai()
    messages = [{"role": "user", "content": "hi"}]
    function = {"name": "f", "parameters": {"type": "object", "properties": {}}}
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model=serve_app.model, messages=messages, max_tokens=2, functions=[function]
        )
    error = refused.value.body
    assert error["param"] == "functions" and "functions is not supported" in error["message"]
    tool: Any = {
        "type": "function",
        "function": {
            **function,
            "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
        },
    }
    called = client.chat.completions.create(
        model=serve_app.model,
        messages=messages,
        max_tokens=60,
        tools=[tool],
        tool_choice="required",
        parallel_tool_calls=False,
    )
    assert called.choices[0].finish_reason == "tool_calls"
    calls = called.choices[0].message.tool_calls or []
    assert calls and all(c.function.name == "f" and c.function.arguments == "{}" for c in calls)
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    response_format: Any = {"type": "json_schema", "json_schema": {"name": "r", "schema": schema}}
    answer = client.chat.completions.create(
        model=serve_app.model, messages=messages, max_tokens=20, response_format=response_format
    )
    content = answer.choices[0].message.content or ""
    assert json.loads(content) in ({"ok": True}, {"ok": False})
    bad: Any = {"type": "json_schema", "json_schema": {"name": "r", "schema": {"type": "x"}}}
    with pytest.raises(openai.BadRequestError) as invalid:
        client.chat.completions.create(
            model=serve_app.model, messages=messages, max_tokens=2, response_format=bad
        )
    assert invalid.value.body["param"] == "response_format"
    assert "invalid JSON schema" in invalid.value.body["message"]
    ok = client.chat.completions.create(
        model=serve_app.model,
        messages=messages,
        max_tokens=2,
        tools=[],
        user="u",
        store=False,
        temperature=0,  # (sampled, the random model ends at EOS within 2 tokens about 1 in 100)
    )
    assert ok.choices[0].finish_reason == "length"
    # (What the bias does is tested in process: tests/cluster/serving/test_serving_in_process.)
    forced = client.completions.create(
        model=serve_app.model,
        prompt=[5, 6, 7],
        max_tokens=4,
        temperature=0,
        logit_bias={"9": 100},
        extra_body={"ignore_eos": True},
    )
    assert forced.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError) as outside:
        client.completions.create(
            model=serve_app.model, prompt=[5, 6], max_tokens=2, logit_bias={"10000000": 5}
        )
    assert outside.value.body["param"] == "logit_bias"
