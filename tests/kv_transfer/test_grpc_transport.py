"""The gRPC KV transport in one process: connectors on loopback serve leased blocks and pull
them bit for bit, by layer range, in chunks of any size; the token is checked; leases end when
pulled or expired (then a pull gets NOT_FOUND); a source that is gone fails a load at once."""

from __future__ import annotations

import pickle
import socket
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest
import torch

from kv_transfer.base import WorkerConnector
from kv_transfer.blocks import allocate_kv_caches
from kv_transfer.connector import KVConnectorMetadata, KVSegment, LoadSpec, SaveSpec
from kv_transfer.grpc_transport import (
    TOKEN_METADATA_KEY,
    GrpcWorkerConnector,
    _KVServicer,
    advertised_host,
)
from kv_transfer.grpc_wire import GrpcLease, frame, unframe
from kv_transfer.leases import LeaseTable
from kv_transfer.proto import kv_transfer_pb2 as pb
from kv_transfer.proto import kv_transfer_pb2_grpc as pb_grpc
from kv_transfer.registry import create_worker_connector
from kv_transfer.tls import TLSMaterial

NUM_LAYERS, BLOCK, KV_HEADS, HEAD_DIM = 4, 4, 2, 8
TOKEN = "test-token-0123456789abcdef"
SRC_TABLE = [5, 1, 7, 2]  # the saved request's block table; 10 tokens fill its first three
DST_IDS = [11, 0, 6]


def _caches(
    num_blocks: int, dtype: torch.dtype, seed: int, layers: range = range(NUM_LAYERS)
) -> list[torch.Tensor]:
    """Random caches in the workers' layout (views of one block-first buffer)."""
    gen = torch.Generator().manual_seed(seed)
    caches = allocate_kv_caches(len(layers), num_blocks, BLOCK, KV_HEADS, HEAD_DIM, dtype)
    for cache in caches:
        cache.copy_(torch.randn(cache.shape, generator=gen))
    return caches


@pytest.fixture
def make() -> Iterator[Callable[..., GrpcWorkerConnector]]:
    """Builds connectors holding ``layers`` of a cache (closed after the test)."""
    made: list[GrpcWorkerConnector] = []

    def build(
        num_blocks: int = 8,
        seed: int = 0,
        layers: range = range(NUM_LAYERS),
        dtype: torch.dtype = torch.float32,
        **options: Any,
    ) -> GrpcWorkerConnector:
        connector = GrpcWorkerConnector(auth_token=options.pop("auth_token", TOKEN), **options)
        connector.register_kv_caches(_caches(num_blocks, dtype, seed, layers), layers)
        made.append(connector)
        return connector

    yield build
    for connector in made:
        connector.close()


def _save(src: WorkerConnector, num_tokens: int = 10, req_id: str = "r") -> list[KVSegment]:
    src.wait_for_save(
        KVConnectorMetadata(saves=[SaveSpec(req_id, num_tokens)]), {req_id: SRC_TABLE}
    )
    saved: list[KVSegment] = src.report().saved[req_id]
    return saved


def _load(
    dst: WorkerConnector, handle: list[KVSegment], timeout_s: float = 5.0, req_id: str = "r"
) -> tuple[set[str] | None, set[str] | None]:
    """Load ``handle`` into ``DST_IDS``, stepping idle until the load ends; (done, failed)."""
    dst.start_load_kv(KVConnectorMetadata(loads=[LoadSpec(req_id, handle, DST_IDS, 0, timeout_s)]))
    deadline = time.monotonic() + timeout_s + 5.0
    while dst.num_loading() and time.monotonic() < deadline:
        dst.start_load_kv(None, idle=True)
    assert dst.num_loading() == 0, "the load never ended"
    _, done, failed = dst.get_finished()
    return done, failed


def _same_blocks(dst: WorkerConnector, src: WorkerConnector, layers: range) -> bool:
    """Whether the destination's ``DST_IDS`` hold the source's first three blocks, bit for bit,
    in the model ``layers`` (both connectors hold them)."""
    for layer in layers:
        got = dst.kv_caches[layer - dst.layers.start]
        want = src.kv_caches[layer - src.layers.start]
        for s, d in zip(SRC_TABLE[:3], DST_IDS, strict=True):
            if not torch.equal(got[:, d].view(torch.uint8), want[:, s].view(torch.uint8)):
                return False
    return True


