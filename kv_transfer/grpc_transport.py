"""The ``grpc`` KV transport: every worker serves its own KV blocks in place; decode workers
pull them over gRPC (protocol: ``kv_transfer/proto/kv_transfer.proto``).

Prefill side: a save copies nothing. ``_publish`` puts the request's blocks under a *lease*
(a random id, the block ids, an expiry) and returns a ``GrpcLease`` handle: the worker's KV
server address, the lease id, the layers it covers. The segment is ``in_place``, so the
scheduler keeps the blocks allocated until ``finished_sending`` reports the lease ended::

    save ─▶ lease (blocks held) ─┬─ every layer pulled at least once ─▶ ended ─▶ blocks freed
                                 └─ expired (lease_s), no pull running ─▶ ended ─▶ blocks freed

An ended lease is gone: a later pull gets NOT_FOUND. A pull in progress pins its lease, so
blocks are never freed (and reused) under a stream that still reads them; a pull cannot
outlive the puller's deadline, after which gRPC cancels it on both sides.

Decode side: ``_fetch`` sends one ``Pull`` for the layers it needs (a pipeline stage pulls its
own range of a lease; the lease ends once all of its layers have been pulled) with the transfer
deadline, and gets a ``PullHeader`` then raw bytes: per layer, K then V, the lease's blocks in
order. They land in one buffer that the ``KVPayload`` views (one run of all blocks). No pickle
crosses the network: protobuf headers, raw tensor bytes. The data messages are encoded and
decoded by hand (``grpc_wire``: protobuf's copies cost more than the network on one
machine), yet they are ordinary ``PullChunk`` messages that any client of the proto can read.

Every call carries the cluster token (``KVTransferConfig.auth_token``) in its metadata; the
server refuses a missing or wrong one with UNAUTHENTICATED, before reading anything. With
``tls`` (``kv_transfer.tls``), servers and clients speak mutual TLS with the cluster's
certificate (``kv_transfer/tls.py``): the KV bytes and the token are encrypted, and a peer
without a certificate of the cluster's CA cannot connect at all. A source that is gone fails
the pull at once (UNAVAILABLE: the call does not wait for the server), and the next pull dials
it afresh: a source back on the same address is reached at once (``_evict``).
"""

from __future__ import annotations

import hmac
import logging
import socket
import threading
from collections import Counter, OrderedDict
from collections.abc import Generator, Iterator
from concurrent import futures
from typing import TYPE_CHECKING, Any, ClassVar

import grpc
import numpy as np
import torch

from kv_transfer.base import WorkerConnector
from kv_transfer.blocks import KVPayload
from kv_transfer.leases import Lease, LeaseTable
from kv_transfer.tls import TLSMaterial

try:
    from kv_transfer.proto import kv_transfer_pb2 as pb
except ImportError as exc:  # a source checkout that was never installed
    raise ImportError(
        "the gRPC KV transport's modules are generated from kv_transfer/proto/kv_transfer.proto "
        "at install time: run `pip install -e .` (or `make`) in the repository"
    ) from exc
# (After the proto: a checkout never installed gets the message above.)
from kv_transfer.grpc_wire import DTYPES, GrpcLease, as_is, frame, receive

if TYPE_CHECKING:
    from pydantic import SecretStr

logger = logging.getLogger(__name__)

TOKEN_METADATA_KEY = "tandem-kv-token"  # gRPC metadata keys are lower case
# Channels a decode worker keeps open, one per source address: past this many, the least
# recently used one no pull is on is closed (restarted prefill workers come back on new
# ports: their old channels would otherwise stay for the worker's life).
MAX_CHANNELS = 64
# A channel whose connection failed waits out gRPC's reconnect backoff before it dials again
# (1 s, growing to 2 min), failing pulls at once meanwhile: a source back on the same address
# (a restarted worker) is reached again within a second.
_RECONNECT_BACKOFF = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]
_WILDCARD_HOSTS = ("", "0.0.0.0", "::", "[::]")


def advertised_host(bind_host: str, advertise_host: str | None) -> str:
    """The address other workers reach a KV server bound to ``bind_host`` at: the one given;
    else ``bind_host``; for a wildcard, this node's address as Ray knows it (what the other
    nodes reach it at), outside Ray the host name's. (That name maps to a loopback address on
    many machines -- Debian's 127.0.1.1 -- where another machine would dial itself: said.)"""
    if advertise_host:
        return advertise_host
    if bind_host not in _WILDCARD_HOSTS:
        return bind_host
    try:
        import ray

        if ray.is_initialized():
            return str(ray.util.get_node_ip_address())  # type: ignore[no-untyped-call]
    except ImportError:
        pass
    host = socket.gethostbyname(socket.gethostname())
    if host.startswith("127."):
        logger.warning(
            "KV server bound to %s advertises %s, a loopback address: workers on other "
            "machines cannot reach it (set kv_transfer.advertise_host)",
            bind_host,
            host,
        )
    return host


