"""The fault matrix on each registry store (docs/reliability.md): in memory, and on etcd.

A test that asks for the ``store`` fixture (or whose module uses it: ``pytestmark``) runs once per store. On
``etcd``, every registry it serves keeps its state in a one-member etcd cluster on loopback (one for the
session, a namespace of its own per test): ``rf.Registry.serve`` in this process opens an ``EtcdStore`` under
the registry it serves, and the ``refitflow registry`` processes it starts get ``REFITFLOW_REGISTRY_STORE``.
A restart of such a registry keeps its state and its incarnation (the state is etcd's): tests whose verdict
rests on that say how. ``@pytest.mark.stores("memory")`` keeps a test to the stores named, saying why.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator, Iterator
from functools import partial
from typing import Any

import pytest

from refitflow.registry.service.embedded import Registry
from refitflow.registry.service.etcd.store import EtcdStore
from refitflow.registry.service.server import RegistryServer, serve
from tests.registry._etcd import Cluster, loopback

STORES = ("memory", "etcd")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "stores(*names): the registry stores a fault test runs on (default: all)")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "store" in metafunc.fixturenames:
        marker = metafunc.definition.get_closest_marker("stores")
        metafunc.parametrize("store", marker.args if marker else STORES, indirect=True)


@pytest.fixture(scope="session")
def etcd_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    cluster = loopback(tmp_path_factory.mktemp("faults-etcd"))
    try:
        yield cluster
    finally:
        cluster.close()


@contextlib.asynccontextmanager
async def serve_on_etcd(url: str, namespace: str, address: str = "tcp://127.0.0.1:7100",
                        **options: Any) -> AsyncIterator[RegistryServer]:  # fmt: skip
    """``Registry.serve`` with its state in etcd (the store a test gave it is kept)."""
    if options.get("registry") is not None:
        async with serve(address, **options) as server:
            yield server
        return
    lease_s = options.pop("lease_s", 10.0)
    async with EtcdStore.open(url, namespace=namespace, lease_s=lease_s, limits=options.get("limits")) as store, \
            serve(address, registry=store, lease_s=lease_s, **options) as server:  # fmt: skip
        yield server


@pytest.fixture
def store(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    name = str(request.param)
    if name == "etcd":
        cluster: Cluster = request.getfixturevalue("etcd_cluster")
        namespace = uuid.uuid4().hex[:12]
        monkeypatch.setenv("REFITFLOW_REGISTRY_STORE", cluster.url)
        monkeypatch.setenv("REFITFLOW_REGISTRY_NAMESPACE", namespace)
        monkeypatch.setattr(Registry, "serve", staticmethod(partial(serve_on_etcd, cluster.url, namespace)))
    return name