def _snapshot(c: WorkerConnector) -> list[torch.Tensor]:
    return [t.clone() for t in c.kv_caches]


def _unchanged(c: WorkerConnector, before: list[torch.Tensor]) -> bool:
    return all(torch.equal(a, b) for a, b in zip(c.kv_caches, before, strict=True))


def _sending(c: WorkerConnector) -> set[str] | None:
    return c.get_finished()[0]


# -- the round trip --------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pulled_blocks_land_bit_for_bit_and_end_the_lease(
    make: Callable[..., GrpcWorkerConnector], dtype: torch.dtype
) -> None:
    src, dst = make(dtype=dtype), make(num_blocks=12, seed=1, dtype=dtype)
    handle = _save(src)
    (segment,) = handle
    assert segment.in_place and segment.layers == range(NUM_LAYERS)
    lease = segment.handle
    assert isinstance(lease, GrpcLease) and lease.address == src.address
    assert lease.num_blocks == 3 and pickle.loads(pickle.dumps(lease)) == lease
    assert _sending(src) is None  # held until pulled
    before = _snapshot(dst)

    assert _load(dst, handle) == ({"r"}, None)
    assert _same_blocks(dst, src, range(NUM_LAYERS))
    others = [b for b in range(12) if b not in DST_IDS]
    for layer, old in zip(dst.kv_caches, before, strict=True):
        assert torch.equal(layer[:, others], old[:, others])
    per_block = NUM_LAYERS * 2 * BLOCK * KV_HEADS * HEAD_DIM * dtype.itemsize
    assert dst.report().bytes_loaded == 3 * per_block
    # The lease ended with the pull: reported once, and gone.
    assert _sending(src) == {"r"}
    assert _sending(src) is None and len(src.leases) == 0
    with pytest.raises(ConnectionError, match="NOT_FOUND"):
        dst._fetch(lease, range(NUM_LAYERS), 5.0)


def test_registry_builds_it_from_the_config_options() -> None:
    from cluster.config import KVTransferConfig

    options = KVTransferConfig(transport="grpc", timeout_s=2.0).connector_options()
    connector = create_worker_connector("grpc", **options)
    try:
        assert isinstance(connector, GrpcWorkerConnector)
        assert connector.lease_s == 3.0 and connector.serves_in_place
    finally:
        connector.close()


