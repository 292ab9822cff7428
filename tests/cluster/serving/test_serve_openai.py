"""The OpenAI-compatible API through the official ``openai`` SDK, on a multi-node cluster:
prefill on one node, decode on another, two ingress replicas (tests/cluster/conftest.py).

Outputs are checked against the cluster's own client (``ClusterClient``: what the API must
reproduce) and usage against the tokenizer.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.cluster.conftest import ADMIN_KEY, ServeApp, assert_clean

openai = pytest.importorskip("openai")

from actors.model.tokenizer import Tokenizer  # noqa: E402
from cluster.control.client import ClusterClient  # noqa: E402
from scheduler import LoRARequest, SamplingParams  # noqa: E402

PROMPT = "The quick brown fox"
GREEDY = {"temperature": 0, "max_tokens": 12, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def tokenizer(serve_app: ServeApp) -> Tokenizer:
    return Tokenizer.from_path(serve_app.model_dir)


@pytest.fixture(scope="module")
def direct(serve_app: ServeApp) -> ClusterClient:
    """The same cluster without the API."""
    return ClusterClient(serve_app.scheduler)


@pytest.fixture(autouse=True)
def _no_leaks(serve_app: ServeApp) -> Any:
    yield
    assert_clean(serve_app.scheduler, objects=False)


def _greedy(direct: ClusterClient, prompt: str | list[int], n: int = 12, **kw: Any) -> Any:
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    return direct.generate([prompt], params, **kw)[0].outputs[0]


def test_models_lists_the_model_and_its_adapters(serve_app: ServeApp) -> None:
    models = serve_app.openai().models.list().data
    assert models[0].id == serve_app.model
    by_id = {m.id: m for m in models}
    assert {"a", "broken"} <= set(by_id)
    assert by_id["a"].parent == serve_app.model  # type: ignore[attr-defined]


def test_completion_equals_the_cluster_and_usage_matches_the_tokenizer(
    serve_app: ServeApp, direct: ClusterClient, tokenizer: Tokenizer
) -> None:
    out = serve_app.openai().completions.create(model=serve_app.model, prompt=PROMPT, **GREEDY)
    expected = _greedy(direct, PROMPT)
    assert out.choices[0].text == expected.text
    assert out.choices[0].finish_reason == "length"
    assert out.usage.prompt_tokens == len(tokenizer.encode(PROMPT))
    assert out.usage.completion_tokens == 12
    assert out.usage.total_tokens == out.usage.prompt_tokens + 12
    assert out.model == serve_app.model and out.object == "text_completion"


def test_completion_stream_adds_up_to_the_whole_and_reports_usage(
    serve_app: ServeApp, direct: ClusterClient
) -> None:
    client = serve_app.openai()
    whole = client.completions.create(model=serve_app.model, prompt=PROMPT, **GREEDY)
    chunks = list(
        client.completions.create(
            model=serve_app.model,
            prompt=PROMPT,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert len([c for c in chunks if c.choices]) > 1  # streamed, not one lump
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_continuous_usage_stats_count_the_tokens_streamed_so_far(
    serve_app: ServeApp, tokenizer: Tokenizer
) -> None:
    chunks = list(
        serve_app.openai().completions.create(
            model=serve_app.model,
            prompt=PROMPT,
            stream=True,
            logprobs=1,  # one entry per token: counts each chunk's tokens
            stream_options={"include_usage": True, "continuous_usage_stats": True},  # type: ignore[typeddict-unknown-key]
            **GREEDY,
        )
    )
    prompt_tokens = len(tokenizer.encode(PROMPT))
    sent = 0
    for c in chunks[:-1]:
        sent += len(c.choices[0].logprobs.tokens)
        assert c.usage.completion_tokens == sent
        assert c.usage.prompt_tokens == prompt_tokens
        assert c.usage.total_tokens == prompt_tokens + sent
    assert sent == 12
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    # Without include_usage, continuous_usage_stats adds nothing (vLLM's rule).
    plain = serve_app.openai().completions.create(
        model=serve_app.model,
        prompt=PROMPT,
        stream=True,
        stream_options={"continuous_usage_stats": True},  # type: ignore[typeddict-unknown-key]
        **GREEDY,
    )
    assert all(c.usage is None for c in plain)


def test_token_id_prompts_and_batches(serve_app: ServeApp, direct: ClusterClient) -> None:
    client = serve_app.openai()
    ids, other = [40, 41, 42, 43, 44], [50, 51, 52]
    out = client.completions.create(model=serve_app.model, prompt=[ids, other], **GREEDY)
    assert [c.index for c in out.choices] == [0, 1]
    assert out.choices[0].text == _greedy(direct, ids).text
    assert out.choices[1].text == _greedy(direct, other).text
    assert out.usage.completion_tokens == 24 and out.usage.prompt_tokens == 8
    texts = client.completions.create(model=serve_app.model, prompt=["Hi", PROMPT], **GREEDY)
    assert [c.text for c in texts.choices] == [_greedy(direct, p).text for p in ("Hi", PROMPT)]


def test_chat_stream_and_whole_agree_and_prompt_follows_the_template(
    serve_app: ServeApp, direct: ClusterClient, tokenizer: Tokenizer
) -> None:
    client = serve_app.openai()
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Name a colour."},
    ]
    whole = client.chat.completions.create(model=serve_app.model, messages=messages, **GREEDY)
    ids = tokenizer.encode_chat(messages)
    assert whole.usage.prompt_tokens == len(ids)
    assert whole.choices[0].message.content == _greedy(direct, ids).text
    assert whole.choices[0].message.role == "assistant"
    chunks = list(
        client.chat.completions.create(
            model=serve_app.model,
            messages=messages,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.total_tokens == whole.usage.total_tokens


def test_max_completion_tokens_and_defaults(serve_app: ServeApp) -> None:
    client = serve_app.openai()
    messages = [{"role": "user", "content": "x"}]
    out = client.chat.completions.create(
        model=serve_app.model,
        messages=messages,
        max_completion_tokens=5,
        extra_body={"ignore_eos": True},
    )
    assert out.usage.completion_tokens == 5


def test_n_and_seeds(serve_app: ServeApp) -> None:
    client = serve_app.openai()

    def sample(seed: int) -> list[str]:
        out = client.completions.create(
            model=serve_app.model,
            prompt=PROMPT,
            n=2,
            seed=seed,
            temperature=1.0,
            max_tokens=10,
            extra_body={"ignore_eos": True},
        )
        assert [c.index for c in out.choices] == [0, 1]
        assert out.usage.completion_tokens == 20
        return [c.text for c in out.choices]

    first = sample(7)
    assert sample(7) == first  # reproducible
    assert first[0] != first[1]  # the two samples use different seeds
    assert sample(8) != first
    # Streaming: n interleaved choices, each ending once.
    chunks = list(
        client.chat.completions.create(
            model=serve_app.model,
            messages=[{"role": "user", "content": "hi"}],
            n=2,
            seed=3,
            max_tokens=6,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    ends = [c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason]
    assert sorted(ends) == [0, 1]


def test_stop_strings_end_the_request_in_the_scheduler(
    serve_app: ServeApp, direct: ClusterClient
) -> None:
    full = _greedy(direct, PROMPT, n=24).text
    ends_before = _ends(serve_app)
    # A printable character first seen as late as possible (the tiny model's bytes are random).
    firsts = {ch: full.index(ch) for ch in full if ch.isascii() and ch.isprintable()}
    assert firsts and max(firsts.values()) > 0, full
    stop = max(firsts, key=lambda ch: firsts[ch])
    client = serve_app.openai()
    kwargs: dict[str, Any] = {**GREEDY, "max_tokens": 24}
    out = client.completions.create(model=serve_app.model, prompt=PROMPT, stop=[stop], **kwargs)
    choice = out.choices[0]
    assert choice.text == full[: full.index(stop)]
    assert choice.finish_reason == "stop"
    assert choice.stop_reason == stop  # type: ignore[attr-defined]
    assert out.usage.completion_tokens < 24  # the scheduler stopped generating
    streamed = client.completions.create(
        model=serve_app.model, prompt=PROMPT, stop=stop, stream=True, **kwargs
    )
    assert "".join(c.choices[0].text for c in streamed) == choice.text
    # Counted as vLLM counts them: ended by a stop, not aborted (goodput counts stops).
    ends = _ends(serve_app)
    assert ends["stop"] - ends_before["stop"] == 2
    assert ends["abort"] == ends_before["abort"]


def _ends(serve_app: ServeApp) -> dict[str, float]:
    """``tandem:request_success_total`` by ``finished_reason``, over every instance."""
    import requests
    from prometheus_client.parser import text_string_to_metric_families

    text = requests.get(f"{serve_app.url}/metrics", timeout=30).text
    ends = {"stop": 0.0, "abort": 0.0}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "tandem:request_success_total":
                reason = s.labels["finished_reason"]
                ends[reason] = ends.get(reason, 0.0) + s.value
    return ends


def test_stop_token_ids(serve_app: ServeApp, direct: ClusterClient) -> None:
    tokens = _greedy(direct, PROMPT).token_ids
    out = serve_app.openai().completions.create(
        model=serve_app.model,
        prompt=PROMPT,
        temperature=0,
        max_tokens=12,
        extra_body={"stop_token_ids": [tokens[4]], "ignore_eos": True},
    )
    assert out.choices[0].finish_reason == "stop"
    assert out.usage.completion_tokens == tokens.index(tokens[4]) + 1


def test_logprobs_shape(serve_app: ServeApp) -> None:
    client = serve_app.openai()
    out = client.completions.create(model=serve_app.model, prompt=PROMPT, logprobs=3, **GREEDY)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 12
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert 1 <= len(top) <= 3 and logprob <= 0.0
        # Greedy: the best. (Top entries are keyed by text: ids that decode alike collide.)
        assert logprob >= max(top.values()) - 1e-4
        assert token in top
    chat = client.chat.completions.create(
        model=serve_app.model,
        messages=[{"role": "user", "content": "hi"}],
        logprobs=True,
        top_logprobs=2,
        **GREEDY,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 12
    assert all(len(c.top_logprobs) == 2 for c in content)
    for c in content:  # a token's own bytes: part of a character alone is no UTF-8
        try:
            assert bytes(c.bytes).decode() == c.token
        except UnicodeDecodeError:
            assert c.token == "\ufffd"  # (what it decodes to alone)
    assert all(c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob for c in content)


def test_penalties_and_vllm_extras_are_accepted(serve_app: ServeApp) -> None:
    out = serve_app.openai().completions.create(
        model=serve_app.model,
        prompt=PROMPT,
        max_tokens=8,
        temperature=0.8,
        top_p=0.9,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        user="tester",
        seed=1,
        extra_body={"top_k": 5, "min_p": 0.05, "min_tokens": 8, "priority": 0},
    )
    assert out.usage.completion_tokens == 8  # min_tokens == max_tokens: exactly 8
    # A priority needs priority scheduling (vLLM's 400): these pools serve fcfs.
    import openai

    with pytest.raises(openai.BadRequestError) as refused:
        serve_app.openai().completions.create(
            model=serve_app.model, prompt=PROMPT, max_tokens=2, extra_body={"priority": 1}
        )
    assert refused.value.body["param"] == "priority"


def test_cached_prompt_tokens_are_reported(serve_app: ServeApp) -> None:
    client = serve_app.openai()
    prompt = "A long shared prefix that spans several KV blocks of four tokens each."
    client.completions.create(model=serve_app.model, prompt=prompt, max_tokens=2)
    again = client.completions.create(model=serve_app.model, prompt=prompt, max_tokens=2)
    assert again.usage.prompt_tokens_details.cached_tokens > 0


def test_lora_adapters_by_model_name(serve_app: ServeApp, direct: ClusterClient) -> None:
    client = serve_app.openai()
    base = client.completions.create(model=serve_app.model, prompt=PROMPT, **GREEDY)
    tuned = client.completions.create(model="a", prompt=PROMPT, **GREEDY)
    adapter = LoRARequest(lora_name="a", lora_int_id=1, lora_path=serve_app.lora_path)
    assert tuned.choices[0].text == _greedy(direct, PROMPT, lora_request=adapter).text
    assert tuned.choices[0].text != base.choices[0].text
    assert tuned.model == "a"


def test_load_and_unload_lora_adapters_at_run_time(serve_app: ServeApp) -> None:
    import requests

    client = serve_app.openai()
    with requests.Session() as http:
        http.headers["Authorization"] = f"Bearer {ADMIN_KEY}"

        def post(path: str, body: dict[str, str]) -> Any:
            return http.post(f"{serve_app.url}{path}", json=body, timeout=60)

        r = post("/v1/load_lora_adapter", {"lora_name": "b", "lora_path": "nope"})
        assert r.status_code == 400 and "lora_path" in r.json()["error"]["message"]
        r = post(
            "/v1/load_lora_adapter", {"lora_name": "b", "lora_path": serve_app.spare_lora_path}
        )
        assert r.status_code == 200, r.text
        assert "b" in [m.id for m in client.models.list().data]
        b = client.completions.create(model="b", prompt=PROMPT, **GREEDY)
        a = client.completions.create(model="a", prompt=PROMPT, **GREEDY)
        assert b.choices[0].text != a.choices[0].text
        r = post("/v1/load_lora_adapter", {"lora_name": "b", "lora_path": "x"})
        assert r.status_code == 400 and "already" in r.json()["error"]["message"]
        assert post("/v1/unload_lora_adapter", {"lora_name": "b"}).status_code == 200
        assert post("/v1/unload_lora_adapter", {"lora_name": "b"}).status_code == 404
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="b", prompt=PROMPT, max_tokens=2)


def test_health_and_metrics(serve_app: ServeApp) -> None:
    import requests
    from prometheus_client.parser import text_string_to_metric_families

    serve_app.openai().completions.create(model=serve_app.model, prompt=PROMPT, **GREEDY)
    serve_app.openai().completions.create(model=serve_app.model, prompt=PROMPT, n=2, max_tokens=3)
    r = requests.get(f"{serve_app.url}/health", timeout=30)
    assert r.status_code == 200 and r.json()["instances"] == ["d-0", "p-0"]
    text = requests.get(f"{serve_app.url}/metrics", timeout=30).text
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }

    def value(name: str, instance: str, **extra: str) -> float:
        role = "decode" if instance == "d-0" else "prefill"
        labels = {"model_name": "tiny-chat", "instance": instance, "role": role, **extra}
        return samples[(name, tuple(sorted(labels.items())))]

    assert value("tandem:num_requests_running", "d-0") == 0
    assert value("tandem:kv_cache_usage_perc", "d-0") == 0
    assert value("tandem:generation_tokens_total", "d-0") > 0
    assert value("tandem:prompt_tokens_total", "p-0") > 0
    assert value("tandem:prefix_cache_queries_total", "p-0") > 0
    # The first token comes from the prefill instance, the rest from the decode instance.
    assert value("tandem:time_to_first_token_seconds_count", "p-0") > 0
    assert value("tandem:inter_token_latency_seconds_count", "d-0") > 0
    assert value("tandem:request_queue_time_seconds_count", "p-0") > 0
    finished = value("tandem:requests_finished_total", "d-0")
    assert finished > 0
    assert 0 < value("tandem:goodput_requests_total", "d-0") <= finished  # generous test SLOs
    assert value("tandem:request_success_total", "d-0", finished_reason="length") > 0
    assert value("tandem:kv_transfer_duration_seconds_count", "d-0", outcome="ok") > 0
    assert value("tandem:kv_transfer_bytes_loaded_total", "d-0") > 0
    assert value("tandem:kv_transfer_bytes_saved_total", "p-0") > 0
    # n once per user request (with its first sample): fewer counts than finished samples,
    # and the n=2 request above adds 2 to the sum.
    n_count = sum(v for (name, _), v in samples.items() if name == "tandem:request_params_n_count")
    n_sum = sum(v for (name, _), v in samples.items() if name == "tandem:request_params_n_sum")
    all_finished = sum(
        v for (name, _), v in samples.items() if name == "tandem:requests_finished_total"
    )
    assert 0 < n_count < all_finished and n_sum >= n_count + 1
    lora_info = [
        dict(labels)
        for (name, labels) in samples
        if name == "tandem:lora_requests_info" and dict(labels)["instance"] == "d-0"
    ]
    assert len(lora_info) == 1 and lora_info[0]["running_lora_adapters"] == ""


def test_every_metric_the_grafana_dashboard_queries_is_exported(serve_app: ServeApp) -> None:
    import json
    import re
    from pathlib import Path

    import requests
    from prometheus_client.parser import text_string_to_metric_families

    dashboard = Path(__file__).resolve().parents[3] / "deploy" / "grafana" / "tandem.json"
    doc = json.loads(dashboard.read_text())
    rows = [p["title"] for p in doc["panels"] if p["type"] == "row"]
    assert rows == ["Traffic", "Latency", "KV cache", "P/D transfer", "Goodput", "Autoscaling"]
    # The autoscaler's series exist where a pool autoscales (this app has none; they are
    # checked in tests/cluster/control/test_autoscaler.py).
    autoscaling = ("tandem:pool_", "tandem:autoscaler_")
    queried = {
        name
        for panel in doc["panels"]
        for target in panel.get("targets", [])
        for name in re.findall(r"tandem:[a-z0-9_:]+", target["expr"])
        if not name.startswith(autoscaling)
    }
    assert len(queried) >= 20
    serve_app.openai().completions.create(model=serve_app.model, prompt=PROMPT, **GREEDY)
    text = requests.get(f"{serve_app.url}/metrics", timeout=30).text
    exported = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
    missing = sorted(queried - exported)
    assert not missing, missing


def test_tokenize_and_detokenize_routes(serve_app: ServeApp, tokenizer: Tokenizer) -> None:
    """vLLM's /tokenize and /detokenize over HTTP, behind the API key."""
    requests = pytest.importorskip("requests")
    from tests.cluster.conftest import API_KEY

    auth = {"Authorization": f"Bearer {API_KEY}"}
    body = {"model": serve_app.model, "prompt": PROMPT}
    reply = requests.post(f"{serve_app.url}/tokenize", json=body, headers=auth, timeout=30)
    assert reply.status_code == 200, reply.text
    ids = tokenizer.encode(PROMPT)
    assert reply.json() == {
        "count": len(ids),
        "max_model_len": reply.json()["max_model_len"],
        "tokens": ids,
        "token_strs": None,
    }
    back = requests.post(
        f"{serve_app.url}/detokenize", json={"tokens": ids}, headers=auth, timeout=30
    )
    assert back.status_code == 200 and back.json()["prompt"].endswith(PROMPT)
    bad = requests.post(f"{serve_app.url}/detokenize", json={"tokens": [-1]}, headers=auth)
    assert bad.status_code == 400 and "tokens" in bad.json()["error"]["param"]
    anonymous = requests.post(f"{serve_app.url}/tokenize", json=body, timeout=30)
    assert anonymous.status_code == 401
