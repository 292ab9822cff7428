"""``bench.pd_cluster``'s KV transfer figures depend on the transport the P/D clusters run: the
bench asks for one (``--kv-transport``; ``auto`` is nixl where it imports), records the one it
got, and says what a transfer is for it -- not ray's two copies whichever ran."""

from __future__ import annotations

import argparse

import pytest

from bench.pd_common import cluster_configs
from bench.pd_report import transfer_note


@pytest.mark.parametrize("transport", ["auto", "ray", "nixl", "grpc"])
def test_the_clusters_use_the_transport_asked_for(transport: str) -> None:
    args = argparse.Namespace(
        model=None, dtype="auto", colocated_threads=2, pd_threads=1, kv_transport=transport
    )
    configs = cluster_configs(args, 64)
    assert configs["disaggregated"].kv_transfer.transport == transport
    assert configs["colocated"].kv_transfer.transport == transport


def test_the_note_names_the_copies_of_the_transport_that_ran() -> None:
    ray = transfer_note("ray")
    assert "two copies" in ray and "0.5" in ray
    nixl = transfer_note("nixl")
    assert "one copy" in nixl and "1.0" in nixl and "0.5" not in nixl
    assert "not recorded" in transfer_note(None)
