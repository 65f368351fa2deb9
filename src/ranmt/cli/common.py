"""What the subcommands share: the :class:`Command` row, messages, and the option groups of
the decoding and scoring commands."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import typing
from collections.abc import Callable
from typing import Literal, NamedTuple


class Command(NamedTuple):
    """One subcommand: its options (``add_arguments``) stand beside its handler (``run``)."""

    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], None]
    defaults: dict = {}


def info(message: str) -> None:
    """A progress or result message for the user: stderr, so stdout stays the output."""
    print(message, file=sys.stderr)


def show_progress(args: argparse.Namespace) -> bool:
    """A progress bar on stderr only where someone watches it: not into logs or pipes."""
    return not args.quiet and sys.stderr.isatty()


def decode_flag_names(group: str) -> tuple[str, ...]:
    """The DecodeConfig fields of a ``group`` (their declarations say which): search fields
    are flags of every decoding command (translate, evaluate); output (--nbest) and sampling
    fields are ``ranmt translate``'s. A decoding option declared in DecodeConfig is on the
    command line without more code."""
    from ranmt.config import decode_fields

    return tuple(f.name for f in decode_fields(group))


def decode_options(parser: argparse.ArgumentParser) -> None:
    """The options of every command that loads a translator (translate, evaluate)."""
    parser.add_argument("--checkpoint", required=True, action="append",
                        help="run directory (its best checkpoint) or a checkpoint; repeat it "
                             "to decode with an ensemble (the mean of the models' "
                             "log-probabilities; same prepared data required)")
    for name in decode_flag_names("search"):
        add_decode_flag(parser, name)
    parser.add_argument("--device", default="auto", help="cpu | cuda | auto (default)")
    parser.add_argument("--quantize", default="none", choices=["none", "int8"],
                        help="int8: int8 dynamic quantization of the linear layers (CPU only; "
                             "faster, BLEU within a few tenths; default none)")
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16"],
                        help="bf16: weights and activations in bf16, scores in fp32 (a GPU, "
                             "or a CPU with AVX512-BF16/AMX; default fp32)")
    parser.add_argument("--quiet", action="store_true",
                        help="no progress bar (shown on stderr when it is a terminal)")


def decode_flag(name: str) -> str:
    """The command-line flag of DecodeConfig field ``name``: ``max_len_a`` -> ``--max-len-a``."""
    return "--" + name.replace("_", "-")


def add_decode_flag(parser, name: str) -> None:
    """``--NAME`` for :class:`ranmt.config.DecodeConfig` field ``name``, from its declaration
    (type, choices, help, default). The flag defaults to None: unset, the checkpoint's
    ``decode.NAME`` applies (the declared default in a config that does not set it)."""
    from ranmt.config import DecodeConfig, decode_field

    spec = decode_field(name)
    kind = typing.get_type_hints(DecodeConfig)[name]
    shown = f"{spec.default:g}" if isinstance(spec.default, float) else spec.default
    help_text = f"{spec.metadata['help']} (default: the checkpoint's; {shown} unless it sets one)"
    if kind is bool:
        parser.add_argument(decode_flag(name), action="store_true", default=None,
                            help=spec.metadata["help"])
    elif typing.get_origin(kind) is Literal:  # "none" is the flag left out
        parser.add_argument(decode_flag(name), choices=[c for c in typing.get_args(kind)
                                                        if c != "none"], help=help_text)
    else:
        parser.add_argument(decode_flag(name), type=kind, help=help_text)


def load_translator(args: argparse.Namespace):
    """The :class:`~ranmt.inference.translator.Translator` that :func:`decode_options` (and, for
    translate, the n-best and sampling options) describe, after checking their ranges."""
    from ranmt.config import DecodeConfig, check_decode_bounds
    from ranmt.inference.translator import Translator

    options = {f.name: getattr(args, f.name, None) for f in dataclasses.fields(DecodeConfig)}
    check_decode_bounds(options, decode_flag)
    tuning = [name for name in decode_flag_names("sampling") if name != "sampling"]
    if not options["sampling"] and any(options[name] is not None for name in tuning):
        raise ValueError(f"{'/'.join(decode_flag(n) for n in tuning)} go with --sampling")
    checkpoints = args.checkpoint[0] if len(args.checkpoint) == 1 else args.checkpoint
    translator = Translator.load(checkpoints, device=args.device, quantize=args.quantize,
                                 precision=args.precision, **options)
    # --nbest against the beam (--beam, else the checkpoint's decode.beam): Translator.load
    # validates the merged DecodeConfig
    translator.progress = show_progress(args)
    return translator


def metric_options(parser: argparse.ArgumentParser) -> None:
    """The metric choice of score and evaluate."""
    from ranmt.evaluate import METRICS, TASK_METRICS

    parser.add_argument("--metrics", nargs="+", choices=METRICS,
                        help="metrics (default: the task's set)")
    parser.add_argument("--task", default="translation", choices=sorted(TASK_METRICS),
                        help="metric set: translation (bleu tok_bleu chrf ter), "
                             "summarization (rouge1 rouge2 rougeL), dialogue (bleu rougeL)")
    parser.add_argument("--compound-split", action="store_true",
                        help="tok_bleu: split hyphenated compounds (##AT##-##AT##)")


def chosen_metrics(args: argparse.Namespace) -> list[str]:
    """``--metrics`` if given, else the ``--task``'s set."""
    from ranmt.evaluate import TASK_METRICS

    return list(args.metrics) if args.metrics else list(TASK_METRICS[args.task])


def print_scores(result: dict, metrics: list[str], prefix: str = "") -> None:
    """One line per metric: value and sacreBLEU signature."""
    for metric in metrics:
        print(f"{prefix}{metric.upper()} = {result[metric]:.2f}  ({result['signature'][metric]})")
