"""schemathesis against the Serve app's OpenAPI schema, loaded from the live app
(``{url}/openapi.json``; tests/cluster/conftest.py): for every route, generated requests --
valid ones (schemathesis' positive mode) and invalid ones (negative mode) -- plus a few
hand-picked edge cases. No request may end in a 5xx, a 5xx inside a 200 event stream, or a hang.

Bounded and reproducible: ``MAX_EXAMPLES`` derandomized examples per route (Hypothesis'
``derandomize``: the same requests on every run; no example database, no shrinking: a failure
is reported as the exact request, a curl command), every call limited to ``TIMEOUT_S`` in all
(event streams are read to their end). The model is tiny with a short context, and the limit is
a hang's, not a speed target: the longest generation the schema allows (``n`` 6 streamed with
logprobs, the whole context) took 30 s on a CI machine with AVX2 only, so the limit has
room for a machine slower still. A test's requests together stay within pytest's timeout
(``pyproject.toml``; the edge cases took 167 s there, on that machine, under load).
Each POST route also gets 4 invalid bodies of their own (negative mode), so that what the mix
draws never leaves a route without them. Each route's cases come from ``operation.as_strategy``
under a plain ``@given`` (schemathesis'
own ``from_fixture(...).parametrize()`` fails under pytest 9: it sets ``node._nodeid``); its
coverage phase (~780 boundary cases for these routes) is not run, to stay bounded.

Every route of the schema is fuzzed; ``test_schema_has_exactly_the_known_routes`` fails when
one is added, so that none goes untested silently. What the generated requests are steered
away from, and why:

* ``model``: a generated name is mostly unknown (a quick 404), so most bodies get the served
  model or adapter "a" instead (a Hypothesis draw), so that generation itself is fuzzed. Never
  "broken": the fixture's adapter whose path is missing on purpose (a quick 404, tested in
  test_serve_errors.py).
* ``logit_bias``: the schema says its keys are token ids (``patternProperties``) but neither
  that no other key may appear nor how many ids the vocabulary has; a map keeps its id keys
  only, taken modulo 1000 (the test model's vocabulary is larger), so that a valid body is
  not refused for a key the schema could not rule out.
* ``/v1/unload_lora_adapter``: a generated ``lora_name`` that names an adapter the app serves
  ("a", "broken", or one another test loaded) is renamed, or the fuzzing would unload it from
  under the other tests. Every other name must give 404 (or 400 for an invalid body).
* ``/v1/load_lora_adapter`` stays as generated: a random ``lora_path`` is no adapter, so every
  request must give 400, or 403 for a path outside the adapter root (and nothing is added).
* The admin routes (adapters, scaling) are called with the admin key, the others with the API
  key.
* ``/admin/scale_pool``: a generated ``pool`` that names one of the app's pools is renamed, or
  the fuzzing would start and stop workers under the other tests; every request must give 400
  (an unknown pool, or an invalid body).
"""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

schemathesis = pytest.importorskip("schemathesis")

import requests  # noqa: E402
from hypothesis import HealthCheck, Phase, example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.config import SchemathesisConfig  # noqa: E402
from schemathesis.generation.modes import GenerationMode  # noqa: E402

from tests.cluster.conftest import ADMIN_KEY, API_KEY, ServeApp, assert_clean  # noqa: E402

MAX_EXAMPLES = 12
TIMEOUT_S = 120.0  # a hang's bound (the module's docstring)
AUTH = {"Authorization": f"Bearer {API_KEY}"}
ADMIN_AUTH = {"Authorization": f"Bearer {ADMIN_KEY}"}
ADMIN_ROUTES = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/admin/scale_pool")
POOLS = ("p", "d")  # the fixture's pools: never resized by the fuzzing

# Every route of the app, and the statuses each may answer (none a 5xx).
ROUTES: dict[str, set[int]] = {
    "GET /v1/models": {200},
    "POST /v1/completions": {200, 400, 404, 429},
    "POST /v1/chat/completions": {200, 400, 404, 429},
    "POST /v1/responses": {200, 400, 404, 429},
    "POST /tokenize": {200, 400, 404},
    "POST /detokenize": {200, 400, 404},
    "POST /v1/load_lora_adapter": {400, 403},
    "POST /v1/unload_lora_adapter": {400, 404},
    "GET /health": {200},
    "GET /metrics": {200},
    "POST /admin/scale_pool": {400},
}
GENERATION = ("POST /v1/completions", "POST /v1/chat/completions", "POST /v1/responses")
VALID = {  # a body each generation route serves (its model is the fixture's)
    "POST /v1/completions": {"model": "m", "prompt": "fuzz", "max_tokens": 2},
    "POST /v1/chat/completions": {
        "model": "m",
        "messages": [{"role": "user", "content": "fuzz"}],
        "max_tokens": 2,
    },
    "POST /v1/responses": {"model": "m", "input": "fuzz", "max_output_tokens": 2},
}


