"""The OpenAI API's logic (``OpenAIServing``) on the in-process engine (``AsyncLLM``) instead
of a Ray cluster: both implement ``EngineClient``, so the same serving code answers the same
way -- greedy text equal to ``LLM``'s, streams whose deltas add up to the whole response,
OpenAI's errors, and every request's blocks freed, finished or abandoned."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from contextlib import aclosing
from pathlib import Path
from typing import Any

import pytest

from cluster import LLM, SamplingParams
from cluster.engine.async_llm import AsyncLLM
from cluster.engine.protocol import EngineClient
from cluster.errors import OverloadedError, StreamLostError
from cluster.serving.errors import APIError, api_error
from cluster.serving.openai_protocol import ChatCompletionRequest, CompletionRequest
from cluster.serving.openai_serving import OpenAIServing
from cluster.serving.responses_api import create_response
from cluster.serving.responses_protocol import ResponsesRequest
from tests.actors.conftest import make_checkpoint
from tests.cluster.conftest import CHAT_TEMPLATE

ENGINE = {"dtype": "float32", "block_size": 4, "num_blocks": 256, "progress": False}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny checkpoint with a chat template, and a context of 1,024 tokens (its byte
    tokenizer spends one per character: the tools' fallback prompt needs room)."""
    path = tmp_path_factory.mktemp("in-process") / "tiny-chat"
    make_checkpoint(path, "llama", max_position_embeddings=1024)
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))
    return path


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> AsyncLLM:
    return AsyncLLM.from_config(str(model_dir), model_name="tiny-chat", **ENGINE)


@pytest.fixture
def serving(engine: AsyncLLM) -> Iterator[OpenAIServing]:
    yield OpenAIServing(engine, "tiny-chat")
    scheduler = engine.engine.scheduler  # nothing left behind, whatever the test did
    scheduler.check_integrity()
    assert not engine.engine.has_unfinished_requests()
    assert scheduler.kv_cache_manager.usage == 0.0


def _run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 120))


async def _drain(chunks: Any) -> list[dict[str, Any]]:
    lines = [line async for line in chunks]
    assert lines[-1] == "data: [DONE]\n\n"
    return [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]


def test_the_in_process_engine_is_an_engine_client(engine: AsyncLLM) -> None:
    """Both engines subclass ``EngineClient``, so ``isinstance`` holds by inheritance alone:
    what makes each one is that it implements every member (none left as the protocol's
    stub, which returns None)."""
    from cluster.control.client import ClusterClient

    members = [name for name in vars(EngineClient) if not name.startswith("_")]
    assert {"generate_async", "abort", "tokenizer", "max_model_len"} <= set(members)
    for cls in (type(engine), ClusterClient):
        stubs = [n for n in members if getattr(cls, n) is getattr(EngineClient, n)]
        assert stubs == [], f"{cls.__name__} leaves {stubs} to the protocol's stubs"


def test_greedy_completions_equal_the_in_process_llm(
    serving: OpenAIServing, model_dir: Path
) -> None:
    prompts = [[5, 17, 99, 3], [42] * 9]
    req = CompletionRequest.model_validate(
        {"model": "tiny-chat", "prompt": prompts, "max_tokens": 6, "temperature": 0, "n": 2}
    )
    body = _run(serving.completion(req))
    reference = LLM(str(model_dir), **ENGINE).generate(
        prompts, SamplingParams(max_tokens=6, temperature=0)
    )
    texts = [c["text"] for c in body["choices"]]
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert texts == [r.outputs[0].text for r in reference for _ in range(2)]
    assert body["usage"]["prompt_tokens"] == 4 + 9
    assert body["usage"]["completion_tokens"] == 4 * 6
    assert {c["finish_reason"] for c in body["choices"]} == {"length"}


def test_a_streamed_chat_adds_up_to_the_whole_one(serving: OpenAIServing) -> None:
    base = {
        "model": "tiny-chat",
        "messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": 8,
        "temperature": 0,
    }
    whole = _run(serving.chat(ChatCompletionRequest.model_validate(base)))
    stream_req = {**base, "stream": True, "stream_options": {"include_usage": True}}

    async def streamed() -> list[dict[str, Any]]:
        return await _drain(await serving.chat(ChatCompletionRequest.model_validate(stream_req)))

    chunks = _run(streamed())
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == whole["choices"][0]["message"]["content"]
    usage = chunks[-1]["usage"]
    assert chunks[-1]["choices"] == [] and usage["total_tokens"] == whole["usage"]["total_tokens"]
    # The same prompt a second time: its full blocks come from the prefix cache.
    assert usage["prompt_tokens_details"]["cached_tokens"] > 0


def test_errors_are_openai_errors(serving: OpenAIServing) -> None:
    too_long = CompletionRequest.model_validate(
        {"model": "tiny-chat", "prompt": [1] * (serving.max_model_len + 1)}
    )
    with pytest.raises(APIError) as long_error:
        _run(serving.completion(too_long))
    assert long_error.value.status == 400 and long_error.value.param == "prompt"
    unknown = CompletionRequest.model_validate({"model": "nope", "prompt": "x"})
    with pytest.raises(APIError) as unknown_error:
        _run(serving.completion(unknown))
    assert unknown_error.value.status == 404 and unknown_error.value.param == "model"
    with pytest.raises(APIError) as vocab_error:  # the engine's own check of the ids
        _run(
            serving.completion(
                CompletionRequest.model_validate({"model": "tiny-chat", "prompt": [10**6]})
            )
        )
    assert vocab_error.value.status == 400 and "vocabulary" in vocab_error.value.message


@pytest.mark.parametrize("token", [2**32, 2**64])
def test_an_echoed_prompt_with_an_id_past_the_tokenizers_range_is_a_400(
    serving: OpenAIServing, token: int
) -> None:
    """``echo`` decoded the prompt's ids before they were checked: one of 2**32 or more made
    the tokenizer raise OverflowError, a 500 (without echo: this 400)."""
    req = CompletionRequest.model_validate(
        {"model": "tiny-chat", "prompt": [5, token], "echo": True, "max_tokens": 1}
    )
    with pytest.raises(APIError) as error:
        _run(serving.completion(req))
    assert error.value.status == 400 and error.value.param == "prompt"


class _Failing:
    """The in-process engine, its streams failing after ``after`` outputs: with an error
    sample (the cluster failed the request: a KV load under ``failure_policy: fail``, no
    decode instance left), a sample ending as ``exc`` says (a ``(finish_reason, error)``
    pair: ``tandem down`` aborts what is in flight with a reason) or by raising ``exc`` (the
    stream itself broke)."""

    def __init__(
        self, engine: AsyncLLM, after: int, exc: BaseException | tuple[str, str] | None
    ) -> None:
        self.engine, self.after, self.exc = engine, after, exc

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    async def generate_async(self, *args: Any, **kwargs: Any) -> Any:
        count = 0
        async with aclosing(self.engine.generate_async(*args, **kwargs)) as stream:
            async for out in stream:
                if count == self.after:
                    if isinstance(self.exc, BaseException):
                        raise self.exc
                    sample = out.outputs[0]
                    sample.finish_reason, sample.error = self.exc or (
                        "error",
                        "remote KV load failed",
                    )
                    yield out
                    return
                count += 1
                yield out


FAILURES = {
    "error sample": (None, 503, "remote KV load failed"),
    # Not a 200 ending with finish_reason "abort" (none of OpenAI's) and a cut answer.
    "cluster shut down": (("abort", "shutdown"), 503, "the cluster ended the request (shutdown)"),
    "stream lost": (StreamLostError("the stream from the cluster broke"), 503, "broke"),
    "a bug": (KeyError("oops"), 500, "internal server error"),
}


@pytest.mark.parametrize("failure", FAILURES)
def test_a_stream_that_fails_midway_ends_with_an_error_event_then_done(
    engine: AsyncLLM, failure: str
) -> None:
    """After the 200 went out, a failure is an SSE error event followed by ``[DONE]`` (as
    vLLM), never a body cut off mid-stream: 503 when the cluster failed the request or the
    stream was lost (the client may retry), 500 for anything else."""
    exc, status, message = FAILURES[failure]
    serving = OpenAIServing(_Failing(engine, 2, exc), "tiny-chat")  # type: ignore[arg-type]
    *chunks, last = _streamed(serving, engine)
    assert len(chunks) == 2 and all(c["choices"] for c in chunks)
    assert last["error"]["code"] == status and message in last["error"]["message"]


@pytest.mark.parametrize("failure", FAILURES)
def test_a_whole_response_that_fails_is_an_error_status(engine: AsyncLLM, failure: str) -> None:
    """Not a 400: the request was fine, the cluster failed it. What escapes is the API error
    itself (the app's handler for anything else answers 500: a lost stream was one)."""
    exc, status, message = FAILURES[failure]
    serving = OpenAIServing(_Failing(engine, 1, exc), "tiny-chat")  # type: ignore[arg-type]
    req = CompletionRequest.model_validate(
        {"model": "tiny-chat", "prompt": [7, 8, 9], "max_tokens": 20}
    )

    async def whole() -> BaseException:
        try:
            await serving.completion(req)
        except Exception as exc:
            await _idle(engine)
            return exc
        raise AssertionError("no error")

    error = _run(whole())
    assert isinstance(error, APIError)
    assert error.status == status and message in error.message


def test_a_central_scheduler_that_died_is_a_503() -> None:
    """A request submitted while the central scheduler actor is dead or restarting fails
    with Ray's actor error: retryable (503), not an internal error (500)."""
    import ray.exceptions

    for exc in (
        ray.exceptions.ActorDiedError(),
        ray.exceptions.ActorUnavailableError("unreachable", None),
    ):
        assert api_error(exc).status == 503


def _streamed(serving: OpenAIServing, engine: AsyncLLM) -> list[dict[str, Any]]:
    """The events of a streamed completion of [7, 8, 9] (20 tokens at most), once its
    request has left the engine."""
    req = CompletionRequest.model_validate(
        {"model": "tiny-chat", "prompt": [7, 8, 9], "max_tokens": 20, "stream": True}
    )

    async def stream() -> list[dict[str, Any]]:
        events = await _drain(await serving.completion(req))
        await _idle(engine)
        return events

    return _run(stream())


