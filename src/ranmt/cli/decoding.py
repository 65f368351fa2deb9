"""``ranmt translate``, ``ranmt score`` and ``ranmt evaluate``: raw text through a model
(beam search, sampling, prefixes, alignments, forced scoring), hypotheses against references,
and both on a prepared split."""

from __future__ import annotations

import argparse
import json
import sys

from ranmt.cli.common import (
    Command,
    add_decode_flag,
    chosen_metrics,
    decode_flag,
    decode_flag_names,
    decode_options,
    info,
    load_translator,
    metric_options,
    print_scores,
)


def _args_translate(p: argparse.ArgumentParser) -> None:
    """The options of ``ranmt translate``."""
    decode_options(p)
    p.add_argument("--input", help="input file (default stdin)")
    p.add_argument("--output", help="output file (default stdout)")
    for name in decode_flag_names("output"):  # --nbest: printed as idx<TAB>score<TAB>text
        add_decode_flag(p, name)
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
    for name in decode_flag_names("sampling"):
        add_decode_flag(group, name)


def _cmd_translate(args) -> None:
    from ranmt.data.text import decode_lines, read_lines, write_lines

    if args.alignment_layer is not None and not args.alignments:
        raise ValueError("--alignment-layer goes with --alignments")
    translator = load_translator(args)
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
        from ranmt.inference.scoring import format_alignment

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


def _args_score(p: argparse.ArgumentParser) -> None:
    """The options of ``ranmt score``."""
    p.add_argument("--ref", required=True, nargs="+",
                   help="reference file; several: one reference stream each, line by line "
                        "(multi-reference BLEU / chrF / TER; ROUGE by --rouge-references), "
                        "length bins on the first")
    p.add_argument("--rouge-references", choices=("max", "mean"), default="max",
                   help="with several --ref: a line's ROUGE is the best over its references "
                        "(max, rouge-score's score_multi) or their mean")
    p.add_argument("--hyp", required=True, action="append",
                   help="hypothesis file; repeat: the first is the baseline")
    metric_options(p)
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

    refs, *extra_refs = [read_lines(path) for path in args.ref]
    hyps = [(path, read_lines(path)) for path in args.hyp]
    metrics = chosen_metrics(args)
    if extra_refs and len(hyps) > 1:
        raise ValueError("several --ref files with several --hyp files: the paired "
                         "bootstrap takes one reference for now")
    if len(hyps) == 1:
        result = score(hyps[0][1], refs, metrics, args.lang, args.compound_split,
                       extra_refs=extra_refs, rouge_rule=args.rouge_references)
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
            print_scores(result, metrics)
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
    decode_options(p)
    p.add_argument("--data", required=True, help="prepared-data directory")
    p.add_argument("--split", default="test", help="split name (see meta.json)")
    metric_options(p)
    p.add_argument("--sweep", metavar="FIELD=V1,V2,...", action="append",
                   help="decode the split once per value of a search option (beam, lenpen, "
                        "max_len_a, max_len_b), score each and report the best by --select "
                        "(e.g. --sweep lenpen=0.6,1,1.5,2 --split valid: choose on valid, "
                        "never on a test set); repeated, every combination of the values; "
                        "--output gets the best decode's translations (ranmt.inference.sweep)")
    p.add_argument("--select", metavar="METRIC",
                   help="--sweep: the metric that chooses (default: the first of --metrics; "
                        "TER is lower-better); ties at two decimals go to the value listed "
                        "first")
    p.add_argument("--output", help="also write the translations here")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _checked_sweep(args) -> dict[str, list] | None:
    """``--sweep``'s {field: values}, checked before a model is loaded; None without it."""
    from ranmt.inference.sweep import parse_sweep

    if not args.sweep:
        if args.select:
            raise ValueError("--select goes with --sweep")
        return None
    settings = parse_sweep(args.sweep)
    for name in settings:
        if getattr(args, name, None) is not None:
            raise ValueError(f"{decode_flag(name)} and --sweep {name}=... both set {name}: "
                             "give one")
    if args.select and args.select not in chosen_metrics(args):
        raise ValueError(f"--select {args.select} is not among the metrics "
                         f"{chosen_metrics(args)}")
    return settings


