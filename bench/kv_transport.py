"""KV transport bandwidth: ``nixl`` (as configured by default; with NIXL READs only; with UCX
forced onto TCP) vs ``grpc`` (plaintext and mutual TLS) vs ``ray`` vs memcpy and a plain TCP
socket copy, for the built-in model's KV layout.

SmolLM2's cache (30 layers, 3 KV heads, head_dim 64, bfloat16, blocks of 16 tokens: 360 KiB per
block, 22.5 KiB per token), random, in two ``KVEndpoint`` actors (a worker's connector and cache,
no model) on a ``ray.cluster_utils.Cluster`` on 127.0.0.1: a head, a ``prefill`` node and a
``decode`` node. The source sits on the prefill node; the destination on the same node
(``same-node``) or on the decode node (``cross-node``).

One transfer = the source saves a prompt's blocks (``wait_for_save``: ``ray`` gathers and
``ray.put``s them; ``grpc`` and ``nixl`` lease them in place), the driver hands the handle
over, the destination loads them into other blocks (``start_load_kv`` until done: ``ray.get`` +
write, the gRPC pull + write, or the NIXL READ straight into the blocks). Times come from the
connectors' ``TransferRecord``s:

- transfer = save copy + load copy (the time spent moving data, as in ``bench/pd_cluster.py``);
  for ``nixl`` the load is end to end: from the decode side's request (descriptors built, READ
  posted) to the blocks being usable;
- bandwidth = bytes / transfer; ratio = bandwidth / memcpy of the same byte count (``np.copyto``
  into a pre-touched array, median), measured in this run with Ray down;
- ``memcpy`` (a row, and the ``x seq`` ratio) = ``np.copyto`` of the same bytes within the
  destination actor's own pool, run through the same sequence as the transports (a call to the
  source, then one to the destination, lengths interleaved): the copy meets the caches and the
  idle core a transfer meets. A cache-hot memcpy in a tight loop (the ``x memcpy`` ratio) is
  2-3.5x faster than the same copy after a few milliseconds idle on this machine;
- ``tcp`` = a plain socket copy of the same bytes between two actors placed like the
  endpoints (one node: loopback within it; two nodes: between them, loopback too here), the
  bar for ``nixl-tcp`` (UCX on TCP only, as where a same-node kernel copy is not permitted).

Lengths and transports are interleaved; a warm-up first pushes the object store's size through
the ``ray`` path (the store's pages are slow on first touch) and a few pulls through ``grpc``.
The first transfer of every (transport, placement, length) is checked bit for bit.

    python -m bench.kv_transport                 # 128 512 2048 tokens, 8 transfers each
    python -m bench.kv_transport --quick         # 128 512, 3 each
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.pd_common import memcpy_bandwidth, ray_cluster

NUM_LAYERS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 30, 3, 64, 16  # SmolLM2-135M
# nixl: the default (a same-node source is copied by one kernel call, kv_transfer/cma.py);
# nixl-read: NIXL READs only (same_node_copy off); nixl-tcp: nixl with kv_transfer.ucx_tls=tcp;
# grpc-tls: grpc with kv_transfer.tls (mutual TLS)
TRANSPORTS = ("nixl", "nixl-read", "nixl-tcp", "grpc", "grpc-tls", "ray", "memcpy")
PLACEMENTS = {"same-node": "prefill", "cross-node": "decode"}  # -> the destination's resource


class KVEndpoint:
    """One side of a transfer: a transport's worker connector over a random bfloat16 cache
    (a Ray actor; plain methods, no model)."""

    def __init__(self, transport: str, options: dict[str, Any], num_blocks: int, seed: int):
        import torch

        from kv_transfer.blocks import allocate_kv_caches
        from kv_transfer.registry import create_worker_connector

        torch.set_num_threads(1)
        gen = torch.Generator().manual_seed(seed)
        self.caches = allocate_kv_caches(
            NUM_LAYERS, num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM, torch.bfloat16
        )
        for cache in self.caches:  # the workers' layout: views of one block-first buffer
            cache.copy_(torch.randn(cache.shape, generator=gen))
        if transport == "memcpy":  # the baseline: a copy within this actor's own pool
            self.connector = None
            flat = torch.empty(0, dtype=torch.bfloat16).set_(self.caches[0].untyped_storage())
            self.pool = flat.view(torch.int16).numpy().reshape(num_blocks, -1)
        else:
            self.connector = create_worker_connector(transport, **options)
            self.connector.register_kv_caches(self.caches, range(NUM_LAYERS))

    def node_id(self) -> str:
        import ray

        return str(ray.get_runtime_context().get_node_id())

    def save(self, req_id: str, block_ids: list[int]) -> tuple[Any, float]:
        """Save ``block_ids`` as ``req_id``; (the handle, seconds the save took)."""
        from kv_transfer.connector import KVConnectorMetadata, SaveSpec

        if self.connector is None:  # memcpy: the handle names the blocks to copy
            return block_ids, 0.0
        meta = KVConnectorMetadata(saves=[SaveSpec(req_id, len(block_ids) * BLOCK_SIZE)])
        self.connector.wait_for_save(meta, {req_id: block_ids})
        record = self.connector.history[-1]
        if not record.ok:
            raise RuntimeError(f"save of {req_id} failed")
        return self.connector.report().saved[req_id], record.copy_seconds

    def load(self, req_id: str, handle: Any, block_ids: list[int]) -> dict[str, Any]:
        """Load ``handle`` into ``block_ids``; the load's record."""
        from kv_transfer.connector import KVConnectorMetadata, LoadSpec

        if self.connector is None:  # memcpy: one np.copyto of the same bytes, timed here
            src, dst = handle, block_ids
            assert src == list(range(src[0], src[0] + len(src)))
            assert dst == list(range(dst[0], dst[0] + len(dst)))
            start = time.perf_counter()
            np.copyto(self.pool[dst[0] : dst[-1] + 1], self.pool[src[0] : src[-1] + 1])
            seconds = time.perf_counter() - start
            nbytes = self.pool[: len(dst)].nbytes
            return {"ok": True, "bytes": nbytes, "copy_s": seconds, "e2e_s": seconds}
        spec = LoadSpec(req_id, handle, block_ids, 0, timeout_s=30.0)
        self._direct = getattr(self.connector, "num_direct_reads", 0)
        self.connector.start_load_kv(KVConnectorMetadata(loads=[spec]))
        while self.connector.num_loading():
            self.connector.start_load_kv(None, idle=True)
        _, done, _ = self.connector.get_finished()
        record = self.connector.history[-1]
        return {
            "ok": bool(done and req_id in done),
            "bytes": record.num_bytes,
            "copy_s": record.copy_seconds,
            "e2e_s": record.seconds,
            # nixl: whether it was the same-node copy (kv_transfer/cma.py), not a NIXL READ
            "direct": getattr(self.connector, "num_direct_reads", 0) > self._direct,
        }

    def finished_sending(self, wait_s: float = 0.0) -> set[str]:
        """Requests whose blocks the source may free now; polls up to ``wait_s`` (nixl: the
        reader's notification comes just after its data)."""
        deadline = time.monotonic() + wait_s
        while True:
            sent = self.connector.get_finished()[0] or set()
            if sent or time.monotonic() >= deadline:
                return sent
            time.sleep(0.001)

    def peer(self) -> Any:
        return self.connector.peer_info()

    def add_peers(self, peers: list[Any]) -> None:
        self.connector.add_peers(peers)

    def digest(self, block_ids: list[int]) -> str:
        """A hash of ``block_ids`` in every layer, in order (to compare two endpoints)."""
        import hashlib

        import torch

        index = torch.tensor(block_ids)
        h = hashlib.sha256()
        for cache in self.caches:
            h.update(cache.index_select(1, index).view(torch.int16).numpy().tobytes())
        return h.hexdigest()

    def close(self) -> None:
        if self.connector is not None:
            self.connector.close()


