"""Where ``tandem serve`` listens: which ports must be free before it starts, who serves
plaintext gRPC (Serve's proxy binds every interface; on a loopback host the ingress replicas
serve it themselves), Serve's HTTP options, and the ready message's gRPC line."""

from __future__ import annotations

from typing import Any


def grpc_where_it_binds(config: Any, address: str | None) -> Any:
    """``config`` with ``serve.grpc_server: ingress`` where plaintext gRPC should come from
    the ingress replicas: Serve's gRPC proxy binds every interface, so on a loopback host
    (and a Ray of its own: every replica on this machine) they serve it there themselves."""
    if address is None and _serves_grpc_itself(config.serve):
        serve = config.serve.model_copy(update={"grpc_server": "ingress"})
        return config.model_copy(update={"serve": serve})
    return config


def _serves_grpc_itself(serve: Any) -> bool:
    """Plaintext gRPC from the ingress replicas (``grpc_server: ingress``) unless the config
    says otherwise: a loopback host, where Serve's proxy would listen on every interface."""
    import ipaddress

    if serve.grpc_port is None or serve.ssl_certfile is not None:
        return False
    if serve.grpc_server is not None:  # (named in the config)
        return bool(serve.grpc_server == "ingress")
    try:
        return ipaddress.ip_address(serve.host).is_loopback
    except ValueError:
        return serve.host == "localhost"


def check_ports_free(serve: Any) -> None:
    """``OSError`` naming the flag when another process listens on the HTTP or the gRPC port.
    Serve's proxies (and the ingress's TLS gRPC server) bind with ``SO_REUSEPORT``, so a second
    server on a port -- another ``tandem serve`` on its own Ray -- binds too, and the kernel
    splits the connections between the two; a probe without ``SO_REUSEPORT`` fails on any
    listener (``SO_REUSEADDR``: not on a closed one's lingering connections)."""
    import errno
    import socket

    ports = [("--port", serve.host, serve.port)]
    if serve.grpc_port is not None:
        # Serve's plaintext gRPC proxy binds every interface ([::]), whatever serve.host says.
        own = serve.ssl_certfile is not None or serve.grpc_server == "ingress"
        grpc_hosts = [serve.host] if own else ["::", "0.0.0.0"]
        ports += [("--grpc-port", host, serve.grpc_port) for host in grpc_hosts]
    for flag, host, port in ports:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        try:
            with socket.socket(family, socket.SOCK_STREAM) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                probe.bind((host, port))
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                continue  # (no IPv6 here, an address not on this machine: Serve will say)
            raise OSError(
                exc.errno,
                f"port {port} ({host}) is in use by another process (another tandem serve?): "
                f"stop it, or give {flag} another port",
            ) from None


def http_options(serve: Any) -> Any:
    """Serve's HTTP options for a ``ServeConfig``: host, port and, with a key and a
    certificate, HTTPS (the proxy's uvicorn terminates TLS)."""
    from ray.serve.config import HTTPOptions

    tls = {}
    if serve.ssl_certfile is not None:
        tls = {"ssl_keyfile": serve.ssl_keyfile, "ssl_certfile": serve.ssl_certfile}
    return HTTPOptions(host=serve.host, port=serve.port, **tls)


def grpc_banner(serve: Any) -> str:
    """Where the gRPC API listens, as the ready message says it: over TLS the ingress binds
    ``serve.host``; Serve's plaintext proxy binds every interface whatever ``--host`` says
    (it said 127.0.0.1), so without an API key the machine's network may call it."""
    if serve.grpc_port is None:
        return ""
    if serve.ssl_certfile is not None:
        return f"gRPC tandem.v1.Generate on {serve.host}:{serve.grpc_port} (TLS)\n"
    if serve.grpc_server == "ingress":
        return f"gRPC tandem.v1.Generate on {serve.host}:{serve.grpc_port}\n"
    line = (
        f"gRPC tandem.v1.Generate on port {serve.grpc_port} of every interface (Serve's gRPC "
        "proxy binds them all"
    )
    if serve.api_key is None:
        line += ", and no --api-key is set: --no-grpc keeps it off the network"
    return line + ")\n"
