"""The ``refitflow`` command. The only place that reads the environment."""

from __future__ import annotations

import argparse
import sys

import anyio

from refitflow.cli.args import OneLineParser, positive

__all__ = ["build_parser", "main"]


class _Unset(float):
    """A default the user did not give (argparse keeps a non-string default as it is)."""


def _demo(args: argparse.Namespace) -> int:
    import logging
    import os
    from pathlib import Path

    from refitflow.cli.demo import DemoConfig, run_demo
    from refitflow.core.errors import ConfigError
    from refitflow.registry.keys import keys_folder, serving_keys

    if not isinstance(args.size_mb, _Unset) and args.model != "synthetic":
        raise ConfigError("--size-mb applies to --model synthetic only")
    os.environ.setdefault("UCX_LOG_LEVEL", "error")  # UCX's exit-time warnings after a peer is gone
    logging.getLogger("nixl").setLevel(logging.WARNING)
    keys = None
    if args.transport != "loopback":  # processes around a registry service: CURVE, keys made on first use
        keys = serving_keys(keys_folder(os.environ, Path.home()), "the demo")[0]
    cfg = DemoConfig(
        keys=keys,
        model=args.model,
        size_bytes=int(args.size_mb * 10**6),
        versions=args.versions,
        budget_bytes=int(args.budget_mb * 2**20),
        transport=args.transport,
        timeout_s=args.timeout_s,
    )
    return 0 if anyio.run(run_demo, cfg) else 1


def build_parser() -> argparse.ArgumentParser:
    from refitflow import __version__

    parser = OneLineParser(prog="refitflow", description="RL weight refit: publish, discover, refit, commit.")
    parser.add_argument("--version", action="version", version=f"refitflow {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{demo,registry,keys}")
    demo = sub.add_parser(
        "demo", help="a trainer refitting inference engines, end to end, with metrics and a per-stage table",
        description="A registry, a Megatron-layout trainer (2 ranks) and inference engines in vLLM's fused "
        "layout refitting each version; exits 0 when every rank verified and committed every version.",
    )  # fmt: skip
    demo.add_argument("--model", default="tiny-llama", choices=["tiny-llama", "synthetic"],
                      help="tiny-llama: a small random transformers Llama, trainer at TP 2, engines at TP 1 and "
                      "TP 2, logits checked; synthetic: a bf16 model of --size-mb, for throughput")  # fmt: skip
    demo.add_argument("--size-mb", type=positive(float), default=_Unset(1000.0),
                      help="the synthetic model's size in MB (10^6 bytes)")  # fmt: skip
    demo.add_argument("--versions", type=positive(int), default=3, help="versions published and refitted")
    demo.add_argument("--budget-mb", type=positive(float), default=256.0, help="staging budget per receiving rank, MiB")
    demo.add_argument(
        "--transport", default="nixl", choices=["nixl", "loopback"],
        help="nixl: trainer and engines in separate processes around a registry service; loopback: all in one "
        "process around an embedded registry",
    )  # fmt: skip
    demo.add_argument("--timeout-s", type=positive(float), default=300.0, help="deadline of the whole demo")
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
    try:
        return int(args.run(args))
    except BaseException as exc:  # a refitflow error is a sentence for the user, not a traceback
        errors = _refit_errors(exc)
        if not errors:
            raise
        for error in errors:
            print(f"refitflow {args.command}: error: {error}", file=sys.stderr)
        return 2


def _refit_errors(exc: BaseException) -> list[BaseException]:
    """The refitflow errors ``exc`` is made of (an exception group's too); empty if anything else is in it."""
    from refitflow.core.errors import RefitError

    if isinstance(exc, BaseExceptionGroup):
        found = [_refit_errors(e) for e in exc.exceptions]
        return [e for errors in found for e in errors] if all(found) else []
    return [exc] if isinstance(exc, RefitError) else []


if __name__ == "__main__":
    sys.exit(main())
