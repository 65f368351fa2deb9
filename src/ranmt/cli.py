"""The ``ranmt`` command line: thin subcommands that call the library (DESIGN §1 contract).

Each subcommand is a row of :data:`COMMANDS`: ``_args_NAME`` (its options) stands right
above ``_cmd_NAME`` (its handler), which calls one library function; errors the user can
fix are printed as one line ``ranmt CMD: error: ...`` with exit status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from typing import NamedTuple


def _args_download(p: argparse.ArgumentParser) -> None:
    """The options of ``ranmt download``."""
    p.add_argument("dataset", help="multi30k (en, de, fr, cs); wmt14 (en-de, en-fr); wmt17 "
                                   "(en-lv, en-fi, en-tr); WMT pairs in either direction")
    p.add_argument("--pair", default="en-de", help="language pair, e.g. en-de, en-fr, en-cs")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--from", dest="source",
                   help="local folder with the files: Multi30k's .gz files (default: "
                        "$RANMT_DATA_DIR), or the WMT archives under their official names "
                        "(checksums verified; an interrupted download resumes on rerun)")


def _cmd_download(args) -> None:
    from ranmt.data.download import download_multi30k
    from ranmt.data.wmt import available, download_wmt

    if args.dataset == "multi30k":
        download_multi30k(args.pair, args.out, args.source, log=_info)
    elif args.dataset in available():
        download_wmt(args.dataset, args.pair, args.out, args.source, log=_info)
    else:
        raise ValueError(f"unknown dataset '{args.dataset}' (available: multi30k, "
                         f"{', '.join(available())})")


def _args_prepare(p: argparse.ArgumentParser) -> None:
    """The options of ``ranmt prepare``."""
    p.add_argument("--src", required=True, help="source language suffix, e.g. en")
    p.add_argument("--tgt", required=True, help="target language suffix, e.g. de")
    p.add_argument("--train", required=True, nargs="+", action="extend", metavar="PREFIX",
                   help="training prefix(es): PREFIX.SRC / PREFIX.TGT, plain or .gz/.xz/.bz2; "
                        "several (or --train repeated) are concatenated, with per-corpus "
                        "counts in meta.json")
    p.add_argument("--valid", required=True, help="validation prefix")
    p.add_argument("--test", action="append", metavar="NAME=PREFIX", help="test split(s)")
    p.add_argument("--vocab-size", type=int, default=8000, help="subword vocabulary size")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--joint", action="store_true", help="one shared vocabulary (default)")
    group.add_argument("--separate", action="store_true", help="one vocabulary per language")
    p.add_argument("--model-type", default="bpe", choices=["bpe", "unigram"],
                   help="SentencePiece model type")
    p.add_argument("--max-positions", type=int, default=256,
                   help="drop training pairs longer than this many subwords (EOS included)")
    p.add_argument("--errors", default="strict", choices=["strict", "replace"],
                   help="invalid UTF-8: fail (default) or replace")
    p.add_argument("--max-ratio", type=float, metavar="R",
                   help="also drop training pairs whose longer side has more than R times "
                        "the subwords of the shorter (off by default; WMT setups use 1.5-9)")
    p.add_argument("--spm-sample", type=int, default=2_000_000, metavar="N",
                   help="train SentencePiece on a uniform sample of at most N sentences "
                        "(one seeded pass; default 2,000,000)")
    p.add_argument("--spm-model", metavar="MODEL",
                   help="encode with this existing (joint) SentencePiece model instead of "
                        "training one: fine-tuning data, back-translations, corpus shards")
    p.add_argument("--spm-src", metavar="MODEL", help="existing source-side model")
    p.add_argument("--spm-tgt", metavar="MODEL", help="existing target-side model")
    p.add_argument("--workers", type=int, metavar="N",
                   help="encoding processes (default: the cores)")
    p.add_argument("--out", required=True, help="prepared-data directory")
    p.add_argument("--quiet", action="store_true",
                   help="no progress bar (shown on stderr when it is a terminal)")


def _cmd_prepare(args) -> None:
    from ranmt.data.corpus import prepare

    tests = {}
    for item in args.test or []:
        if "=" not in item:
            raise ValueError(f"--test expects NAME=PREFIX, got '{item}'")
        name, prefix = item.split("=", 1)
        tests[name] = prefix
    if args.vocab_size < 8:
        raise ValueError("--vocab-size must be at least 8")
    if args.max_positions < 2:
        raise ValueError("--max-positions must be at least 2")
    if args.spm_model and (args.spm_src or args.spm_tgt):
        raise ValueError("give --spm-model (one joint model) or --spm-src and --spm-tgt")
    if bool(args.spm_src) != bool(args.spm_tgt):
        raise ValueError("--spm-src and --spm-tgt go together")
    spm_models = ((args.spm_model, args.spm_model) if args.spm_model else
                  (args.spm_src, args.spm_tgt) if args.spm_src else None)
    if args.workers is not None and args.workers < 1:
        raise ValueError(f"--workers must be at least 1, not {args.workers}")
    prepare(args.src, args.tgt, args.train, args.valid, args.out, tests, args.vocab_size,
            not args.separate, args.model_type, args.max_positions, args.errors, log=_info,
            progress=not args.quiet and sys.stderr.isatty(), spm_sample=args.spm_sample,
            spm_models=spm_models, max_ratio=args.max_ratio, workers=args.workers)


def _args_train(p: argparse.ArgumentParser) -> None:
    """The options of ``ranmt train``."""
    p.add_argument("--data", required=True, help="prepared-data directory")
    p.add_argument("--out", required=True, help="run directory (resumed when it exists)")
    p.add_argument("--config", help="YAML config file")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")


def _cmd_train(args) -> None:
    from ranmt.config import load_config
    from ranmt.train import train

    cfg = load_config(args.config, args.overrides)
    summary = train(cfg, args.data, args.out)
    if os.environ.get("RANK", "0") == "0":  # under torchrun only rank 0 reports
        print(json.dumps(summary))


def _load_translator(args):
    from ranmt.translator import Translator

    if args.beam is not None and args.beam < 1:
        raise ValueError(f"--beam must be >= 1, not {args.beam}")
    if args.batch_size is not None and args.batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, not {args.batch_size}")
    nbest = getattr(args, "nbest", None)
    sampling = getattr(args, "sampling", None)
    if nbest is not None and nbest < 1:
        raise ValueError("--nbest must be >= 1")
    if nbest is not None and not sampling and nbest > (args.beam or 4):
        raise ValueError("--nbest must be between 1 and the beam size (or the number of "
                         "samples with --sampling)")
    for name in ("max_len_a", "max_len_b"):
        if getattr(args, name) is not None and getattr(args, name) < 0:
            raise ValueError(f"--{name.replace('_', '-')} must be non-negative")
    if not sampling and any(getattr(args, name, None) is not None
                            for name in ("topk", "topp", "epsilon", "temperature", "seed")):
        raise ValueError("--topk/--topp/--epsilon/--temperature/--seed go with --sampling")
    sampling_options = ({"sampling": sampling, "topk": args.topk, "topp": args.topp,
                         "epsilon": args.epsilon, "temperature": args.temperature,
                         "seed": args.seed} if sampling else {})
    checkpoints = args.checkpoint[0] if len(args.checkpoint) == 1 else args.checkpoint
    translator = Translator.load(checkpoints, device=args.device, quantize=args.quantize,
                                 precision=args.precision, beam=args.beam, lenpen=args.lenpen,
                                 batch_size=args.batch_size,
                                 max_len_a=args.max_len_a, max_len_b=args.max_len_b,
                                 nbest=nbest, truncate_long=True if args.truncate_long else None,
                                 **sampling_options)
    # A progress bar on stderr only where someone watches it: not into logs or pipes.
    translator.progress = not args.quiet and sys.stderr.isatty()
    return translator


def _args_translate(p: argparse.ArgumentParser) -> None:
    """The options of ``ranmt translate``."""
    _decode_options(p)
    p.add_argument("--input", help="input file (default stdin)")
    p.add_argument("--output", help="output file (default stdout)")
    p.add_argument("--nbest", type=int, help="print the n best hypotheses (the number of "
                   "samples with --sampling): idx<TAB>score<TAB>text")
    p.add_argument("--errors", default="strict", choices=["strict", "replace"])
    p.add_argument("--prefix", metavar="FILE",
                   help="target prefixes, one line per input line (empty: none): each "
                        "translation starts with its prefix and continues from it")
    p.add_argument("--alignments", action="store_true",
                   help="append ' ||| i-j ...' word alignments (source word i, target word j) "
                        "from the cross-attention")
    p.add_argument("--alignment-layer", type=int, metavar="L",
                   help="decoder layer whose head-averaged cross-attention aligns (default "
                        "-2: the penultimate; negative counts from the top)")
    p.add_argument("--score-target", metavar="FILE",
                   help="score these translations of the input instead of translating: "
                        "per line normalized<TAB>total<TAB>per-token log-probs")
    group = p.add_argument_group("sampling (instead of beam search; --nbest N samples)")
    group.add_argument("--sampling", choices=["topk", "topp", "eps"],
                       help="topk: the k most probable tokens; topp: nucleus (the smallest "
                            "set holding P); eps: tokens of probability >= epsilon")
    group.add_argument("--topk", type=int, help="topk: k (default 0 = the whole vocabulary)")
    group.add_argument("--topp", type=float, help="topp: P (default 0.9)")
    group.add_argument("--epsilon", type=float, help="eps: epsilon (default 0.02)")
    group.add_argument("--temperature", type=float, help="divide log-probs by T (default 1)")
    group.add_argument("--seed", type=int, help="seed: same inputs and seed, same samples "
                                                "(default 0)")


def _cmd_translate(args) -> None:
    from ranmt.data.text import decode_lines, read_lines, write_lines

    if args.alignment_layer is not None and not args.alignments:
        raise ValueError("--alignment-layer goes with --alignments")
    translator = _load_translator(args)
    if args.input:
        lines = read_lines(args.input, args.errors)
    elif sys.stdin.isatty() and not (args.prefix or args.score_target):  # interactive
        for line in sys.stdin:
            print(_translation_lines(translator, [line.rstrip("\n")], None, args)[0],
                  flush=True)
        return
    else:
        lines = decode_lines(sys.stdin.buffer.read(), "<stdin>", args.errors)
    if args.score_target:
        out = _score_lines(translator, lines, _paired(args.score_target, lines, args.errors,
                                                      "--score-target"))
    else:
        prefixes = (_paired(args.prefix, lines, args.errors, "--prefix")
                    if args.prefix else None)
        out = _translation_lines(translator, lines, prefixes, args)
    if args.output:
        write_lines(args.output, out)
    else:
        sys.stdout.write("".join(line + "\n" for line in out))
        sys.stdout.flush()


def _paired(path: str, lines: list[str], errors: str, option: str) -> list[str]:
    """The lines of ``path``, one per input line (an error naming both counts otherwise)."""
    from ranmt.data.text import read_lines

    paired = read_lines(path, errors)
    if len(paired) != len(lines):
        raise ValueError(f"{option} {path} has {len(paired)} lines but the input has "
                         f"{len(lines)}; give one line per input line")
    return paired


def _translation_lines(translator, lines: list[str], prefixes: list[str] | None,
                       args) -> list[str]:
    """Output lines: the text (n-best or samples: ``index<TAB>score<TAB>text``), followed by
    `` ||| i-j ...`` word alignments with --alignments."""
    results = translator.translate_detailed(lines, prefixes=prefixes,
                                            alignment=args.alignments,
                                            alignment_layer=args.alignment_layer)

    def text(hyp) -> str:
        if not args.alignments:
            return hyp.text
        from ranmt.scoring import format_alignment

        return f"{hyp.text} ||| {format_alignment(hyp.alignment or [])}"

    if args.nbest and args.nbest > 1:
        return [f"{i}\t{hyp.score:.4f}\t{text(hyp)}" for i, hyps in enumerate(results)
                for hyp in hyps]
    return [text(hyps[0]) for hyps in results]


def _score_lines(translator, sources: list[str], targets: list[str]) -> list[str]:
    """``normalized<TAB>total<TAB>per-token log-probs`` per pair (``nan`` for an empty side);
    the per-token values are the target subwords' and then EOS's."""
    lines = []
    for pair in translator.score(sources, targets):
        if pair is None:
            lines.append("nan\tnan\t")
            continue
        tokens = " ".join(f"{value:.4f}" for value in pair.token_logprobs)
        lines.append(f"{pair.normalized:.4f}\t{pair.total:.4f}\t{tokens}")
    return lines


def _metrics(args) -> list[str]:
    from ranmt.evaluate import TASK_METRICS

    return list(args.metrics) if args.metrics else list(TASK_METRICS[args.task])


def _print_scores(result: dict, metrics: list[str], prefix: str = "") -> None:
    for metric in metrics:
        print(f"{prefix}{metric.upper()} = {result[metric]:.2f}  ({result['signature'][metric]})")


def _args_score(p: argparse.ArgumentParser) -> None:
    """The options of ``ranmt score``."""
    p.add_argument("--ref", required=True, help="reference file")
    p.add_argument("--hyp", required=True, action="append",
                   help="hypothesis file; repeat: the first is the baseline")
    _metric_options(p)
    p.add_argument("--src", help="source file: adds BLEU by source/reference length bins")
    p.add_argument("--length-edges", type=int, nargs="+", default=[0, 10, 20, 30, 40, 50, 60],
                   help="lower edges of the length bins in words (default: seven bins)")
    p.add_argument("--lang", default="", help="target language (Moses tokenization)")
    p.add_argument("--bootstrap-samples", type=int, default=1000)
    p.add_argument("--alpha", type=float, default=0.05,
                   help="significance level of the † mark (default 0.05, as the grids')")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _cmd_score(args) -> None:
    from ranmt.data.text import read_lines
    from ranmt.evaluate import bleu_by_length, paired_bootstrap, score, single_run_mark

    if not 0 < args.alpha < 1:
        raise ValueError(f"--alpha must be in (0, 1), not {args.alpha}")

    refs = read_lines(args.ref)
    hyps = [(path, read_lines(path)) for path in args.hyp]
    metrics = _metrics(args)
    if len(hyps) == 1:
        result = score(hyps[0][1], refs, metrics, args.lang, args.compound_split)
        if args.src:
            sources = read_lines(args.src)
            edges = tuple(args.length_edges)
            result["bleu_by_source_length"] = bleu_by_length(hyps[0][1], refs, sources,
                                                             edges=edges)
            result["bleu_by_reference_length"] = bleu_by_length(hyps[0][1], refs, sources,
                                                                by="reference", edges=edges)
        if args.json:
            print(json.dumps(result))
        else:
            _print_scores(result, metrics)
            for key in ("bleu_by_source_length", "bleu_by_reference_length"):
                for row in result.get(key, []):
                    bleu = "-" if row["bleu"] is None else f"{row['bleu']:.2f}"
                    print(f"{key} {row['bin']:>6}: {bleu} ({row['sentences']} sentences)")
        return
    result = paired_bootstrap(hyps, refs, metrics, args.bootstrap_samples)
    metrics = [m for m in metrics if m in ("bleu", "chrf", "ter")]
    if args.json:
        print(json.dumps(result))
        return
    print("system\t" + "\t".join(m.upper() for m in metrics))
    for row, entry in enumerate(result["systems"]):
        cells = []
        for metric in metrics:
            mark = single_run_mark(entry[f"{metric}_p"], args.alpha) if row > 0 else ""
            cells.append(f"{entry[metric]:.2f}{mark}"
                         + (f" (p={entry[f'{metric}_p']:.4f})" if row > 0 else ""))
        print(f"{entry['name']}{' (baseline)' if row == 0 else ''}\t" + "\t".join(cells))
    print(f"† p < {args.alpha:g}, paired bootstrap resampling against the baseline (the "
          "grids mark seeds with the same alpha: ranmt.evaluate)")


def _args_evaluate(p: argparse.ArgumentParser) -> None:
    """The options of ``ranmt evaluate``."""
    _decode_options(p)
    p.add_argument("--data", required=True, help="prepared-data directory")
    p.add_argument("--split", default="test", help="split name (see meta.json)")
    _metric_options(p)
    p.add_argument("--output", help="also write the translations here")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _cmd_evaluate(args) -> None:
    from ranmt.data.corpus import load_meta, raw_text
    from ranmt.data.text import write_lines
    from ranmt.evaluate import score

    translator = _load_translator(args)
    meta = load_meta(args.data)
    sources, refs = raw_text(args.data, args.split, "src"), raw_text(args.data, args.split, "tgt")
    hyps = translator.translate(sources)
    if args.output:
        write_lines(args.output, hyps)
    metrics = _metrics(args)
    result = score(hyps, refs, metrics, meta.get("tgt_lang", ""), args.compound_split)
    result.update({"split": args.split, "sentences": len(hyps),
                   "checkpoint": str(translator.checkpoint_dir),
                   **({"ensemble": [str(c) for c in args.checkpoint]}
                      if len(args.checkpoint) > 1 else {}),
                   "beam": translator.decode_config.beam,
                   "lenpen": translator.decode_config.lenpen})
    if args.json:
        print(json.dumps(result))
    else:
        _print_scores(result, metrics, f"{args.split} ")


def _args_analyze(p: argparse.ArgumentParser) -> None:
    """The options of ``ranmt analyze``."""
    p.add_argument("--checkpoint", required=True, action="append",
                   help="run or checkpoint; repeat to draw several systems in one figure")
    p.add_argument("--data", required=True, help="prepared-data directory")
    p.add_argument("--split", default="test", help="split whose real sentences are used")
    p.add_argument("--out", required=True, help="output directory for PNG files and JSON")
    p.add_argument("--max-sentences", type=int, default=0, help="first N sentences (0 = all)")
    p.add_argument("--beam", type=int, help="beam for the BLEU-by-bin translations")
    p.add_argument("--layers", type=int, nargs="+",
                   help="layers (1-based) drawn in the histograms (default: first, middle, last)")
    p.add_argument("--device", default="auto")
    p.add_argument("--quiet", action="store_true",
                   help="no progress bars (shown on stderr when it is a terminal)")


def _cmd_analyze(args) -> None:
    from ranmt.analysis import analyze

    if args.max_sentences < 0:
        raise ValueError("--max-sentences must be >= 0")
    analyze(args.checkpoint, args.data, args.split, args.out, args.max_sentences, args.beam,
            args.device, log=_info, histogram_layers=args.layers,
            progress=not args.quiet and sys.stderr.isatty())


def _args_experiment(p: argparse.ArgumentParser) -> None:
    """The options of ``ranmt experiment``."""
    p.add_argument("config", help="experiment YAML (see configs/experiments/)")
    p.add_argument("--out", help="output directory (default: the file's `out`)")
    p.add_argument("--variants", nargs="+", metavar="NAME",
                   help="run only these variants' cells (the tables still show every "
                        "finished cell of the grid)")
    p.add_argument("--seeds", nargs="+", type=int, metavar="N",
                   help="run only these seeds' cells")
    p.add_argument("--tables-only", action="store_true",
                   help="train nothing: rewrite results.md/json from the finished cells")
    p.add_argument("--reuse", nargs="+", metavar="DIR", default=[],
                   help="output folders of other grids: a finished cell there that is the "
                        "same training (seed, resolved config, identical prepared data) is "
                        "copied instead of trained; a cell whose training only runs longer "
                        "(or validates less often) than one there starts from its checkpoint")
    p.add_argument("--baseline", nargs="+", metavar="NAME", default=[],
                   help="also compare every variant against these variants of the grid "
                        "(results.vs-NAME.md|json beside results.md; with --tables-only "
                        "nothing is trained)")
    p.add_argument("--dry-run", action="store_true",
                   help="print the plan (cells, resolved configs, parameter counts, tokens "
                        "per step) and check every cell; train nothing")
    p.add_argument("--work", metavar="DIR",
                   help="keep the cells' run folders (checkpoints, trainer state) under "
                        "DIR/<out's folder name>/runs/... instead of beside cell.json, so "
                        "that a stopped cell resumes from another checkout of the grid "
                        "(default: $RANMT_WORK_DIR, else beside cell.json)")


def _cmd_experiment(args) -> None:
    from ranmt.experiment import run_experiment

    if args.dry_run:
        from ranmt.plan import plan_experiment

        plan_experiment(args.config, out=args.out, log=print)
        return
    try:
        run_experiment(args.config, log=_info, out=args.out, variants=args.variants,
                       seeds=args.seeds, tables_only=args.tables_only,
                       reuse_from=args.reuse, baselines=args.baseline, work=args.work)
    except KeyboardInterrupt as err:
        _info(f"interrupted: {err}" if str(err) else "interrupted")
        raise


def _args_average(p: argparse.ArgumentParser) -> None:
    """The options of ``ranmt average``."""
    p.add_argument("--checkpoint", required=True, help="run directory")
    p.add_argument("--last", type=int, default=5, help="how many of the newest checkpoints")
    p.add_argument("--out", required=True, help="output checkpoint directory")


def _cmd_average(args) -> None:
    from ranmt.checkpoint import average_checkpoints

    path = average_checkpoints(args.checkpoint, args.last, args.out)
    _info(f"wrote the average of the last {args.last} checkpoints to {path}")


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
    p.add_argument("--fixed-length", type=int,
                   help="every hypothesis exactly this many tokens (EOS suppressed before, "
                        "forced at it): equal work for any two checkpoints, trained or not")
    p.add_argument("--quantize", nargs="+", default=["none"], choices=["none", "int8", "bf16"],
                   help="modes to measure: none (fp32), int8 (quantized copies, CPU), bf16 "
                        "(bf16 copies for decoding, and bf16 training rows beside fp32's)")
    p.add_argument("--out", default="benchmark", help="output directory")
    p.add_argument("--device", default="auto")


def _cmd_benchmark(args) -> None:
    from ranmt.benchmark import run_benchmark

    if args.repeats < 1 or args.sentences < 1:
        raise ValueError("--repeats and --sentences must be >= 1")
    run_benchmark(checkpoints=args.checkpoint or [], archs=args.arch or [], out=args.out,
                  preset=args.preset, vocab_size=args.vocab_size, data=args.data,
                  split=args.split, sentences=args.sentences, batch_sizes=args.batch_sizes,
                  beams=args.beams, fixed_beam=args.beam, fixed_batch=args.batch,
                  repeats=args.repeats, train_tokens=args.train_tokens,
                  device_name=args.device, log=_info, fixed_length=args.fixed_length,
                  quantize=args.quantize, train=not args.no_train)


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
    p.add_argument("--max-lines", type=int, default=64, help="lines per request")
    p.add_argument("--max-chars", type=int, default=2000, help="characters per line")
    p.add_argument("--max-beam", type=int, default=16)
    p.add_argument("--batch-window-ms", type=float, default=5.0,
                   help="how long a batch collects concurrent requests")
    p.add_argument("--max-batch-tokens", type=int, default=8000,
                   help="source tokens per dynamic batch")
    p.add_argument("--max-batch-lines", type=int, default=64,
                   help="lines per dynamic batch (default 64, one decoding batch: a larger "
                        "batch decodes no faster and delays every request in it)")
    p.add_argument("--max-queued-tokens", type=int, default=32000,
                   help="source tokens a model's queue may hold; beyond, requests get 503 "
                        "with Retry-After at once (default 32000, four full batches)")
    p.add_argument("--request-timeout", type=float, default=60.0, metavar="SECONDS",
                   help="drop a request (504) whose batch has not started after this long; "
                        "a request may ask for less with timeout_s (default 60)")
    p.add_argument("--api-key-file", metavar="FILE",
                   help="require 'Authorization: Bearer KEY' on every endpoint but /health, "
                        "KEY the file's first line (or set $RANMT_API_KEY)")


def _cmd_serve(args) -> None:
    from ranmt.serve import ServeLimits, read_api_key, serve

    if not 0 < args.port < 65536:
        raise ValueError(f"--port must be in 1..65535, not {args.port}")
    if args.max_queued_tokens < 1 or args.request_timeout <= 0 or args.max_batch_lines < 1:
        raise ValueError("--max-queued-tokens, --max-batch-lines and --request-timeout must "
                         "be positive")
    limits = ServeLimits(max_lines=args.max_lines, max_chars=args.max_chars,
                         max_beam=args.max_beam, batch_window_ms=args.batch_window_ms,
                         max_batch_tokens=args.max_batch_tokens,
                         max_batch_lines=args.max_batch_lines,
                         max_queued_tokens=args.max_queued_tokens,
                         request_timeout_s=args.request_timeout)
    serve(args.checkpoint, args.host, args.port, args.device, args.quantize, limits,
          api_key=read_api_key(args.api_key_file), precision=args.precision)


def _args_export(p: argparse.ArgumentParser) -> None:
    """The options of ``ranmt export``."""
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--format", default="hf-marian", choices=["hf-marian", "ctranslate2"],
                   help="hf-marian (post-norm TransF only) or ctranslate2 (any TransF)")
    p.add_argument("--quantization", default=None,
                   help="ctranslate2 only: weight type, e.g. int8, float16 (default float32)")
    p.add_argument("--out", required=True, help="output directory")


def _cmd_export(args) -> None:
    from ranmt.export import export_ctranslate2, export_hf_marian

    if args.format == "hf-marian":
        path = export_hf_marian(args.checkpoint, args.out)
        _info(f"wrote a Hugging Face Marian model to {path}")
    elif args.format == "ctranslate2":
        path = export_ctranslate2(args.checkpoint, args.out, args.quantization)
        _info(f"wrote a CTranslate2 model to {path}")
    else:
        raise ValueError(f"unknown export format '{args.format}' "
                         "(available: hf-marian, ctranslate2)")


def _args_info(p: argparse.ArgumentParser) -> None:
    """The options of ``ranmt info``."""
    p.add_argument("--checkpoint")
    p.add_argument("--config")
    p.add_argument("--data", help="prepared data (for the vocabulary sizes)")
    p.add_argument("--vocab-size", type=int, default=8000,
                   help="vocabulary size assumed without --data (default 8000)")
    p.add_argument("overrides", nargs="*", metavar="key=value")
    p.add_argument("--json", action="store_true")


def _cmd_info(args) -> None:
    from ranmt.checkpoint import load_checkpoint
    from ranmt.config import load_config, to_dict
    from ranmt.model import build_model, count_parameters

    if args.checkpoint:
        model, cfg, _, _ = load_checkpoint(args.checkpoint)
    else:
        cfg = load_config(args.config, args.overrides)
        if args.data:
            from ranmt.config import fill_config_from_data

            fill_config_from_data(cfg, args.data)  # as training does (gamma included)
        else:
            cfg.model.src_vocab_size = cfg.model.src_vocab_size or args.vocab_size
            cfg.model.tgt_vocab_size = cfg.model.tgt_vocab_size or args.vocab_size
            cfg.model.joint_vocab = True
        model = build_model(cfg.model)
    counts = count_parameters(model)
    if args.json:
        print(json.dumps({**counts, "parameters": counts, "model": to_dict(cfg.model)}))
    else:
        width = max(len(k) for k in counts)
        for key, value in counts.items():
            print(f"{key:<{width}}  {value:>12,}")


def _info(message: str) -> None:
    print(message, file=sys.stderr)


def _decode_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", required=True, action="append",
                        help="run directory (its best checkpoint) or a checkpoint; repeat it "
                             "to decode with an ensemble (the mean of the models' "
                             "log-probabilities; same prepared data required)")
    parser.add_argument("--beam", type=int, help="beam size (default from the config: 4)")
    parser.add_argument("--lenpen", type=float, help="length penalty alpha (default 0.6)")
    parser.add_argument("--batch-size", type=int, help="sentences per batch (default 64)")
    parser.add_argument("--max-len-a", type=float, help="max output length a*|src|+b: a")
    parser.add_argument("--max-len-b", type=int, help="max output length a*|src|+b: b")
    parser.add_argument("--truncate-long", action="store_true",
                        help="truncate inputs longer than max_positions (with a warning) "
                             "instead of failing")
    parser.add_argument("--device", default="auto", help="cpu | cuda | auto (default)")
    parser.add_argument("--quantize", default="none", choices=["none", "int8"],
                        help="int8: int8 dynamic quantization of the linear layers (CPU only; "
                             "faster, BLEU within a few tenths; default none)")
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16"],
                        help="bf16: weights and activations in bf16, scores in fp32 (a GPU, "
                             "or a CPU with AVX512-BF16/AMX; default fp32)")
    parser.add_argument("--quiet", action="store_true",
                        help="no progress bar (shown on stderr when it is a terminal)")


def _metric_options(parser: argparse.ArgumentParser) -> None:
    from ranmt.evaluate import METRICS, TASK_METRICS

    parser.add_argument("--metrics", nargs="+", choices=METRICS,
                        help="metrics (default: the task's set)")
    parser.add_argument("--task", default="translation", choices=sorted(TASK_METRICS),
                        help="metric set: translation (bleu tok_bleu chrf ter), "
                             "summarization (rouge1 rouge2 rougeL), dialogue (bleu rougeL)")
    parser.add_argument("--compound-split", action="store_true",
                        help="tok_bleu: split hyphenated compounds (##AT##-##AT##)")


class Command(NamedTuple):
    """One subcommand: its options (``add_arguments``) stand beside its handler (``run``)."""

    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], None]
    defaults: dict = {}


COMMANDS = (
    Command("download", "download a public corpus (multi30k, wmt14, wmt17)",
            _args_download, _cmd_download),
    Command("prepare", "train SentencePiece and encode a parallel corpus",
            _args_prepare, _cmd_prepare),
    Command("train", "train a model",
            _args_train, _cmd_train),
    Command("translate", "translate raw text (stdin or --input)",
            _args_translate, _cmd_translate),
    Command("score", "score hypotheses with sacreBLEU (+ paired bootstrap)",
            _args_score, _cmd_score),
    Command("evaluate", "translate a prepared split and score it",
            _args_evaluate, _cmd_evaluate, {'nbest': None}),
    Command("analyze", "attention statistics and the papers' figures (PNG+JSON)",
            _args_analyze, _cmd_analyze),
    Command("experiment", "run a grid of datasets x variants x seeds",
            _args_experiment, _cmd_experiment),
    Command("average", "average the weights of a run's last K checkpoints",
            _args_average, _cmd_average),
    Command("benchmark", "decoding/training speed of systems, side by side",
            _args_benchmark, _cmd_benchmark),
    Command("serve", "serve models over HTTP (translation API and the attention explorer at /)",
            _args_serve, _cmd_serve),
    Command("export", "export a TransF checkpoint to CTranslate2 or Hugging Face Marian (identical "
                      "logits)",
            _args_export, _cmd_export),
    Command("info", "parameter counts of a checkpoint or config",
            _args_info, _cmd_info),
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
    args = build_parser().parse_args(argv)
    if os.environ.get("RANMT_DEBUG"):
        args.func(args)
        return
    try:
        args.func(args)
    except KeyboardInterrupt:
        sys.exit(130)
    except (ValueError, FileNotFoundError, RuntimeError, OSError) as err:
        print(f"ranmt {args.command}: error: {err}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main(sys.argv[1:])