def _traced() -> tuple[Any, Any]:
    """A tracer whose spans end in the returned in-memory exporter."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider.get_tracer("test"), exporter


async def _idle(engine: AsyncLLM) -> None:
    """Until the failed request's abort has landed (at the engine's next step)."""
    for _ in range(200):
        if not engine.engine.has_unfinished_requests():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the failed request still runs")


class _RefusingSecond:
    """The in-process engine, refusing a batch's second prompt (as the cluster refuses one
    with a 429) while the first waits for its first output."""

    def __init__(self, engine: AsyncLLM) -> None:
        self.engine = engine

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    async def generate_async(self, *args: Any, request_id: str, **kwargs: Any) -> Any:
        if request_id.endswith("-1"):  # (the first prompt waits for its first output)
            raise OverloadedError(1, 1, 1)
        async with aclosing(
            self.engine.generate_async(*args, request_id=request_id, **kwargs)
        ) as stream:
            async for out in stream:
                yield out


def test_a_batch_with_a_refused_prompt_stops_the_others(engine: AsyncLLM) -> None:
    """One prompt of a batched ``/v1/completions`` refused: the request is refused (429),
    and its other prompts are aborted at once -- not left to run for a client that already
    has its answer (their streams could not be closed while their first output ran)."""
    serving = OpenAIServing(_RefusingSecond(engine), "tiny-chat")  # type: ignore[arg-type]
    req = CompletionRequest.model_validate(
        {"model": "tiny-chat", "prompt": [[5, 6, 7] * 20, [8, 9]], "max_tokens": 500}
    )

    async def refused() -> APIError:
        try:
            await serving.completion(req)
        except APIError as exc:
            # Already let go when the error is raised (not when its stream is collected).
            assert not engine._queues, "the other prompt still streams"
            await _idle(engine)
            return exc
        raise AssertionError("not refused")

    assert _run(refused()).status == 429


class _FailingSecond:
    """The in-process engine, failing a batch's second prompt at its second output with an
    error sample (the cluster failed it: a KV load under ``failure_policy: fail``) while the
    first prompt runs on; ``tokens``: how many the first one made."""

    def __init__(self, engine: AsyncLLM) -> None:
        self.engine = engine
        self.tokens = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    async def generate_async(self, *args: Any, request_id: str, **kwargs: Any) -> Any:
        failing = request_id.endswith("-1")
        async with aclosing(
            self.engine.generate_async(*args, request_id=request_id, **kwargs)
        ) as stream:
            count = 0
            async for out in stream:
                if failing and count == 1:
                    sample = out.outputs[0]
                    sample.finish_reason, sample.error = "error", "remote KV load failed"
                    yield out
                    return
                count += 1
                if not failing:
                    self.tokens = len(out.outputs[0].token_ids)
                yield out


def test_a_whole_response_with_a_failed_prompt_stops_the_others_at_once(
    engine: AsyncLLM,
) -> None:
    """A non-streamed request one of whose prompts (or samples) the cluster failed is a 503
    at once, its other prompts aborted then, as a stream's error event does -- not after
    they ran to their end (hundreds of tokens, their KV blocks held) for an answer that is
    an error anyway."""
    serving = OpenAIServing(_FailingSecond(engine), "tiny-chat")  # type: ignore[arg-type]
    req = CompletionRequest.model_validate(
        {
            "model": "tiny-chat",
            "prompt": [[5, 6, 7], [8, 9]],
            "max_tokens": 500,
            "ignore_eos": True,  # (the tiny model's EOS would end it early)
        }
    )

    async def failed() -> APIError:
        try:
            await serving.completion(req)
        except APIError as exc:
            assert not engine._queues, "the other prompt still streams"
            await _idle(engine)
            return exc
        raise AssertionError("not failed")

    error = _run(failed())
    assert error.status == 503 and "remote KV load failed" in error.message
    assert serving.engine.tokens < 50  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"prompt": [1, 2], "min_tokens": 50, "max_tokens": 10}, "min_tokens", "max_tokens (10)"),
        ({"prompt": [1, 2], "echo": True, "max_tokens": 0, "min_tokens": 2}, "min_tokens", "echo"),
        (
            {"messages": [{"role": "user", "content": "x" * 960}], "min_tokens": 50},
            "min_tokens",
            "room left in the context",
        ),
        (
            {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 5000},
            "max_completion_tokens",
            "max_completion_tokens",
        ),
    ],
)
def test_token_limits_that_conflict_are_400s_naming_the_field(
    serving: OpenAIServing, body: dict[str, Any], param: str, words: str
) -> None:
    """``min_tokens`` above ``max_tokens`` (or the room the context leaves) is refused, as
    vLLM does (it was clamped); a chat's limit is named as the client gave it."""
    body = {"model": "tiny-chat", **body}
    if "messages" in body:
        call = serving.chat(ChatCompletionRequest.model_validate(body))
    else:
        call = serving.completion(CompletionRequest.model_validate(body))
    with pytest.raises(APIError) as error:
        _run(call)
    assert error.value.status == 400 and error.value.param == param
    assert words in error.value.message


def test_model_may_be_left_out_as_in_vllm(serving: OpenAIServing) -> None:
    body = _run(serving.completion(CompletionRequest.model_validate({"prompt": [5, 6]})))
    assert body["model"] == "tiny-chat" and body["choices"][0]["text"]
    chat = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True}
    )

    async def stream() -> list[dict[str, Any]]:
        return await _drain(await serving.chat(chat))

    assert all(chunk["model"] == "tiny-chat" for chunk in _run(stream()))


def test_a_prompt_longer_than_any_tokenization_is_refused_before_tokenizing(
    serving: OpenAIServing, monkeypatch: pytest.MonkeyPatch
) -> None:
    limit = serving.max_prompt_chars
    assert limit == serving.max_model_len * serving.tokenizer.max_token_chars
    tokenized: list[str] = []
    encode = serving.tokenizer.encode

    def spy(text: str, *args: Any, **kwargs: Any) -> list[int]:
        tokenized.append(text)
        return encode(text, *args, **kwargs)

    monkeypatch.setattr(serving.tokenizer, "encode", spy)
    body = {"model": "tiny-chat", "prompt": ["ok", "x" * (limit + 1)]}
    with pytest.raises(APIError) as refused:
        _run(serving.completion(CompletionRequest.model_validate(body)))
    assert refused.value.status == 400 and refused.value.param == "prompt"
    assert f"{limit + 1} characters" in refused.value.message
    half = "y" * (limit // 2 + 1)
    chat = ChatCompletionRequest.model_validate(
        {"model": "tiny-chat", "messages": [{"role": "user", "content": half}] * 2}
    )
    with pytest.raises(APIError) as refused:
        _run(serving.chat(chat))
    assert refused.value.status == 400 and refused.value.param == "messages"
    assert tokenized == []  # neither reached the tokenizer
    fits = CompletionRequest.model_validate({"model": "tiny-chat", "prompt": "hi", "max_tokens": 1})
    _run(serving.completion(fits))
    assert tokenized == ["hi"]  # the spy sees what is tokenized


def test_a_prompt_far_over_the_context_is_refused_from_its_prefixes(
    serving: OpenAIServing, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where characters give no bound (a long-context model, a tokenizer without one), a
    prompt is counted by growing prefixes before it is tokenized whole: one far over the
    context is refused after a few thousand characters, not a megabyte."""
    serving.max_prompt_chars = None
    lengths: list[int] = []
    encode = serving.tokenizer.encode

    def spy(text: str, *args: Any, **kwargs: Any) -> list[int]:
        lengths.append(len(text))
        return encode(text, *args, **kwargs)

    monkeypatch.setattr(serving.tokenizer, "encode", spy)
    huge = "the quick brown fox jumps " * 40_000  # 1M characters
    for body, param in (
        ({"model": "tiny-chat", "prompt": huge}, "prompt"),
        ({"model": "tiny-chat", "messages": [{"role": "user", "content": huge}]}, "messages"),
    ):
        request: Any = CompletionRequest if param == "prompt" else ChatCompletionRequest
        with pytest.raises(APIError) as refused:
            work = request.model_validate(body)
            _run(serving.completion(work) if param == "prompt" else serving.chat(work))
        assert refused.value.status == 400 and refused.value.param == param
        assert "more than" in refused.value.message and "tokens" in refused.value.message
        assert sum(lengths) <= 4 * serving.max_model_len  # the first prefix was enough
        lengths.clear()
    fits = CompletionRequest.model_validate({"model": "tiny-chat", "prompt": "hi", "max_tokens": 1})
    _run(serving.completion(fits))
    assert lengths == [2]


def test_prompts_are_tokenized_off_the_event_loop(
    serving: OpenAIServing, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prompt that takes long to tokenize (here: the character bound and the prefix guard
    lifted, so it is tokenized whole before the context check refuses it) leaves the event
    loop free meanwhile."""
    from cluster.serving import request_checks

    serving.max_prompt_chars = None
    monkeypatch.setattr(request_checks, "PREFIX_CHARS_PER_TOKEN", 10**9)
    req = CompletionRequest.model_validate(
        {"model": "tiny-chat", "prompt": "the quick brown fox jumps " * 60_000}
    )

    async def run() -> tuple[float, float]:
        gaps: list[float] = []
        stop = asyncio.Event()

        async def tick() -> None:
            last = time.monotonic()
            while not stop.is_set():
                await asyncio.sleep(0.002)
                now = time.monotonic()
                gaps.append(now - last)
                last = now

        ticker = asyncio.ensure_future(tick())
        start = time.monotonic()
        with pytest.raises(APIError) as refused:
            await serving.completion(req)
        elapsed = time.monotonic() - start
        stop.set()
        await ticker
        assert refused.value.status == 400 and str(serving.max_model_len) in refused.value.message
        return elapsed, max(gaps)

    elapsed, longest_gap = _run(run())
    assert elapsed > 0.1 and longest_gap < elapsed / 3, (elapsed, longest_gap)


def test_a_request_id_still_streamed_is_refused_not_lost(engine: AsyncLLM) -> None:
    """A stream that has its final output but is not closed yet still holds its id: a new
    request with it is refused (it was accepted, and the first stream's close then dropped
    the new one's outputs: it hung); once closed, the id is free again."""
    params = SamplingParams(max_tokens=2, temperature=0.0)

    async def run() -> list[int]:
        first = engine.generate_async([7, 8, 9], params, request_id="x")
        while not (await first.__anext__()).finished:
            pass
        with pytest.raises(ValueError, match="request id 'x' is in use"):
            await engine.generate_async([7, 8], params, request_id="x").__anext__()
        await first.aclose()
        outs = [o async for o in engine.generate_async([7, 8], params, request_id="x")]
        return outs[-1].outputs[0].token_ids

    assert len(_run(run())) == 2


def test_a_failed_step_ends_the_engine_and_frees_its_requests(model_dir: Path) -> None:
    """A step that raises fails every live request and the engine with it (vLLM's
    EngineDeadError): its requests are not left running, holding blocks, and new requests
    are refused with a 503 instead of stepping a scheduler a half-done step left behind."""
    from cluster.errors import EngineDeadError

    llm = AsyncLLM.from_config(str(model_dir), **ENGINE)
    steps = {"n": 0}
    real_step = llm.engine.step

    def failing_step() -> Any:
        steps["n"] += 1
        if steps["n"] == 3:
            raise RuntimeError("boom")
        return real_step()

    llm.engine.step = failing_step  # type: ignore[method-assign]
    params = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)

    async def run() -> None:
        live = llm.generate_async([7, 8, 9], params)
        await live.__anext__()
        with pytest.raises(EngineDeadError, match="boom"):  # a 503 for streams in flight too
            async for _ in live:
                pass
        assert (await llm.check_health()) == {"local": False}
        # Its end is counted, as an error (it was missing from every per-request series).
        series = _series(await llm.metrics_text())

        def total(name: str, *labels: tuple[str, str]) -> float:
            return sum(v for (n, ls), v in series.items() if n == name and set(labels) <= set(ls))

        assert total("tandem:request_success_total", ("finished_reason", "error")) == 1
        assert total("tandem:e2e_request_latency_seconds_count") == 1
        assert total("tandem:request_generation_tokens_sum") >= 1  # (made before the failure)
        assert not llm.metrics._requests
        llm.abort("anything")  # no step of the dead engine after its failure
        await asyncio.sleep(0.05)
        assert steps["n"] == 3
        with pytest.raises(EngineDeadError) as dead:
            await llm.generate_async([7, 8], params).__anext__()
        assert api_error(dead.value).status == 503

    _run(run())
    scheduler = llm.engine.scheduler
    assert not scheduler.requests and scheduler.kv_cache_manager.usage == 0.0


def test_a_stream_left_early_aborts_its_request(serving: OpenAIServing, engine: AsyncLLM) -> None:
    req = CompletionRequest.model_validate(
        {"model": "tiny-chat", "prompt": [7, 8, 9], "max_tokens": 200, "stream": True}
    )

    async def leave_after_two() -> None:
        chunks = await serving.completion(req)
        async for _ in chunks:
            if engine.engine.scheduler.num_steps >= 3:
                break
        await chunks.aclose()
        # Asked for at once: the response stream closes what it reads from (the garbage
        # collector's finalizer did, a turn of the loop or more later).
        assert engine._aborts
        for _ in range(200):  # the abort lands at the engine's next step
            if not engine.engine.has_unfinished_requests():
                return
            await asyncio.sleep(0.01)

    _run(leave_after_two())
    assert not engine.engine.has_unfinished_requests()


def test_a_stream_closed_unread_aborts_its_requests(
    serving: OpenAIServing, engine: AsyncLLM
) -> None:
    """The server closes the response stream before its first step -- the client left before
    the first byte: its requests are aborted at once, not left running unread until the
    collector finds the stream (a generator never started runs no ``finally``)."""
    req = CompletionRequest.model_validate(
        {"model": "tiny-chat", "prompt": [[7, 8, 9], [4, 5]], "max_tokens": 200, "stream": True}
    )

    async def leave_at_once() -> None:
        chunks = await serving.completion(req)
        assert engine.engine.has_unfinished_requests()
        await chunks.aclose()
        assert engine._aborts  # with the stream still held: not left to the collector
        await _idle(engine)
        del chunks

    _run(leave_at_once())


def test_an_abort_from_another_thread_reaches_the_engine(engine: AsyncLLM) -> None:
    """``abort`` from a thread without the engine's event loop (a watchdog, a signal
    handler's thread) is handed to that loop: the request ends as aborted."""
    import threading

    params = SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True)
    errors: list[BaseException] = []

    def abort() -> None:
        try:
            engine.abort("far")
        except BaseException as exc:  # (it raised: no event loop in this thread)
            errors.append(exc)

    async def run() -> Any:
        final = None
        async for out in engine.generate_async([5, 6, 7], params, request_id="far"):
            final = out
            if len(out.outputs[0].token_ids) == 2:
                threading.Thread(target=abort).start()
        return final

    final = _run(run())
    assert errors == []
    assert final.outputs[0].finish_reason == "abort"
    assert len(final.outputs[0].token_ids) < 500


