"""The etcd-backed registry over TLS with client certificates (etcd's ``--client-cert-auth``): certificates
made by ``openssl`` in the test, one etcd member on loopback. A replica with the CA and its client
certificate serves; one without a certificate is refused by etcd within its deadline, saying so."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import uuid
from pathlib import Path

import anyio
import pytest

import refitflow as rf
from refitflow.registry.client.client import RegistryClient
from refitflow.registry.service.etcd.keys import EtcdTLS
from refitflow.registry.service.etcd.store import EtcdStore
from tests.registry._etcd import free_port, require
from tests.registry.test_registry_client import ID, manifest


def openssl(*args: str, cwd: Path) -> None:
    if shutil.which("openssl") is None:
        raise RuntimeError("`openssl` is not installed: apt-get install openssl")
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def certificates(where: Path) -> None:
    """ca.crt; server.crt/key for 127.0.0.1; client.crt/key."""
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=refitflow-test-ca",
            "-keyout", "ca.key", "-out", "ca.crt", cwd=where)  # fmt: skip
    (where / "san.cnf").write_text("subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth\n")
    for name in ("server", "client"):
        openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}", "-keyout", f"{name}.key",
                "-out", f"{name}.csr", cwd=where)  # fmt: skip
        openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
                "-days", "2", "-extfile", "san.cnf", "-out", f"{name}.crt", cwd=where)  # fmt: skip


@contextlib.contextmanager
def tls_etcd(where: Path) -> object:
    require()
    client, peer = free_port(), free_port()
    log = (where / "etcd.log").open("ab")
    proc = subprocess.Popen(
        ["etcd", "--name", "t", "--data-dir", str(where / "data"),
         "--listen-client-urls", f"https://127.0.0.1:{client}", "--advertise-client-urls", f"https://127.0.0.1:{client}",
         "--listen-peer-urls", f"http://127.0.0.1:{peer}", "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
         "--initial-cluster", f"t=http://127.0.0.1:{peer}",
         "--cert-file", str(where / "server.crt"), "--key-file", str(where / "server.key"),
         "--trusted-ca-file", str(where / "ca.crt"), "--client-cert-auth"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    try:
        yield f"etcd://127.0.0.1:{client}"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
        log.close()


@pytest.mark.asyncio
async def test_the_etcd_store_speaks_tls_with_a_client_certificate(tmp_path: Path) -> None:
    certificates(tmp_path)
    tls = EtcdTLS(ca_file=tmp_path / "ca.crt", cert_file=tmp_path / "client.crt", key_file=tmp_path / "client.key")
    with tls_etcd(tmp_path) as url, anyio.fail_after(60):
        ns = uuid.uuid4().hex[:10]
        async with (
            EtcdStore.open(url, namespace=ns, tls=tls, op_timeout_s=15.0) as store,  # etcd takes a moment to listen
            rf.Registry.serve("tcp://127.0.0.1:*", registry=store) as server,
            RegistryClient(server.address) as client,
        ):
            await client.publish(manifest(1, 0, world=1))
            assert (await client.latest(ID)) is not None
        no_cert = EtcdTLS(ca_file=tmp_path / "ca.crt")
        with pytest.raises(rf.RefitTimeoutError, match="did not answer"):
            async with EtcdStore.open(url, namespace=ns, tls=no_cert, op_timeout_s=2.0):
                pass
        with pytest.raises(rf.ConfigError, match="go together"):
            EtcdTLS(ca_file=tmp_path / "ca.crt", cert_file=tmp_path / "client.crt")
