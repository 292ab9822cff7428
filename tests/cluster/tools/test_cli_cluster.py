"""``tandem up`` starts a local Ray and the cluster, ``tandem generate --cluster`` streams
through it from another process, ``tandem scale`` resizes a pool of it, and a signal (Ctrl-C's
SIGINT, or SIGTERM) shuts everything down."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tests.cluster.conftest import free_port, own_ray_env

pytest.importorskip("ray")


def _tandem(*args: str, env: dict[str, str] | None = None) -> Any:
    """A ``tandem`` command running, its output (stderr too) readable as text."""
    command = [sys.executable, "-m", "cluster.tools.cli", *args]
    return subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def _sigterm_stops(process: Any) -> None:
    """A running ``tandem serve`` stops on SIGTERM with status 0."""
    process.send_signal(signal.SIGTERM)
    rest, _ = process.communicate(timeout=60)
    assert process.returncode == 0, rest


def _until_ready(process: Any, prefix: str, timeout_s: float) -> list[str]:
    """The lines a ``tandem`` command printed up to the one starting with ``prefix``."""
    lines: list[str] = []
    deadline = time.monotonic() + timeout_s
    assert process.stdout is not None
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        assert line, f"{process.args[3:5]} exited early:\n{''.join(lines)}"
        lines.append(line)
        if line.startswith(prefix):
            break
    return lines


def test_up_generate_and_ctrl_c(tiny_model: Path, tmp_path: Path) -> None:
    config = tmp_path / "cluster.yaml"
    config.write_text(
        f"model: {tiny_model}\n"
        "block_size: 4\n"
        "pools:\n"
        "  - {name: p, role: prefill, num_blocks: 64, num_threads: 1, resources: {prefill: 1}}\n"
        "  - {name: d, role: decode, num_blocks: 64, num_threads: 1, resources: {decode: 1}}\n"
        "router: {disaggregation: always}\n"
    )
    with own_ray_env("tandem-cli-") as env:  # its own Ray, found by address 'auto'
        _up_generate_scale_and_stop(config, env)


def _up_generate_scale_and_stop(config: Path, env: dict[str, str]) -> None:
    tandem = [sys.executable, "-m", "cluster.tools.cli"]
    up = _tandem("up", str(config), "--num-cpus", "2", "--object-store-mb", "80", env=env)
    try:
        lines = _until_ready(up, "ready", 120)
        assert any("p-0: prefill" in x for x in lines) and any("d-0: decode" in x for x in lines)
        address = lines[-1].split("Ray at ")[1].split(")")[0]  # as `tandem up` tells users
        assert address.startswith("127.0.0.1:")
        out = subprocess.run(
            [*tandem, "generate", "--cluster", "--address", address, "--raw", "-v", "hello"],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0, out.stderr
        assert "[finish_reason=" in out.stderr
        scale = [*tandem, "scale", "--address", address]
        grown = subprocess.run([*scale, "d=2"], env=env, capture_output=True, text=True)
        assert grown.returncode == 0 and grown.stdout.strip() == "pool d: d-0, d-1", grown
        shrunk = subprocess.run([*scale, "d=1"], env=env, capture_output=True, text=True)
        assert shrunk.returncode == 0 and shrunk.stdout.strip() == "pool d: d-0", shrunk
        last = subprocess.run([*scale, "d=0"], env=env, capture_output=True, text=True)
        assert last.returncode == 1 and "at least one instance" in last.stderr, last
        bad = subprocess.run([*scale, "d"], env=env, capture_output=True, text=True)
        assert bad.returncode == 2 and "expected POOL=N" in bad.stderr, bad
        up.send_signal(signal.SIGTERM)  # a `kill` or container stop shuts down like Ctrl-C
        rest, _ = up.communicate(timeout=60)
        assert up.returncode == 0, rest
        assert "shutting down" in rest
    finally:
        if up.poll() is None:
            up.kill()


def _processes_under(folder: str) -> list[str]:
    """The command lines of the processes that name ``folder`` (Ray's, under its RAY_TMPDIR)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # it ended meanwhile
            continue
        if folder in args:
            found.append(args)
    return found


def test_ctrl_c_while_starting_stops_cleanly(tiny_model: Path, tmp_path: Path) -> None:
    """A signal while the cluster starts (Ray up, models loading) takes down what was begun --
    the workers and the Ray it started -- and says so: exit 130, no traceback."""
    config = tmp_path / "cluster.yaml"
    config.write_text(f"model: {tiny_model}\nblock_size: 4\n")
    with own_ray_env("tandem-cli-") as env:
        up = _tandem("up", str(config), "--num-cpus", "2", "--object-store-mb", "80", env=env)
        try:
            _until_ready(up, "starting cluster", 120)  # Ray is up; the cluster is building
            assert _processes_under(env["RAY_TMPDIR"])  # (the check below can fail)
            up.send_signal(signal.SIGINT)
            rest, _ = up.communicate(timeout=120)
        finally:
            if up.poll() is None:
                up.kill()
        assert up.returncode == 130, rest
        assert "interrupted while starting: shutting down" in rest
        assert "Traceback" not in rest, rest
        deadline = time.monotonic() + 30
        while _processes_under(env["RAY_TMPDIR"]) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not _processes_under(env["RAY_TMPDIR"])


def test_sigterm_while_serve_starts_takes_everything_down(tiny_model: Path, tmp_path: Path) -> None:
    """`tandem serve` loads the model inside Serve's deploy, after ``ray.init`` set Ray's own
    SIGTERM handler (``sys.exit``): a container stop then took nothing down. It stops as
    Ctrl-C does: exit 143 (128 + SIGTERM), no traceback, nothing left of its Ray."""
    config = tmp_path / "cluster.yaml"
    config.write_text(f"model: {tiny_model}\nblock_size: 4\n")
    port, grpc_port = free_port(), free_port()
    args = ["--port", str(port), "--grpc-port", str(grpc_port), "--num-cpus", "2"]
    with own_ray_env("tandem-cli-") as env:
        env["PYTHONFAULTHANDLER"] = "1"  # (SIGABRT below: every thread's stack, to see why)
        serve = _tandem("serve", str(config), *args, "--object-store-mb", "80", env=env)
        try:
            _until_ready(serve, "starting Tandem", 120)
            deadline = time.monotonic() + 120
            while not _processes_under(env["RAY_TMPDIR"]):  # Ray is up: Serve deploys
                assert serve.poll() is None and time.monotonic() < deadline
                time.sleep(0.2)
            time.sleep(3)
            serve.send_signal(signal.SIGTERM)
            try:
                rest, _ = serve.communicate(timeout=180)
            except subprocess.TimeoutExpired:  # (seen once, on a loaded CI machine)
                serve.send_signal(signal.SIGABRT)
                try:
                    rest, _ = serve.communicate(timeout=60)
                except subprocess.TimeoutExpired as again:  # (its Ray holds the pipe open)
                    out = again.output or b""
                    rest = out.decode(errors="replace") if isinstance(out, bytes) else str(out)
                pytest.fail(f"no exit 180 s after SIGTERM; its output and stacks:\n{rest[-8000:]}")
        finally:
            if serve.poll() is None:
                serve.kill()
        assert "ready:" not in rest, "it had started: the signal came too late to test"
        assert serve.returncode == 143, rest
        assert "interrupted while starting" in rest and "Traceback" not in rest, rest
        deadline = time.monotonic() + 30
        while _processes_under(env["RAY_TMPDIR"]) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not _processes_under(env["RAY_TMPDIR"])


def test_ctrl_c_while_starting_on_a_joined_ray_leaves_no_detached_actor(
    ray_cluster: Any, tiny_model: Path, tmp_path: Path
) -> None:
    """On a Ray it joined, Ctrl-C while the cluster starts takes down what the start began:
    with engine actors the workers are detached (they outlive a restarting central actor), and
    a start cut short left them holding their nodes' resources for as long as that Ray ran.
    One instance's workers load; the other's wait for room on their node."""
    import ray

    from cluster.control.launch import DEFAULT_NAMESPACE

    config = tmp_path / "cluster.yaml"
    config.write_text(
        f"model: {tiny_model}\nblock_size: 4\nengine_actors: true\n"
        # 0.6 of the decode node's 1 each (the session's Serve app holds 0.01): the second
        # instance waits for room that never comes, until Ctrl-C.
        "pools:\n"
        "  - {name: c, role: both, replicas: 2, num_blocks: 64, resources: {decode: 0.6}}\n"
    )

    def detached() -> set[str]:
        entries = ray.util.list_named_actors(all_namespaces=True)
        names = {e["name"] for e in entries if e["namespace"] == DEFAULT_NAMESPACE}
        return {n for n in names if n.startswith(("tandem-worker/", "tandem-engine/"))}

    before = detached()
    address = ray_cluster.cluster.address
    up = _tandem("up", str(config), "--address", address, "--name", "ctrl-c-joined")
    try:
        _until_ready(up, "starting cluster", 120)
        deadline = time.monotonic() + 120
        while not detached() - before:  # the first instance's workers are up
            assert up.poll() is None, up.communicate()[0]
            assert time.monotonic() < deadline
            time.sleep(0.2)
        up.send_signal(signal.SIGTERM)  # (a container stop: as Ctrl-C, not Ray's handler)
        rest, _ = up.communicate(timeout=120)
    finally:
        if up.poll() is None:
            up.kill()
    assert up.returncode == 143, rest  # 128 + SIGTERM
    assert "interrupted while starting" in rest and "Traceback" not in rest, rest
    deadline = time.monotonic() + 30
    while detached() - before and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not detached() - before


def test_generate_without_a_cluster_says_how_to_start_one(tmp_path: Path) -> None:
    with own_ray_env("tandem-cli-") as env:
        out = subprocess.run(
            [sys.executable, "-m", "cluster.tools.cli", "generate", "--cluster", "hi"],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert out.returncode != 0
    assert "tandem up" in out.stderr


def test_generate_on_a_cluster_refuses_the_in_process_engines_flags(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The cluster serves the model it was started with: --model and the engine's flags with
    --cluster are refused, not silently ignored (before any cluster is looked for)."""
    from cluster.tools.cli import main

    assert main(["generate", "--cluster", "--model", "other.gguf", "-q", "int8", "hi"]) == 2
    err = capsys.readouterr().err
    assert "--model, --quantization set the in-process engine" in err and "tandem up" in err


def test_down_stops_a_running_cluster(ray_cluster: Any, tiny_model: Path) -> None:
    import ray

    from cluster.config import ClusterConfig
    from cluster.control.launch import build_cluster, get_cluster

    config = ClusterConfig.model_validate(
        {"model": str(tiny_model), "block_size": 4, "pools": [{"name": "c", "num_blocks": 64}]}
    )
    build_cluster(config, name="to-stop", detached=True)
    tandem = [sys.executable, "-m", "cluster.tools.cli"]
    address = ray_cluster.cluster.address
    down = [*tandem, "down", "--name", "to-stop", "--address", address]
    stopped = subprocess.run(down, capture_output=True, text=True, timeout=120)
    assert stopped.returncode == 0 and "cluster 'to-stop' stopped" in stopped.stdout, stopped
    with pytest.raises(ValueError):
        for _ in range(50):  # the kill is asynchronous
            get_cluster("to-stop")
            time.sleep(0.1)
    again = subprocess.run(down, capture_output=True, text=True, timeout=120)
    assert again.returncode == 1 and "no running cluster 'to-stop'" in again.stderr, again
    assert ray.is_initialized()


def test_scale_when_the_scheduler_dies_during_the_call_says_so(ray_cluster: Any) -> None:
    """The central scheduler dies while it resizes (a restartable one may come back): the
    command says so and exits 1, no traceback."""
    import ray

    from cluster.control.launch import DEFAULT_NAMESPACE

    @ray.remote(num_cpus=0)
    class DiesOnScale:
        def scale_pool(self, *args: Any) -> None:
            import os

            os._exit(1)

    name = "dies-on-scale"
    handle = DiesOnScale.options(name=name, namespace=DEFAULT_NAMESPACE).remote()
    try:
        ray.get(handle.__ray_ready__.remote())
        tandem = [sys.executable, "-m", "cluster.tools.cli"]
        address = ray_cluster.cluster.address
        scale = [*tandem, "scale", "--name", name, "--address", address, "d=2"]
        out = subprocess.run(scale, capture_output=True, text=True, timeout=120)
        assert out.returncode == 1, out
        assert "died during the call" in out.stderr and "Traceback" not in out.stderr, out
    finally:
        ray.kill(handle)


def test_scale_when_the_scheduler_cannot_be_reached_says_so_not_that_it_died(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """An unreachable central scheduler (``ActorUnavailableError``: restarting, or its node
    cut off) is not a dead one: the command says which, and that POOL=N may be run again."""
    import ray
    from ray.exceptions import ActorUnavailableError

    from cluster.tools import cli

    def unreachable(ref: Any) -> Any:
        raise ActorUnavailableError("the actor is restarting", None)

    handle = SimpleNamespace(scale_pool=SimpleNamespace(remote=lambda *args: "ref"))
    monkeypatch.setattr(cli, "_running_cluster", lambda args, verb: handle)
    monkeypatch.setattr(ray, "get", unreachable)
    assert cli.main(["scale", "decode=2"]) == 1
    err = capsys.readouterr().err
    assert "could not be reached (it may be restarting)" in err and "died" not in err, err
    assert "run `tandem scale decode=2` again" in err


def test_serve_over_https_with_a_self_signed_ca(tiny_model: Path, tmp_path: Path) -> None:
    """``tandem serve --ssl-keyfile --ssl-certfile``: the API answers over HTTPS with a
    certificate of our own CA (clients that trust the CA get answers; plain HTTP and clients
    that do not trust it get none), the gRPC API over TLS (served by the ingress replica, not
    Serve's plaintext proxy, which would bind every interface ([::])) on 127.0.0.1 alone --
    nothing listens on the port's wildcard address -- and SIGTERM stops it."""

    from kv_transfer.tls import TLSMaterial

    tls = TLSMaterial.generate("localhost", ip_addresses=("127.0.0.1",))
    for name, pem in (("ca", tls.ca), ("cert", tls.cert), ("key", tls.key)):
        (tmp_path / f"{name}.pem").write_bytes(pem)
    config = tmp_path / "cluster.yaml"
    config.write_text(
        f"model: {tiny_model}\n"
        "block_size: 4\n"
        "pools:\n"
        "  - {name: c, role: both, num_blocks: 64, num_threads: 1}\n"
    )
    port, grpc_port = free_port(), free_port()
    with own_ray_env("tandem-https-") as env:
        _serve_over_tls(config, tmp_path, tls, port, grpc_port, env)


def _serve_over_tls(
    config: Path, tmp_path: Path, tls: Any, port: int, grpc_port: int, env: dict[str, str]
) -> None:
    import requests

    serve = subprocess.Popen(
        [
            *(sys.executable, "-m", "cluster.tools.cli", "serve", str(config)),
            *("--port", str(port), "--grpc-port", str(grpc_port)),
            *("--num-cpus", "2", "--object-store-mb", "80"),
            *("--ssl-keyfile", str(tmp_path / "key.pem")),
            *("--ssl-certfile", str(tmp_path / "cert.pem")),
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        lines = _until_ready(serve, "ready:", 180)
        url = f"https://127.0.0.1:{port}"
        assert lines[-1].startswith(f"ready: {url}/v1"), lines[-1]
        assert serve.stdout is not None
        more = [serve.stdout.readline() for _ in range(2)]
        assert f"gRPC tandem.v1.Generate on 127.0.0.1:{grpc_port} (TLS)\n" in more, more
        ca = str(tmp_path / "ca.pem")
        body = {"model": "tiny", "prompt": "hello", "max_tokens": 3, "temperature": 0}
        models = requests.get(f"{url}/v1/models", verify=ca, timeout=60).json()
        body["model"] = models["data"][0]["id"]
        answer = requests.post(f"{url}/v1/completions", json=body, verify=ca, timeout=60)
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 3
        with pytest.raises(requests.exceptions.SSLError):  # a client that trusts no such CA
            requests.get(f"{url}/v1/models", timeout=30)
        with pytest.raises(requests.exceptions.ConnectionError):  # plain HTTP: no answer
            requests.get(f"http://127.0.0.1:{port}/v1/models", timeout=30)
        # The gRPC API, served over TLS by the ingress replica itself.
        import grpc

        from cluster.proto import tandem_pb2, tandem_pb2_grpc

        target = f"127.0.0.1:{grpc_port}"
        request = tandem_pb2.GenerateRequest(model=body["model"], prompt="hello", max_tokens=3)
        options = (("grpc.ssl_target_name_override", "localhost"),)
        credentials = grpc.ssl_channel_credentials(root_certificates=tls.ca)
        with grpc.secure_channel(target, credentials, options=options) as channel:
            grpc.channel_ready_future(channel).result(timeout=30)
            stream = tandem_pb2_grpc.GenerateStub(channel).Generate(request, timeout=60)
            responses = list(stream)
        assert (
            responses[-1].finish_reason == "length" and responses[-1].usage.completion_tokens == 3
        )
        with grpc.insecure_channel(target) as channel:  # plaintext: no call gets through
            stream = tandem_pb2_grpc.GenerateStub(channel).Generate(request, timeout=10)
            with pytest.raises(grpc.RpcError) as refused:
                list(stream)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        if Path("/proc/net/tcp").exists():  # (Linux's socket tables)
            listening = _listeners(grpc_port)
            assert listening and all(a.endswith("0100007F") for a in listening), listening
        _sigterm_stops(serve)
    finally:
        if serve.poll() is None:
            serve.kill()


def test_an_os_error_of_generate_keeps_its_traceback_with_verbose(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """An ``OSError`` is said in one line (a file of the caller's) -- with -v it keeps its
    traceback (one from deep in a model load is not the caller's); a reader of the output
    that left (``| head``) ends the command quietly."""
    from cluster.tools import cli

    def fails(args: Any) -> int:
        raise PermissionError(13, "Permission denied", "weights.safetensors")

    monkeypatch.setattr(cli, "_dispatch", fails)
    assert cli.main(["generate", "hi"]) == 2
    assert capsys.readouterr().err.strip() == (
        "tandem generate: [Errno 13] Permission denied: 'weights.safetensors'"
    )
    with pytest.raises(PermissionError):
        cli.main(["generate", "-v", "hi"])

    def pipe_left(args: Any) -> int:
        raise BrokenPipeError(32, "Broken pipe")

    dup2: list[int] = []
    monkeypatch.setattr(cli, "_dispatch", pipe_left)
    monkeypatch.setattr(cli.os, "dup2", lambda fd, to: dup2.append(to))
    monkeypatch.setattr(cli.sys, "stdout", SimpleNamespace(fileno=lambda: 99))
    assert cli.main(["generate", "hi"]) == 1
    assert dup2 == [99] and capsys.readouterr().err == ""  # (stdout: no flush at exit)

    def left_unread() -> None:  # what it printed was still buffered when the reader left
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(cli, "_dispatch", lambda args: 0)
    monkeypatch.setattr(cli.sys, "stdout", SimpleNamespace(fileno=lambda: 98, flush=left_unread))
    assert cli.main(["plan", "--slo-ttft-ms", "500"]) == 1
    assert dup2 == [99, 98]


def _listeners(port: int) -> set[str]:
    """The local addresses (hex, as /proc/net/tcp{,6} write them) listening on ``port``."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for row in f.read().splitlines()[1:]:
                local, state = row.split()[1], row.split()[3]
                address, hex_port = local.split(":")
                if state == "0A" and int(hex_port, 16) == port:
                    found.add(address)
    return found