@pytest.fixture(scope="module")
def schema(serve_app: ServeApp) -> Any:
    # Event streams read to their end (schemathesis stops at 20 events by default), within
    # TIMEOUT_S in all.
    config = SchemathesisConfig.from_dict(
        {"max-stream-events": 1_000_000, "request-timeout": TIMEOUT_S}
    )
    return schemathesis.openapi.from_url(f"{serve_app.url}/openapi.json", config=config)


@pytest.fixture(autouse=True)
def _no_leaks(serve_app: ServeApp) -> Any:
    yield
    assert_clean(serve_app.scheduler, timeout_s=30, objects=False)


def _served_adapters(app: ServeApp) -> set[str]:
    r = requests.get(f"{app.url}/v1/models", headers=AUTH, timeout=TIMEOUT_S)
    r.raise_for_status()
    return {m["id"] for m in r.json()["data"]} - {app.model}


def _prepare(case: Any, label: str, model: str | None, protected: set[str]) -> None:
    """Steer a generated case (see the module's docstring)."""
    body = case.body
    if not isinstance(body, dict):
        return
    # Only a valid name is replaced: an invalid one (not a string, empty) is what a negative
    # case is about.
    generated = body.get("model")
    if label in GENERATION and model is not None and isinstance(generated, str) and generated:
        body["model"] = model
    # A valid logit_bias (ids as the schema allows) is kept within the vocabulary, which
    # the schema cannot say; an invalid one stays as generated.
    bias = body.get("logit_bias")
    if label in GENERATION and isinstance(bias, dict):
        body["logit_bias"] = {
            str(int(k) % 1000): v
            for k, v in bias.items()
            if isinstance(k, str) and k.isascii() and k.isdigit()
        }
    name = body.get("lora_name")
    if label == "POST /v1/unload_lora_adapter" and isinstance(name, str) and name in protected:
        body["lora_name"] = f"not-{name}"
    pool = body.get("pool")
    if label == "POST /admin/scale_pool" and isinstance(pool, str) and pool in POOLS:
        body["pool"] = f"not-{pool}"


def _events(response: Any) -> list[dict[str, Any]]:
    """The data of an event stream's events (but chat's and completions' `[DONE]`)."""
    lines = response.content.decode("utf-8", "replace").splitlines()
    data = [line[len("data: ") :] for line in lines if line.startswith("data: ")]
    return [json.loads(item) for item in data if item != "[DONE]"]


def _stream_errors(response: Any) -> list[dict[str, Any]]:
    """The error events of an event stream (an error inside a 200 stream): chat's and
    completions' `{"error": ...}`, the Responses API's `{"type": "error", ...}`."""
    errors = []
    for event in _events(response):
        if "error" in event:
            errors.append(event["error"])
        elif event.get("type") == "error":
            errors.append(event)
    return errors


def _stream_ended(response: Any, label: str) -> bool:
    """The stream was sent whole: chat and completions end with `data: [DONE]`, a response
    (as OpenAI's) with its `response.completed` event (an incomplete one too)."""
    if label != "POST /v1/responses":
        return bool(response.content.rstrip().endswith(b"data: [DONE]"))
    events = _events(response)
    return bool(events) and events[-1].get("type") == "response.completed"


def _send(case: Any, label: str, seen: dict[str, set[int]]) -> int:
    """One request: no 5xx, no hang, a status the route may answer (returned)."""
    auth = ADMIN_AUTH if label.partition(" ")[2] in ADMIN_ROUTES else AUTH
    start = time.monotonic()
    try:
        response = case.call(headers=auth, timeout=TIMEOUT_S)
    except requests.Timeout:
        pytest.fail(f"no answer in {TIMEOUT_S}s:\n{case.as_curl_command(headers=auth)}")
    elapsed = time.monotonic() - start
    status = response.status_code
    seen.setdefault(label, set()).add(status)
    repro = f"{case.as_curl_command(headers=auth)}\n-> {status} {response.content[:2000]!r}"
    assert elapsed < TIMEOUT_S and not response.stream_cut_short, f"{elapsed:.1f}s: {repro}"
    case.validate_response(response, checks=[not_a_server_error])
    assert status in ROUTES[label], repro
    if status == 200 and "text/event-stream" in response.headers.get("content-type", [""])[0]:
        assert not _stream_errors(response), repro
        assert _stream_ended(response, label), repro
    return status


def test_schema_has_exactly_the_known_routes(schema: Any) -> None:
    labels = {result.ok().label for result in schema.get_all_operations()}
    assert labels == set(ROUTES)


