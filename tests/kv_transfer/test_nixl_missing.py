"""Without the nixl extra (NIXL's package not importable, here by its module names): asking
for the transport fails with an error naming the extra, and ``transport: auto`` takes
``ray``. Runs whether or not NIXL is installed."""

from __future__ import annotations

import pytest

from cluster.config import KVTransferConfig
from kv_transfer import nixl_package


@pytest.fixture
def no_nixl(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nixl_package, "MODULES", ("tandem_test_no_such_nixl",))
    assert not nixl_package.nixl_available()


def test_the_nixl_transport_names_the_missing_extra(no_nixl: None) -> None:
    from kv_transfer.registry import create_worker_connector

    options = KVTransferConfig(transport="nixl").connector_options()
    with pytest.raises(ImportError, match=r"pip install 'tandem-serve\[nixl\]'"):
        create_worker_connector("nixl", **options)


def test_auto_takes_ray_without_the_extra(no_nixl: None) -> None:
    assert KVTransferConfig(transport="auto").resolved().transport == "ray"
