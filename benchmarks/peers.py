"""Peers side by side on one machine: ranmt against CTranslate2, Hugging Face ``generate`` and
Joey NMT 2.3.0 (speed issue, part 3). Not part of the test suite.

``decode``: one process decodes the same source sentences, in the same length-sorted
batches, with the same beam size, length penalty and length cap, with

* ranmt TransF (``--transf``, a trained TransF checkpoint) and, if given, ranmt RAN-ALL
  (``--ran``) and further checkpoints (``--student NAME=RUN``, repeatable: the students'
  decoders), each through ``ranmt.inference.decode.search``;
* CTranslate2 (float32, ``intra_threads`` = ``--threads``) on the TransF checkpoint exported
  with ``ranmt export --format ctranslate2`` (built in memory, written to ``--out``);
* Hugging Face ``generate`` on the same checkpoint as a Marian model (``build_marian``; a
  post-norm TransF only: Marian is post-norm; skipped otherwise);
* with ``--int8``: ranmt TransF/RAN-ALL with ``--quantize int8`` and CTranslate2 int8;
* with ``--bf16`` (a CPU with native bf16): ranmt TransF/RAN-ALL with ``--precision bf16``,
  against CTranslate2 int8 (its fastest CPU mode: it has no bf16 on a CPU) and fp32;
* with ``--compile-step``: ranmt with its whole search step compiled (``decode.compile_step``;
  int8 with ``--int8``), each batch shape compiled in the warm-up round;
* with ``--shortlist`` (the TransF run has a ``shortlist.safetensors``, ``ranmt
  shortlist``): ranmt TransF with it (``--shortlist``) and CTranslate2 with it as its
  vocabulary map (``vmap.txt`` written by the export, ``use_vmap=True``), fp32 and, with
  ``--int8``, int8 (CTranslate2's own benchmark: int8 + vmap 1.31x int8); with ``--bf16``
  also ranmt bf16 with the shortlist.

``--fixed-length L`` makes every hypothesis of every system exactly L tokens (ranmt:
``search(fixed_length=L)``; CTranslate2: ``min_decoding_length = max_decoding_length = L``;
HF: ``min_new_tokens = L``, ``max_new_tokens = L + 1`` with EOS forced last), so any two
checkpoints, trained or not, do identical work; without it each system decodes the real
outputs of the model. ``--batch 1`` gives interactive latency (``ms_per_sentence``).
``--json FILE`` writes ``{"tokens_per_s": {"ranmt TransF": ..., "CTranslate2 fp32": ...},
"ms_per_sentence": {...}, "ratios": {...}, "systems": {...}, ...}``.

Systems run interleaved, in a rotating order, ``--repeats`` times after a warm-up round;
each system and round runs in a fresh process (``--one-process``: all in this one; biased:
once CTranslate2 has run with 2 threads, PyTorch's 2-thread matrix products in the same
process take ~1.5x as long — two copies of libgomp competing — which slowed ranmt in the
one-process comparisons in docs/PERFORMANCE.md measured before 2026-11-24);
the median tokens/s (generated target tokens incl. EOS) is reported with the ratio to ranmt
TransF, and each peer's share of outputs identical to ranmt TransF's shows that all decoded
the same model with the same settings. Length penalty: score / |Y|^alpha for every system
(ranmt ``lenpen_style=fairseq``; CTranslate2 and HF use that form); length cap: a fixed
number of new tokens (``--max-len``), the one limit all three express alike.

``train``: training throughput (target tokens/s, the median of the trainer's own logging
windows after the first) of ranmt and Joey NMT 2.3.0 with the same model size (``small``:
d 256, 3+3 layers, 4 heads, FFN 1024, pre-norm, tied embeddings), the same SentencePiece
vocabulary and data, token batches of the same definition (sentences x longest side incl.
EOS, ``--max-tokens``) and the same thread count, alternating ``--rounds`` times. Joey NMT
is installed on demand into its own virtual environment (``--joey-venv``, with torch==
``--torch``); Joey batches unbucketed (its design), so its batches carry more padding.

``quality``: is ranmt's baseline a straw man? ranmt TransF and Joey NMT 2.3.0's Transformer
trained with the same data and SentencePiece model, the same size (``small``), token
batches of the same size, the same schedule (Adam 0.9/0.98, 500 warm-up steps to 1e-3,
inverse square root, label smoothing 0.1, seed 1) and the same number of optimizer steps
(``--steps``, at least 600), each validated once at the end (so the evaluated checkpoint is
the last), then both decode the test sets with beam 4 and the GNMT length penalty 0.6;
sacreBLEU BLEU and chrF side by side. ``--ranmt-checkpoint`` reuses a ranmt checkpoint
trained that way (e.g. a grid cell's ``checkpoints/step_N``) instead of training one.

    python benchmarks/peers.py decode --transf RUN_T --ran RUN_R --data DATA \\
        --split test_2016_flickr --fixed-length 30 --int8 --bf16 --json decode.json \\
        --out benchmark/peers
    python benchmarks/peers.py train --data DATA --out benchmark/peers
    python benchmarks/peers.py quality --data DATA --steps 1000 --out benchmark/peers-quality
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from ranmt.data.batching import make_batches, pad_sources
from ranmt.data.corpus import raw_text
from ranmt.inference.decode import search
from ranmt.inference.shortlist import RestrictedOutput, bucketed_vocabulary
from ranmt.inference.translator import Translator
from ranmt.model import EOS_ID, PAD_ID
from ranmt.runtime.precision import cpu_description

# ------------------------------------------------------------------------------ decoding


def _ranmt_system(translator: Translator, beam: int, lenpen: float, max_len: int,
                  fixed_length: int | None):
    model = translator.model.eval()
    shortlist = translator.lexical_shortlist() if translator.decode_config.shortlist else None
    compiled = translator.decode_config.compile_step

    def run(batch: list[list[int]]) -> list[list[int]]:
        src, runner, ids = pad_sources(batch), model, None
        if shortlist is not None:  # the batch's list: the search runs over its indices
            vocabulary, blocked = shortlist.vocabulary(src), None
            if compiled:  # padded to its bucket, as the translator does
                vocabulary, blocked = bucketed_vocabulary(vocabulary,
                                                          shortlist.target_vocab_size)
            runner = RestrictedOutput(model, vocabulary, blocked)
            ids = vocabulary.tolist()
        hyps = search(runner, src, beam=beam, lenpen=lenpen, lenpen_style="fairseq",
                      max_len_a=0.0, max_len_b=max_len, nbest=1,
                      fixed_length=fixed_length, compile_step=compiled)
        if ids is None:
            return [h[0][0] for h in hyps]
        return [[ids[token] for token in h[0][0]] for h in hyps]

    return run


def _ct2_system(translator: Translator, path: Path, beam: int, lenpen: float, max_len: int,
                fixed_length: int | None, threads: int, compute_type: str = "float32",
                use_vmap: bool = False):
    """CTranslate2 on the model exported to ``path``, weights converted to ``compute_type``
    when loaded (float32 or int8); ``use_vmap``: its vocabulary map (the run's lexical
    shortlist, written by the export as ``vmap.txt``)."""
    import ctranslate2

    engine = ctranslate2.Translator(str(path), device="cpu", compute_type=compute_type,
                                    intra_threads=threads, inter_threads=1)
    src = translator.src_vocab.processor
    tgt = translator.tgt_vocab.processor
    src_pieces = [src.id_to_piece(i) for i in range(src.get_piece_size())]
    # Fixed length L: at least and at most L tokens; otherwise up to max_len (CT2's minimum
    # is 1 by default, ranmt's 0).
    lengths = ((fixed_length, fixed_length) if fixed_length is not None else (0, max_len))

    def run(batch: list[list[int]]) -> list[list[int]]:
        results = engine.translate_batch([[src_pieces[i] for i in s] for s in batch],
                                         beam_size=beam, length_penalty=lenpen,
                                         min_decoding_length=lengths[0],
                                         max_decoding_length=lengths[1], use_vmap=use_vmap)
        return [[tgt.piece_to_id(p) for p in r.hypotheses[0]] for r in results]

    return run


def _hf_system(translator: Translator, beam: int, lenpen: float, max_len: int,
               fixed_length: int | None):
    from ranmt.inference.export import ExportError, build_marian

    try:
        marian = build_marian(translator.model, translator.config)
    except ExportError as err:
        print(f"Hugging Face generate skipped: {err}", file=sys.stderr)
        return None
    # New tokens include the EOS that ends a hypothesis; Marian forces EOS at the last one.
    lengths = {"max_new_tokens": max_len + 1}
    if fixed_length is not None:
        lengths = {"min_new_tokens": fixed_length, "max_new_tokens": fixed_length + 1}

    def run(batch: list[list[int]]) -> list[list[int]]:
        src = pad_sources(batch)  # (B, S) with EOS, right-padded with PAD_ID
        output = marian.generate(input_ids=src, attention_mask=src.ne(PAD_ID),
                                 num_beams=beam, length_penalty=lenpen, early_stopping=True,
                                 do_sample=False, **lengths)
        hyps = []
        for row in output[:, 1:].tolist():  # drop the decoder start token
            ids = [t for t in row if t != PAD_ID]
            hyps.append(ids[:ids.index(EOS_ID)] if EOS_ID in ids else ids)
        return hyps

    return run


def _decode_systems(args, out: Path) -> tuple[dict, Translator]:
    """name -> builder of run(batch of source ids) -> best hypotheses, for every system
    measured, in the tables' order (a builder returns None for a system that cannot run),
    and the TransF translator whose vocabulary encodes the sources. Nothing is built or run
    here: a process that measures one system (``--only``) builds that one alone."""
    transf = Translator.load(args.transf, device="cpu")
    settings = (args.beam, args.lenpen, args.max_len, args.fixed_length)
    students = _students(args)
    for name, run in ({args.ran_name: args.ran} if args.ran else {}) | students.items():
        vocab = Translator.load(run, device="cpu").src_vocab.processor
        if vocab.serialized_model_proto() != \
                transf.src_vocab.processor.serialized_model_proto():
            raise SystemExit(f"{name} ({run}) and --transf must share the source vocabulary")

    def ct2(compute_type: str, use_vmap: bool = False):
        from ranmt.inference.export import export_ctranslate2

        path = export_ctranslate2(transf.checkpoint_dir, out / "ct2-transf")
        return _ct2_system(transf, path, *settings, args.threads, compute_type, use_vmap)

    def ranmt(run: str, **options):
        return lambda: _ranmt_system(Translator.load(run, device="cpu", **options), *settings)

    runs = {"TransF": args.transf, **({args.ran_name: args.ran} if args.ran else {}),
            **students}
    builders = {f"ranmt {name}": ranmt(run) for name, run in runs.items()}
    builders["CTranslate2 fp32"] = lambda: ct2("float32")
    if args.int8:
        builders.update({f"ranmt {name} int8": ranmt(run, quantize="int8")
                         for name, run in runs.items()})
    if args.bf16:
        builders.update({f"ranmt {name} bf16": ranmt(run, precision="bf16")
                         for name, run in runs.items()})
    if args.compile_step:  # the whole step compiled
        builders.update({f"ranmt {name} int8 compiled": ranmt(run, quantize="int8",
                                                              compile_step=True)
                         for name, run in runs.items()} if args.int8 else
                        {f"ranmt {name} compiled": ranmt(run, compile_step=True)
                         for name, run in runs.items()})
        if args.int8 and args.shortlist:
            builders.update({f"ranmt {name} int8 compiled + shortlist": ranmt(
                run, quantize="int8", compile_step=True, shortlist=True)
                for name, run in runs.items()})
    if args.int8 or args.bf16:
        builders["CTranslate2 int8"] = lambda: ct2("int8")
    if args.shortlist:  # the runs' shortlist.safetensors: ranmt's list, CTranslate2's vmap
        builders.update({f"ranmt {name} + shortlist": ranmt(run, shortlist=True)
                         for name, run in runs.items()})
        builders["CTranslate2 fp32 + vmap"] = lambda: ct2("float32", True)
        if args.int8:
            builders.update({f"ranmt {name} int8 + shortlist": ranmt(run, quantize="int8",
                                                                     shortlist=True)
                             for name, run in runs.items()})
            builders["CTranslate2 int8 + vmap"] = lambda: ct2("int8", True)
        if args.bf16:
            builders.update({f"ranmt {name} bf16 + shortlist": ranmt(run, precision="bf16",
                                                                     shortlist=True)
                             for name, run in runs.items()})
    if not args.no_hf:
        builders["HF generate"] = lambda: _hf_system(transf, *settings)
    return builders, transf


def _students(args) -> dict[str, str]:
    """``--student NAME=RUN`` (repeatable): further checkpoints decoded like ``--ran``
    (every ranmt system the flags enable, e.g. the distilled students' decoders at
    Bergamot's setting), in the order given."""
    students = {}
    for item in getattr(args, "student", None) or []:
        name, _, run = item.partition("=")
        if not name or not run:
            raise SystemExit(f"--student {item!r}: expected NAME=RUN")
        if name in students or name in ("TransF", args.ran_name if args.ran else None):
            raise SystemExit(f"--student {item!r}: the name {name!r} is taken")
        students[name] = run
    return students


def _source_batches(args, transf: Translator) -> tuple[list[list[int]], list]:
    """The split's source ids and their length-sorted batches (the same for every system)."""
    sentences = raw_text(args.data, args.split, "src")[:args.sentences]
    ids = [s for s in transf.src_vocab.encode(sentences) if s]
    lengths = np.array([len(s) for s in ids])
    batches = [[ids[i] for i in rows]
               for rows in make_batches(lengths, lengths, 10 ** 9, args.batch)]
    return ids, batches


def _time_systems(systems: dict, batches: list, repeats: int, label: str = "") -> tuple:
    """Every system ``repeats`` times after a warm-up round, in a rotating order: per system
    its tokens/s and seconds per timed round, and its outputs."""
    samples: dict[str, list[float]] = {name: [] for name in systems}
    seconds: dict[str, list[float]] = {name: [] for name in systems}
    outputs: dict[str, list[list[int]]] = {}
    names = list(systems)
    with torch.inference_mode():
        for repeat in range(repeats + 1):  # round 0 = warm-up
            for shift in range(len(names)):  # a rotating order: no system always goes first
                name = names[(repeat + shift) % len(names)]
                start = time.perf_counter()
                hyps = [h for batch in batches for h in systems[name](batch)]
                elapsed = time.perf_counter() - start
                outputs[name] = hyps
                if repeat:
                    samples[name].append(sum(len(h) + 1 for h in hyps) / elapsed)
                    seconds[name].append(elapsed)
                print(f"{label}round {repeat}: {name} {elapsed:.2f} s", file=sys.stderr)
    return samples, seconds, outputs


def _child_argv(args, name: str, child_out: Path) -> list[str]:
    """The command measuring system ``name`` alone in a fresh process (one timed round)."""
    argv = [sys.executable, str(Path(__file__).resolve()), "decode", "--transf", args.transf,
            "--data", args.data, "--split", args.split, "--sentences", str(args.sentences),
            "--batch", str(args.batch), "--beam", str(args.beam), "--lenpen", str(args.lenpen),
            "--max-len", str(args.max_len), "--threads", str(args.threads), "--out", args.out,
            "--repeats", "1", "--only", name, "--child-out", str(child_out)]
    argv += ["--ran", args.ran, "--ran-name", args.ran_name] if args.ran else []
    for student in getattr(args, "student", None) or []:
        argv += ["--student", student]
    argv += ["--fixed-length", str(args.fixed_length)] if args.fixed_length is not None else []
    return argv + [flag for flag, on in (("--int8", args.int8), ("--bf16", args.bf16),
                                         ("--no-hf", args.no_hf),
                                         ("--compile-step", args.compile_step),
                                         ("--shortlist", args.shortlist)) if on]


def _time_isolated(args, names: list[str]) -> tuple:
    """Like :func:`_time_systems`, but every system and round in a fresh process (rotating
    order; each process decodes a warm-up round, then the timed one). In one process,
    PyTorch's and CTranslate2's OpenMP runtimes (two copies of libgomp) slow each other:
    once CTranslate2 has run with 2 threads, PyTorch's 2-thread products take ~1.5x as long
    for the rest of the process."""
    samples: dict[str, list[float]] = {name: [] for name in names}
    seconds: dict[str, list[float]] = {name: [] for name in names}
    outputs: dict[str, list[list[int]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        child_out = Path(tmp) / "child.json"
        for repeat in range(args.repeats):
            for shift in range(len(names)):
                name = names[(repeat + shift) % len(names)]
                subprocess.run(_child_argv(args, name, child_out), check=True)
                child = json.loads(child_out.read_text(encoding="utf-8"))
                if child["skipped"]:
                    continue
                samples[name] += child["samples"]
                seconds[name] += child["seconds"]
                outputs[name] = child["outputs"]
    skipped = [name for name in names if not samples[name]]
    for name in skipped:
        del samples[name], seconds[name]
    return samples, seconds, outputs


def decode(args) -> dict:
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    builders, transf = _decode_systems(args, out)
    if args.only:  # a child of an isolated run: one system, its numbers to --child-out
        built = builders[args.only]()
        _, batches = _source_batches(args, transf)
        timed = _time_systems({args.only: built}, batches, args.repeats, f"[{args.only}] ") \
            if built is not None else ({}, {}, {})
        Path(args.child_out).write_text(json.dumps(
            {"skipped": built is None, "samples": timed[0].get(args.only),
             "seconds": timed[1].get(args.only), "outputs": timed[2].get(args.only)}),
            encoding="utf-8")
        return {}
    if args.systems:  # the reference (ranmt TransF, fp32 eager) and the systems named
        wanted = ["ranmt TransF"] + [n.strip() for n in args.systems.split(",") if n.strip()]
        unknown = [name for name in wanted if name not in builders]
        if unknown:
            raise SystemExit(f"--systems: no system {', '.join(map(repr, unknown))} with these "
                             f"flags; there are: {', '.join(builders)}")
        builders = {name: build for name, build in builders.items() if name in wanted}
    ids, batches = _source_batches(args, transf)
    if args.isolate:
        samples, seconds, outputs = _time_isolated(args, list(builders))
    else:
        systems = {name: build() for name, build in builders.items()}
        systems = {name: run for name, run in systems.items() if run is not None}
        samples, seconds, outputs = _time_systems(systems, batches, args.repeats)
    result = _decode_result(args, ids, list(samples), samples, seconds, outputs)
    table = _decode_table(args, result)
    print(table)
    (out / "decode.json").write_text(json.dumps(result, indent=1), encoding="utf-8")
    (out / "decode.md").write_text(table + "\n", encoding="utf-8")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1), encoding="utf-8")
    return result


def _decode_result(args, ids, systems, samples, seconds, outputs) -> dict:
    reference = outputs["ranmt TransF"]
    base = statistics.median(samples["ranmt TransF"])
    rows = {}
    for name in systems:
        tok_s = statistics.median(samples[name])
        same = sum(a == b for a, b in zip(outputs[name], reference)) / len(reference)
        lengths = {len(h) for h in outputs[name]}
        rows[name] = {"tokens_per_s": tok_s, "sentences_per_s": tok_s * len(ids) / sum(
            len(h) + 1 for h in outputs[name]),
            "ms_per_sentence": 1000 * statistics.median(seconds[name]) / len(ids),
            "ratio_to_ranmt_transf": tok_s / base, "same_output_as_ranmt_transf": same,
            "output_lengths": [min(lengths), max(lengths)], "samples": samples[name]}
    result = {"kind": "decode", "split": args.split, "sentences": len(ids),
              "batch": args.batch, "beam": args.beam, "lenpen": args.lenpen,
              "max_len": args.max_len, "fixed_length": args.fixed_length,
              "threads": args.threads, "repeats": args.repeats, "torch": torch.__version__,
              "cpu": cpu_description(),
              "tokens_per_s": {name: row["tokens_per_s"] for name, row in rows.items()},
              "ms_per_sentence": {name: row["ms_per_sentence"] for name, row in rows.items()},
              "systems": rows}
    ran = args.ran_name
    for name in _students(args):  # each student at its best against CTranslate2's best
        for mine, theirs in ((f"ranmt {name} int8 compiled + shortlist", "CTranslate2 int8 + vmap"),
                             (f"ranmt {name} int8 + shortlist", "CTranslate2 int8 + vmap"),
                             (f"ranmt {name} int8", "CTranslate2 int8")):
            if mine in rows and theirs in rows:
                result.setdefault("ratios", {})[f"{mine} / {theirs}"] = (
                    rows[mine]["tokens_per_s"] / rows[theirs]["tokens_per_s"])
    for mine, theirs in (("ranmt TransF", "CTranslate2 fp32"),
                         (f"ranmt {ran}", "CTranslate2 fp32"),
                         ("ranmt TransF int8", "CTranslate2 int8"),
                         (f"ranmt {ran} int8", "CTranslate2 int8"),
                         ("ranmt TransF bf16", "CTranslate2 int8"),
                         (f"ranmt {ran} bf16", "CTranslate2 int8"),
                         ("ranmt TransF bf16", "CTranslate2 fp32"),
                         (f"ranmt {ran} bf16", "CTranslate2 fp32"),
                         ("ranmt TransF bf16", "ranmt TransF"),
                         (f"ranmt {ran} bf16", f"ranmt {ran}"),
                         ("ranmt TransF + shortlist", "CTranslate2 fp32 + vmap"),
                         (f"ranmt {ran} + shortlist", "CTranslate2 fp32 + vmap"),
                         ("ranmt TransF int8 + shortlist", "CTranslate2 int8 + vmap"),
                         ("ranmt TransF int8 compiled", "CTranslate2 int8"),
                         ("ranmt TransF int8 compiled", "CTranslate2 int8 + vmap"),
                         ("ranmt TransF int8 compiled", "ranmt TransF int8"),
                         ("ranmt TransF int8 compiled + shortlist", "CTranslate2 int8 + vmap"),
                         ("ranmt TransF int8 compiled + shortlist",
                          "ranmt TransF int8 + shortlist"),
                         (f"ranmt {ran} int8 + shortlist", "CTranslate2 int8 + vmap"),
                         ("CTranslate2 int8 + vmap", "CTranslate2 int8")):
        if mine in rows and theirs in rows:
            result.setdefault("ratios", {})[f"{mine} / {theirs}"] = (
                rows[mine]["tokens_per_s"] / rows[theirs]["tokens_per_s"])
    return result


def _decode_table(args, result: dict) -> str:
    length = (f"fixed output length {args.fixed_length}" if args.fixed_length is not None
              else "outputs as the model writes them")
    lines = [f"decoding {result['sentences']} sentences of {args.split}, batch {args.batch}, "
             f"beam {args.beam}, lenpen {args.lenpen}, {length}, {args.threads} threads, "
             f"median of {args.repeats}; CPU: {result['cpu']}", "",
             "| system | tgt tok/s | sent/s | ms/sentence | ratio to ranmt TransF | same output "
             "as ranmt TransF |", "|---|---|---|---|---|---|"]
    for name, row in result["systems"].items():
        lines.append(f"| {name} | {row['tokens_per_s']:,.0f} | {row['sentences_per_s']:,.1f} "
                     f"| {row['ms_per_sentence']:.1f} | {row['ratio_to_ranmt_transf']:.2f}x | "
                     f"{100 * row['same_output_as_ranmt_transf']:.1f}% |")
    if result.get("ratios"):
        lines.append("")
        lines += [f"{pair}: {ratio:.2f}x" for pair, ratio in result["ratios"].items()]
    return "\n".join(lines)

# ------------------------------------------------------------------------------ training


JOEY_WINDOW = re.compile(r"Tokens per Sec:\s+([0-9.]+)")
RANMT_WINDOW = re.compile(r"\|\s+([0-9,]+) tgt tok/s")


def _joey_python(venv: Path, torch_version: str) -> Path:
    """The venv's python, with torch==torch_version, joeynmt 2.3.0, importlib-metadata and
    sentencepiece 0.2.0.

    joeynmt 2.3.0 imports ``importlib_metadata`` without declaring it, and calls
    ``SentencePieceProcessor.SetVocabulary``, which sentencepiece 0.2.1+ no longer has; its
    requirements do not bound sentencepiece, so both are installed here. An existing venv is
    checked too (a venv left by an interrupted install is repaired).
    """
    python = venv / "bin" / "python"
    if not python.is_file():
        print(f"creating {venv} for Joey NMT 2.3.0 (once)", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    probe = ("import importlib.util as u, sys\n"
             "if any(u.find_spec(m) is None for m in "
             "('torch', 'joeynmt', 'importlib_metadata', 'sentencepiece')): sys.exit(1)\n"
             "import sentencepiece\n"
             "sys.exit(not hasattr(sentencepiece.SentencePieceProcessor, 'SetVocabulary'))")
    if subprocess.run([str(python), "-c", probe]).returncode != 0:
        print(f"installing Joey NMT 2.3.0 into {venv}", file=sys.stderr)
        subprocess.run([str(python), "-m", "pip", "install", "-q", f"torch=={torch_version}"],
                       check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", "joeynmt==2.3.0",
                        "importlib-metadata", "sentencepiece==0.2.0"], check=True)
    return python


def _joey_config(data: Path, work: Path, args, validation_freq: int = 10 ** 9,
                 beam: int = 1, alpha: float = 0.0) -> Path:
    """Joey NMT's YAML for the `small` Transformer on ranmt's prepared data and vocabulary;
    ``beam`` / ``alpha`` are its decoding settings (``testing``), used by ``translate``."""
    import yaml

    from ranmt.data.vocab import Vocab

    meta = json.loads((data / "meta.json").read_text(encoding="utf-8"))
    src_lang, tgt_lang = meta.get("src_lang", "src"), meta.get("tgt_lang", "tgt")
    work.mkdir(parents=True, exist_ok=True)
    for split, joey_split in (("train", "train"), ("valid", "dev")):
        for side, lang in (("src", src_lang), ("tgt", tgt_lang)):
            link = work / f"{joey_split}.{lang}"
            link.unlink(missing_ok=True)
            link.symlink_to((data / f"{split}.{side}.txt").resolve())
    vocab_files = {}
    for side in ("src", "tgt"):
        processor = Vocab(data / f"spm.{side}.model").processor
        # Joey puts <unk> <pad> <s> </s> at ids 0-3 itself; the file holds the other pieces.
        pieces = [processor.id_to_piece(i) for i in range(4, processor.get_piece_size())]
        vocab_files[side] = work / f"vocab.{side}.txt"
        vocab_files[side].write_text("\n".join(pieces) + "\n", encoding="utf-8")

    def side(lang: str, key: str) -> dict:
        return {"lang": lang, "level": "bpe", "lowercase": False, "max_length": 255,
                "voc_file": str(vocab_files[key]), "tokenizer_type": "sentencepiece",
                "tokenizer_cfg": {"model_file": str((data / f"spm.{key}.model").resolve())}}

    layers = {"type": "transformer", "num_layers": 3, "num_heads": 4, "hidden_size": 256,
              "ff_size": 1024, "dropout": 0.1, "layer_norm": "pre",
              "embeddings": {"embedding_dim": 256, "scale": True, "dropout": 0.1}}
    joint = vocab_files["src"].read_text() == vocab_files["tgt"].read_text()
    config = {
        "name": "joey-small", "joeynmt_version": "2.3.0", "model_dir": str(work / "model"),
        "use_cuda": False, "fp16": False,
        "data": {"train": str(work / "train"), "dev": str(work / "dev"),
                 "dataset_type": "plain", "src": side(src_lang, "src"),
                 "trg": side(tgt_lang, "tgt")},
        "training": {"random_seed": args.seed, "optimizer": "adam", "adam_betas": [0.9, 0.98],
                     "learning_rate": 0.001, "scheduling": "warmupinversesquareroot",
                     "learning_rate_warmup": 500, "learning_rate_min": 1e-8,
                     "loss": "crossentropy", "label_smoothing": 0.1,
                     "batch_size": args.max_tokens, "batch_type": "token",
                     "normalization": "tokens", "epochs": 100, "updates": args.steps,
                     "validation_freq": validation_freq, "logging_freq": args.log_every,
                     "shuffle": True, "overwrite": True, "keep_best_ckpts": 1,
                     "use_cuda": False},
        "testing": {"beam_size": beam, "beam_alpha": alpha, "batch_size": 3000,
                    "batch_type": "token", "max_output_length": 100,
                    "eval_metrics": ["bleu"]},
        "model": {"initializer": "xavier_uniform", "tied_embeddings": joint,
                  "tied_softmax": True, "encoder": layers, "decoder": layers},
    }
    path = work / "joey.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    return path


def _windows(text: str, pattern: re.Pattern) -> list[float]:
    return [float(m.replace(",", "")) for m in pattern.findall(text)]


def train(args) -> dict:
    data, out = Path(args.data), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads),
           "MKL_NUM_THREADS": str(args.threads)}
    joey = _joey_python(Path(args.joey_venv), args.torch)
    joey_cfg = _joey_config(data, out / "joey", args)
    ranmt_cmd = [sys.executable, "-m", "ranmt", "train", "--data", str(data), "--config",
                 args.ranmt_config, "train.max_steps=" + str(args.steps),
                 f"train.log_every={args.log_every}", "train.validate_every=1000000000",
                 f"data.max_tokens={args.max_tokens}", f"train.threads={args.threads}",
                 "train.progress=false", "train.tensorboard=false", "model.arch=transf"]
    samples: dict[str, list[float]] = {"ranmt TransF": [], "Joey NMT 2.3.0": []}
    for round_ in range(args.rounds):
        for name in samples:
            if name.startswith("ranmt"):
                run_dir = out / f"ranmt-run{round_}"
                subprocess.run(["rm", "-rf", str(run_dir)], check=True)
                proc = subprocess.run(ranmt_cmd + ["--out", str(run_dir)], env=env,
                                      capture_output=True, text=True)
                log = (run_dir / "train.log").read_text() if (run_dir / "train.log").is_file() \
                    else ""
                windows = _windows(log, RANMT_WINDOW)
            else:
                subprocess.run(["rm", "-rf", str(out / "joey" / "model")], check=True)
                proc = subprocess.run([str(joey), "-m", "joeynmt", "train", str(joey_cfg),
                                       "--skip-test"],
                                      env=env, capture_output=True, text=True)
                log = proc.stdout + proc.stderr
                (out / f"joey-round{round_}.log").write_text(log, encoding="utf-8")
                windows = _windows(log, JOEY_WINDOW)
            if proc.returncode != 0 or len(windows) < 2:
                raise SystemExit(f"{name} failed (exit {proc.returncode}):\n"
                                 f"{(proc.stdout + proc.stderr)[-3000:]}")
            samples[name].extend(windows[1:])  # the first window holds start-up costs
            print(f"round {round_}: {name} windows {[round(w) for w in windows]}",
                  file=sys.stderr)
    base = statistics.median(samples["ranmt TransF"])
    rows = {name: {"tokens_per_s": statistics.median(v), "windows": v,
                   "ratio_to_ranmt": statistics.median(v) / base} for name, v in samples.items()}
    table = "\n".join(
        [f"training throughput, small Transformer, {args.max_tokens}-token batches, "
         f"{args.threads} threads, {args.steps} steps x {args.rounds} rounds", "",
         "| system | tgt tok/s (median window) | ratio to ranmt |", "|---|---|---|"]
        + [f"| {n} | {r['tokens_per_s']:,.0f} | {r['ratio_to_ranmt']:.2f}x |"
           for n, r in rows.items()])
    print(table)
    result = {"kind": "train", "steps": args.steps, "rounds": args.rounds,
              "threads": args.threads, "max_tokens": args.max_tokens, "systems": rows}
    (out / "train.json").write_text(json.dumps(result, indent=1), encoding="utf-8")
    (out / "train.md").write_text(table + "\n", encoding="utf-8")
    return result