@pytest.mark.parametrize("label", list(ROUTES))
def test_generated_requests_give_no_server_error_and_no_hang(
    serve_app: ServeApp, schema: Any, label: str
) -> None:
    method, path = label.split(" ", 1)
    operation = schema[path][method]
    protected = _served_adapters(serve_app)
    modes = [GenerationMode.POSITIVE]
    if label in GENERATION:  # two valid bodies to an invalid one: generation must be reached
        modes.append(GenerationMode.POSITIVE)  # whatever the draws (they shift with the schema)
    if method == "POST":  # a GET without parameters cannot be made invalid
        modes.append(GenerationMode.NEGATIVE)
    cases = st.one_of(*(operation.as_strategy(generation_mode=m) for m in modes))
    models = st.sampled_from([None, serve_app.model, serve_app.model, "a"])  # None: as generated
    seen: dict[str, set[int]] = {}
    sent: dict[str, int] = {}

    def send(case: Any, model: str | None) -> None:
        _prepare(case, label, model, protected)
        mode = case.meta.generation.mode.value if case.meta else "explicit"
        sent[mode] = sent.get(mode, 0) + 1
        _send(case, label, seen)

    @given(case=cases, model=models)
    @settings(
        max_examples=MAX_EXAMPLES,
        deadline=None,
        derandomize=True,
        database=None,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    def check(case: Any, model: str | None) -> None:
        send(case, model)

    if label in GENERATION:
        # One valid body always goes with the draws (hypothesis' explicit phase): whether
        # the draws hold one the server serves shifts with every change of the schema.
        valid = operation.Case(body=VALID[label], media_type="application/json")
        check = example(case=valid, model=serve_app.model)(check)
    check()
    if method == "POST":
        # Invalid bodies for sure (the mix above may draw none: which it draws shifts with
        # every change of the schema, as making ``model`` optional did).
        @given(case=operation.as_strategy(generation_mode=GenerationMode.NEGATIVE))
        @settings(
            max_examples=4,
            deadline=None,
            derandomize=True,
            database=None,
            phases=[Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
        def check_invalid(case: Any) -> None:
            send(case, serve_app.model)

        check_invalid()
    # The fuzzing reached where it should: generation ran, and invalid bodies were refused.
    if label in GENERATION:
        assert {200, 400} <= seen[label], (seen, sent)
    if method == "POST":
        assert sent.get("negative") and sent.get("positive"), sent
    # Nothing was loaded or unloaded: the adapters served are the same.
    assert _served_adapters(serve_app) == protected


def _edge_cases(app: ServeApp) -> list[tuple[str, dict[str, Any], int]]:
    """Bodies at the edges of what the schema allows (or just past them), with the real
    model: huge ``max_tokens``/``n`` must give 400, never a 5xx or a wait. The third item:
    the status the case must get."""
    m = app.model
    prompt = {"model": m, "prompt": "The quick brown fox"}
    chat = {"model": m, "messages": [{"role": "user", "content": "hi"}]}
    cmpl, chat_ = "POST /v1/completions", "POST /v1/chat/completions"
    wide = {"stream": True, "logprobs": True}
    return [
        (cmpl, {**prompt, "max_tokens": 2**63}, 400),
        (cmpl, {**prompt, "max_tokens": 10**30}, 400),
        (cmpl, {**prompt, "n": 10**9}, 400),
        (cmpl, {**prompt, "n": 16, "max_tokens": 2**31}, 400),
        (cmpl, {**prompt, "n": 16, "best_of": 16, "logprobs": 20, "echo": True}, 200),
        (cmpl, {**prompt, "seed": 2**64 - 1, "top_k": 10**12, "min_tokens": 10**12}, 400),
        (cmpl, {**prompt, "seed": -(2**63), "priority": 10**30, "stop_token_ids": [10**30]}, 400),
        (cmpl, {**prompt, "stop_token_ids": [2**63 - 1], "max_tokens": 4}, 200),
        (cmpl, {"model": m, "prompt": [10**30], "max_tokens": 1}, 400),
        (cmpl, {"model": m, "prompt": [[1, 2], [2**63]], "max_tokens": 1}, 400),
        (cmpl, {**prompt, "stream": True, "n": 3, "stream_options": {"include_usage": True}}, 200),
        (chat_, {**chat, "max_tokens": 2**63}, 400),
        (chat_, {**chat, "max_completion_tokens": 10**30, "n": 2}, 400),
        # The longest generation: the whole context, n times, streamed with logprobs (one such
        # case: each takes about 10 s here).
        (chat_, {**chat, **wide, "n": 6, "ignore_eos": True}, 200),
        # n above the fixture's bound of 6 waiting requests: a request is admitted as a whole.
        (chat_, {**chat, **wide, "n": 16, "max_tokens": 48, "top_logprobs": 20}, 200),
        (chat_, {**chat, "chat_template_kwargs": {"add_generation_prompt": 1}}, 200),
        (chat_, {**chat, "model": "a", "n": 4, "priority": -(10**30)}, 400),
    ]


def test_edge_cases_give_no_server_error_and_no_hang(serve_app: ServeApp, schema: Any) -> None:
    seen: dict[str, set[int]] = {}
    for label, body, want in _edge_cases(serve_app):
        method, path = label.split(" ", 1)
        status = _send(schema[path][method].Case(body=body), label, seen)
        assert status == want, (label, body, status)
