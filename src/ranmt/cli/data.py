"""``ranmt download`` and ``ranmt prepare``: corpora in, SentencePiece models and encoded
arrays out (:mod:`ranmt.data`)."""

from __future__ import annotations

import argparse

from ranmt.cli.common import Command, info, show_progress


def _args_download(p: argparse.ArgumentParser) -> None:
    """The options of ``ranmt download``."""
    p.add_argument("dataset", help="multi30k (en, de, fr, cs); wmt14 (en-de, en-fr); wmt17 "
                                   "(en-lv, en-fi, en-tr); WMT pairs in either direction; "
                                   "dialogsum (dialogue -> summary, from a local copy)")
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
        download_multi30k(args.pair, args.out, args.source, log=info)
    elif args.dataset == "dialogsum":
        from ranmt.data.dialogsum import download_dialogsum

        download_dialogsum(args.out, args.source, log=info)
    elif args.dataset in available():
        download_wmt(args.dataset, args.pair, args.out, args.source, log=info)
    else:
        raise ValueError(f"unknown dataset '{args.dataset}' (available: multi30k, "
                         f"dialogsum, {', '.join(available())})")


def _args_prepare(p: argparse.ArgumentParser) -> None:
    """The options of ``ranmt prepare``."""
    p.add_argument("--src", help="source language suffix, e.g. en")
    p.add_argument("--tgt", help="target language suffix, e.g. de")
    p.add_argument("--train", nargs="+", action="extend", metavar="PREFIX",
                   help="training prefix(es): PREFIX.SRC / PREFIX.TGT, plain or .gz/.xz/.bz2; "
                        "several (or --train repeated) are concatenated, with per-corpus "
                        "counts in meta.json")
    p.add_argument("--valid", help="validation prefix")
    p.add_argument("--test", action="append", metavar="NAME=PREFIX", help="test split(s)")
    p.add_argument("--add-tests", action="store_true",
                   help="encode only the --test splits into the existing prepared-data "
                        "directory --out, with its SentencePiece models and languages (a "
                        "new test set for models trained on it); the other splits stay")
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
    from ranmt.data.corpus import add_test_splits, prepare

    tests = {}
    for item in args.test or []:
        if "=" not in item:
            raise ValueError(f"--test expects NAME=PREFIX, got '{item}'")
        name, prefix = item.split("=", 1)
        tests[name] = prefix
    if args.workers is not None and args.workers < 1:
        raise ValueError(f"--workers must be at least 1, not {args.workers}")
    given = [flag for flag in ("src", "tgt", "train", "valid", "spm_model", "spm_src",
                               "spm_tgt", "max_ratio") if getattr(args, flag)]
    if args.add_tests:
        if not tests:
            raise ValueError("--add-tests encodes the --test NAME=PREFIX splits: give one")
        if given:
            raise ValueError("--add-tests takes the languages and SentencePiece models of "
                             f"--out; drop {', '.join('--' + f.replace('_', '-') for f in given)}")
        add_test_splits(args.out, tests, log=info, workers=args.workers or 1)
        return
    missing = [f"--{flag}" for flag in ("src", "tgt", "train", "valid")
               if not getattr(args, flag)]
    if missing:
        raise ValueError(f"the following arguments are required: {', '.join(missing)} "
                         "(or --add-tests to add test sets to a prepared directory)")
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
    prepare(args.src, args.tgt, args.train, args.valid, args.out, tests, args.vocab_size,
            not args.separate, args.model_type, args.max_positions, args.errors, log=info,
            progress=show_progress(args), spm_sample=args.spm_sample,
            spm_models=spm_models, max_ratio=args.max_ratio, workers=args.workers)


DOWNLOAD = Command("download", "download a public corpus (multi30k, wmt14, wmt17)",
                   _args_download, _cmd_download)
PREPARE = Command("prepare", "train SentencePiece and encode a parallel corpus",
                  _args_prepare, _cmd_prepare)
