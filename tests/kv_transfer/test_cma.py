"""The same-node copy (``kv_transfer/cma.py``): a reader attaches only to the process that
published the token it was given, copies spans bit for bit, and never reads a source that
has exited."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from dataclasses import replace

import numpy as np
import pytest

from kv_transfer.cma import IOV_MAX, SourceProcess, StaleSource, Token, TokenHolder, host_id

pytestmark = pytest.mark.skipif(
    TokenHolder().token is None, reason="no process_vm_readv / pidfd / boot id here"
)

SOURCE = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    from kv_transfer.cma import TokenHolder
    holder = TokenHolder()
    data = np.arange(1 << 16, dtype=np.uint32).view(np.uint8)
    token = holder.token
    print(json.dumps({"pid": token.pid, "host": token.host, "address": token.address,
                      "value": token.value.hex(), "data": data.ctypes.data}), flush=True)
    for line in sys.stdin:  # "renew" or "clear", answered "ok", until the test closes it
        getattr(holder, line.strip())()
        print("ok", flush=True)
    """
)


@pytest.fixture
def source() -> Iterator[tuple[subprocess.Popen[str], Token, int]]:
    """Another process publishing a token, and the address of 256 KiB of known bytes in it."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.Popen(
        [sys.executable, "-c", SOURCE],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=root,
    )
    assert proc.stdout is not None
    info = json.loads(proc.stdout.readline())
    token = Token(info["host"], info["pid"], info["address"], bytes.fromhex(info["value"]))
    try:
        yield proc, token, info["data"]
    finally:
        proc.kill()
        proc.wait()


def _spans(
    dst: np.ndarray, base: int, pairs: list[tuple[int, int, int]]
) -> tuple[np.ndarray, np.ndarray]:
    local = np.array([[dst.ctypes.data + d, n, 0] for _, d, n in pairs], dtype=np.uint64)
    remote = np.array([[base + s, n, 0] for s, _, n in pairs], dtype=np.uint64)
    return local, remote


def test_spans_are_copied_bit_for_bit(source: tuple[subprocess.Popen[str], Token, int]) -> None:
    _, token, base = source
    reader = SourceProcess.attach(token)
    assert reader is not None and reader.alive
    want = np.arange(1 << 16, dtype=np.uint32).view(np.uint8)
    dst = np.zeros(1 << 16, dtype=np.uint8)
    pairs = [(4096, 0, 1000), (100_000, 1000, 20_000), (0, 30_000, 7)]  # (src, dst, length)
    assert reader.read(*_spans(dst, base, pairs)) == 21_007
    for s, d, n in pairs:
        assert np.array_equal(dst[d : d + n], want[s : s + n])
    assert not dst[21_000:30_000].any() and not dst[30_007:].any()  # nothing else written
    reader.close()


def test_only_the_publisher_is_attached(source: tuple[subprocess.Popen[str], Token, int]) -> None:
    _, token, _ = source
    assert SourceProcess.attach(replace(token, value=bytes(16))) is None  # another value
    assert SourceProcess.attach(replace(token, host="another-machine")) is None
    assert SourceProcess.attach(replace(token, pid=2**22 + 7)) is None  # no such process
    assert token.host == host_id()


def test_a_source_that_exited_is_never_read(
    source: tuple[subprocess.Popen[str], Token, int],
) -> None:
    proc, token, base = source
    reader = SourceProcess.attach(token)
    assert reader is not None
    dst = np.zeros(64, dtype=np.uint8)
    proc.kill()
    proc.wait()
    assert not reader.alive
    with pytest.raises(ProcessLookupError):
        reader.read(*_spans(dst, base, [(0, 0, 64)]))
    assert not dst.any()


def test_a_span_the_source_does_not_have_fails_the_read(
    source: tuple[subprocess.Popen[str], Token, int],
) -> None:
    _, token, _ = source
    reader = SourceProcess.attach(token)
    assert reader is not None
    dst = np.zeros(64, dtype=np.uint8)
    with pytest.raises(OSError, match="copied"):
        reader.read(*_spans(dst, 8, [(0, 0, 64)]))  # address 8: unmapped in any process
    with pytest.raises(ValueError, match="differ"):
        reader.read(
            np.array([[dst.ctypes.data, 64]], dtype=np.uint64),
            np.array([[token.address, 16]], dtype=np.uint64),
        )


def test_more_spans_than_one_call_takes(source: tuple[subprocess.Popen[str], Token, int]) -> None:
    _, token, base = source
    reader = SourceProcess.attach(token)
    assert reader is not None
    want = np.arange(1 << 16, dtype=np.uint32).view(np.uint8)
    dst = np.zeros(1 << 16, dtype=np.uint8)
    count = 2 * IOV_MAX + 452  # three calls
    pairs = [(7 * i, 8 * i, 5) for i in range(count)]  # overlapping reads, spread writes
    assert reader.read(*_spans(dst, base, pairs)) == 5 * count
    for s, d, n in pairs:
        assert np.array_equal(dst[d : d + n], want[s : s + n])


@pytest.mark.parametrize("command", ["renew", "clear"])
def test_a_source_that_replaced_or_closed_its_cache_is_not_read(
    source: tuple[subprocess.Popen[str], Token, int], command: str
) -> None:
    """The source renews its token before a new cache and clears it before closing: a reader
    attached to the old one copies nothing (and would throw a copy away if it changed during
    the copy: the token is checked again after it)."""
    proc, token, base = source
    reader = SourceProcess.attach(token)
    assert reader is not None
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(command + "\n")
    proc.stdin.flush()
    assert proc.stdout.readline().strip() == "ok"
    dst = np.zeros(64, dtype=np.uint8)
    with pytest.raises(StaleSource):
        reader.read(*_spans(dst, base, [(0, 0, 64)]))
    assert not dst.any()
    assert reader.alive  # alive, but not the cache it was attached to


def test_a_change_during_the_copy_throws_the_copy_away(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check after the copy: the source renews its token (a new cache) while the data is
    being copied -- here between the data's copy and the second check, in this process -- and
    the read fails although every byte arrived."""
    holder = TokenHolder()
    assert holder.token is not None
    reader = SourceProcess.attach(holder.token)
    assert reader is not None
    data = np.arange(4096, dtype=np.uint32).view(np.uint8)
    dst = np.zeros(64, dtype=np.uint8)
    copy = SourceProcess._copy

    def copy_then_renew(self: SourceProcess, local: np.ndarray, remote: np.ndarray) -> int:
        done = copy(self, local, remote)
        if int(remote[0, 0]) != self.token.address:  # the data, not a check of the token
            holder.renew()
        return done

    monkeypatch.setattr(SourceProcess, "_copy", copy_then_renew)
    with pytest.raises(StaleSource):
        reader.read(*_spans(dst, data.ctypes.data, [(0, 0, 64)]))
    assert np.array_equal(dst, data[:64])  # it did arrive: only the check refused it
