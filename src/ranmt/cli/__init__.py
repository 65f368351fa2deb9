"""The ``ranmt`` command line: thin subcommands that call the library (DESIGN §1 contract).

Each subcommand is a :class:`~ranmt.cli.common.Command` row of :data:`COMMANDS`, defined in
the module of its kind — :mod:`.data` (download, prepare), :mod:`.training` (train,
experiment, average), :mod:`.decoding` (translate, score, evaluate, distill), :mod:`.checkpoints`
(analyze, export, shortlist, info), :mod:`.serving` (serve, benchmark) — where ``_args_NAME`` (its
options) stands right above ``_cmd_NAME`` (its handler), which calls one library function.
Errors the user can fix are printed as one line ``ranmt CMD: error: ...`` with exit status 2.
"""

from __future__ import annotations

import argparse
import os
import sys

from ranmt.cli import checkpoints, data, decoding, serving, training
from ranmt.cli.common import Command

COMMANDS: tuple[Command, ...] = (
    data.DOWNLOAD, data.PREPARE, training.TRAIN, decoding.TRANSLATE, decoding.SCORE,
    decoding.EVALUATE, decoding.DISTILL, checkpoints.ANALYZE, training.EXPERIMENT, training.AVERAGE,
    serving.BENCHMARK, serving.SERVE, checkpoints.EXPORT, checkpoints.SHORTLIST,
    checkpoints.INFO,
)
"""The subcommands, in the order ``ranmt --help`` lists them."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ranmt", description="Neural machine translation with pluggable attention: "
        "Transformer, Recurrent Attention (RAN), hard-coded Gaussian, Random Synthesizer and "
        "recurrent cross-attention.", epilog="Run `ranmt COMMAND --help` for a command's "
        "options.")
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        p = sub.add_parser(command.name, help=command.help)
        command.add_arguments(p)
        p.set_defaults(func=command.run, **command.defaults)
    return parser


def _version() -> str:
    from ranmt import __version__

    return f"ranmt {__version__}"


def main(argv: list[str] | None = None) -> None:
    from ranmt.runtime.signals import honour_stop_signals

    honour_stop_signals()  # Ctrl-C / SIGTERM stop it even when its parent ignored them
    args = build_parser().parse_args(argv)
    if os.environ.get("RANMT_DEBUG"):
        args.func(args)
        return
    try:
        args.func(args)
    except KeyboardInterrupt:
        _exit(130)
    except (ValueError, FileNotFoundError, RuntimeError, OSError) as err:
        print(f"ranmt {args.command}: error: {err}", file=sys.stderr)
        _exit(2)
    _leave_torchrun_worker(0)


def _leave_torchrun_worker(code: int) -> None:
    """End a torchrun worker with ``code`` now, skipping interpreter finalization, where
    gloo's leaked threads can turn the exit into an abort (ranmt.training.distributed);
    anywhere else, return."""
    if "WORLD_SIZE" in os.environ:  # torchrun's; a plain command does not import torch here
        from ranmt.training.distributed import exit_worker, launched_by_torchrun

        if launched_by_torchrun():
            exit_worker(code)


def _exit(code: int) -> None:
    """Leave with ``code`` (a torchrun worker without interpreter finalization)."""
    _leave_torchrun_worker(code)
    sys.exit(code)


if __name__ == "__main__":
    main(sys.argv[1:])
