"""CLI entries for the registry: ``refitflow registry`` (serve until SIGINT/SIGTERM) and ``refitflow keys``.

Both take the arguments that follow their sub-command. Environment variables are read here only:
``REFITFLOW_REGISTRY_BIND``, ``REFITFLOW_REGISTRY_LEASE_S``, ``REFITFLOW_REGISTRY_STORE`` (``memory`` or
``etcd://h1:2379,h2:2379,h3:2379``), ``REFITFLOW_REGISTRY_NAMESPACE``, ``REFITFLOW_CURVE_SECRET`` (the
server's ``.key_secret``) and ``REFITFLOW_CURVE_AUTHORIZED`` (folder of allowed clients' ``.key``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from refitflow.cli.args import OneLineParser, positive
from refitflow.core.errors import ConfigError, RefitError
from refitflow.registry.address import check_address
from refitflow.registry.limits import RegistryLimits
from refitflow.registry.security import ServerSecurity
from refitflow.registry.service.embedded import Registry
from refitflow.registry.service.etcd.keys import EtcdTLS, endpoints_of

__all__ = ["keys_main", "registry_main"]


def registry_main(argv: Sequence[str] | None = None) -> int:
    """``refitflow registry [--bind tcp://127.0.0.1:7100] [--lease-s 10] [--store memory|etcd://h:2379,…]
    [--namespace NAME] [--curve-secret F --curve-authorized D] [--max-message-bytes N]``."""
    env = os.environ
    parser = OneLineParser(prog="refitflow registry", description="Serve a refitflow registry over ZMQ.")
    parser.add_argument(
        "--bind",
        default=env.get("REFITFLOW_REGISTRY_BIND", "tcp://127.0.0.1:7100"),
        help="request endpoint; loopback unless you say otherwise (a '*' port picks a free one); "
        "env REFITFLOW_REGISTRY_BIND",
    )
    parser.add_argument(
        "--lease-s",
        type=positive(float),
        default=env.get("REFITFLOW_REGISTRY_LEASE_S", "10"),
        help="seconds without a heartbeat before a publisher's versions stop being offered; "
        "env REFITFLOW_REGISTRY_LEASE_S",
    )
    parser.add_argument(
        "--store",
        default=env.get("REFITFLOW_REGISTRY_STORE", "memory"),
        help="where the state lives: memory (this process; the default) or etcd://h1:2379,h2:2379,h3:2379 "
        "(a stateless replica: run two or more on one etcd cluster); env REFITFLOW_REGISTRY_STORE",
    )
    parser.add_argument(
        "--namespace",
        default=env.get("REFITFLOW_REGISTRY_NAMESPACE", "default"),
        help="with --store etcd: the deployment's keys in etcd (/refitflow/NAME/); env REFITFLOW_REGISTRY_NAMESPACE",
    )
    for name, what in (
        ("ca", "the CA file that signed the etcd members' certificates (enables TLS)"),
        ("cert", "this replica's client certificate for etcd"),
        ("key", "its private key"),
    ):
        parser.add_argument(f"--etcd-{name}", default=env.get(f"REFITFLOW_ETCD_{name.upper()}"),
                            help=f"with --store etcd: {what}; env REFITFLOW_ETCD_{name.upper()}")  # fmt: skip
    parser.add_argument(
        "--curve-secret",
        default=env.get("REFITFLOW_CURVE_SECRET"),
        help="the server's CURVE .key_secret file (enables CURVE); env REFITFLOW_CURVE_SECRET",
    )
    parser.add_argument(
        "--curve-authorized",
        default=env.get("REFITFLOW_CURVE_AUTHORIZED"),
        help="folder of the allowed clients' public .key files; env REFITFLOW_CURVE_AUTHORIZED",
    )
    parser.add_argument("--max-message-bytes", type=positive(int), default=RegistryLimits.max_message_bytes,
                        help="the largest request (a manifest) the registry takes, in bytes")  # fmt: skip
    args = parser.parse_args(argv)
    if (args.curve_secret is None) != (args.curve_authorized is None):
        parser.error("--curve-secret and --curve-authorized go together")
    try:
        check_address(args.bind)
    except ConfigError as exc:
        parser.error(f"argument --bind: {exc}")
    if args.store != "memory":
        try:
            endpoints_of(args.store)
        except ConfigError as exc:
            parser.error(f"argument --store: memory or etcd://host:port,…: {exc}")
    try:
        security = None
        if args.curve_secret is not None:
            security = ServerSecurity(secret_key_file=Path(args.curve_secret),
                                      authorized_dir=Path(args.curve_authorized))  # fmt: skip
        limits = RegistryLimits(max_message_bytes=args.max_message_bytes)
        tls = None
        if args.etcd_ca is not None:
            tls = EtcdTLS(ca_file=Path(args.etcd_ca), cert_file=args.etcd_cert and Path(args.etcd_cert),
                          key_file=args.etcd_key and Path(args.etcd_key))  # fmt: skip
        elif args.etcd_cert is not None or args.etcd_key is not None:
            parser.error("--etcd-cert and --etcd-key need --etcd-ca")
        asyncio.run(_serve_until_signalled(args.bind, args.lease_s, security, limits, args.store, args.namespace,
                                           tls))  # fmt: skip
    except RefitError as exc:
        print(f"refitflow registry: {exc}", file=sys.stderr)
        return 2
    return 0


async def _serve_until_signalled(
    bind: str,
    lease_s: float,
    security: ServerSecurity | None,
    limits: RegistryLimits,
    store: str,
    namespace: str,
    tls: EtcdTLS | None,
) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with contextlib.AsyncExitStack() as stack:
        registry = None
        if store != "memory":
            from refitflow.registry.service.etcd.store import EtcdStore

            registry = await stack.enter_async_context(
                EtcdStore.open(store, namespace=namespace, lease_s=lease_s, limits=limits, tls=tls)
            )
        server = await stack.enter_async_context(
            Registry.serve(bind, registry=registry, lease_s=lease_s, security=security, limits=limits, freeze_gc=True)
        )
        kept = "in memory" if registry is None else f"in etcd ({store}, namespace {namespace})"
        print(f"refitflow registry serving at {server.address} (announcements at {server.pub_address}); "
              f"state {kept}", flush=True)  # fmt: skip
        await stop.wait()


def keys_main(argv: Sequence[str] | None = None) -> int:
    """``refitflow keys DIR [--clients NAME ...]``: CURVE key pairs for the registry and its clients.

    Secret keys are written 0600 in a folder this command creates 0700 (nobody else can list it); the
    public keys (``.key``, ``authorized/``) are 0644, they are meant to be handed out.
    """
    parser = OneLineParser(prog="refitflow keys", description="Generate CURVE key pairs (zmq.auth).")
    parser.add_argument("dir", type=Path, help="where to write the keys (created if missing)")
    parser.add_argument("--clients", nargs="+", default=["client"], help="one key pair per client name")
    args = parser.parse_args(argv)
    from zmq.auth import create_certificates

    authorized = args.dir / "authorized"
    old_umask = os.umask(0o077)  # every file and folder private from its first byte; public keys opened below
    try:
        args.dir.mkdir(parents=True, exist_ok=True)
        authorized.mkdir(exist_ok=True)
        public_keys = [Path(create_certificates(str(args.dir), "server")[0])]
        for name in args.clients:
            public, _ = create_certificates(str(args.dir), name)
            shutil.copy(public, authorized / Path(public).name)
            public_keys += [Path(public), authorized / Path(public).name]
    finally:
        os.umask(old_umask)
    for path in public_keys:
        path.chmod(0o644)
    authorized.chmod(0o755)
    print(f"server: {args.dir / 'server.key_secret'} (keep) and {args.dir / 'server.key'} (give to clients)")
    print(f"clients: {', '.join(f'{n}.key_secret' for n in args.clients)}; allow-list: {authorized}")
    return 0


if __name__ == "__main__":
    sys.exit(registry_main())