def test_models_health_and_metrics(serving: OpenAIServing) -> None:
    models = _run(serving.models())
    assert [m["id"] for m in models["data"]] == ["tiny-chat"]
    assert models["data"][0]["max_model_len"] == serving.max_model_len
    assert _run(serving.health()) == (200, {"status": "ok", "instances": ["local"]})
    text = _run(serving.metrics())
    assert 'tandem:num_requests_running{instance="local",model_name="tiny-chat",role="both"}' in (
        text
    )
    with pytest.raises(APIError) as error:  # no adapter by that name
        _run(serving.resolve("adapter-x"))
    assert error.value.status == 404


def _series(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    from prometheus_client.parser import text_string_to_metric_families

    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_the_in_process_engine_records_the_clusters_request_series(
    serving: OpenAIServing, engine: AsyncLLM
) -> None:
    """``/metrics`` in front of one process has the series the cluster's SchedulerActor
    records per request (TTFT, ITL, queue time, e2e, tokens, finish reasons), on its one
    instance: a request of two samples counts two, an abandoned one as aborted."""
    before = _series(_run(serving.metrics()))
    req = CompletionRequest.model_validate(
        {
            "model": "tiny-chat",
            "prompt": [5, 6, 7],
            "max_tokens": 5,
            "n": 2,
            "temperature": 0,
            "ignore_eos": True,
        }
    )
    _run(serving.completion(req))
    left = CompletionRequest.model_validate(
        {"model": "tiny-chat", "prompt": [8, 9], "max_tokens": 200, "stream": True}
    )

    async def leave() -> None:
        chunks = await serving.completion(left)
        await chunks.aclose()
        await _idle(engine)

    _run(leave())
    after = _series(_run(serving.metrics()))
    where = (("instance", "local"), ("model_name", "tiny-chat"), ("role", "both"))

    def grew(name: str, *extra: tuple[str, str]) -> float:
        key = (name, tuple(sorted((*where, *extra))))
        return after[key] - before.get(key, 0.0)

    assert grew("tandem:request_success_total", ("finished_reason", "length")) == 2
    assert grew("tandem:request_success_total", ("finished_reason", "abort")) == 1
    assert grew("tandem:e2e_request_latency_seconds_count") == 3
    assert grew("tandem:request_queue_time_seconds_count") == 3
    assert grew("tandem:time_to_first_token_seconds_count") >= 2  # (the left one: maybe)
    assert grew("tandem:inter_token_latency_seconds_count") >= 2 * 4
    assert grew("tandem:request_generation_tokens_sum") >= 10
    assert grew("tandem:request_prompt_tokens_sum") == 3 + 3 + 2
    assert grew("tandem:request_params_n_sum") == 2 + 1  # once per request, not per sample
    assert grew("tandem:request_time_per_output_token_seconds_count") >= 2
    assert grew("tandem:iteration_tokens_total_count") >= 5
    assert not engine.metrics._requests  # nothing kept of them


def test_operators_see_the_in_process_engine(engine: AsyncLLM) -> None:
    params = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)

    async def run() -> tuple[dict[str, Any], dict[str, Any]]:
        live: dict[str, Any] = {}
        async for out in engine.generate_async([9, 8, 7, 6], params, request_id="ops"):
            if len(out.outputs[0].token_ids) >= 2 and not live:
                live = await engine.live_requests()
                stats = await engine.engine_stats()
                engine.abort("ops")
            if out.finished:
                assert out.outputs[0].finish_reason == "abort"
        return live, stats

    live, stats = _run(run())
    assert live["ops"]["instance"] == "local" and live["ops"]["phase"] == "decode"
    assert live["ops"]["num_tokens_sent"] >= 2
    assert stats["instances"]["local"]["num_running"] == 1
    assert _run(engine.transfer_history()) == {"local": []}
    assert _run(engine.reset_prefix_cache()) is True
    assert not engine.engine.has_unfinished_requests()


def test_live_requests_count_every_sample_of_an_id_with_a_hash(engine: AsyncLLM) -> None:
    """A client's id may hold "#" (the samples' ids are "<id>#<i>"): its samples are its own,
    not those of client "a", whose samples' ids would start the same."""
    params = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True, n=2)

    async def run() -> dict[str, Any]:
        live: dict[str, Any] = {}
        other = engine.generate_async([5, 4, 3], SamplingParams(max_tokens=1), request_id="a")
        mine = engine.generate_async([9, 8, 7, 6], params, request_id="a#b")
        async with aclosing(other), aclosing(mine):
            assert (await anext(other)).finished  # its stream is still open
            async for out in mine:
                if all(len(o.token_ids) >= 2 for o in out.outputs) and not live:
                    live = await engine.live_requests()
                    engine.abort("a#b")
                    engine.abort("a")
        return live

    live = _run(run())
    assert set(live) == {"a", "a#b"} and live["a"]["num_tokens_sent"] == 0  # (it left)
    assert live["a#b"]["num_tokens_sent"] >= 4 and live["a#b"]["phase"] == "decode"


def _tokenize(serving: OpenAIServing, body: dict[str, Any]) -> dict[str, Any]:
    from pydantic import TypeAdapter

    from cluster.serving.openai_protocol import TokenizeRequest

    req = TypeAdapter(TokenizeRequest).validate_python(body)
    result: dict[str, Any] = _run(serving.tokenize(req))
    return result


