"""CLI entries for the registry: ``refitflow registry`` (serve until SIGINT/SIGTERM) and ``refitflow keys``.

Both take the arguments that follow their sub-command. Environment variables are read here only:
``REFITFLOW_REGISTRY_BIND``, ``REFITFLOW_REGISTRY_LEASE_S``, ``REFITFLOW_REGISTRY_STORE`` (``memory`` or
``etcd://h1:2379,h2:2379,h3:2379``), ``REFITFLOW_REGISTRY_NAMESPACE``, ``REFITFLOW_CURVE_SECRET`` (the
server's ``.key_secret``) and ``REFITFLOW_CURVE_AUTHORIZED`` (folder of allowed clients' ``.key``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from refitflow.cli.args import OneLineParser, positive
from refitflow.core.errors import ConfigError, RefitError
from refitflow.registry.address import check_address
from refitflow.registry.keys import ENV, ROLES, DeploymentKeys, keys_folder, serving_keys
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
        "--keys",
        type=Path,
        default=None,
        help=f"the deployment's CURVE key folder, made on first run (default: ${ENV}, else ~/.refitflow/keys); "
        "clients and engine ranks find it the same way",
    )
    parser.add_argument("--open", action="store_true",
                        help=f"serve WITHOUT authentication (a private network only); also {ENV}=open")  # fmt: skip
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
    if args.open + (args.keys is not None) + (args.curve_secret is not None) > 1:
        parser.error("--open, --keys and --curve-secret are three different choices: give one")
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
        security, said = _security(args)
        limits = RegistryLimits(max_message_bytes=args.max_message_bytes)
        tls = None
        if args.etcd_ca is not None:
            tls = EtcdTLS(ca_file=Path(args.etcd_ca), cert_file=args.etcd_cert and Path(args.etcd_cert),
                          key_file=args.etcd_key and Path(args.etcd_key))  # fmt: skip
        elif args.etcd_cert is not None or args.etcd_key is not None:
            parser.error("--etcd-cert and --etcd-key need --etcd-ca")
        asyncio.run(_serve_until_signalled(args.bind, args.lease_s, security, limits, args.store, args.namespace,
                                           tls, said))  # fmt: skip
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
    said: str,
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
            Registry.serve(
                bind,
                registry=registry,
                lease_s=lease_s,
                security=security,
                limits=limits,
                freeze_gc=True,
                insecure=security is None,
            )
        )
        kept = "in memory" if registry is None else f"in etcd ({store}, namespace {namespace})"
        print(f"refitflow registry serving at {server.address} (announcements at {server.pub_address}); "
              f"state {kept}; {said}", flush=True)  # fmt: skip
        await stop.wait()


def _security(args: argparse.Namespace) -> tuple[ServerSecurity | None, str]:
    """The registry's CURVE (keys made on first run unless told otherwise), and what its banner says of it."""
    if args.curve_secret is not None:
        return ServerSecurity(secret_key_file=Path(args.curve_secret), authorized_dir=Path(args.curve_authorized)), (
            f"CURVE with {args.curve_secret}"
        )
    folder = None if args.open else args.keys or keys_folder(os.environ, Path.home())
    keys, made = serving_keys(folder, "the registry")
    if keys is None:
        return None, "OPEN: no authentication"
    return keys.server, (f"CURVE keys {'made in' if made else 'from'} {keys.folder} "
                         f"(clients and engine ranks: {ENV}={keys.folder}, or a copy of it on their host)")  # fmt: skip


def keys_main(argv: Sequence[str] | None = None) -> int:
    """``refitflow keys DIR [--clients NAME[:ROLE] ...] [--force]``: CURVE key pairs for the registry and one per
    role — trainer, rollout, operator by default (a pair already there is kept unless ``--force``: making keys
    again never locks a deployment out).

    Secret keys are written 0600 in a folder this command creates 0700 (nobody else can list it); the
    public keys (``.key``, ``authorized/<role>/``) are 0644, they are meant to be handed out.
    """
    parser = OneLineParser(prog="refitflow keys", description="Generate CURVE key pairs (zmq.auth), one per role.")
    parser.add_argument("dir", type=Path, help="where to write the keys (created if missing)")
    parser.add_argument("--clients", nargs="+", default=list(ROLES), metavar="NAME[:ROLE]",
                        help=f"one key pair per name: {', '.join(ROLES)} (the default: each its own role), NAME:ROLE "
                        "for another pair of a role (e.g. rollout-host2:rollout), or client: one pair for every "
                        "role, as folders made before roles")  # fmt: skip
    parser.add_argument("--force", action="store_true", help="replace the pairs already there (default: kept)")
    args = parser.parse_args(argv)
    names = [c.partition(":")[0] for c in args.clients]
    kept = [n for n in ("server", *names) if not args.force and (args.dir / f"{n}.key_secret").exists()]
    try:
        DeploymentKeys.create(args.dir, args.clients, replace=args.force)
    except ConfigError as exc:
        parser.error(str(exc))
    authorized = args.dir / "authorized"
    if kept:
        print(f"kept the pairs already in {args.dir}: {', '.join(kept)} (--force makes new ones)")
    print(f"server: {args.dir / 'server.key_secret'} (keep) and {args.dir / 'server.key'} (give to clients)")
    print(f"clients: {', '.join(f'{n}.key_secret' for n in names)}; allow-list by role: {authorized}/<role>/")
    if (authorized / "client.key").exists():
        print(f"{authorized / 'client.key'} holds every role (a folder made before roles): once every process "
              "presents its role's pair, move it out of the allow-list")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(registry_main())
