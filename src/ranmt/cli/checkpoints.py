"""``ranmt analyze``, ``ranmt export`` and ``ranmt info``: look inside a trained model
(attention statistics and figures, parameter counts) and convert it for other engines."""

from __future__ import annotations

import argparse
import json

from ranmt.cli.common import Command, info, show_progress


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
            args.device, log=info, histogram_layers=args.layers,
            progress=show_progress(args))


def _args_export(p: argparse.ArgumentParser) -> None:
    """The options of ``ranmt export``."""
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--format", default="hf-marian", choices=["hf-marian", "ctranslate2"],
                   help="hf-marian (post-norm TransF only) or ctranslate2 (any TransF)")
    p.add_argument("--quantization", default=None,
                   help="ctranslate2 only: weight type, e.g. int8, float16 (default float32)")
    p.add_argument("--out", required=True, help="output directory")


def _cmd_export(args) -> None:
    from ranmt.inference.export import export_ctranslate2, export_hf_marian

    if args.format == "hf-marian":
        path = export_hf_marian(args.checkpoint, args.out)
        info(f"wrote a Hugging Face Marian model to {path}")
    elif args.format == "ctranslate2":
        path = export_ctranslate2(args.checkpoint, args.out, args.quantization)
        info(f"wrote a CTranslate2 model to {path}")
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
            from ranmt.data.corpus import fill_config_from_data

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


def _args_shortlist(p: argparse.ArgumentParser) -> None:
    """The options of ``ranmt shortlist``."""
    p.add_argument("--data", required=True, help="prepared-data directory (its training split)")
    p.add_argument("--out", required=True,
                   help="run or checkpoint directory: writes shortlist.safetensors there "
                        "(decoding with --shortlist finds it beside the checkpoint)")
    p.add_argument("--split", default="train", help="split counted (default train)")
    p.add_argument("--k", type=int, default=50,
                   help="candidate target tokens per source token (default 50, as Bergamot)")
    p.add_argument("--frequent", type=int, default=100,
                   help="most frequent target tokens always allowed (default 100)")


def _cmd_shortlist(args) -> None:
    from pathlib import Path

    from ranmt.cli.common import info
    from ranmt.inference.shortlist import SHORTLIST_FILE, build_shortlist

    out = Path(args.out)
    if not out.is_dir():
        raise FileNotFoundError(f"--out {out} is not a directory")
    shortlist = build_shortlist(args.data, args.k, args.frequent, args.split)
    shortlist.save(out / SHORTLIST_FILE, {"data": str(args.data), "split": args.split,
                                          "k": args.k, "frequent": args.frequent})
    filled = int((shortlist.candidates >= 0).sum(axis=1).mean())
    info(f"wrote {out / SHORTLIST_FILE}: {shortlist.candidates.shape[0]} source tokens, "
         f"{filled} candidates each on average, {len(shortlist.frequent)} frequent")


ANALYZE = Command("analyze", "attention statistics and the papers' figures (PNG+JSON)",
                  _args_analyze, _cmd_analyze)
EXPORT = Command("export", "export a TransF checkpoint to CTranslate2 or Hugging Face Marian "
                           "(identical logits)",
                 _args_export, _cmd_export)
SHORTLIST = Command("shortlist", "build a lexical shortlist beside a checkpoint (decode with "
                                 "--shortlist)", _args_shortlist, _cmd_shortlist)
INFO = Command("info", "parameter counts of a checkpoint or config", _args_info, _cmd_info)