def test_tokenize_gives_the_ids_a_request_would_send(serving: OpenAIServing) -> None:
    """/tokenize (vLLM's shapes): a prompt's ids are a completion's, a conversation's are a
    chat completion's (the template rendered the same way), and /detokenize gives the text
    back."""
    tok = serving.tokenizer
    text = "hello world, hello"
    body = _tokenize(serving, {"model": "tiny-chat", "prompt": text, "return_token_strs": True})
    assert body["tokens"] == tok.encode(text) and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == serving.max_model_len
    assert body["token_strs"] == [tok.id_to_token(t) for t in body["tokens"]]
    bare = _tokenize(serving, {"prompt": text, "add_special_tokens": False})
    assert bare["tokens"] == tok.encode(text, add_special_tokens=False)
    assert bare["token_strs"] is None
    messages = [{"role": "user", "content": "hi there"}]
    chat = _tokenize(serving, {"model": "tiny-chat", "messages": messages})
    job = _run(
        serving.chat_job(
            ChatCompletionRequest.model_validate({"model": "tiny-chat", "messages": messages})
        )
    )
    assert chat["tokens"] == job.prompt_ids
    no_prompt = _tokenize(serving, {"messages": messages, "add_generation_prompt": False})
    assert len(no_prompt["tokens"]) < len(chat["tokens"])
    from cluster.serving.openai_protocol import DetokenizeRequest

    back = _run(serving.detokenize(DetokenizeRequest(tokens=bare["tokens"])))
    assert back == {"prompt": text}


def test_tokenize_errors_name_what_is_wrong(serving: OpenAIServing) -> None:
    from pydantic import ValidationError

    from cluster.serving.openai_protocol import DetokenizeRequest

    with pytest.raises(APIError) as unknown:
        _tokenize(serving, {"model": "nope", "prompt": "x"})
    assert unknown.value.status == 404
    vocab = serving.tokenizer.vocab_size
    with pytest.raises(APIError) as outside:
        _run(serving.detokenize(DetokenizeRequest(tokens=[1, vocab])))
    assert outside.value.status == 400 and outside.value.param == "tokens"
    assert str(vocab) in outside.value.message
    with pytest.raises(ValidationError, match="chat_template is not supported"):
        _tokenize(serving, {"messages": [{"role": "user", "content": "x"}], "chat_template": "x"})
    long = "hello " * (serving.max_model_len * 2)  # counted whole, as vLLM does
    counted = _tokenize(serving, {"prompt": long, "add_special_tokens": False})
    assert counted["count"] > serving.max_model_len
    assert counted["tokens"] == serving.tokenizer.encode(long, add_special_tokens=False)


def test_logit_bias_is_applied_and_checked(serving: OpenAIServing) -> None:
    """OpenAI's logit_bias: +100 on a token makes greedy decoding pick it every step (what
    -100 does: tests/actors/test_sampler.py); an id outside the vocabulary is a 400 naming
    logit_bias, a bias outside [-100, 100] or a key that is no id fails validation."""
    from pydantic import ValidationError

    base = {"model": "tiny-chat", "prompt": [5, 17, 99], "max_tokens": 4, "temperature": 0}
    forced_req = CompletionRequest.model_validate({**base, "logit_bias": {"42": 100}})
    forced = _run(serving.completion(forced_req))
    assert forced["choices"][0]["text"] == serving.tokenizer.decode([42] * 4)
    vocab = serving.tokenizer.vocab_size
    with pytest.raises(APIError) as outside:
        _run(
            serving.completion(
                CompletionRequest.model_validate({**base, "logit_bias": {str(vocab): 1}})
            )
        )
    assert outside.value.status == 400 and outside.value.param == "logit_bias"
    with pytest.raises(ValidationError, match="less than or equal to 100"):
        CompletionRequest.model_validate({**base, "logit_bias": {"3": 200}})
    for key in ("the", "²", "-3", "1.5"):  # ("²" is a digit to str.isdigit, no int)
        with pytest.raises(ValidationError, match="logit_bias") as bad:
            CompletionRequest.model_validate({**base, "logit_bias": {key: 1}})
        assert "should match pattern" in str(bad.value)


SMALL_SCHEMA = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no"]}, "sure": {"type": "boolean"}},
    "required": ["answer", "sure"],
    "additionalProperties": False,
}


def test_structured_outputs_match_their_spec(serving: OpenAIServing) -> None:
    """Each way of asking -- OpenAI's response_format (json_schema, json_object), vLLM's
    structured_outputs and guided_* -- constrains the (random) model's output to the spec,
    sampled or greedy, streamed or whole, for every sample of n."""
    chat = {"model": "tiny-chat", "messages": [{"role": "user", "content": "well?"}]}
    schema_format = {
        "type": "json_schema",
        "json_schema": {"name": "verdict", "schema": SMALL_SCHEMA, "strict": True},
    }
    body = _run(
        serving.chat(
            ChatCompletionRequest.model_validate(
                {**chat, "max_tokens": 60, "n": 3, "seed": 1, "response_format": schema_format}
            )
        )
    )
    for choice in body["choices"]:
        assert choice["finish_reason"] == "stop"
        value = json.loads(choice["message"]["content"])
        assert value["answer"] in ("yes", "no") and isinstance(value["sure"], bool)
    # (Any object: a random model's strings wander, and may hold the byte that is its EOS.)
    any_object = {**chat, "max_tokens": 8, "response_format": {"type": "json_object"}}
    text = _run(serving.chat(ChatCompletionRequest.model_validate(any_object)))["choices"][0]
    assert text["message"]["content"].startswith("{")
    completion = {"model": "tiny-chat", "prompt": [5, 6, 7], "max_tokens": 60}
    for field, value, check in (
        ("guided_choice", ["red", "green"], lambda t: t in ("red", "green")),
        ("guided_regex", "[a-c]{3}-[0-9]{2}", lambda t: len(t) == 6 and t[3] == "-"),
        ("guided_grammar", 'root ::= "<" [a-z] [a-z]? ">"', lambda t: t[0] + t[-1] == "<>"),
        ("guided_json", SMALL_SCHEMA, lambda t: set(json.loads(t)) == {"answer", "sure"}),
        ("structured_outputs", {"choice": ["up", "down"]}, lambda t: t in ("up", "down")),
    ):
        req = {**completion, field: value, "temperature": 1.0, "seed": 7}
        out = _run(serving.completion(CompletionRequest.model_validate(req)))["choices"][0]
        assert out["finish_reason"] == "stop" and check(out["text"]), (field, out)
    streamed = CompletionRequest.model_validate(
        {**completion, "stream": True, "guided_regex": "[a-c]{3}-[0-9]{2}"}
    )

    async def stream() -> list[dict[str, Any]]:
        return await _drain(await serving.completion(streamed))

    chunks = _run(stream())
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert len(text) == 6 and set(text[:3]) <= set("abc") and text[4:].isdigit()


def test_structured_outputs_errors_name_the_field(serving: OpenAIServing) -> None:
    """A spec that does not compile, a shape the API does not take, or two ways of asking
    at once: a 400 naming the field, before anything is scheduled."""
    completion = {"model": "tiny-chat", "prompt": [5, 6, 7], "max_tokens": 4}
    chat = {"model": "tiny-chat", "messages": [{"role": "user", "content": "x"}]}
    cases = [
        (completion, {"guided_regex": "(a"}, "guided_regex", "invalid regex"),
        (completion, {"guided_json": '{"type": "nope"}'}, "guided_json", "invalid JSON schema"),
        (completion, {"guided_grammar": "root ::= ("}, "guided_grammar", "GBNF"),
        (
            chat,
            {"response_format": {"type": "json_schema", "json_schema": {"schema": 5}}},
            "response_format",
            "json_schema.schema",
        ),
        (chat, {"response_format": {"type": "xml"}}, "response_format", "not supported"),
        (
            completion,
            {"structured_outputs": {"structural_tag": "{}"}},
            "structured_outputs",
            "structural_tag is not supported",
        ),
        (
            completion,
            {"structured_outputs": {"regex": "a", "choice": ["b"]}},
            "structured_outputs",
            "exactly one",
        ),
        (
            chat,
            {"guided_regex": "a", "response_format": {"type": "json_object"}},
            "guided_regex",
            "asked for twice",
        ),
    ]
    for base, extra, param, words in cases:
        model = ChatCompletionRequest if "messages" in base else CompletionRequest
        req = model.model_validate({**base, **extra})
        call: Any = serving.chat if "messages" in base else serving.completion
        with pytest.raises(APIError) as refused:
            _run(call(req))
        error = refused.value
        assert error.status == 400 and error.param == param and words in error.message, extra


LOOKUP = {
    "type": "function",
    "function": {
        "name": "lookup",
        "parameters": {
            "type": "object",
            "properties": {
                "unit": {"enum": ["C", "F"]},
                "day": {"type": "integer", "minimum": 0, "maximum": 9},
            },
            "required": ["unit", "day"],
            "additionalProperties": False,
        },
    },
}
PING = {"type": "function", "function": {"name": "ping"}}


def _chat(serving: OpenAIServing, **extra: Any) -> dict[str, Any]:
    body = {"model": "tiny-chat", "messages": [{"role": "user", "content": "go"}], **extra}
    result: dict[str, Any] = _run(serving.chat(ChatCompletionRequest.model_validate(body)))
    return result


def _streamed_chat(serving: OpenAIServing, **extra: Any) -> list[dict[str, Any]]:
    body = {"model": "tiny-chat", "messages": [{"role": "user", "content": "go"}], **extra}

    async def stream() -> list[dict[str, Any]]:
        req = ChatCompletionRequest.model_validate({**body, "stream": True})
        return await _drain(await serving.chat(req))

    chunks: list[dict[str, Any]] = _run(stream())
    return chunks


def _assembled(chunks: list[dict[str, Any]]) -> tuple[str, list[dict[str, Any]], str]:
    """A client's view of a streamed choice 0: its content, its calls, its finish reason."""
    content, calls, reason = "", [], ""
    for chunk in chunks:
        for choice in chunk["choices"]:
            delta = choice["delta"]
            content += delta.get("content") or ""
            for call in delta.get("tool_calls", []):
                if call["index"] == len(calls):
                    calls.append({"id": call["id"], **call["function"]})
                else:
                    calls[call["index"]]["arguments"] += call["function"]["arguments"]
            reason = choice["finish_reason"] or reason
    return content, calls, reason


