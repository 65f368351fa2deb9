"""``ranmt serve`` and ``ranmt benchmark``: models behind HTTP, and their decoding and
training speed side by side."""

from __future__ import annotations

import argparse

from ranmt.cli.common import Command, info


def _args_benchmark(p: argparse.ArgumentParser) -> None:
    """The options of ``ranmt benchmark``."""
    p.add_argument("--checkpoint", action="append", help="trained system (repeatable)")
    p.add_argument("--arch", action="append",
                   help="freshly initialised system of --preset (repeatable)")
    p.add_argument("--preset", default="small")
    p.add_argument("--vocab-size", type=int, default=8000, help="vocabulary for --arch")
    p.add_argument("--data", help="prepared data whose --split sources are decoded")
    p.add_argument("--split", default="test")
    p.add_argument("--sentences", type=int, default=200)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 10, 50, 100])
    p.add_argument("--beams", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--beam", type=int, default=4, help="beam while varying the batch size")
    p.add_argument("--batch", type=int, default=100, help="batch while varying the beam")
    p.add_argument("--repeats", type=int, default=3, help="timed runs (median) after warm-up")
    p.add_argument("--train-tokens", type=int, default=4096, help="tokens per training batch")
    p.add_argument("--no-train", action="store_true", help="decoding speed only")
    p.add_argument("--dropout-masks", default="torch", choices=["torch", "fast"],
                   help="dropout masks of the training rows (as train.dropout_masks)")
    p.add_argument("--fixed-length", type=int,
                   help="every hypothesis exactly this many tokens (EOS suppressed before, "
                        "forced at it): equal work for any two checkpoints, trained or not")
    p.add_argument("--quantize", nargs="+", default=["none"], choices=["none", "int8", "bf16"],
                   help="modes to measure: none (fp32), int8 (quantized copies, CPU), bf16 "
                        "(bf16 copies for decoding, and bf16 training rows beside fp32's)")
    p.add_argument("--out", default="benchmark", help="output directory")
    p.add_argument("--device", default="auto")


def _cmd_benchmark(args) -> None:
    from ranmt.benchmark import BenchmarkSpec, run_benchmark

    if args.repeats < 1 or args.sentences < 1:
        raise ValueError("--repeats and --sentences must be >= 1")
    spec = BenchmarkSpec(checkpoints=args.checkpoint or [], archs=args.arch or [], out=args.out,
                         preset=args.preset, vocab_size=args.vocab_size, data=args.data,
                         split=args.split, sentences=args.sentences,
                         batch_sizes=tuple(args.batch_sizes), beams=tuple(args.beams),
                         fixed_beam=args.beam, fixed_batch=args.batch, repeats=args.repeats,
                         train_tokens=args.train_tokens, device=args.device,
                         fixed_length=args.fixed_length, quantize=tuple(args.quantize),
                         train=not args.no_train, dropout_masks=args.dropout_masks)
    run_benchmark(spec, log=info)


def _args_serve(p: argparse.ArgumentParser) -> None:
    """The options of ``ranmt serve``."""
    p.add_argument("--checkpoint", action="append", required=True,
                   help="run or checkpoint to serve, optionally NAME=PATH (repeatable)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--device", default="auto")
    p.add_argument("--quantize", default="none", choices=["none", "int8"])
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16"],
                   help="bf16: weights and activations in bf16 (see translate --help)")
    from ranmt.serving.limits import add_limit_options

    add_limit_options(p)  # --max-lines ... --request-timeout: ranmt.serving.limits
    p.add_argument("--api-key-file", metavar="FILE",
                   help="require 'Authorization: Bearer KEY' on every endpoint but /health, "
                        "KEY the file's first line (or set $RANMT_API_KEY)")


def _cmd_serve(args) -> None:
    from ranmt.serving.app import ServeLimits, read_api_key
    from ranmt.serving.server import serve

    if not 0 < args.port < 65536:
        raise ValueError(f"--port must be in 1..65535, not {args.port}")
    limits = ServeLimits.from_args(args)  # checks every limit's bound
    serve(args.checkpoint, args.host, args.port, args.device, args.quantize, limits,
          api_key=read_api_key(args.api_key_file), precision=args.precision)


BENCHMARK = Command("benchmark", "decoding/training speed of systems, side by side",
                    _args_benchmark, _cmd_benchmark)
SERVE = Command("serve", "serve models over HTTP (translation API and the attention explorer "
                         "at /)",
                _args_serve, _cmd_serve)
