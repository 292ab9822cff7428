"""The API's sampling defaults from the model's ``generation_config.json`` (vLLM's
``--generation-config auto``): applied to the fields a request leaves unset, never over what it
asks; ``max_new_tokens`` caps the default ``max_tokens``; ``vllm`` turns them off."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from cluster.engine.async_llm import AsyncLLM
from cluster.engine.generation_config import sampling_defaults
from cluster.serving.errors import APIError
from cluster.serving.openai_protocol import ChatCompletionRequest, CompletionRequest
from cluster.serving.openai_serving import OpenAIServing
from tests.actors.conftest import make_checkpoint
from tests.cluster.conftest import CHAT_TEMPLATE

MODEL_GENERATION = {
    "temperature": 0.6,
    "top_p": 0.9,
    "top_k": 20,
    "repetition_penalty": 1.1,
    "max_new_tokens": 7,
    "do_sample": True,  # (not a sampling default vLLM reads)
    "eos_token_id": 2,
}


def test_the_models_file_gives_the_defaults_by_request_field(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text(json.dumps(MODEL_GENERATION))
    expected = {
        "temperature": 0.6,
        "top_p": 0.9,
        "top_k": 20,
        "repetition_penalty": 1.1,
        "max_tokens": 7,
    }
    assert sampling_defaults("auto", tmp_path) == expected
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    assert sampling_defaults("auto", gguf) == expected  # the file beside a GGUF model
    assert sampling_defaults("vllm", tmp_path) == {}
    assert sampling_defaults(str(tmp_path), None) == expected  # a folder named in the config
    assert sampling_defaults("auto", tmp_path / "sub") == {}  # none: vLLM's usual defaults
    with pytest.raises(FileNotFoundError, match="generation_config"):
        sampling_defaults(str(tmp_path / "sub"), None)
    (tmp_path / "generation_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot be read"):
        sampling_defaults("auto", tmp_path)


def test_the_defaults_fill_only_what_the_request_leaves_unset() -> None:
    defaults = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.1}
    unset = CompletionRequest.model_validate({"model": "m", "prompt": "x"})
    params = unset.sampling_params(16, None, None, defaults)
    assert (params.temperature, params.top_p, params.top_k) == (0.6, 0.9, 20)
    assert params.repetition_penalty == 1.1 and params.min_p == 0.0
    given = CompletionRequest.model_validate(
        {"model": "m", "prompt": "x", "temperature": 0, "top_p": 1.0, "top_k": -1}
    )
    params = given.sampling_params(16, None, None, defaults)
    assert (params.temperature, params.top_p, params.top_k) == (0.0, 1.0, -1)
    assert params.repetition_penalty == 1.1
    plain = unset.sampling_params(16, None)  # no defaults: the usual ones
    assert (plain.temperature, plain.top_p, plain.top_k) == (1.0, 1.0, 0)


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> AsyncLLM:
    path = tmp_path_factory.mktemp("generation-config") / "tiny-chat"
    make_checkpoint(path, "llama", max_position_embeddings=256)
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))
    config = {"dtype": "float32", "block_size": 4, "num_blocks": 128, "progress": False}
    return AsyncLLM.from_config(str(path), model_name="tiny-chat", **config)


def _chat(serving: OpenAIServing, **fields: Any) -> Any:
    body = {
        "model": "tiny-chat",
        "messages": [{"role": "user", "content": "hi"}],
        "ignore_eos": True,
        **fields,
    }
    call = serving.chat(ChatCompletionRequest.model_validate(body))
    return asyncio.run(asyncio.wait_for(call, 60))


def test_max_new_tokens_caps_the_length(engine: AsyncLLM) -> None:
    """As vLLM: the smallest of the request's max_tokens, the room left and the model's
    max_new_tokens."""
    serving = OpenAIServing(engine, "tiny-chat", sampling_defaults={"max_tokens": 7})
    out = _chat(serving, temperature=0)
    assert out["usage"]["completion_tokens"] == 7
    assert out["choices"][0]["finish_reason"] == "length"
    assert _chat(serving, temperature=0, max_tokens=3)["usage"]["completion_tokens"] == 3
    assert _chat(serving, temperature=0, max_tokens=30)["usage"]["completion_tokens"] == 7
    with pytest.raises(APIError) as error:
        _chat(serving, temperature=0, min_tokens=9)
    assert error.value.param == "min_tokens" and "max_new_tokens (7)" in error.value.message
    plain = OpenAIServing(engine, "tiny-chat")  # no defaults: the room left in the context
    assert _chat(plain, temperature=0)["usage"]["completion_tokens"] > 7


def test_values_the_scheduler_would_refuse_are_ignored(tmp_path: Path) -> None:
    bad = {"temperature": -1, "top_p": 0, "max_new_tokens": 0, "top_k": 40, "min_p": "x"}
    (tmp_path / "generation_config.json").write_text(json.dumps(bad))
    assert sampling_defaults("auto", tmp_path) == {"top_k": 40}


def _ingress(setting: str, model: Path | None = None) -> Any:
    from cluster.config import ClusterConfig
    from cluster.serving.app import OpenAIIngress

    config = ClusterConfig.model_validate(
        {"pools": [{"name": "c", "role": "both"}], "serve": {"generation_config": setting}}
    )

    class Remote:  # a Serve handle's and a Ray actor's method: ``await x.remote()``
        def __init__(self, value: Any) -> None:
            self.value = value

        async def remote(self) -> Any:
            return self.value

    actor = type("Actor", (), {"model_info": Remote({"model_path": str(model)})})()
    cluster = type("Cluster", (), {"scheduler": Remote(actor)})()
    ingress_class = OpenAIIngress.func_or_class  # (Serve's ingress: its __init__ is async)
    ingress = ingress_class.__new__(ingress_class)
    asyncio.run(ingress_class.__init__(ingress, cluster, config))
    return ingress


# Serve's ingress wrapper has an async __del__ (run by Serve on a replica's shutdown).
QUIET_DEL = pytest.mark.filterwarnings("ignore:coroutine .*ASGIIngressWrapper.__del__")


@QUIET_DEL
def test_a_generation_config_folder_without_the_file_stops_the_start(tmp_path: Path) -> None:
    """A folder given for ``serve.generation_config`` without the file: the ingress does
    not start (it did, and every request then failed with "internal server error")."""
    with pytest.raises(FileNotFoundError, match=r"^serve\.generation_config: no .*json"):
        _ingress(str(tmp_path))
    (tmp_path / "generation_config.json").write_text(json.dumps(MODEL_GENERATION))
    ingress = _ingress(str(tmp_path))
    assert ingress._serving is None  # starts; connects on first use
    (tmp_path / "generation_config.json").unlink()  # gone after the start: each request 500
    with pytest.raises(APIError) as caught:
        asyncio.run(ingress.serving())
    assert caught.value.status == 500
    assert str(caught.value).count("serve.generation_config") == 1, caught.value


@QUIET_DEL
def test_a_models_unreadable_generation_config_is_named_in_each_error(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text("{not json")
    ingress = _ingress("auto", tmp_path)
    with pytest.raises(APIError) as caught:
        asyncio.run(ingress.serving())
    assert caught.value.status == 500
    assert str(caught.value).count("serve.generation_config") == 1  # (it said it twice)
    assert "generation_config.json cannot be read" in str(caught.value)