_SERVICE = pb.DESCRIPTOR.services_by_name["KVTransfer"].full_name  # tandem.kv.v1.KVTransfer
_PULL = f"/{_SERVICE}/Pull"


class _KVServicer:
    """The ``KVTransfer`` service of one connector (runs on the gRPC server's threads)."""

    def __init__(self, connector: GrpcWorkerConnector) -> None:
        self.connector = connector

    def Pull(self, request: Any, context: Any) -> Iterator[bytes]:  # the RPC's name
        c = self.connector
        if not c.is_authorized(context.invocation_metadata()):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong cluster token")
        layers = range(request.first_layer, request.last_layer)
        try:
            lease = c.leases.pin(request.lease_id, layers)
        except KeyError:
            lease = None
            context.abort(grpc.StatusCode.NOT_FOUND, "no such lease (expired or pulled)")
        except ValueError as exc:
            lease = None
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        assert lease is not None  # abort() raises
        complete = False
        try:
            complete = yield from c.stream(lease, layers, context)
        finally:
            c.leases.unpin(request.lease_id, layers, complete)


class GrpcWorkerConnector(WorkerConnector):
    """Serves this worker's blocks under leases and pulls other workers' over gRPC.

    ``auth_token``: the cluster token (requests without it are refused). ``lease_s``: how long
    saved blocks wait for their pull. ``bind_host``: the address the KV server binds (port
    chosen by the system); ``advertise_host``: the one handles name, by default ``bind_host``
    or, for a wildcard, this machine's address. ``chunk_size_bytes``: the largest data message.
    ``tls``: the cluster's TLS material (mutual TLS on every pull), or None for plaintext.
    """

    transport: ClassVar[str] = "grpc"
    supports_cross_node: ClassVar[bool] = True
    supports_layer_ranges: ClassVar[bool] = True
    serves_in_place: ClassVar[bool] = True

    def __init__(
        self,
        *,
        auth_token: str | SecretStr,
        lease_s: float = 10.0,
        bind_host: str = "127.0.0.1",
        advertise_host: str | None = None,
        chunk_size_bytes: int = 1 << 20,
        max_parallel_loads: int = 4,
        server_threads: int = 8,
        tls: TLSMaterial | None = None,
    ) -> None:
        super().__init__(max_parallel_loads)
        token = auth_token if isinstance(auth_token, str) else auth_token.get_secret_value()
        if not token:
            raise ValueError("the grpc KV transport needs a non-empty auth_token")
        if lease_s <= 0 or chunk_size_bytes <= 0:
            raise ValueError("lease_s and chunk_size_bytes must be > 0")
        self._token = token.encode()
        self.lease_s = lease_s
        self.bind_host = bind_host
        self.advertise_host = advertise_host
        self.chunk_size_bytes = chunk_size_bytes
        self.server_threads = server_threads
        self.tls = tls
        self.leases = LeaseTable()
        self.address: str | None = None  # host:port of the KV server, once started
        self._server: Any = None
        # address -> grpc.Channel, shared by fetches, least recently used first
        self._channels: OrderedDict[str, Any] = OrderedDict()
        self._pulling: Counter[str] = Counter()  # pulls to each address now
        self._on_channel: Counter[int] = Counter()  # pulls on each channel (by id) now
        # Channels evicted after a connection failure, closed once no pull to them runs.
        self._evicted: dict[int, Any] = {}  # by id
        self._channels_lock = threading.Lock()

    # -- set-up ----------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: list[torch.Tensor], layers: range) -> None:
        """Also starts the KV server (once). New caches end every lease, unreported: the
        blocks they named are gone (``LeaseTable.end_all``)."""
        self.leases.end_all()
        super().register_kv_caches(kv_caches, layers)
        if self._server is None:
            self._start_server()

    def release_caches(self) -> None:
        """Leases first: no pull starts on the old cache (one running holds what it reads)."""
        self.leases.end_all()
        super().release_caches()

    def _start_server(self) -> None:
        server = grpc.server(
            futures.ThreadPoolExecutor(self.server_threads, thread_name_prefix="kv-serve"),
            options=[("grpc.max_receive_message_length", 1 << 16), ("grpc.so_reuseport", 0)],
        )
        # Data messages are framed by hand (``frame``), so responses go out as they are.
        pull = grpc.unary_stream_rpc_method_handler(
            _KVServicer(self).Pull,
            request_deserializer=pb.PullRequest.FromString,
            response_serializer=as_is,
        )
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(_SERVICE, {"Pull": pull}),)
        )
        bind = _join(self.bind_host, 0)
        if self.tls is None:
            port = server.add_insecure_port(bind)
        else:
            port = server.add_secure_port(bind, self.tls.server_credentials())
        server.start()
        self._server = server
        self.address = _join(advertised_host(self.bind_host, self.advertise_host), port)
        logger.info(
            "KV server on %s (%s), advertised as %s",
            self.bind_host,
            "plaintext" if self.tls is None else "mutual TLS",
            self.address,
        )

    def close(self) -> None:
        """Stop the KV server (pulls in progress are cancelled) and drop the channels."""
        if self._server is not None:
            self._server.stop(grace=None)
            self._server = None
        with self._channels_lock:
            channels, self._channels = self._channels, OrderedDict()
            evicted, self._evicted = self._evicted, {}
        for channel in [*channels.values(), *evicted.values()]:
            channel.close()
        super().close()

    # -- prefill side ----------------------------------------------------------------------
    def _publish(self, req_id: str, block_ids: list[int]) -> tuple[Any, int]:
        if self.address is None:
            raise RuntimeError("register_kv_caches first: the KV server is not running")
        lease_id = self.leases.add(req_id, block_ids, self.layers, self.lease_s)
        handle = GrpcLease(
            self.address, lease_id, self.layers.start, self.layers.stop, len(block_ids)
        )
        per_block = sum(cache[:, 0].nbytes for cache in self.kv_caches)
        return handle, per_block * len(block_ids)

    def _finished_sending(self) -> set[str]:
        return self.leases.take_ended()

    def is_authorized(self, metadata: Any) -> bool:
        """Whether gRPC ``metadata`` carries the cluster token (constant-time comparison)."""
        for key, value in metadata or ():
            if key == TOKEN_METADATA_KEY:
                given = value if isinstance(value, bytes) else str(value).encode()
                return hmac.compare_digest(given, self._token)
        return False

    def stream(self, lease: Lease, layers: range, context: Any) -> Generator[bytes, None, bool]:
        """The encoded messages of a pull: the header, then the layers' K and V blocks as one
        byte stream cut into ``chunk_size_bytes`` messages (a message may span layers: fewer,
        larger messages are what makes gRPC fast). Each layer's blocks are gathered (one
        copy) just before they are sent; framing builds each message (a second). Returns
        whether every byte was sent (False: the puller went away first)."""
        caches = [self.kv_caches[layer - self.layers.start] for layer in layers]
        first = caches[0]
        code, _ = DTYPES[first.dtype]
        num_blocks = len(lease.block_ids)
        layer_bytes = 2 * num_blocks * first[0, 0].nbytes
        header = pb.PullHeader(
            first_layer=layers.start,
            num_layers=len(layers),
            num_blocks=num_blocks,
            block_size=first.shape[2],
            kv_heads=first.shape[3],
            head_dim=first.shape[4],
            dtype=code,
            total_bytes=layer_bytes * len(layers),
        )
        yield pb.PullChunk(header=header).SerializeToString()
        index = torch.tensor(lease.block_ids, dtype=torch.long, device=first.device)
        chunk = self.chunk_size_bytes
        parts: list[memoryview] = []  # views of gathered layers, for the next message
        size, sent, total = 0, 0, header.total_bytes
        for cache in caches:
            if not context.is_active():
                return False  # the puller gave up (its deadline): stop reading the blocks
            blocks = cache.index_select(1, index)  # [2, num_blocks, ...]: K then V, in order
            if blocks.dtype == torch.bfloat16:
                blocks = blocks.view(torch.int16)
            data = blocks.cpu().numpy().reshape(-1).view(np.uint8).data
            pos = 0
            while pos < layer_bytes:
                take = min(chunk - size, layer_bytes - pos)
                parts.append(data[pos : pos + take])
                size, pos = size + take, pos + take
                if size == chunk and sent + size < total:  # the last message waits
                    yield frame(parts, size)
                    parts, size, sent = [], 0, sent + size
        # Everything is gathered. New caches (a restore) end every lease, and the blocks may
        # hold other data since: a pull that spans that is cut short before its last message,
        # and the puller, short of bytes, fails the load (and recomputes).
        if lease.ended:
            context.abort(grpc.StatusCode.ABORTED, "the lease ended during the pull")
        if parts:
            yield frame(parts, size)
        return True

    # -- decode side -----------------------------------------------------------------------
    def _fetch(self, handle: Any, layers: range, timeout_s: float) -> KVPayload:
        if not isinstance(handle, GrpcLease):
            raise TypeError(f"the grpc transport cannot fetch a {type(handle).__name__}")
        if timeout_s <= 0:
            raise TimeoutError("no time left for the KV pull")
        request = pb.PullRequest(
            lease_id=handle.lease_id, first_layer=layers.start, last_layer=layers.stop
        )
        # Inside the try: ``_stub`` counts the pull before anything in it can fail, and a
        # pull left counted would pin its channel (never evicted) for the worker's life.
        channel = None
        try:
            channel, pull = self._stub(handle.address)
            call = pull(
                request,
                timeout=timeout_s,
                metadata=((TOKEN_METADATA_KEY, self._token.decode()),),
                wait_for_ready=False,  # a source that is gone fails at once, not at the deadline
            )
            try:
                return receive(call, handle, layers)
            except grpc.RpcError as exc:
                code = exc.code() if hasattr(exc, "code") else None
                if code == grpc.StatusCode.UNAVAILABLE:
                    self._evict(handle.address, channel)
                details = exc.details() if hasattr(exc, "details") else str(exc)
                name = code.name if code is not None else "error"
                raise ConnectionError(
                    f"KV pull from {handle.address} failed: {name}: {details}"
                ) from None
            finally:
                call.cancel()  # a no-op once the stream ended; stops the server after an error
        finally:
            self._done_with(handle.address, channel)

    def _stub(self, address: str) -> tuple[Any, Any]:
        """A channel to ``address`` (one per address, shared) and the ``Pull`` call on it,
        for one pull, counted before anything can fail (``_done_with`` when it ends)."""
        idle: list[Any] = []
        with self._channels_lock:
            self._pulling[address] += 1
            channel = self._channels.get(address)
            if channel is not None:
                self._channels.move_to_end(address)
            else:
                limit = max(self.chunk_size_bytes, 4 << 20) + (64 << 10)
                options: list[tuple[str, Any]] = [
                    ("grpc.max_receive_message_length", limit),
                    *_RECONNECT_BACKOFF,
                ]
                if self.tls is None:
                    channel = grpc.insecure_channel(address, options=options)
                else:
                    options.append(("grpc.ssl_target_name_override", self.tls.server_name))
                    credentials = self.tls.channel_credentials()
                    channel = grpc.secure_channel(address, credentials, options=options)
                self._channels[address] = channel
            self._on_channel[id(channel)] += 1
            for old in list(self._channels):  # the least recently used idle ones go
                if len(self._channels) <= MAX_CHANNELS:
                    break
                if old not in self._pulling:
                    idle.append(self._channels.pop(old))
        for old_channel in idle:
            old_channel.close()
        # Responses arrive encoded: ``receive`` decodes them.
        return channel, channel.unary_stream(
            _PULL, request_serializer=pb.PullRequest.SerializeToString, response_deserializer=as_is
        )

    def _evict(self, address: str, channel: Any) -> None:
        """Forget ``channel``, whose connection failed (UNAVAILABLE): gRPC keeps a failed
        channel in TRANSIENT_FAILURE, failing each pull at once until its reconnect backoff
        ends, though the source may be back (a restart on the same port). The next pull
        dials afresh; this channel is closed once no pull on it runs (another may still read
        through it), whatever runs on the new one."""
        with self._channels_lock:
            if self._channels.get(address) is channel:
                del self._channels[address]
                self._evicted[id(channel)] = channel

    def _done_with(self, address: str, channel: Any) -> None:
        closing = None
        with self._channels_lock:
            self._pulling[address] -= 1
            if self._pulling[address] <= 0:
                del self._pulling[address]
            if channel is not None:
                self._on_channel[id(channel)] -= 1
                if self._on_channel[id(channel)] <= 0:
                    del self._on_channel[id(channel)]
                    closing = self._evicted.pop(id(channel), None)
        if closing is not None:
            closing.close()


def _join(host: str, port: int) -> str:
    """``host:port``, with an IPv6 address in brackets."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"
