"""The worker side of a KV connector: the per-step hooks a model worker calls, the load
pipeline every transport shares, and the shape of ``kv_transfer_params``.

Per-step order on a worker (DESIGN §3.2, vLLM v1's names)::

    start_load_kv(metadata)         fetches of this step's loads begin (background threads);
                                    fetched data is written into its blocks now, between
                                    forward passes, so a load never races the model
    wait_for_layer_load(layer)      no-op here: loads land before the forward starts
    forward pass
    save_kv_layer(layer, ...)       no-op here: the whole prompt is copied at once, below
    wait_for_save(metadata, tables) this step's saves are copied out of the cache
    get_finished()                  -> (sending done, receiving done, receives failed)
    report()                        -> KVConnectorReport (handles of saved KV, bytes moved)

A transport subclasses ``WorkerConnector`` and implements ``_save`` (a ``KVPayload`` -> handle;
a transport that serves blocks in place overrides ``_publish`` instead) and ``_fetch`` (handle and
layer range -> ``KVPayload``); ``kv_transfer.blocks`` gathers and scatters blocks.

Pipeline stages: each stage's connector holds its own layers (``register_kv_caches``). A save
yields one ``KVSegment`` per stage; a load fetches every segment overlapping the stage's layers
and writes only those layers, so a prefill instance with one split hands off to a decode
instance with another.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, TypedDict

from kv_transfer.blocks import KVPayload, gather_blocks, scatter_blocks
from kv_transfer.connector import (
    KVConnectorMetadata,
    KVConnectorReport,
    KVSegment,
    LoadSpec,
    SaveSpec,
)

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


class KVTransferParams(TypedDict, total=False):
    """Where a request's KV is and what to do with it; a plain dict on the request."""

    do_remote_prefill: bool  # decode side: load the prompt's KV instead of computing it
    do_remote_decode: bool  # prefill side: keep the KV for a decode instance to take
    remote_instance_id: str
    remote_block_ids: list[int]
    remote_num_tokens: int
    handle: list[KVSegment]  # per layer range: an object reference, or a gRPC lease
    deadline: float  # absolute time (time.time()) after which the source may be gone
    trace_context: dict[str, str]  # the transfer's span (W3C carrier) when tracing is on


@dataclass
class _Fetched:
    """A fetch's outcome. A failure is a message, not the exception: its traceback would hold
    the fetch's frames -- and the transport handles in them -- in a reference cycle until the
    garbage collector runs (Ray objects would outlive their request)."""

    data: list[KVPayload] | None
    seconds: float
    error: str | None = None


@dataclass
class _Load:
    spec: LoadSpec
    future: cf.Future[_Fetched] | None  # None: a transport that writes in place (nixl)
    started: float  # time.monotonic()
    deadline: float  # time.monotonic()
    started_at: float  # time.time()


@dataclass(frozen=True)
class TransferRecord:
    """One save or one finished load, for benchmarks and metrics."""

    req_id: str
    num_bytes: int
    seconds: float  # load: from the start of the fetch to the data in the blocks (waits too)
    ok: bool
    kind: str = "load"  # "load" (decode side) or "save" (prefill side)
    copy_seconds: float = 0.0  # moving the data only: save = gather + publish, load = fetch + write
    started_at: float = 0.0  # time.time() when it started