def test_a_chunk_smaller_than_a_block_works(make: Callable[..., GrpcWorkerConnector]) -> None:
    block_bytes = BLOCK * KV_HEADS * HEAD_DIM * 4  # one block of K (float32): 256 bytes
    src = make(chunk_size_bytes=block_bytes // 3)  # 86 bytes: chunks straddle blocks
    dst = make(num_blocks=12, seed=1, chunk_size_bytes=block_bytes // 3)
    assert _load(dst, _save(src)) == ({"r"}, None)
    assert _same_blocks(dst, src, range(NUM_LAYERS))


def test_the_stream_is_plain_protobuf_for_any_client(
    make: Callable[..., GrpcWorkerConnector],
) -> None:
    """The generated stub (protobuf all the way) reads what the hand-framed server sends."""
    src = make(dtype=torch.bfloat16, chunk_size_bytes=1000)
    (segment,) = _save(src)
    lease = segment.handle
    request = pb.PullRequest(lease_id=lease.lease_id, first_layer=1, last_layer=3)
    with grpc.insecure_channel(lease.address) as channel:
        stub = pb_grpc.KVTransferStub(channel)
        messages = list(stub.Pull(request, timeout=5.0, metadata=((TOKEN_METADATA_KEY, TOKEN),)))
    header = messages[0].header
    assert messages[0].WhichOneof("kind") == "header"
    assert (header.first_layer, header.num_layers, header.num_blocks) == (1, 2, 3)
    assert header.dtype == pb.DTYPE_BFLOAT16
    assert all(m.WhichOneof("kind") == "data" for m in messages[1:])
    data = b"".join(m.data for m in messages[1:])
    assert {len(m.data) for m in messages[1:-1]} == {1000}
    index = torch.tensor(SRC_TABLE[:3])
    want = b"".join(
        src.kv_caches[layer].index_select(1, index).view(torch.int16).numpy().tobytes()
        for layer in (1, 2)
    )
    assert header.total_bytes == len(data) and data == want


@pytest.mark.parametrize("size", [0, 1, 127, 128, 16383, 16384, (1 << 20) + 3])
def test_data_framing_round_trips_through_protobuf(size: int) -> None:
    payload = bytes(i % 251 for i in range(size))
    parts = [memoryview(payload)[: size // 2], memoryview(payload)[size // 2 :]]
    framed = frame(parts, size)
    assert pb.PullChunk.FromString(framed).data == payload
    assert pb.PullChunk(data=payload).SerializeToString() == framed
    start, length = unframe(framed)
    assert framed[start : start + length] == payload


@pytest.mark.parametrize(
    "message",
    [
        b"",
        pb.PullChunk(header=pb.PullHeader(num_layers=1)).SerializeToString(),
        b"\x12\x05abc",  # shorter than announced
        b"\x12\x80",  # a varint cut short
        b"\x12\x01ab",  # longer than announced
    ],
)
def test_malformed_data_messages_are_refused(message: bytes) -> None:
    with pytest.raises(ValueError):
        unframe(message)


# -- layer ranges (pipeline stages on either side) ---------------------------------------------
def test_decode_stages_pull_their_ranges_and_the_lease_ends_after_both(
    make: Callable[..., GrpcWorkerConnector],
) -> None:
    src = make()
    low = make(num_blocks=12, seed=1, layers=range(0, 1))
    high = make(num_blocks=12, seed=2, layers=range(1, NUM_LAYERS))
    handle = _save(src)
    assert _load(low, handle) == ({"r"}, None)
    assert _same_blocks(low, src, range(0, 1))
    assert _sending(src) is None  # layers 1-3 not pulled yet: still held
    assert _load(high, handle) == ({"r"}, None)
    assert _same_blocks(high, src, range(1, NUM_LAYERS))
    assert _sending(src) == {"r"}
    assert high.report().bytes_loaded == 3 * low.report().bytes_loaded


def test_prefill_stages_each_lease_their_layers_for_one_decode_worker(
    make: Callable[..., GrpcWorkerConnector],
) -> None:
    first, second = make(layers=range(0, 3)), make(seed=5, layers=range(3, NUM_LAYERS))
    dst = make(num_blocks=12, seed=1)
    handle = sorted(_save(first) + _save(second), key=lambda s: s.first_layer)
    assert [s.layers for s in handle] == [range(0, 3), range(3, NUM_LAYERS)]
    assert _load(dst, handle) == ({"r"}, None)
    assert _same_blocks(dst, first, range(0, 3))
    assert _same_blocks(dst, second, range(3, NUM_LAYERS))
    assert _sending(first) == {"r"} and _sending(second) == {"r"}


class _Context:
    """What ``GrpcWorkerConnector.stream`` asks of a gRPC server context (``active``: the
    puller is still there)."""

    def __init__(self) -> None:
        self.active = True

    def is_active(self) -> bool:
        return self.active

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return ((TOKEN_METADATA_KEY, TOKEN),)

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise RuntimeError(f"{code.name}: {details}")


def test_a_pull_spanning_new_caches_is_cut_short_before_its_last_message(
    make: Callable[..., GrpcWorkerConnector],
) -> None:
    """New caches (a restore) end every lease while a pull streams one: what it still
    gathers may come from the new cache, so its last message is never sent (the puller
    fails the load for the missing bytes) -- while an undisturbed pull sends them all."""
    src = make(chunk_size_bytes=256)
    (segment,) = _save(src)
    lease = src.leases.pin(segment.handle.lease_id, range(NUM_LAYERS))
    whole = list(src.stream(lease, range(NUM_LAYERS), _Context()))
    assert len(whole) > 3 and sum(len(m) for m in whole[1:]) > 0

    pull = src.stream(lease, range(NUM_LAYERS), _Context())
    first = [next(pull), next(pull)]  # the header and a first part of the data
    src.register_kv_caches(_caches(8, torch.float32, 5), range(NUM_LAYERS))
    with pytest.raises(RuntimeError, match="ABORTED: the lease ended during the pull"):
        first.extend(pull)
    assert len(first) < len(whole)


def test_a_pull_its_puller_left_does_not_count_as_pulled(
    make: Callable[..., GrpcWorkerConnector],
) -> None:
    """The puller went away mid-pull (its deadline): the layers it never got stay unpulled,
    so the lease ends by a complete pull or by expiry, not as delivered."""
    src = make(chunk_size_bytes=256)
    (segment,) = _save(src)
    lease_id = segment.handle.lease_id
    request = pb.PullRequest(lease_id=lease_id, first_layer=0, last_layer=NUM_LAYERS)
    context = _Context()
    pull = _KVServicer(src).Pull(request, context)
    next(pull), next(pull)  # the header and a first part of the data
    context.active = False
    list(pull)
    assert _sending(src) is None and len(src.leases) == 1  # still waiting for its pull
    assert list(_KVServicer(src).Pull(request, _Context()))  # a whole pull ends it
    assert _sending(src) == {"r"}


def test_layers_outside_the_lease_are_refused(make: Callable[..., GrpcWorkerConnector]) -> None:
    src, dst = make(layers=range(0, 2)), make(num_blocks=12, seed=1)
    (segment,) = _save(src)
    with pytest.raises(ConnectionError, match="INVALID_ARGUMENT"):
        dst._fetch(segment.handle, range(1, 3), 5.0)
    assert _sending(src) is None  # a refused pull pulls nothing


# -- the token ------------------------------------------------------------------------------
def test_a_wrong_token_is_refused_and_nothing_is_written(
    make: Callable[..., GrpcWorkerConnector],
) -> None:
    src = make()
    dst = make(num_blocks=12, seed=1, auth_token="another-token-0123456789")
    handle = _save(src)
    before = _snapshot(dst)
    assert _load(dst, handle) == (None, {"r"})
    assert _unchanged(dst, before)
    with pytest.raises(ConnectionError, match="UNAUTHENTICATED"):
        dst._fetch(handle[0].handle, range(NUM_LAYERS), 5.0)
    assert _sending(src) is None and len(src.leases) == 1  # the lease is untouched


@pytest.mark.parametrize("metadata", [None, ((TOKEN_METADATA_KEY, ""),), (("other", TOKEN),)])
def test_a_missing_token_is_refused(
    make: Callable[..., GrpcWorkerConnector], metadata: Any
) -> None:
    src = make()
    (segment,) = _save(src)
    lease = segment.handle
    request = pb.PullRequest(lease_id=lease.lease_id, first_layer=0, last_layer=NUM_LAYERS)
    with grpc.insecure_channel(lease.address) as channel:
        call = pb_grpc.KVTransferStub(channel).Pull(request, timeout=5.0, metadata=metadata)
        with pytest.raises(grpc.RpcError) as info:
            list(call)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert len(src.leases) == 1


# -- mutual TLS ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tls() -> TLSMaterial:
    return TLSMaterial.generate()


def test_pulls_over_mutual_tls_land_bit_for_bit(
    make: Callable[..., GrpcWorkerConnector], tls: TLSMaterial
) -> None:
    src = make(tls=tls)
    dst = make(num_blocks=12, seed=1, tls=tls)
    assert _load(dst, _save(src)) == ({"r"}, None)
    assert _same_blocks(dst, src, range(NUM_LAYERS))


def test_a_plaintext_client_cannot_reach_a_tls_server(
    make: Callable[..., GrpcWorkerConnector], tls: TLSMaterial
) -> None:
    src = make(tls=tls)
    dst = make(num_blocks=12, seed=1)  # the right token, no TLS
    handle = _save(src)
    before = _snapshot(dst)
    assert _load(dst, handle) == (None, {"r"})
    assert _unchanged(dst, before) and len(src.leases) == 1


def test_a_certificate_of_another_ca_is_refused_both_ways(
    make: Callable[..., GrpcWorkerConnector], tls: TLSMaterial
) -> None:
    """Another cluster's certificate (its own CA): the server refuses the client's, the client
    refuses the server's. Nothing is read or written either way."""
    other = TLSMaterial.generate()
    src = make(tls=tls)
    dst = make(num_blocks=12, seed=1, tls=other)
    handle = _save(src)
    before = _snapshot(dst)
    assert _load(dst, handle) == (None, {"r"})
    assert _unchanged(dst, before) and len(src.leases) == 1
    with pytest.raises(ConnectionError, match="UNAVAILABLE"):
        dst._fetch(handle[0].handle, range(NUM_LAYERS), 5.0)
    # Our CA, but no client certificate: the server asks for one and gets none.
    lease = handle[0].handle
    request = pb.PullRequest(lease_id=lease.lease_id, first_layer=0, last_layer=NUM_LAYERS)
    credentials = grpc.ssl_channel_credentials(root_certificates=tls.ca)
    options = (("grpc.ssl_target_name_override", tls.server_name),)
    with grpc.secure_channel(lease.address, credentials, options=options) as channel:
        call = pb_grpc.KVTransferStub(channel).Pull(
            request, timeout=5.0, metadata=((TOKEN_METADATA_KEY, TOKEN),)
        )
        with pytest.raises(grpc.RpcError) as info:
            list(call)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert len(src.leases) == 1


def test_the_config_makes_one_cluster_identity_or_reads_it_from_files(tmp_path: Any) -> None:
    from cluster.config import KVTransferConfig

    made = KVTransferConfig(transport="grpc", tls=True)
    tls = made.connector_options()["tls"]
    assert isinstance(tls, TLSMaterial) and b"BEGIN CERTIFICATE" in tls.ca
    assert pickle.loads(pickle.dumps(made)).connector_options()["tls"] == tls  # every worker's copy
    assert "PRIVATE KEY" not in repr(tls)
    assert KVTransferConfig(transport="grpc").connector_options()["tls"] is None
    for name, pem in (("ca", tls.ca), ("cert", tls.cert), ("key", tls.key)):
        (tmp_path / f"{name}.pem").write_bytes(pem)
    files = KVTransferConfig(
        transport="grpc",
        tls=True,
        tls_ca_file=str(tmp_path / "ca.pem"),
        tls_cert_file=str(tmp_path / "cert.pem"),
        tls_key_file=str(tmp_path / "key.pem"),
    )
    assert files.connector_options()["tls"] == tls
    with pytest.raises(ValueError, match="go together"):
        KVTransferConfig(transport="grpc", tls=True, tls_ca_file=str(tmp_path / "ca.pem"))
    with pytest.raises(ValueError, match="ray transport"):
        KVTransferConfig(transport="ray", tls=True)
    with pytest.raises(ValueError, match="tls is false"):
        KVTransferConfig(
            transport="grpc",
            tls_ca_file="a",
            tls_cert_file="b",
            tls_key_file="c",
        )


# -- lease expiry -----------------------------------------------------------------------------
def test_a_release_and_a_new_save_of_one_request_in_one_step_keep_the_new_lease(
    make: Callable[..., GrpcWorkerConnector],
) -> None:
    """A prefill preempted during its saving step: the step that saves its recomputed prompt
    may also carry the release of the old save. The old lease ends, but the request is not
    reported done sending -- that would free the blocks the new lease lends -- until the new
    lease ends too."""
    src, dst = make(), make(num_blocks=12, seed=1)
    _save(src)  # the old save
    src.wait_for_save(
        KVConnectorMetadata(releases=["r"], saves=[SaveSpec("r", 10)]), {"r": SRC_TABLE}
    )
    (segment,) = src.report().saved["r"]
    assert len(src.leases) == 1 and _sending(src) is None
    assert _load(dst, [segment]) == ({"r"}, None)  # the new lease serves
    assert _same_blocks(dst, src, range(NUM_LAYERS))
    assert _sending(src) == {"r"} and len(src.leases) == 0


def test_an_expired_lease_is_reported_and_a_later_pull_fails(
    make: Callable[..., GrpcWorkerConnector],
) -> None:
    src, dst = make(lease_s=0.2), make(num_blocks=12, seed=1)
    handle = _save(src)
    assert _sending(src) is None
    time.sleep(0.3)
    assert _sending(src) == {"r"}  # expired: the prefill side may free the blocks
    assert _sending(src) is None and len(src.leases) == 0
    before = _snapshot(dst)
    assert _load(dst, handle) == (None, {"r"})
    assert _unchanged(dst, before)
    with pytest.raises(ConnectionError, match="NOT_FOUND"):
        dst._fetch(handle[0].handle, range(NUM_LAYERS), 5.0)


def test_a_pull_in_progress_holds_its_lease_past_the_expiry() -> None:
    table = LeaseTable()
    lease_id = table.add("r", [1, 2], range(0, 4), duration_s=0.01)
    other = table.add("s", [3], range(0, 4), duration_s=0.01)
    table.pin(lease_id, range(0, 2))
    time.sleep(0.02)
    assert table.take_ended() == {"s"}  # "r" is being read: its blocks must stay
    table.unpin(lease_id, range(0, 2), complete=False)  # the puller gave up
    assert table.take_ended() == {"r"}
    with pytest.raises(KeyError):
        table.pin(other, range(0, 1))


def test_a_release_during_a_pull_is_not_counted_as_an_expiry() -> None:
    """The decode side lets go of a lease (an abort) while a pull of part of it is reading:
    it ends with that pull, as a release -- it was counted (and logged) as expired, and the
    expiry count is how an operator tells a healthy cluster (0) from a failing one."""
    table = LeaseTable()
    lease_id = table.add("r", [1, 2], range(0, 4), duration_s=60.0)
    table.pin(lease_id, range(0, 2))
    table.end_request("r")
    assert table.take_ended() == set()  # the pull still reads its blocks
    table.unpin(lease_id, range(0, 2), complete=True)  # half the layers: the rest unread
    assert table.take_ended() == {"r"} and table.num_expired == 0
    assert table.take_ended() == set() and len(table) == 0


def test_a_request_ends_when_its_last_lease_does() -> None:
    table = LeaseTable()
    first = table.add("r", [1], range(0, 2), duration_s=60.0)
    second = table.add("r", [1], range(0, 2), duration_s=60.0)
    for lease_id in (first, second):
        table.pin(lease_id, range(0, 2))
    table.unpin(first, range(0, 2), complete=True)
    assert table.take_ended() == set()
    table.unpin(second, range(0, 2), complete=True)
    assert table.take_ended() == {"r"}


def test_new_caches_end_every_lease_unreported(make: Callable[..., GrpcWorkerConnector]) -> None:
    """New caches come with a fresh scheduler (a recovery). It may hold "r" again, placed
    anew; a report of the old lease's end would free the new lease's blocks early (through
    a pipeline's report merger, where another stage's end completes the set)."""
    src = make()
    _save(src)
    src.register_kv_caches(_caches(8, torch.float32, 3), range(NUM_LAYERS))
    assert _sending(src) is None and len(src.leases) == 0
    _save(src)  # "r" again, on the new cache: its own lease is reported when it ends
    src.wait_for_save(KVConnectorMetadata(releases=["r"]), {})
    assert _sending(src) == {"r"}


# -- a source that is gone ------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@pytest.mark.parametrize("how", ["server stopped", "nothing listening"])
def test_a_source_that_is_gone_fails_the_load_fast(
    make: Callable[..., GrpcWorkerConnector], how: str
) -> None:
    src, dst = make(), make(num_blocks=12, seed=1)
    handle = _save(src)
    if how == "server stopped":
        assert _load(dst, _save(src, req_id="warm"), req_id="warm") == ({"warm"}, None)
        src.close()  # the channel to it was open: it finds the server gone
    else:
        lease = handle[0].handle
        moved = GrpcLease(f"127.0.0.1:{_free_port()}", lease.lease_id, 0, NUM_LAYERS, 3)
        handle = [KVSegment(0, NUM_LAYERS, moved, in_place=True)]
    before = _snapshot(dst)
    start = time.monotonic()
    assert _load(dst, handle, timeout_s=10.0) == (None, {"r"})
    assert time.monotonic() - start < 3.0  # refused at once, not at the 10 s deadline
    assert _unchanged(dst, before)
    assert not dst.history[-1].ok


def test_a_decode_worker_keeps_a_bounded_number_of_channels(
    make: Callable[..., GrpcWorkerConnector], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A channel per source address: restarted prefill workers come back on new ports, so
    the old addresses' channels piled up for the worker's life. Past ``MAX_CHANNELS`` the
    least recently used one goes; pulls keep working."""
    from kv_transfer import grpc_transport

    monkeypatch.setattr(grpc_transport, "MAX_CHANNELS", 2)
    sources = [make(seed=i) for i in range(3)]
    dst = make(num_blocks=12, seed=9)
    for i, src in enumerate([*sources, sources[0]]):
        rid = f"r{i}"
        assert _load(dst, _save(src, req_id=rid), req_id=rid) == ({rid}, None)
    assert list(dst._channels) == [sources[2].address, sources[0].address]
    assert not dst._pulling  # no pull holds a channel now


def _serve_again(src: GrpcWorkerConnector) -> None:
    """Stop ``src``'s KV server and start another on the same address (a restarted worker
    that got its port back), serving the same leases."""
    src._server.stop(grace=None)
    server = grpc.server(futures.ThreadPoolExecutor(2), options=[("grpc.so_reuseport", 0)])
    pull = grpc.unary_stream_rpc_method_handler(
        _KVServicer(src).Pull,
        request_deserializer=pb.PullRequest.FromString,
        response_serializer=lambda data: data,
    )
    service = pb.DESCRIPTOR.services_by_name["KVTransfer"].full_name
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(service, {"Pull": pull}),)
    )
    assert src.address is not None
    assert server.add_insecure_port(src.address) == int(src.address.rsplit(":", 1)[1])
    server.start()
    src._server = server  # stopped by ``close``


def test_a_source_back_on_its_address_is_pulled_from_at_once(
    make: Callable[..., GrpcWorkerConnector],
) -> None:
    """A pull from a source that is gone fails (UNAVAILABLE); once it is back on the same
    address the next pull succeeds at once. A failed channel used to stay cached, failing
    every pull until gRPC's reconnect backoff (1 s, growing to minutes) ran out."""
    src, dst = make(), make(num_blocks=12, seed=1)
    (first,) = _save(src, req_id="r0")
    assert dst._fetch(first.handle, range(NUM_LAYERS), 5.0).num_layers == NUM_LAYERS
    (segment,) = _save(src, req_id="r1")
    src._server.stop(grace=None)
    with pytest.raises(ConnectionError, match="UNAVAILABLE"):
        dst._fetch(segment.handle, range(NUM_LAYERS), 5.0)
    _serve_again(src)
    payload = dst._fetch(segment.handle, range(NUM_LAYERS), 5.0)
    assert payload.num_layers == NUM_LAYERS
    assert list(dst._channels) == [src.address] and not dst._pulling and not dst._evicted


def test_a_pull_that_fails_to_start_holds_no_channel(
    make: Callable[..., GrpcWorkerConnector], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pull counted on its channel but failing before its call (here: making the call)
    must be uncounted, or the channel would never be evicted."""
    src, dst = make(), make(num_blocks=12, seed=1)
    (segment,) = _save(src)

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("no call")

    channel = grpc.insecure_channel(src.address or "")
    monkeypatch.setattr(channel, "unary_stream", broken)
    monkeypatch.setattr(grpc, "insecure_channel", lambda *args, **kwargs: channel)
    with pytest.raises(RuntimeError, match="no call"):
        dst._fetch(segment.handle, range(NUM_LAYERS), 5.0)
    assert not dst._pulling
    channel.close()


def test_no_time_left_fails_without_a_call(make: Callable[..., GrpcWorkerConnector]) -> None:
    src, dst = make(), make(num_blocks=12, seed=1)
    (segment,) = _save(src)
    with pytest.raises(TimeoutError):
        dst._fetch(segment.handle, range(NUM_LAYERS), 0.0)
    assert len(src.leases) == 1


def test_a_wildcard_bind_advertises_this_nodes_address_not_a_loopback_name(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Debian maps the host name to 127.0.1.1: a worker on another machine would dial itself
    # and every hand-off from here would quietly recompute.
    monkeypatch.setattr(socket, "gethostbyname", lambda name: "127.0.1.1")
    ray = pytest.importorskip("ray")
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "10.0.0.7")
    assert advertised_host("0.0.0.0", None) == "10.0.0.7"  # in a Ray worker: Ray's node address
    assert advertised_host("::", None) == "10.0.0.7"
    assert advertised_host("0.0.0.0", "kv.example") == "kv.example"  # as given
    assert advertised_host("127.0.0.1", None) == "127.0.0.1"
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    with caplog.at_level("WARNING", logger="kv_transfer.grpc_transport"):
        assert advertised_host("0.0.0.0", None) == "127.0.1.1"  # outside Ray: said
    assert "loopback" in caplog.text and "advertise_host" in caplog.text


def test_an_evicted_channel_closes_when_its_own_pulls_end(
    make: Callable[..., GrpcWorkerConnector],
) -> None:
    """Under steady traffic to one source some pull always runs there (on the new channel):
    the evicted one closes once the pulls on it end, not once every pull to the address
    does (never, then: one more kept open per failure)."""
    dst = make(num_blocks=12, seed=2)
    address = "127.0.0.1:1"
    old, _ = dst._stub(address)  # a pull on the channel that then fails
    dst._evict(address, old)
    new, _ = dst._stub(address)  # the next pull dials afresh and is still running
    assert new is not old
    dst._done_with(address, old)  # the failed pull ends
    assert not dst._evicted  # closed, though a pull to the address runs on
    assert dst._pulling[address] == 1
    dst._done_with(address, new)
    assert not dst._pulling and list(dst._channels) == [address]