def _train_ranmt_for_quality(data: Path, run: Path, args, env: dict) -> Path:
    """ranmt TransF for ``args.steps`` steps, validated once at the end; its last checkpoint."""
    subprocess.run(["rm", "-rf", str(run)], check=True)
    command = [sys.executable, "-m", "ranmt", "train", "--data", str(data), "--out", str(run),
               "--config", args.ranmt_config, "model.arch=transf", "train.max_time=0",
               f"train.max_steps={args.steps}", f"train.validate_every={args.steps}",
               f"train.seed={args.seed}", f"data.max_tokens={args.max_tokens}",
               f"train.threads={args.threads}", "train.progress=false",
               "train.tensorboard=false"]
    proc = subprocess.run(command, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"ranmt train failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
    return run / "checkpoints" / f"step_{args.steps:08d}"


def _train_joey_for_quality(data: Path, work: Path, args, env: dict) -> tuple[Path, Path]:
    """Joey NMT for ``args.steps`` steps (validated once, at the end); (python, config)."""
    joey = _joey_python(Path(args.joey_venv), args.torch)
    config = _joey_config(data, work, args, validation_freq=args.steps, beam=args.beam,
                          alpha=args.lenpen)
    subprocess.run(["rm", "-rf", str(work / "model")], check=True)
    proc = subprocess.run([str(joey), "-m", "joeynmt", "train", str(config), "--skip-test"],
                          env=env, capture_output=True, text=True)
    (work / "train.log").write_text(proc.stdout + proc.stderr, encoding="utf-8")
    if proc.returncode != 0 or not (work / "model" / "best.ckpt").exists():
        raise SystemExit(f"Joey NMT train failed (exit {proc.returncode}):\n"
                         f"{(proc.stdout + proc.stderr)[-3000:]}")
    return joey, config


def quality(args) -> dict:
    """BLEU / chrF of ranmt TransF and Joey NMT trained alike (see the module docstring)."""
    from ranmt.evaluate import score

    if args.steps < 600 and not args.allow_short:
        raise SystemExit("--steps must be at least 600 for a quality comparison "
                         "(--allow-short for a smoke run)")
    data, out = Path(args.data), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads),
           "MKL_NUM_THREADS": str(args.threads)}
    checkpoint = Path(args.ranmt_checkpoint) if args.ranmt_checkpoint else \
        _train_ranmt_for_quality(data, out / "ranmt", args, env)
    joey, joey_config = _train_joey_for_quality(data, out / "joey", args, env)
    translator = Translator.load(checkpoint, device="cpu", beam=args.beam, lenpen=args.lenpen)
    meta = json.loads((data / "meta.json").read_text(encoding="utf-8"))
    rows: dict = {"ranmt TransF": {}, "Joey NMT 2.3.0": {}}
    for test in args.tests:
        sources, refs = raw_text(data, test, "src"), raw_text(data, test, "tgt")
        outputs = {"ranmt TransF": translator.translate(sources)}
        with (out / "joey" / f"{test}.src").open("w", encoding="utf-8") as handle:
            handle.write("\n".join(sources) + "\n")
        # Joey 2.3.0's `translate -o FILE` fails (BaseConfig has no n_best): read stdout,
        # where it prints one hypothesis per input line (its log goes to stderr).
        with (out / "joey" / f"{test}.src").open(encoding="utf-8") as stdin:
            proc = subprocess.run([str(joey), "-m", "joeynmt", "translate", str(joey_config)],
                                  stdin=stdin, env=env, capture_output=True, text=True)
        joey_hyps = proc.stdout.split("\n")[:len(refs)]
        if proc.returncode != 0 or len(joey_hyps) != len(refs):
            raise SystemExit(f"Joey NMT translate failed (exit {proc.returncode}, "
                             f"{len(joey_hyps)} lines):\n{proc.stderr[-3000:]}")
        outputs["Joey NMT 2.3.0"] = joey_hyps
        for name, hyps in outputs.items():
            (out / f"{name.split()[0].lower()}.{test}.hyp").write_text(
                "\n".join(hyps) + "\n", encoding="utf-8")
            result = score(hyps, refs, ("bleu", "chrf"), meta.get("tgt_lang", ""))
            rows[name][test] = {"bleu": result["bleu"], "chrf": result["chrf"]}
    header = " | ".join(f"{t} BLEU | {t} chrF" for t in args.tests)
    table = "\n".join(
        [f"quality at equal steps: small Transformer, {args.steps} optimizer steps, "
         f"{args.max_tokens}-token batches, seed {args.seed}, beam {args.beam}, "
         f"lenpen {args.lenpen}", "", f"| system | {header} |",
         "|---|" + "---|---|" * len(args.tests)]
        + [f"| {name} | " + " | ".join(f"{r[t]['bleu']:.2f} | {r[t]['chrf']:.2f}"
                                        for t in args.tests) + " |"
           for name, r in rows.items()])
    print(table)
    result = {"kind": "quality", "steps": args.steps, "seed": args.seed,
              "max_tokens": args.max_tokens, "beam": args.beam, "lenpen": args.lenpen,
              "ranmt_checkpoint": str(checkpoint), "systems": rows}
    (out / "quality.json").write_text(json.dumps(result, indent=1), encoding="utf-8")
    (out / "quality.md").write_text(table + "\n", encoding="utf-8")
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("decode", help="ranmt vs CTranslate2 vs HF generate")
    p.add_argument("--transf", required=True, help="trained ranmt TransF run or checkpoint")
    p.add_argument("--ran", help="trained ranmt RAN-ALL run (same vocabulary)")
    p.add_argument("--student", action="append", metavar="NAME=RUN",
                   help="a further checkpoint decoded with every ranmt system the flags "
                   "enable, named NAME in the tables (repeatable; same source vocabulary "
                   "as --transf), e.g. the students RAN-D, AAN and SSRU")
    p.add_argument("--ran-name", default="RAN-ALL",
                   help="its name in the tables (e.g. RAN-D for a RAN-D student)")
    p.add_argument("--data", required=True, help="prepared data directory")
    p.add_argument("--split", default="test_2016_flickr")
    p.add_argument("--sentences", type=int, default=1000)
    p.add_argument("--batch", type=int, default=100)
    p.add_argument("--beam", type=int, default=4)
    p.add_argument("--lenpen", type=float, default=0.6)
    p.add_argument("--max-len", type=int, default=64, help="new tokens at most (then EOS)")
    p.add_argument("--fixed-length", type=int,
                   help="every hypothesis exactly this many tokens in every system (EOS "
                        "suppressed before, forced at it): equal work whatever the model writes")
    p.add_argument("--int8", action="store_true",
                   help="also ranmt --quantize int8 and CTranslate2 int8")
    p.add_argument("--bf16", action="store_true",
                   help="also ranmt --precision bf16 (a CPU with native bf16) and "
                        "CTranslate2 int8, its fastest CPU mode")
    p.add_argument("--no-hf", action="store_true", help="leave Hugging Face generate out")
    p.add_argument("--shortlist", action="store_true",
                   help="also ranmt TransF with the run's lexical shortlist (ranmt shortlist) "
                        "and CTranslate2 with it as its vocabulary map (use_vmap), fp32 and, "
                        "with --int8, int8")
    p.add_argument("--compile-step", action="store_true",
                   help="also ranmt with decode.compile_step (with --int8: int8 compiled); "
                        "the warm-up round compiles every batch shape")
    p.add_argument("--systems", help="only these systems (comma-separated names as in the "
                   "table, e.g. 'ranmt TransF int8 compiled + shortlist,CTranslate2 int8 + "
                   "vmap'), beside ranmt TransF (the outputs' reference); default: every "
                   "system the flags enable")
    p.add_argument("--json", help="also write the result (tokens_per_s per system, ...) here")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--one-process", dest="isolate", action="store_false",
                   help="measure every system in this process (faster, but biased: "
                        "CTranslate2's and PyTorch's OpenMP runtimes slow each other); by "
                        "default each system and round runs in a fresh process")
    p.add_argument("--only", help=argparse.SUPPRESS)  # a child of an isolated run: this system
    p.add_argument("--child-out", help=argparse.SUPPRESS)  # ... and its numbers here
    p.set_defaults(func=decode)
    p = sub.add_parser("train", help="ranmt vs Joey NMT training throughput")
    p.add_argument("--data", required=True, help="prepared data directory (joint vocab)")
    p.add_argument("--ranmt-config", default="configs/multi30k_small.yaml")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--max-tokens", type=int, default=4096)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--joey-venv", default="benchmark/peers/joey-venv")
    p.add_argument("--torch", default=torch.__version__.split("+")[0],
                   help="torch version for Joey's environment (the same as ranmt's)")
    p.set_defaults(func=train)
    p = sub.add_parser("quality", help="ranmt TransF vs Joey NMT: BLEU/chrF at equal steps")
    p.add_argument("--data", required=True, help="prepared data directory (joint vocab)")
    p.add_argument("--ranmt-config", default="configs/multi30k_small.yaml")
    p.add_argument("--ranmt-checkpoint", help="a ranmt TransF checkpoint trained with the "
                   "same settings and --steps (default: train one)")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--allow-short", action="store_true", help="allow --steps below 600")
    p.add_argument("--tests", nargs="+", default=["test_2016_flickr", "test_2017_flickr"])
    p.add_argument("--beam", type=int, default=4)
    p.add_argument("--lenpen", type=float, default=0.6)
    p.add_argument("--log-every", type=int, default=100)
    p.add_argument("--max-tokens", type=int, default=4096)
    p.add_argument("--joey-venv", default="benchmark/peers/joey-venv")
    p.add_argument("--torch", default=torch.__version__.split("+")[0])
    p.set_defaults(func=quality)
    for p in sub.choices.values():
        p.add_argument("--seed", type=int, default=1)
        p.add_argument("--threads", type=int, default=torch.get_num_threads())
        p.add_argument("--out", default="benchmark/peers")
    args = parser.parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