def test_forced_tool_calls_match_their_functions(serving: OpenAIServing) -> None:
    """required and a named function, on the (random) tiny model: calls to the given
    functions with arguments that match their schemas, whole and streamed alike."""
    required = _chat(
        serving, tools=[LOOKUP, PING], tool_choice="required", max_tokens=400, n=3, seed=4
    )
    for choice in required["choices"]:
        message = choice["message"]
        assert choice["finish_reason"] == "tool_calls" and message["content"] is None
        assert message["tool_calls"]
        for call in message["tool_calls"]:
            assert call["type"] == "function" and call["id"].startswith("call_")
            arguments = json.loads(call["function"]["arguments"])
            if call["function"]["name"] == "lookup":
                assert arguments["unit"] in ("C", "F") and arguments["day"] <= 9
            else:
                assert call["function"]["name"] == "ping" and isinstance(arguments, dict)
    single = _chat(
        serving, tools=[LOOKUP, PING], tool_choice="required", parallel_tool_calls=False, seed=1
    )
    assert len(single["choices"][0]["message"]["tool_calls"]) == 1
    named = {"type": "function", "function": {"name": "lookup"}}
    whole = _chat(serving, tools=[LOOKUP, PING], tool_choice=named, max_tokens=40, temperature=0)
    (call,) = whole["choices"][0]["message"]["tool_calls"]
    assert whole["choices"][0]["finish_reason"] == "stop"  # OpenAI's, for a forced function
    assert call["function"]["name"] == "lookup"
    assert set(json.loads(call["function"]["arguments"])) == {"unit", "day"}
    chunks = _streamed_chat(
        serving, tools=[LOOKUP, PING], tool_choice=named, max_tokens=40, temperature=0
    )
    content, calls, reason = _assembled(chunks)
    assert content == "" and reason == "stop"
    assert [(c["name"], c["arguments"]) for c in calls] == [
        ("lookup", call["function"]["arguments"])  # greedy: the same arguments
    ]
    forced = {"tools": [LOOKUP, PING], "tool_choice": "required", "max_tokens": 400, "seed": 9}
    chunks = _streamed_chat(serving, **forced)
    content, calls, reason = _assembled(chunks)
    whole = _chat(serving, **forced)
    expected = whole["choices"][0]["message"]["tool_calls"]
    assert reason == "tool_calls" and content == ""
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (e["function"]["name"], e["function"]["arguments"]) for e in expected
    ]


def test_auto_parses_the_models_own_format(serving: OpenAIServing) -> None:
    """auto: the output is read for Hermes-style calls (the tiny chat template has no tool
    format, so the fallback prompt asks for that one). The random model would never write a
    call, so a regex holds it to text + a call here -- the parser does the rest."""
    block = (
        r'Sure\.\n<tool_call>\n\{"name": "lookup", '
        r'"arguments": \{"unit": "C", "day": [1-9]\}\}\n</tool_call>'
    )
    whole = _chat(serving, tools=[LOOKUP], guided_regex=block, max_tokens=120, seed=3)
    choice = whole["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Sure."
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "lookup"
    assert json.loads(call["function"]["arguments"])["unit"] == "C"
    content, calls, reason = _assembled(
        _streamed_chat(serving, tools=[LOOKUP], guided_regex=block, max_tokens=120, seed=3)
    )
    assert reason == "tool_calls" and content.strip() == "Sure."
    assert calls[0]["arguments"] == call["function"]["arguments"]
    # No call in the output: plain text, finish "stop" or "length" as without tools.
    plain = _chat(serving, tools=[LOOKUP], guided_regex="[a-z]{4}", max_tokens=20)
    assert plain["choices"][0]["finish_reason"] == "stop"
    assert "tool_calls" not in plain["choices"][0]["message"]
    # Two calls written, parallel_tool_calls false: the first only (vLLM's rule).
    two = block + (
        r'\n<tool_call>\n\{"name": "lookup", "arguments": \{"unit": "F", "day": 2\}\}'
        r"\n</tool_call>"
    )
    kept = {"tools": [LOOKUP], "guided_regex": two, "max_tokens": 200, "seed": 3}
    both = _chat(serving, **kept)["choices"][0]["message"]["tool_calls"]
    assert len(both) == 2
    one = _chat(serving, parallel_tool_calls=False, **kept)["choices"][0]["message"]
    assert [c["function"]["arguments"] for c in one["tool_calls"]] == [
        both[0]["function"]["arguments"]
    ]
    _, calls, _ = _assembled(_streamed_chat(serving, parallel_tool_calls=False, **kept))
    assert [c["arguments"] for c in calls] == [both[0]["function"]["arguments"]]


def test_tools_in_the_prompt_follow_tool_choice(serving: OpenAIServing) -> None:
    """The fallback prompt carries the tools for auto (and forced calls), not for none; the
    history's calls and results reach the prompt as text."""

    def prompt(**extra: Any) -> str:
        body = {"model": "tiny-chat", "messages": [{"role": "user", "content": "go"}], **extra}
        job = _run(serving.chat_job(ChatCompletionRequest.model_validate(body)))
        return str(serving.tokenizer.decode(job.prompt_ids))

    assert "<tools>" in prompt(tools=[LOOKUP]) and '"name": "lookup"' in prompt(tools=[LOOKUP])
    assert "<tools>" not in prompt(tools=[LOOKUP], tool_choice="none")
    assert "<tools>" not in prompt()
    call = {"id": "c1", "type": "function", "function": {"name": "ping", "arguments": "{}"}}
    history = [
        {"role": "user", "content": "ping it"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "pong", "tool_call_id": "c1"},
    ]
    text = prompt(messages=history, tools=[PING])
    assert '<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>' in text
    assert "<tool_response>\npong\n</tool_response>" in text
    # /tokenize renders the same conversation the same way (clients count to truncate).
    counted = _tokenize(serving, {"messages": history, "tools": [PING]})
    body = {"model": "tiny-chat", "messages": history, "tools": [PING]}
    job = _run(serving.chat_job(ChatCompletionRequest.model_validate(body)))
    assert counted["tokens"] == job.prompt_ids
    with pytest.raises(APIError) as both:
        _chat(serving, tools=[LOOKUP], tool_choice="required", guided_regex="a")
    assert both.value.status == 400 and both.value.param == "guided_regex"


def test_echo_and_prompt_logprobs_for_loglikelihood(serving: OpenAIServing) -> None:
    """What evaluation harnesses send -- echo, max_tokens 0, logprobs -- answers the prompt
    alone with a logprob per prompt token (the first null) and no completion tokens; with
    generation, the prompt's entries come first; vLLM's prompt_logprobs gives the same
    values with ranks; streamed echo adds up to the whole answer."""
    from pydantic import ValidationError

    prompt = [5, 17, 99, 3, 42, 42, 8]
    base = {"model": "tiny-chat", "prompt": prompt, "echo": True, "logprobs": 2}
    only = _run(serving.completion(CompletionRequest.model_validate({**base, "max_tokens": 0})))
    choice = only["choices"][0]
    text = serving.tokenizer.decode(prompt, skip_special_tokens=False)
    assert choice["text"] == text and choice["finish_reason"] == "length"
    assert only["usage"]["completion_tokens"] == 0 and only["usage"]["prompt_tokens"] == 7
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == 7 and lp["token_logprobs"][0] is None
    assert lp["top_logprobs"][0] is None and all(v < 0 for v in lp["token_logprobs"][1:])
    # The 2 best and the token itself (OpenAI's and vLLM's k + 1 at most)
    for token, top in zip(lp["tokens"][1:], lp["top_logprobs"][1:], strict=True):
        assert 1 <= len(top) <= 3 and token in top
    assert lp["text_offset"] == sorted(lp["text_offset"]) and lp["text_offset"][0] == 0
    # logprobs 0: the sampled token's own entry (it was {}), whatever its rank
    sampled = {"model": "tiny-chat", "prompt": prompt, "logprobs": 0, "max_tokens": 6}
    for k, temperature in ((0, 1.0), (1, 2.0)):
        req = CompletionRequest.model_validate(
            {**sampled, "logprobs": k, "seed": 1, "temperature": temperature}
        )
        got = _run(serving.completion(req))["choices"][0]["logprobs"]
        for token, top in zip(got["tokens"], got["top_logprobs"], strict=True):
            assert token in top and len(top) <= k + 1, (k, token, top)

    generated = CompletionRequest.model_validate({**base, "max_tokens": 3, "temperature": 0})
    both = _run(serving.completion(generated))["choices"][0]
    assert both["text"].startswith(text) and len(both["logprobs"]["tokens"]) == 7 + 3
    assert both["logprobs"]["token_logprobs"][:7] == lp["token_logprobs"]

    vllm_style = {"model": "tiny-chat", "prompt": prompt, "max_tokens": 1, "prompt_logprobs": 0}
    body = _run(serving.completion(CompletionRequest.model_validate(vllm_style)))
    entries = body["choices"][0]["prompt_logprobs"]
    assert entries[0] is None and len(entries) == 7
    for position in range(1, 7):
        own = entries[position][str(prompt[position])]
        assert own["logprob"] == pytest.approx(lp["token_logprobs"][position])
        assert own["rank"] >= 1 and isinstance(own["decoded_token"], str)
    chat = {"model": "tiny-chat", "messages": [{"role": "user", "content": "hi"}]}
    chat_body = _run(
        serving.chat(ChatCompletionRequest.model_validate({**chat, "prompt_logprobs": 1}))
    )
    assert chat_body["prompt_logprobs"][0] is None and len(chat_body["prompt_logprobs"]) > 3

    async def streamed() -> list[dict[str, Any]]:
        req = CompletionRequest.model_validate({**base, "max_tokens": 3, "temperature": 0})
        req.stream = True
        return await _drain(await serving.completion(req))

    chunks = [c["choices"][0] for c in _run(streamed()) if c["choices"]]
    assert "".join(c["text"] for c in chunks) == both["text"]
    for key in ("tokens", "token_logprobs", "text_offset"):  # offsets run over the whole text
        streamed_values = [v for c in chunks if c["logprobs"] for v in c["logprobs"][key]]
        assert streamed_values == both["logprobs"][key], key
    offsets, tokens = both["logprobs"]["text_offset"], both["logprobs"]["tokens"]
    assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    # The engine computes as many as echo needs; the field shows what it asked for.
    trimmed = CompletionRequest.model_validate({**base, "max_tokens": 1, "prompt_logprobs": 0})
    entries = _run(serving.completion(trimmed))["choices"][0]["prompt_logprobs"]
    assert all(len(e) == 1 for e in entries[1:])  # the prompt's own token only
    with pytest.raises(ValidationError, match="0 only with echo"):
        CompletionRequest.model_validate({"model": "tiny-chat", "prompt": "x", "max_tokens": 0})
    with pytest.raises(ValidationError, match="not available when stream"):
        CompletionRequest.model_validate({**vllm_style, "stream": True, "prompt_logprobs": 1})


def test_the_engine_serves_one_event_loop_after_another(engine: AsyncLLM) -> None:
    """Each ``asyncio.run`` is a new event loop: requests that wait for the engine in one
    (another's step holds it) and then in the next are served -- the engine's lock, bound
    to the first loop that waited on it, refused every later one's waits."""

    async def last(gen: Any) -> Any:
        outs = [out async for out in gen]
        return outs[-1]

    async def two_at_once(i: int) -> list[Any]:
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        a = engine.generate_async([5, 4, 3], params, request_id=f"loop{i}-a")
        first = await anext(a)  # the engine steps now: b's submit waits for a step
        b = engine.generate_async([5, 4, 3, 2], params, request_id=f"loop{i}-b")
        outs = list(await asyncio.gather(last(a), last(b)))
        return [first, *outs]

    for i in range(3):
        first, a, b = _run(two_at_once(i))
        assert len(first.outputs[0].token_ids) + len(a.outputs[0].token_ids) >= 12
        assert len(b.outputs[0].token_ids) == 12


def test_an_event_loop_that_ends_with_a_stream_open_leaves_the_engine_serving(
    engine: AsyncLLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An ``asyncio.run`` ends while a stream of it is still open (held, or left without
    ``aclose``): the loop's shutdown closes it, its abort starts a step as the loop's executor
    shuts down -- which failed, and was taken for the engine's own failure (every later
    request got EngineDeadError); or the step task was left in the closed loop, never to
    run again, and the next loop's requests hung. (Here an abort leaves the scheduler a few
    steps of work, as blocks that wait for a KV send would.)"""
    core, scheduler = engine.engine, engine.engine.scheduler
    abort, holds = core.abort_request, scheduler.has_requests
    steps_left = [0]

    def abort_request(ids: Any) -> None:
        abort(ids)
        steps_left[0] = 3

    def has_requests() -> bool:
        steps_left[0] -= 1
        return holds() or steps_left[0] >= 0

    monkeypatch.setattr(core, "abort_request", abort_request)
    monkeypatch.setattr(scheduler, "has_requests", has_requests)
    params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    kept: list[Any] = []

    async def leave_open(i: int) -> None:
        stream = engine.generate_async([5, 4, 3], params, request_id=f"open{i}")
        await anext(stream)
        kept.append(stream)  # still referenced when the loop shuts down

    for i in range(6):
        asyncio.run(leave_open(i))
        assert engine._failure is None
    kept.clear()

    async def whole() -> Any:
        short = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        outs = [out async for out in engine.generate_async([7, 8], short, request_id="after")]
        return outs[-1]

    assert len(_run(whole()).outputs[0].token_ids) == 4
    assert not engine.engine.has_unfinished_requests()  # the open streams' aborts applied


def test_an_id_is_free_again_as_soon_as_its_stream_is_left(engine: AsyncLLM) -> None:
    """A stream left early and a new request of the same id at once, before the engine's
    next step: vLLM's abort frees the id at once; here it was "in use" until that step."""
    params = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)

    async def main() -> Any:
        stream = engine.generate_async([5, 4, 3], params, request_id="again")
        await anext(stream)
        await stream.aclose()  # its abort waits for the next step
        short = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
        outs = [out async for out in engine.generate_async([6, 7], short, request_id="again")]
        return outs[-1]

    final = _run(main())
    assert final.finished and len(final.outputs[0].token_ids) == 3
    assert not engine.engine.has_unfinished_requests()


