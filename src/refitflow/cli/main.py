"""The ``refitflow`` command. The only place that reads the environment."""

from __future__ import annotations

import argparse
import sys

import anyio

__all__ = ["main"]


def _demo(args: argparse.Namespace) -> int:
    import logging
    import os

    from refitflow.cli.demo import DemoConfig, run_demo

    os.environ.setdefault("UCX_LOG_LEVEL", "error")  # UCX's exit-time warnings after a peer is gone
    logging.getLogger("nixl").setLevel(logging.WARNING)
    cfg = DemoConfig(
        size_bytes=int(args.size_mb * 10**6),
        versions=args.versions,
        budget_bytes=int(args.budget_mb * 2**20),
        transport=args.transport,
    )
    return 0 if anyio.run(run_demo, cfg) else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="refitflow", description="RL weight refit.")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="publish and refit a synthetic model, print GB/s and stage times")
    demo.add_argument("--size-mb", type=float, default=1000.0, help="model size in MB (10^6 bytes)")
    demo.add_argument("--versions", type=int, default=3)
    demo.add_argument("--budget-mb", type=float, default=256.0, help="staging budget per receiver, MiB")
    demo.add_argument(
        "--transport", default="nixl", choices=["nixl", "loopback"],
        help="nixl: trainer and receivers in separate processes; loopback: all in one process",
    )  # fmt: skip
    demo.set_defaults(run=_demo)
    sub.add_parser("registry", help="run the registry service (refitflow registry --help)", add_help=False)
    sub.add_parser("keys", help="generate CURVE key pairs for the registry (refitflow keys --help)", add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("registry", "keys"):  # these parse their own arguments
        from refitflow.cli.registry_cmd import keys_main, registry_main

        return (registry_main if argv[0] == "registry" else keys_main)(argv[1:])
    args = build_parser().parse_args(argv)
    return int(args.run(args))


if __name__ == "__main__":
    sys.exit(main())