def _blocks(tokens: int) -> int:
    return -(-tokens // BLOCK_SIZE)


def run_pair(
    args: argparse.Namespace, transport: str, src: Any, dst: Any, label: str
) -> dict[int, list[dict[str, Any]]]:
    """``args.repeat`` transfers of every length from ``src`` to ``dst``, lengths interleaved.
    Source blocks [0, n), destination blocks [n_max, n_max + n): distinct ids, one run each."""
    import ray

    rows: dict[int, list[dict[str, Any]]] = {n: [] for n in args.prompt_tokens}
    top = _blocks(max(args.prompt_tokens))
    for i in range(args.repeat):
        for tokens in args.prompt_tokens:
            n = _blocks(tokens)
            src_ids, dst_ids = list(range(n)), list(range(top, top + n))
            req_id = f"{label}-{tokens}-{i}"
            handle, save_s = ray.get(src.save.remote(req_id, src_ids))
            load = ray.get(dst.load.remote(req_id, handle, dst_ids))
            del handle  # the ray transport's object goes with the last reference
            if not load["ok"]:
                raise RuntimeError(f"{req_id}: the load failed")
            origin = dst if transport == "memcpy" else src  # memcpy copies within dst
            if i == 0 and ray.get(origin.digest.remote(src_ids)) != ray.get(
                dst.digest.remote(dst_ids)
            ):
                raise RuntimeError(f"{req_id}: the destination's blocks differ from the source's")
            if transport.startswith(("grpc", "nixl")):  # the read ended the lease
                sent = ray.get(src.finished_sending.remote(5.0))
                if req_id not in sent:
                    raise RuntimeError(f"{req_id}: the lease did not end with the pull")
            transfer_s = save_s + load["copy_s"]
            rows[tokens].append(
                {
                    "bytes": load["bytes"],
                    "save_s": save_s,
                    "load_copy_s": load["copy_s"],
                    "load_e2e_s": load["e2e_s"],
                    "transfer_s": transfer_s,
                    "bw": load["bytes"] / transfer_s,
                    "direct": load.get("direct", False),
                }
            )
    return rows


def run_all(args: argparse.Namespace) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """Every (placement, transport) pair of endpoints, with warm-ups; raw rows."""
    import ray

    from cluster.config import KVTransferConfig

    endpoint = ray.remote(num_cpus=0)(KVEndpoint)
    num_blocks = 2 * _blocks(max(args.prompt_tokens)) + 8
    kv = KVTransferConfig(transport="grpc", chunk_size_bytes=args.chunk_size_bytes)
    tls = KVTransferConfig(transport="grpc", chunk_size_bytes=args.chunk_size_bytes, tls=True)
    options = {"grpc": kv.connector_options(), "grpc-tls": tls.connector_options(), "ray": {}}
    options["memcpy"] = {}
    options["nixl"] = KVTransferConfig(transport="nixl").connector_options()
    options["nixl-read"] = KVTransferConfig(
        transport="nixl", same_node_copy=False
    ).connector_options()
    options["nixl-tcp"] = KVTransferConfig(transport="nixl", ucx_tls="tcp").connector_options()
    transports = [t for t in TRANSPORTS if t in args.transports]
    per_block = NUM_LAYERS * 2 * BLOCK_SIZE * KV_HEADS * HEAD_DIM * 2
    results: list[dict[str, Any]] = []
    where: dict[str, str] = {}
    for placement, dst_resource in PLACEMENTS.items():
        results.extend(tcp_rows(args, placement, dst_resource))
        for transport in transports:
            kind = transport.removesuffix("-tls").removesuffix("-tcp").removesuffix("-read")
            src = endpoint.options(resources={"prefill": 0.01}).remote(
                kind, options[transport], num_blocks, 0
            )
            dst = endpoint.options(resources={dst_resource: 0.01}).remote(
                kind, options[transport], num_blocks, 1
            )
            nodes = ray.get([src.node_id.remote(), dst.node_id.remote()])
            if kind == "nixl":  # what the control plane does when instances register
                peers = ray.get([src.peer.remote(), dst.peer.remote()])
                ray.get([src.add_peers.remote(peers), dst.add_peers.remote(peers)])
            where[placement] = "one node" if nodes[0] == nodes[1] else "two nodes"
            # Warm-up: the object store's size through the ray path (first touch of its
            # pages), a few transfers through grpc (connections, allocator).
            warm_bytes = args.object_store_mb * 2**20 if transport == "ray" else 0
            count = max(3, -(-warm_bytes // (per_block * _blocks(max(args.prompt_tokens)))))
            warm = argparse.Namespace(prompt_tokens=[max(args.prompt_tokens)], repeat=count)
            run_pair(warm, transport, src, dst, f"warm-{placement}-{transport}")
            start = time.perf_counter()
            rows = run_pair(args, transport, src, dst, f"{placement}-{transport}")
            seconds = time.perf_counter() - start
            print(f"{placement:10s} {transport:8s} {seconds:6.1f} s", flush=True)
            for tokens, samples in rows.items():
                results.append(
                    {"placement": placement, "transport": transport, "tokens": tokens}
                    | _summary(samples)
                    | {"samples": samples}
                )
            ray.get([src.close.remote(), dst.close.remote()])
            for actor in (src, dst):
                ray.kill(actor)
    return results, where


class TcpPeer:
    """One end of a plain TCP socket copy (the bar for ``nixl-tcp``): ``serve`` receives
    ``nbytes`` into a pre-touched buffer and answers one byte; ``send`` times that."""

    def __init__(self) -> None:
        self.server: Any = None

    def serve(self, nbytes: int) -> int:
        import socket
        import threading

        import numpy as np

        server = socket.create_server(("127.0.0.1", 0))
        buffer = np.zeros(nbytes, dtype=np.uint8)

        def run() -> None:
            conn, _ = server.accept()
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            view = memoryview(buffer)
            with conn:
                while True:
                    got = 0
                    while got < nbytes:
                        n = conn.recv_into(view[got:], nbytes - got)
                        if n == 0:
                            return
                        got += n
                    conn.sendall(b"k")

        threading.Thread(target=run, daemon=True).start()
        self.server = server
        port: int = server.getsockname()[1]
        return port

    def send(self, port: int, nbytes: int, repeat: int) -> list[float]:
        import socket

        import numpy as np

        data = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
        times = []
        with socket.create_connection(("127.0.0.1", port)) as conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for i in range(repeat + 2):  # two warm-ups
                start = time.perf_counter()
                conn.sendall(memoryview(data))
                if conn.recv(1) != b"k":
                    raise RuntimeError("the TCP peer did not answer")
                if i >= 2:
                    times.append(time.perf_counter() - start)
        return times


def tcp_rows(args: argparse.Namespace, placement: str, dst_resource: str) -> list[dict[str, Any]]:
    """The plain socket copy of each transfer's bytes, placed like the endpoints."""
    import ray

    peer = ray.remote(num_cpus=0)(TcpPeer)
    per_block = NUM_LAYERS * 2 * BLOCK_SIZE * KV_HEADS * HEAD_DIM * 2
    rows = []
    for tokens in args.prompt_tokens:
        nbytes = _blocks(tokens) * per_block
        receiver = peer.options(resources={"prefill": 0.01}).remote()
        sender = peer.options(resources={dst_resource: 0.01}).remote()
        port = ray.get(receiver.serve.remote(nbytes))
        times = ray.get(sender.send.remote(port, nbytes, args.repeat))
        samples = [
            {"bytes": nbytes, "save_s": 0.0, "load_copy_s": t, "load_e2e_s": t, "transfer_s": t}
            | {"bw": nbytes / t}
            for t in times
        ]
        rows.append(
            {"placement": placement, "transport": "tcp", "tokens": tokens}
            | _summary(samples)
            | {"samples": samples}
        )
        for actor in (receiver, sender):
            ray.kill(actor)
    return rows


def _summary(samples: list[dict[str, Any]]) -> dict[str, Any]:
    def p50(key: str) -> float:
        return float(statistics.median(s[key] for s in samples))

    return {
        "transfers": len(samples),
        "bytes": samples[0]["bytes"],
        "save_s_p50": p50("save_s"),
        "load_copy_s_p50": p50("load_copy_s"),
        "load_e2e_s_p50": p50("load_e2e_s"),
        "transfer_s_p50": p50("transfer_s"),
        "bw_p50": p50("bw"),
        "bw_max": max(s["bw"] for s in samples),
        "direct_share": sum(bool(s.get("direct")) for s in samples) / len(samples),
    }


def report(results: list[dict[str, Any]], where: dict[str, str]) -> list[dict[str, Any]]:
    """memcpy of each byte count (Ray down), ratios, and the table."""
    sizes = sorted({r["bytes"] for r in results})
    memcpy = {n: memcpy_bandwidth(n, min_time_s=0.2, min_iters=10) for n in sizes}
    rows = []
    print(
        "\nKV transfer bandwidth (SmolLM2 layout, bf16; transfer = save copy + load copy; "
        "memcpy = np.copyto of the same bytes, median)"
    )
    head = (
        f"{'placement':22s} {'tokens':>6s} {'MiB':>6s} {'transport':>9s} {'save ms':>8s} "
        f"{'load ms':>8s} {'GB/s':>6s} {'x memcpy':>8s} {'x seq':>6s} {'x tcp':>6s}"
    )
    tcp = {(r["placement"], r["tokens"]): r["bw_p50"] for r in results if r["transport"] == "tcp"}
    seq = {
        (r["placement"], r["tokens"]): r["bw_p50"] for r in results if r["transport"] == "memcpy"
    }
    print(head)
    print("-" * len(head))
    for r in sorted(results, key=lambda r: (r["placement"], r["tokens"], r["transport"])):
        mc = memcpy[r["bytes"]]["prealloc_bw"]
        row = {k: v for k, v in r.items() if k != "samples"} | {
            "memcpy_bw": mc,
            "ratio_to_memcpy": r["bw_p50"] / mc,
            "where": where[r["placement"]],
        }
        bar = tcp.get((r["placement"], r["tokens"]))
        row["ratio_to_tcp"] = None if bar is None else r["bw_p50"] / bar
        in_seq = seq.get((r["placement"], r["tokens"]))
        row["ratio_to_memcpy_in_sequence"] = None if in_seq is None else r["bw_p50"] / in_seq
        rows.append(row | {"samples": r["samples"]})
        print(
            f"{r['placement'] + ' (' + where[r['placement']] + ')':22s} {r['tokens']:6d} "
            f"{r['bytes'] / 2**20:6.1f} {r['transport']:>9s} {r['save_s_p50'] * 1e3:8.2f} "
            f"{r['load_copy_s_p50'] * 1e3:8.2f} {r['bw_p50'] / 1e9:6.2f} "
            f"{row['ratio_to_memcpy']:8.3f} "
            + ("     - " if in_seq is None else f"{row['ratio_to_memcpy_in_sequence']:6.3f} ")
            + ("     -" if bar is None else f"{row['ratio_to_tcp']:6.2f}")
            + ("  (same-node copy)" if r["direct_share"] == 1.0 else "")
            + (f"  ({r['direct_share']:.0%} same-node copies)" if 0 < r["direct_share"] < 1 else "")
        )
    print(
        "memcpy: "
        + ", ".join(
            f"{n / 2**20:.1f} MiB {m['prealloc_bw'] / 1e9:.1f} GB/s" for n, m in memcpy.items()
        )
    )
    return rows


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--prompt-tokens", type=int, nargs="+", default=None, help="128 512 2048")
    ap.add_argument("--repeat", type=int, default=None, help="transfers per cell; default 8")
    ap.add_argument("--chunk-size-bytes", type=int, default=1 << 20, help="grpc data messages")
    ap.add_argument("--object-store-mb", type=int, default=256, help="per Ray node")
    ap.add_argument("--quick", action="store_true", help="128 512 tokens, 3 transfers each")
    ap.add_argument(
        "--transports", nargs="+", default=list(TRANSPORTS), help=f"of {', '.join(TRANSPORTS)}"
    )
    ap.add_argument("--out", default=None, help="default: bench/results/kv_transport.json")
    args = ap.parse_args()
    default_tokens = [128, 512] if args.quick else [128, 512, 2048]
    args.prompt_tokens = sorted(set(args.prompt_tokens or default_tokens))
    args.repeat = args.repeat or (3 if args.quick else 8)
    args.out = args.out or f"bench/results/kv_transport{'_quick' if args.quick else ''}.json"
    if min(args.prompt_tokens) < 1 or args.repeat < 1:
        ap.error("--prompt-tokens and --repeat must be >= 1")
    return args


def main() -> None:
    args = parse_args()
    from cluster.control.launch import ray_env_defaults

    ray_env_defaults()
    os.environ.setdefault("RAY_TMPDIR", str(Path(tempfile.gettempdir()) / "tandem-kv-bench"))
    import ray
    import torch

    with ray_cluster(args.object_store_mb * 2**20):
        results, where = run_all(args)
    rows = report(results, where)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "load_avg": os.getloadavg(),
        "torch": torch.__version__,
        "ray": ray.__version__,
        "layout": {
            "num_layers": NUM_LAYERS,
            "kv_heads": KV_HEADS,
            "head_dim": HEAD_DIM,
            "block_size": BLOCK_SIZE,
            "dtype": "bfloat16",
        },
        "chunk_size_bytes": args.chunk_size_bytes,
        "repeat": args.repeat,
    }
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