def test_chat_template_kwargs_override_the_requests_own_settings(serving: OpenAIServing) -> None:
    """``chat_template_kwargs`` naming what the renderer sets itself (add_generation_prompt,
    bos_token) override it, as in vLLM -- they were a 400 ("multiple values")."""
    messages = [{"role": "user", "content": "hi"}]

    def prompt(**fields: Any) -> list[int]:
        body = {"model": "tiny-chat", "messages": messages, **fields}
        job = _run(serving.chat_job(ChatCompletionRequest.model_validate(body)))
        return list(job.prompt_ids)

    plain = prompt(add_generation_prompt=False)
    assert plain != prompt()
    assert prompt(chat_template_kwargs={"add_generation_prompt": False}) == plain
    assert prompt(chat_template_kwargs={"bos_token": "", "eos_token": ""})  # rendered


def test_a_priority_needs_priority_scheduling(serving: OpenAIServing, model_dir: Path) -> None:
    """Under ``policy: fcfs`` a request's priority is refused with a 400 naming it, as vLLM
    refuses it (it was accepted and ignored); under ``policy: priority`` it is served."""
    body = {"model": "tiny-chat", "prompt": [5, 6, 7], "max_tokens": 2, "priority": 3}
    with pytest.raises(APIError) as refused:
        _run(serving.completion(CompletionRequest.model_validate(body)))
    assert refused.value.status == 400 and refused.value.param == "priority"
    with pytest.raises(ValueError, match="priority scheduling"):
        LLM(str(model_dir), **ENGINE).generate([5, 6], SamplingParams(max_tokens=1), priority=[1])
    ordered = AsyncLLM.from_config(
        str(model_dir), model_name="tiny-chat", **{**ENGINE, "policy": "priority"}
    )
    served = _run(
        OpenAIServing(ordered, "tiny-chat").completion(CompletionRequest.model_validate(body))
    )
    assert served["usage"]["completion_tokens"] == 2


def test_a_stream_refused_at_its_first_output_is_an_error_status(engine: AsyncLLM) -> None:
    """A request the cluster fails before any output (a rejection, a failed admission: its
    first output is a failed sample) gets the status a whole response would, as vLLM: not a
    200 stream holding one error event."""
    serving = OpenAIServing(_Failing(engine, 0, None), "tiny-chat")  # type: ignore[arg-type]
    for body in (
        {"prompt": [7, 8, 9], "max_tokens": 20, "stream": True},
        {"prompt": [[7, 8, 9], [4, 5]], "max_tokens": 20, "stream": True},  # both stop
    ):
        req = CompletionRequest.model_validate({"model": "tiny-chat", **body})

        async def refused(req: CompletionRequest) -> BaseException:
            try:
                await serving.completion(req)
            except Exception as exc:
                await _idle(engine)
                return exc
            raise AssertionError("a stream began")

        error = _run(refused(req))
        assert isinstance(error, APIError)
        assert error.status == 503 and "remote KV load failed" in error.message


class _Adapters:
    """The in-process engine serving adapter ``a`` (by name only), its unload raising
    ``unload_error``."""

    def __init__(self, engine: AsyncLLM, unload_error: BaseException) -> None:
        self.engine, self.unload_error = engine, unload_error

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    async def lora_adapters(self) -> dict[str, Any]:
        return {"a": object()}

    async def unload_lora_adapter(self, name: str) -> None:
        raise self.unload_error


def test_adapter_errors_name_their_field_and_only_a_missing_one_is_a_404(
    engine: AsyncLLM,
) -> None:
    """As vLLM: loading a name already served is a 400 naming ``lora_name`` (not its path);
    unloading one not served is a 404, but a cluster that cannot be asked is a 503, not a
    404 saying the adapter is missing."""
    import ray.exceptions

    from cluster.serving.openai_protocol import (
        LoadLoRAAdapterRequest,
        ScalePoolRequest,
        UnloadLoRAAdapterRequest,
    )

    def error(serving: OpenAIServing, call: Any) -> APIError:
        try:
            _run(call)
        except APIError as exc:
            return exc
        raise AssertionError("no error")

    serving = OpenAIServing(_Adapters(engine, KeyError("b")), "tiny-chat")  # type: ignore[arg-type]
    load = LoadLoRAAdapterRequest(lora_name="a", lora_path="/elsewhere")
    duplicate = error(serving, serving.load_lora_adapter(load))
    assert (duplicate.status, duplicate.param) == (400, "lora_name")
    assert "already been loaded" in duplicate.message
    missing = error(serving, serving.unload_lora_adapter(UnloadLoRAAdapterRequest(lora_name="b")))
    assert (missing.status, missing.param) == (404, "lora_name")
    away = OpenAIServing(
        _Adapters(engine, ray.exceptions.ActorDiedError()),  # type: ignore[arg-type]
        "tiny-chat",
    )
    died = error(away, away.unload_lora_adapter(UnloadLoRAAdapterRequest(lora_name="a")))
    assert died.status == 503

    class _Away(_Adapters):
        async def lora_adapters(self) -> dict[str, Any]:
            raise ray.exceptions.ActorDiedError()

        async def metrics_text(self) -> str:
            raise ray.exceptions.ActorDiedError()

        async def scale_pool(self, pool: str, replicas: int) -> dict[str, Any]:
            raise ray.exceptions.ActorDiedError()

    gone = OpenAIServing(_Away(engine, KeyError("a")), "tiny-chat")  # type: ignore[arg-type]
    assert error(gone, gone.load_lora_adapter(load)).status == 503
    # Naming an adapter, or listing the models, asks the cluster too: a 503 (it was a 500).
    by_adapter = CompletionRequest(model="a", prompt="x", max_tokens=1)
    assert error(gone, gone.completion(by_adapter)).status == 503
    assert error(gone, gone.models()).status == 503
    # So do a scrape and a resize (they were 500s, a traceback logged at every scrape).
    assert error(gone, gone.metrics()).status == 503
    resize = ScalePoolRequest(pool="d", replicas=2)
    assert error(gone, gone.scale_pool(resize)).status == 503


def test_a_stream_that_fails_midway_ends_its_span_as_an_error(engine: AsyncLLM) -> None:
    """The stream says so in an event and ends normally; its ingress span still ends as
    the error (status, type), or error-rate queries miss every failure after the 200."""
    from opentelemetry.trace import StatusCode

    tracer, exporter = _traced()
    failing = _Failing(engine, 2, None)
    serving = OpenAIServing(failing, "tiny-chat", tracer=tracer)  # type: ignore[arg-type]
    assert "error" in _streamed(serving, engine)[-1]
    (span,) = exporter.get_finished_spans()  # the ingress's (the engine here traces none)
    assert span.status.status_code == StatusCode.ERROR
    assert span.attributes["http.response.status_code"] == 503


class _CallContext:
    """What ``generate_stream`` reads and sets of a gRPC call's context."""

    def __init__(self, metadata: dict[str, str]) -> None:
        self.metadata, self.code, self.details = metadata, None, None

    def invocation_metadata(self) -> list[tuple[str, str]]:
        return list(self.metadata.items())

    def set_code(self, code: Any) -> None:
        self.code = code

    def set_details(self, details: str) -> None:
        self.details = details