class WorkerConnector(ABC):
    """Moves KV blocks in and out of one worker's paged cache (or a stage's layer range).

    Not thread-safe: every public method is called from the worker's step thread; only
    ``_fetch`` runs on the background pool.
    """

    transport: ClassVar[str] = ""
    tracer: Any = None  # set by the worker when tracing is on (kv_transfer.tracing)
    supports_cross_node: ClassVar[bool] = False
    supports_layer_ranges: ClassVar[bool] = False  # can move a pipeline stage's layers alone
    serves_in_place: ClassVar[bool] = False  # the source keeps the blocks until pulled

    def __init__(self, max_parallel_loads: int = 4) -> None:
        self.kv_caches: list[torch.Tensor] = []
        self.layers = range(0)
        self._pool = cf.ThreadPoolExecutor(max_parallel_loads, thread_name_prefix="kv-load")
        self._loads: dict[str, _Load] = {}
        self._recving_done: set[str] = set()
        self._recving_failed: set[str] = set()
        self._report = KVConnectorReport()
        self.history: deque[TransferRecord] = deque(maxlen=4096)
        self.num_reads_started = 0  # loads whose data started to move (fetch begun, READ posted)
        self._count_lock = threading.Lock()
        self.load_delay_s = 0.0  # fault injection for tests: every fetch starts this late

    # -- set-up ----------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: list[torch.Tensor], layers: range) -> None:
        """The worker's caches (one tensor per layer it holds) and which model layers they
        are. Drops any load in progress, and every load's outcome not yet reported: a new
        cache comes with a fresh scheduler, which may hold a request of the same id again (a
        lost request placed anew) whose own load has not landed. The step report not yet
        taken goes too (a step that raised after its loads landed never returned it): its
        loads, bytes and saves belong to the old scheduler's requests."""
        self.kv_caches = kv_caches
        self.layers = layers
        self._loads.clear()
        self._recving_done, self._recving_failed = set(), set()
        self._report = KVConnectorReport()

    def retire_caches(self) -> None:
        """The worker is about to let its caches go (a new cache follows): nothing may read
        them from another process any more. A no-op but where a peer reads in place."""
        return None

    def release_caches(self) -> None:
        """Let go of the caches before the worker allocates the next (``register_kv_caches``
        follows): the two are never held at once (on a GPU sized for one, the second did
        not fit). What may still read or write them keeps them alive itself."""
        self.retire_caches()
        self.kv_caches = []
        self._loads.clear()

    def peer_info(self) -> Any:
        """What peers must know before they can read from this worker (published once per
        cache through the control plane), or None for a transport that needs nothing."""
        return None

    def add_peers(self, peers: list[Any]) -> None:  # noqa: B027
        """Learn other workers' ``peer_info`` (a no-op for transports that need none)."""

    def num_peers(self) -> int:
        """How many other workers' ``peer_info`` this one holds."""
        return 0

    def remove_peers(self, names: list[str]) -> None:  # noqa: B027
        """Forget the peers named ``names`` (``peer_name``): their workers left (a no-op for
        transports that keep nothing per peer)."""

    # -- loading (decode side) -------------------------------------------------------------
    def start_load_kv(self, metadata: KVConnectorMetadata | None, idle: bool = False) -> None:
        """Start this step's fetches; write every fetched load into its blocks. ``idle``: the
        step computes nothing, so wait briefly for a pending fetch rather than spin."""
        now, wall = time.monotonic(), time.time()
        for spec in metadata.loads if metadata else ():
            deadline = now + spec.timeout_s
            future = self._pool.submit(self._delayed_fetch, spec.handle, deadline)
            self._loads[spec.req_id] = _Load(spec, future, now, deadline, wall)
        if idle and self._loads:
            soonest = min(load.deadline for load in self._loads.values())
            wait = min(0.05, max(0.0, soonest - time.monotonic()))
            futures = [load.future for load in self._loads.values() if load.future is not None]
            cf.wait(futures, wait, cf.FIRST_COMPLETED)
        self._apply_loads()

    def wait_for_layer_load(self, layer: int) -> None:  # noqa: B027
        """Loads are written before the forward pass, so every layer is ready."""

    def _delayed_fetch(self, segments: list[KVSegment], deadline: float) -> _Fetched:
        """Fetch on a pool thread, within what is left of the load's ``deadline`` (monotonic):
        a load that queued behind others does not pull past the point its report failed."""
        start = time.perf_counter()
        try:
            timeout_s = deadline - time.monotonic()
            if timeout_s <= 0:
                raise TimeoutError("the load's deadline passed while it queued for a thread")
            data = self._fetch_segments(segments, timeout_s)
        except Exception as exc:
            return _Fetched(None, time.perf_counter() - start, f"{type(exc).__name__}: {exc}")
        return _Fetched(data, time.perf_counter() - start)

    def _fetch_segments(self, segments: list[KVSegment], timeout_s: float) -> list[KVPayload]:
        if self.load_delay_s:
            time.sleep(self.load_delay_s)
        with self._count_lock:  # (the loads' threads)
            self.num_reads_started += 1
        start = time.perf_counter()
        deadline = start + timeout_s
        mine = self.layers
        data, covered = [], 0
        for segment in segments:
            lo, hi = max(segment.first_layer, mine.start), min(segment.last_layer, mine.stop)
            if lo >= hi:
                continue  # another stage's layers
            payload = self._fetch(segment.handle, range(lo, hi), deadline - time.perf_counter())
            if not (payload.first_layer <= lo and hi <= payload.first_layer + payload.num_layers):
                raise ValueError(f"the source sent layers {payload.layers}, not [{lo}, {hi})")
            data.append(payload)
            covered += hi - lo
        if covered != len(mine):
            raise ValueError(
                f"the saved KV covers {covered} of this worker's {len(mine)} layers "
                f"({[s.layers for s in segments]} vs {mine})"
            )
        return data

    def _apply_loads(self) -> None:
        now = time.monotonic()
        for req_id, load in list(self._loads.items()):
            assert load.future is not None
            if load.future.done():
                del self._loads[req_id]
                self._write(load)
            elif now >= load.deadline:
                # The fetch thread may still finish; its result is dropped unread, so it can
                # never write into blocks that have been handed to someone else.
                del self._loads[req_id]
                load.future.cancel()
                self._end_load(load, 0, f"timed out after {now - load.started:.1f}s")

    def _end_load(
        self, load: _Load, num_bytes: int, error: str | None, copy_seconds: float = 0.0
    ) -> None:
        """A load is over (``error`` None: its blocks hold the data): report it to the
        scheduler (``finished_recving`` / ``failed_recving``), the metrics, the trace and
        the history."""
        spec, ok = load.spec, error is None
        seconds = time.monotonic() - load.started
        if not ok:
            logger.warning("KV load of %s failed: %s", spec.req_id, error)
            num_bytes = 0
        self._report.bytes_loaded += num_bytes
        self._report.loads.append((spec.req_id, seconds, num_bytes, ok))
        self._trace_load(load, num_bytes, ok, error)
        self.history.append(
            TransferRecord(
                spec.req_id, num_bytes, seconds, ok, "load", copy_seconds, load.started_at
            )
        )
        (self._recving_done if ok else self._recving_failed).add(spec.req_id)

    def _trace_save(
        self, spec: SaveSpec, started_at: float, num_bytes: int, error: str | None
    ) -> None:
        """The save (copy-out or lease) as a span of the request's trace, from this worker."""
        if self.tracer is None or not spec.trace_context:
            return
        from kv_transfer.tracing import extract

        span = self.tracer.start_span(
            "tandem.kv_save",
            context=extract(spec.trace_context),
            start_time=int(started_at * 1e9),
            attributes={
                "tandem.kv.transport": self.transport,
                "tandem.kv.bytes": num_bytes,
                "tandem.kv.in_place": self.serves_in_place,
                "tandem.kv.layers": f"{self.layers.start}-{self.layers.stop}",
                "tandem.kv.outcome": "failed" if error else "ok",
            },
        )
        if error:
            from opentelemetry.trace import Status, StatusCode

            span.set_status(Status(StatusCode.ERROR, error))
        span.end()

    def _trace_load(self, load: _Load, num_bytes: int, ok: bool, error: str | None) -> None:
        """The load as a span of the request's trace (this worker's node, its timing)."""
        tracer = self.tracer
        carrier = load.spec.trace_context
        if tracer is None or not carrier:
            return
        from kv_transfer.tracing import extract

        span = tracer.start_span(
            "tandem.kv_load",
            context=extract(carrier),
            start_time=int(load.started_at * 1e9),
            attributes={
                "tandem.kv.transport": self.transport,
                "tandem.kv.bytes": num_bytes,
                "tandem.kv.blocks": len(load.spec.block_ids),
                "tandem.kv.outcome": "ok" if ok else "failed",
                "tandem.kv.layers": f"{self.layers.start}-{self.layers.stop}",
            },
        )
        if error:
            from opentelemetry.trace import Status, StatusCode

            span.set_status(Status(StatusCode.ERROR, error))
        span.end()

    def _write(self, load: _Load) -> None:
        assert load.future is not None
        fetched = load.future.result()
        data, error = fetched.data, fetched.error
        num_bytes, copy_seconds = 0, 0.0
        try:
            if data is None:
                raise ConnectionError(error)
            start = time.perf_counter()
            num_bytes = self._scatter(load.spec, data)
            copy_seconds = fetched.seconds + time.perf_counter() - start
        except Exception as exc:  # any failure of a load means "recompute" (or "fail")
            error = f"{type(exc).__name__}: {exc}"
        finally:
            # Release the transport's buffers (an object store pin) now.
            del data, fetched
        self._end_load(load, num_bytes, error, copy_seconds)

    def _scatter(self, spec: LoadSpec, data: list[KVPayload]) -> int:
        """Write each fetched payload's overlap with this worker's layers. A payload that does
        not fit raises before writing; one written earlier only touched this request's own
        blocks, which a failed load recomputes anyway."""
        mine, written = self.layers, 0
        for payload in data:
            lo = max(payload.first_layer, mine.start)
            hi = min(payload.first_layer + payload.num_layers, mine.stop)
            written += scatter_blocks(
                self.kv_caches,
                spec.block_ids,
                payload,
                spec.first_block,
                range(lo - mine.start, hi - mine.start),
                payload_layer_offset=lo - payload.first_layer,
            )
        return written

    def num_loading(self) -> int:
        return len(self._loads)

    # -- saving (prefill side) -------------------------------------------------------------
    def save_kv_layer(self, layer: int, kv_layer: Any, metadata: Any) -> None:  # noqa: B027
        """Saves copy all layers at once in ``wait_for_save``."""

    def wait_for_save(
        self, metadata: KVConnectorMetadata | None, block_tables: Mapping[str, list[int]]
    ) -> None:
        """Copy out the KV of this step's saves (after the forward pass wrote it); end the
        leases of saves nobody will take (``metadata.releases``)."""
        if metadata and metadata.releases:
            self._release_saved(metadata.releases)
        if not metadata or not metadata.saves:
            return
        block_size = self.kv_caches[0].shape[2]
        for spec in metadata.saves:
            table = block_tables.get(spec.req_id)
            if table is None:  # finished meanwhile: nothing to hand off
                continue
            num_blocks = -(-spec.num_tokens // block_size)
            started_at, start = time.time(), time.perf_counter()
            try:
                handle, nbytes = self._publish(spec.req_id, table[:num_blocks])
                segment = KVSegment(
                    self.layers.start, self.layers.stop, handle, self.serves_in_place
                )
                self._report.saved[spec.req_id] = [segment]
            except Exception as exc:  # e.g. the object store is full: the decode side recomputes
                logger.warning("KV save of %s failed: %s: %s", spec.req_id, type(exc).__name__, exc)
                self._trace_save(spec, started_at, 0, f"{type(exc).__name__}: {exc}")
                self.history.append(
                    TransferRecord(
                        spec.req_id, 0, time.perf_counter() - start, False, "save", 0.0, started_at
                    )
                )
                continue
            seconds = time.perf_counter() - start
            self._report.bytes_saved += nbytes
            self._trace_save(spec, started_at, nbytes, None)
            self.history.append(
                TransferRecord(spec.req_id, nbytes, seconds, True, "save", seconds, started_at)
            )

    def _release_saved(self, req_ids: list[str]) -> None:
        """In-place transports: end these requests' leases now (reported as sending done).
        Copy-out transports keep nothing to end."""
        leases = getattr(self, "leases", None)
        if leases is not None:
            for req_id in req_ids:
                leases.end_request(req_id)

    def _publish(self, req_id: str, block_ids: list[int]) -> tuple[Any, int]:
        """Make the blocks of this worker's layers fetchable; ``(handle, bytes)``. Copy-out
        transports gather the blocks and ``_save`` them; an in-place transport overrides this
        to lease the blocks instead."""
        data = gather_blocks(self.kv_caches, block_ids)
        data.first_layer = self.layers.start
        return self._save(req_id, data), data.nbytes

    # -- reports ---------------------------------------------------------------------------
    def get_finished(self) -> tuple[set[str] | None, set[str] | None, set[str] | None]:
        """``(sending done, receiving done, receives failed)`` since the last call."""
        done, failed = self._recving_done, self._recving_failed
        self._recving_done, self._recving_failed = set(), set()
        sending = self._finished_sending()
        return sending or None, done or None, failed or None

    def _finished_sending(self) -> set[str]:
        """In-place transports: requests whose blocks the source no longer needs (pulled,
        or the lease expired) since the last call."""
        return set()

    def report(self) -> KVConnectorReport:
        """Handles of this step's saves and bytes moved since the last call."""
        report, self._report = self._report, KVConnectorReport()
        return report

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._loads.clear()

    # -- the transport ---------------------------------------------------------------------
    def _save(self, req_id: str, data: KVPayload) -> Any:
        """Make ``data`` fetchable elsewhere and return its handle. Its pieces are views of
        the cache: copy them before returning."""
        raise NotImplementedError(f"{type(self).__name__} must implement _save or _publish")

    @abstractmethod
    def _fetch(self, handle: Any, layers: range, timeout_s: float) -> KVPayload:
        """The blocks behind ``handle`` for at least the model ``layers`` (a transport may
        return more, e.g. a whole object); raise on failure or after ``timeout_s``. Runs on a
        background thread."""