def _evaluate_sweep(args, settings, translator, sources, refs, tgt_lang) -> None:
    """``ranmt evaluate --sweep``: one decode per combination, the table, the best."""
    from ranmt.data.text import write_lines
    from ranmt.inference import sweep as sweeping

    metrics = chosen_metrics(args)
    result = sweeping.sweep(translator, sources, refs, settings, metrics, tgt_lang,
                            args.select, log=None if args.json else info)
    if args.output:
        write_lines(args.output, sweeping.best_hypotheses(result))
    best = result["rows"][sweeping.best_index(result)]
    if args.json:
        print(json.dumps({"split": args.split, "sentences": len(sources),
                          "checkpoint": str(translator.checkpoint_dir),
                          "sweep": sweeping.public_result(result)}))
        return
    print(sweeping.sweep_table(result, metrics))
    print(f"best on {args.split}: {sweeping.describe(result['best'])} ({result['select']} "
          f"{best[result['select']]:.2f}, length ratio {best['length_ratio']:.3f})")
    print_scores({**best, "signature": result["signature"]}, metrics, f"{args.split} ")


def _cmd_evaluate(args) -> None:
    from ranmt.data.corpus import load_meta, raw_text
    from ranmt.data.text import write_lines
    from ranmt.evaluate import score

    swept = _checked_sweep(args)
    translator = load_translator(args)
    meta = load_meta(args.data)
    sources, refs = raw_text(args.data, args.split, "src"), raw_text(args.data, args.split, "tgt")
    if swept is not None:
        _evaluate_sweep(args, swept, translator, sources, refs, meta.get("tgt_lang", ""))
        return
    hyps = translator.translate(sources)
    if args.output:
        write_lines(args.output, hyps)
    metrics = chosen_metrics(args)
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
        print_scores(result, metrics, f"{args.split} ")


def _args_distill(p: argparse.ArgumentParser) -> None:
    """The options of ``ranmt distill``."""
    decode_options(p)
    p.add_argument("--data", required=True, help="prepared-data directory of the corpus")
    p.add_argument("--split", default="train", help="split to distill (default train)")
    p.add_argument("--out", required=True,
                   help="output folder: parts/ while running (a rerun resumes), then "
                        "SPLIT.SRC / SPLIT.TGT, the other splits and distill.json")
    p.add_argument("--chunk-lines", type=int, default=2000, metavar="N",
                   help="lines translated and written at a time (default 2000)")
    p.add_argument("--max-ratio", type=float, default=3.0, metavar="R",
                   help="drop pairs whose longer side has more than R times the words of the "
                        "shorter (default 3; 0 keeps them)")
    p.add_argument("--max-repeats", type=int, default=4, metavar="K",
                   help="drop translations where a word n-gram (n <= 4) occurs K times in a "
                        "row (default 4; 0 keeps them)")
    p.add_argument("--keep-empty", action="store_true", help="keep empty translations")


def _cmd_distill(args) -> None:
    from ranmt.cli.common import info, show_progress
    from ranmt.inference.distill import DistillFilter, distill

    if args.max_ratio < 0 or args.max_repeats < 0:
        raise ValueError("--max-ratio and --max-repeats must be >= 0 (0: no such filter)")
    translator = load_translator(args)
    distill(translator, args.data, args.out, args.split, args.chunk_lines,
            DistillFilter(args.max_ratio, args.max_repeats, not args.keep_empty), log=info,
            progress=show_progress(args))


TRANSLATE = Command("translate", "translate raw text (stdin or --input)",
                    _args_translate, _cmd_translate)
SCORE = Command("score", "score hypotheses with sacreBLEU (+ paired bootstrap)",
                _args_score, _cmd_score)
EVALUATE = Command("evaluate", "translate a prepared split and score it",
                   _args_evaluate, _cmd_evaluate, {"nbest": None})
DISTILL = Command("distill", "translate a prepared corpus with a teacher: a student's "
                  "training data (resumable)", _args_distill, _cmd_distill, {"nbest": None})