def test_a_grpc_call_is_an_ingress_span_in_its_callers_trace(engine: AsyncLLM) -> None:
    """As an HTTP request: the call's ``traceparent`` is its span's parent, and the span
    says what the call produced; a call that fails ends its span as the error."""
    from opentelemetry.trace import StatusCode

    from cluster.proto import tandem_pb2
    from cluster.serving.grpc_api import generate_stream

    tracer, exporter = _traced()
    serving = OpenAIServing(engine, "tiny-chat", tracer=tracer)

    async def connect() -> OpenAIServing:
        return serving

    trace_id, parent = "ab" * 16, "cd" * 8
    context = _CallContext({"traceparent": f"00-{trace_id}-{parent}-01"})
    good = tandem_pb2.GenerateRequest(prompt_token_ids=[7, 8, 9], max_tokens=3)
    bad = tandem_pb2.GenerateRequest(prompt_token_ids=[7, 8, 9], max_tokens=3, model="nope")

    async def call(message: Any) -> list[Any]:
        async with aclosing(generate_stream(connect, None, message, context)) as stream:
            return [r async for r in stream]

    responses = _run(call(good))
    assert responses[-1].usage.completion_tokens == 3
    with pytest.raises(APIError):
        _run(call(bad))
    ok, failed = exporter.get_finished_spans()
    assert format(ok.context.trace_id, "032x") == trace_id
    assert ok.parent is not None and format(ok.parent.span_id, "016x") == parent
    assert ok.attributes["gen_ai.usage.output_tokens"] == 3
    assert tuple(ok.attributes["gen_ai.response.finish_reasons"]) == ("length",)
    assert failed.status.status_code == StatusCode.ERROR
    assert failed.attributes["http.response.status_code"] == 404


def test_a_grpc_call_without_a_model_is_traced_as_the_served_model(engine: AsyncLLM) -> None:
    """proto3 has no unset string: a call that leaves ``model`` out is for the served model,
    and its span says so, as an HTTP request's does (it was "text_completion None", without
    gen_ai.request.model: what is grouped by model missed every such gRPC call)."""
    from cluster.proto import tandem_pb2
    from cluster.serving.grpc_api import generate_stream

    tracer, exporter = _traced()
    serving = OpenAIServing(engine, "tiny-chat", tracer=tracer)

    async def connect() -> OpenAIServing:
        return serving

    message = tandem_pb2.GenerateRequest(prompt_token_ids=[7, 8, 9], max_tokens=2, ignore_eos=True)

    async def call() -> list[Any]:
        async with aclosing(generate_stream(connect, None, message, _CallContext({}))) as stream:
            return [r async for r in stream]

    assert _run(call())[-1].usage.completion_tokens == 2
    (span,) = exporter.get_finished_spans()
    assert span.name == "text_completion tiny-chat"
    assert span.attributes["gen_ai.request.model"] == "tiny-chat"


