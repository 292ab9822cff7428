"""An ingress replica killed mid-stream, as the Serve tests stage it (central mode and engine
actors alike): the client's stream ends with an error (no [DONE]), the request is aborted
on the cluster and its blocks freed once the replica's keep-alives stop (client_timeout_s),
and Serve's new replicas serve again."""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

import psutil
import ray
import requests

from tests.cluster.conftest import API_KEY, assert_clean


def kill_the_ingress_mid_stream(
    url: str, app: str, model: str, scheduler: Any, client_timeout_s: float
) -> None:
    """``url``: the app's base URL; ``app``: its Serve name (its replicas' process titles
    carry it); ``scheduler``: its cluster's SchedulerActor."""
    ray.get(scheduler.set_fault_injection.remote("d-0", 0.0, 0.05))  # 300 tokens: 15 s
    events: list[str] = []
    streaming = threading.Event()

    def stream() -> None:
        try:
            with chat(url, model, stream=True, max_tokens=300, ignore_eos=True) as reply:
                for line in reply.iter_lines():
                    if line.startswith(b"data: {"):
                        streaming.set()
                    events.append(line.decode())
        except requests.RequestException as exc:
            events.append(f"error: {type(exc).__name__}")
        finally:
            events.append("end")

    reader = threading.Thread(target=stream, daemon=True)
    try:
        reader.start()
        assert streaming.wait(30), events
        assert ray.get(scheduler.live_request_ids.remote())  # it runs on the cluster
        replicas = [  # their processes' titles name them
            p.pid
            for p in psutil.process_iter(["cmdline"])
            if f"ServeReplica:{app}:OpenAIIngress" in " ".join(p.info["cmdline"] or ())
        ]
        assert replicas
        for pid in replicas:  # whichever holds the client: a crash, no goodbye
            os.kill(pid, signal.SIGKILL)
        reader.join(30)
        assert not reader.is_alive() and events[-1] == "end"
        assert "data: [DONE]" not in events  # the client saw its stream break
        # The replica's keep-alives stopped: the request is aborted, every block freed.
        deadline = time.monotonic() + client_timeout_s + 15
        while ray.get(scheduler.live_request_ids.remote()) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not ray.get(scheduler.live_request_ids.remote())
        assert_clean(scheduler, objects=False)  # (Serve's own objects stay in the store)
    finally:
        ray.get(scheduler.set_fault_injection.remote("d-0", 0.0, 0.0))
    deadline = time.monotonic() + 60
    while True:  # Serve replaces the dead replicas
        try:
            if chat(url, model).status_code == 200:
                break
        except requests.RequestException:
            pass
        assert time.monotonic() < deadline, "the ingress did not come back"
        time.sleep(0.5)


def chat(
    url: str,
    model: str,
    stream: bool = False,
    max_tokens: int = 4,
    ignore_eos: bool = False,
    content: str = "hi",
) -> Any:
    """A greedy chat completion (streamed: read it in a ``with``)."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": ignore_eos,
        "stream": stream,
    }
    headers = {"Authorization": f"Bearer {API_KEY}"}
    return requests.post(
        f"{url}/v1/chat/completions", json=body, headers=headers, timeout=60, stream=stream
    )