def test_add_special_tokens_is_vllms(
    serving: OpenAIServing, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's field: a completion's text prompt gets the tokenizer's BOS unless it is off; a
    chat's rendered template gets none unless it is on (the template writes its own)."""
    from tokenizers.processors import TemplateProcessing

    bos = 1  # the tiny byte tokenizer adds none: this one's post-processor, as Llama's
    backend = serving.tokenizer.backend
    processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    monkeypatch.setattr(backend, "post_processor", processor)

    def completion_ids(**extra: Any) -> list[int]:
        body = {"model": "tiny-chat", "prompt": "hello there", **extra}
        req = CompletionRequest.model_validate(body)
        (job,) = _run(serving.completion_jobs(req))
        return list(job.prompt_ids)

    def chat_ids(**extra: Any) -> list[int]:
        messages = [{"role": "user", "content": "hello there"}]
        req = ChatCompletionRequest.model_validate(
            {"model": "tiny-chat", "messages": messages, "chat_template_kwargs": {"bos_token": ""}}
            | extra
        )
        return list(_run(serving.chat_job(req)).prompt_ids)

    with_bos, without = completion_ids(), completion_ids(add_special_tokens=False)
    assert with_bos[0] == bos and with_bos[1:] == without and without[0] != bos
    plain, added = chat_ids(), chat_ids(add_special_tokens=True)
    assert plain[0] != bos and added == [bos, *plain]


def test_chat_logprobs_bytes_are_each_tokens_own(serving: OpenAIServing) -> None:
    """The OpenAI API's ``bytes``: joined over a reply's tokens they give its text back. A
    token holding part of a character (an emoji is several byte-level tokens) has its own
    bytes, not those of the U+FFFD it decodes to alone."""
    from cluster.serving.openai_responses import chat_logprobs

    tokenizer = serving.tokenizer
    text = "ok 😀 é"
    ids = tokenizer.encode(text, add_special_tokens=False)
    logprobs = [{tid: -0.5, (tid + 1) % 200: -1.5} for tid in ids]
    content = chat_logprobs(tokenizer, ids, logprobs, 1)
    assert any(entry["token"] == "\ufffd" for entry in content)  # parts of the emoji
    assert bytes(b for entry in content for b in entry["bytes"]).decode() == text
    for entry in content:
        (top,) = entry["top_logprobs"]
        assert top["bytes"] == entry["bytes"]  # the token itself is its best here


def test_an_adapter_that_cannot_be_loaded_is_a_400_naming_lora_path(
    model_dir: Path, tmp_path: Path
) -> None:
    """As on a cluster (and in vLLM): a path with no adapter is the caller's error, a 400
    naming ``lora_path`` -- in process the loader's FileNotFoundError made it a 500."""
    from cluster.serving.openai_protocol import LoadLoRAAdapterRequest

    llm = AsyncLLM.from_config(str(model_dir), enable_lora=True, **ENGINE)
    serving = OpenAIServing(llm, "tiny-chat")
    body = LoadLoRAAdapterRequest(lora_name="a", lora_path=str(tmp_path / "none"))
    with pytest.raises(APIError) as caught:
        _run(serving.load_lora_adapter(body))
    assert (caught.value.status, caught.value.param) == (400, "lora_path")
    assert "could not be loaded" in caught.value.message
    assert _run(llm.lora_adapters()) == {}  # not served


def test_a_request_on_a_serving_closed_under_it_is_a_503(engine: AsyncLLM) -> None:
    """The ingress lets go of a serving whose cluster is gone (its health check) while
    requests may still use it: theirs are 503s to retry -- a closed thread pool made them
    500s ("cannot schedule new futures after shutdown")."""
    serving = OpenAIServing(engine, "tiny-chat")
    serving.close()
    request = CompletionRequest(model="tiny-chat", prompt="x", max_tokens=1)
    with pytest.raises(APIError) as caught:
        _run(serving.completion(request))
    assert caught.value.status == 503


def test_an_adapter_its_instance_cannot_load_is_the_clients_error_naming_it() -> None:
    """A worker's error loading the adapter a request names becomes a 404 (its files are not
    on that node, as vLLM's "No adapter found") or a 400 (the model cannot take it), naming
    the adapter but not its path, and crossing Ray intact; a dead worker stays a 503."""
    import pickle

    import ray.exceptions

    from cluster.control.adapters import LoRAAdapters
    from cluster.errors import AdapterLoadError
    from scheduler import LoRARequest

    lora = LoRARequest(lora_name="b", lora_int_id=2, lora_path="/nowhere/b")
    gone = LoRAAdapters.request_error(lora, "d-1", FileNotFoundError("/nowhere/b: no config"))
    unfit = LoRAAdapters.request_error(lora, "d-1", ValueError("rank 64 > max_lora_rank 16"))
    for exc, status in ((gone, 404), (unfit, 400)):
        assert isinstance(exc, AdapterLoadError)
        error = api_error(pickle.loads(pickle.dumps(exc)))
        assert (error.status, error.param) == (status, "model")
        assert "`b`" in error.message and "d-1" in error.message
        assert "/nowhere" not in error.message
    dead = ray.exceptions.ActorDiedError()
    assert LoRAAdapters.request_error(lora, "d-1", dead) is dead
    assert api_error(dead).status == 503
    # Files the worker may not read there: another node may (a 404 if none can), not a 500.
    denied = LoRAAdapters.request_error(lora, "d-1", PermissionError(13, "Permission denied"))
    assert isinstance(denied, AdapterLoadError) and denied.missing
    assert api_error(denied).status == 404


# -- the Responses API: an adapter over chat completions (serving/responses_api.py) -----------
def _flat(tool: dict[str, Any]) -> dict[str, Any]:
    """A chat tool in the Responses API's flat form."""
    return {"type": "function", **tool["function"]}


def _response(serving: OpenAIServing, **body: Any) -> dict[str, Any]:
    req = ResponsesRequest.model_validate({"model": "tiny-chat", **body})
    result: dict[str, Any] = _run(create_response(serving, req))
    return result


def _response_events(serving: OpenAIServing, **body: Any) -> list[dict[str, Any]]:
    """A streamed response's events (each ``event:`` line names its data's type)."""
    req = ResponsesRequest.model_validate({"model": "tiny-chat", "stream": True, **body})

    async def stream() -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        result: Any = await create_response(serving, req)
        async with aclosing(result) as blocks:
            async for block in blocks:
                kind, data = block.removesuffix("\n\n").split("\n")
                event = json.loads(data.removeprefix("data: "))
                assert kind == f"event: {event['type']}"
                events.append(event)
        return events

    events: list[dict[str, Any]] = _run(stream())
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


def test_a_response_is_its_chat_completion_as_output_items(serving: OpenAIServing) -> None:
    """Text in, a message item out: the chat completion's text and usage; cut by
    max_output_tokens it is incomplete; instructions are a system message first;
    text.format holds the output to a schema (then it completes)."""
    body = _response(serving, input="hello there", max_output_tokens=8, temperature=0)
    chat = _chat(
        serving,
        messages=[{"role": "user", "content": "hello there"}],
        max_completion_tokens=8,
        temperature=0,
    )
    assert body["object"] == "response" and body["id"].startswith("resp_")
    (item,) = body["output"]
    assert item["type"] == "message" and item["role"] == "assistant"
    assert item["id"].startswith("msg_")
    text = chat["choices"][0]["message"]["content"]
    assert item["content"] == [{"type": "output_text", "text": text, "annotations": []}]
    cut = chat["choices"][0]["finish_reason"] == "length"
    assert body["status"] == ("incomplete" if cut else "completed")
    usage = body["usage"]
    assert usage["input_tokens"] == chat["usage"]["prompt_tokens"]
    assert usage["output_tokens"] == chat["usage"]["completion_tokens"]
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    assert usage["output_tokens_details"] == {"reasoning_tokens": 0}
    assert body["max_output_tokens"] == 8 and body["temperature"] == 0
    assert body["store"] is False and body["previous_response_id"] is None
    assert body["error"] is None and body["tools"] == [] and body["tool_choice"] == "auto"
    req = ResponsesRequest.model_validate({"input": "hi", "instructions": "be brief"})
    messages = req.chat_request().messages
    assert [(m.role, m.content) for m in messages] == [("system", "be brief"), ("user", "hi")]
    verdict = {"type": "json_schema", "name": "verdict", "schema": SMALL_SCHEMA, "strict": True}
    held = _response(
        serving, input="well?", max_output_tokens=60, temperature=0, text={"format": verdict}
    )
    assert held["status"] == "completed" and held["incomplete_details"] is None
    value = json.loads(held["output"][0]["content"][0]["text"])
    assert value["answer"] in ("yes", "no") and isinstance(value["sure"], bool)
    assert held["text"] == {"format": verdict}


def test_a_response_cut_by_max_output_tokens_is_incomplete(serving: OpenAIServing) -> None:
    """A schema's object cannot end in 3 tokens: the output is cut by max_output_tokens,
    whole and streamed alike."""
    verdict = {"type": "json_schema", "name": "verdict", "schema": SMALL_SCHEMA}
    fields = {"input": "well?", "max_output_tokens": 3, "text": {"format": verdict}}
    body = _response(serving, **fields)
    assert body["status"] == "incomplete"
    assert body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert body["usage"]["output_tokens"] == 3
    assert body["output"][-1]["status"] == "incomplete"
    events = _response_events(serving, **fields)
    # (response.completed, its status incomplete: the openai SDK's stream helper finalizes
    # on that event alone)
    assert events[-1]["type"] == "response.completed"
    final = events[-1]["response"]
    assert final["status"] == "incomplete" and final["usage"]["output_tokens"] == 3
    assert final["incomplete_details"] == {"reason": "max_output_tokens"}


def test_a_streamed_response_sends_openais_events_in_order(serving: OpenAIServing) -> None:
    """created, in_progress, the message item added, its text part added, the text's deltas,
    then each done, then the whole response: what the response would be whole."""
    fields = {"input": "hello there", "max_output_tokens": 8, "temperature": 0}
    whole = _response(serving, **fields)
    events = _response_events(serving, **fields)
    text = whole["output"][0]["content"][0]["text"]
    deltas = [e["delta"] for e in events if e["type"] == "response.output_text.delta"]
    final = "response.completed"
    assert [e["type"] for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * len(deltas),
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        final,
    ]
    assert "".join(deltas) == text and bool(deltas) == bool(text)
    created = events[0]["response"]
    assert created["status"] == "in_progress" and created["output"] == []
    item_id = events[2]["item"]["id"]
    assert {e["item_id"] for e in events if "item_id" in e} == {item_id}
    assert events[-2]["item"]["content"][0]["text"] == text
    done = events[-1]["response"]
    assert done["id"] == created["id"] and done["status"] == whole["status"]
    (item,) = done["output"]
    assert item["id"] == item_id and item["content"] == whole["output"][0]["content"]
    assert done["usage"]["output_tokens"] == whole["usage"]["output_tokens"]


@pytest.mark.parametrize("failure", FAILURES)
def test_a_response_stream_that_fails_midway_ends_with_response_failed(
    engine: AsyncLLM, failure: str
) -> None:
    """After the 200 went out, a failure is an ``error`` event, then ``response.failed``
    (its ``error`` saying why, what was output so far), never ``response.completed``; the
    request is gone from the engine."""
    exc, status, message = FAILURES[failure]
    serving = OpenAIServing(_Failing(engine, 2, exc), "tiny-chat")  # type: ignore[arg-type]
    req = ResponsesRequest.model_validate(
        {"model": "tiny-chat", "stream": True, "input": "hello there", "max_output_tokens": 20}
    )

    async def stream() -> list[dict[str, Any]]:
        result: Any = await create_response(serving, req)
        async with aclosing(result) as blocks:
            events = [
                json.loads(block.split("\n")[1].removeprefix("data: ")) async for block in blocks
            ]
        await _idle(engine)
        return events

    events: list[dict[str, Any]] = _run(stream())
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert "response.completed" not in [e["type"] for e in events]
    error, failed = events[-2:]
    assert error["type"] == "error" and error["code"] == str(status)
    assert message in error["message"]
    assert failed["type"] == "response.failed"
    response = failed["response"]
    assert response["id"] == events[0]["response"]["id"] and response["status"] == "failed"
    assert response["error"] == {"code": "server_error", "message": error["message"]}
    added = [e["item"]["id"] for e in events if e["type"] == "response.output_item.added"]
    assert [item["id"] for item in response["output"]] == added


def test_a_response_stream_closed_early_aborts_its_request(
    serving: OpenAIServing, engine: AsyncLLM
) -> None:
    """The client leaves a streamed response -- before its first byte, or after a few
    events: closing the event stream closes the chat stream under it, which aborts the
    request at once (not when the collector finds the stream)."""

    async def leave(read: int) -> None:
        req = ResponsesRequest.model_validate(
            {"model": "tiny-chat", "stream": True, "input": "hello there", "max_output_tokens": 200}
        )
        events: Any = await create_response(serving, req)
        assert engine.engine.has_unfinished_requests()
        for _ in range(read):
            await events.__anext__()
        await events.aclose()
        assert engine._aborts  # with the stream still held: not left to the collector
        await _idle(engine)
        del events

    _run(leave(0))
    _run(leave(3))  # (created, in_progress, then one read from the chat stream)


def test_input_items_map_to_chat_messages() -> None:
    """An assistant message and the calls after it are one assistant message (its text, then
    its tool_calls in order); each function_call_output is a tool message answering its
    call_id; a call after a tool result starts a new assistant message."""
    lookup = "lookup"
    parts = {"type": "input_text", "text": "21"}  # (an output may be text parts)
    items: list[dict[str, Any]] = [
        {"role": "user", "content": "Oslo and Rome?"},
        {
            "type": "message",
            "role": "assistant",
            "id": "msg_1",
            "status": "completed",
            "content": [{"type": "output_text", "text": "Checking.", "annotations": []}],
        },
        {"type": "function_call", "id": "fc_1", "call_id": "c1", "name": lookup, "arguments": "1"},
        {"type": "function_call", "id": "fc_2", "call_id": "c2", "name": lookup, "arguments": "2"},
        {"type": "function_call_output", "call_id": "c1", "output": "-3"},
        {"type": "function_call_output", "call_id": "c2", "output": [parts]},
        {"type": "function_call", "call_id": "c3", "name": "ping", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c3", "output": "pong"},
    ]
    req = ResponsesRequest.model_validate(
        {"model": "tiny-chat", "instructions": "be brief", "input": items}
    )
    messages = req.chat_request().messages
    roles = ["system", "user", "assistant", "tool", "tool", "assistant", "tool"]
    assert [m.role for m in messages] == roles
    first = messages[2]
    assert first.content == "Checking."
    calls = [(c.id, c.function.name, c.function.arguments) for c in first.tool_calls or []]
    assert calls == [("c1", lookup, "1"), ("c2", lookup, "2")]
    assert [(m.tool_call_id, m.content) for m in messages[3:5]] == [("c1", "-3"), ("c2", "21")]
    assert messages[5].content is None
    assert [c.id for c in messages[5].tool_calls or []] == ["c3"]
    assert (messages[6].tool_call_id, messages[6].content) == ("c3", "pong")


def test_a_function_call_round_trip(serving: OpenAIServing) -> None:
    """A named function: a function_call item (streamed, its arguments as deltas); sent back
    as input items with its output, the call and its result reach the prompt as chat's
    tool history does."""
    tools = [_flat(LOOKUP), _flat(PING)]
    choice = {"type": "function", "name": "lookup"}
    fields = {"input": "go", "tools": tools, "tool_choice": choice, "max_output_tokens": 40}
    body = _response(serving, temperature=0, **fields)
    (call,) = body["output"]
    assert call["type"] == "function_call" and call["name"] == "lookup"
    assert call["id"].startswith("fc_") and call["call_id"].startswith("call_")
    assert call["status"] == "completed" and body["status"] == "completed"
    assert set(json.loads(call["arguments"])) == {"unit", "day"}
    assert body["tool_choice"] == choice
    assert [t["name"] for t in body["tools"]] == ["lookup", "ping"]
    events = _response_events(serving, temperature=0, **fields)
    pieces = [e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"]
    assert [e["type"] for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        *["response.function_call_arguments.delta"] * len(pieces),
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    added = events[2]["item"]
    assert (added["type"], added["name"], added["arguments"]) == ("function_call", "lookup", "")
    assert "".join(pieces) == events[-3]["arguments"] == call["arguments"]  # greedy: the same
    # (OpenAI's done event names the function too: clients generated from its spec need it)
    assert events[-3]["name"] == "lookup" and events[-3]["item_id"] == added["id"]
    follow_up = [
        {"role": "user", "content": [{"type": "input_text", "text": "go"}]},
        call,  # as it came back (its id and status too)
        {"type": "function_call_output", "call_id": call["call_id"], "output": "sunny"},
    ]
    req = ResponsesRequest.model_validate(
        {"model": "tiny-chat", "input": follow_up, "tools": tools, "max_output_tokens": 4}
    )
    user, assistant, result = req.chat_request().messages
    assert (user.role, assistant.role, result.role) == ("user", "assistant", "tool")
    assert [c.id for c in assistant.tool_calls or []] == [call["call_id"]]
    assert result.tool_call_id == call["call_id"] and result.content == "sunny"
    job = _run(serving.chat_job(req.chat_request()))
    prompt = str(serving.tokenizer.decode(job.prompt_ids))
    assert '<tool_call>\n{"name": "lookup", "arguments": ' in prompt
    assert "<tool_response>\nsunny\n</tool_response>" in prompt
    answer = _run(create_response(serving, req))
    assert answer["output"] and answer["usage"]["input_tokens"] == len(job.prompt_ids)
