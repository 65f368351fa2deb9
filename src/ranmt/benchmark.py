"""``ranmt benchmark``: decoding and training speed of several systems, side by side.

Systems are trained checkpoints (``--checkpoint``) or freshly initialised models of a preset
(``--arch``), each also int8-quantized with ``--quantize none int8``. What a model writes
decides how much work decoding is (lengths, repetitions), so two systems' decoding speeds
compare like work only with ``--fixed-length L``: every hypothesis then has exactly L
tokens (EOS suppressed before L, forced at L), trained or not. Without it, the systems
decode their real outputs (the second table of docs/PERFORMANCE.md).
Every measurement is interleaved over the systems (system A, B, C, then A, B, C again) so
machine noise hits all of them alike, repeated ``--repeats`` times after one warm-up, and
the median is reported, with the ratio to the first system (and, in the table, the range
of the ratios measured within each interleaved round, to show the noise):

* decoding throughput (generated target tokens/s incl. EOS, and sentences/s) across batch
  sizes with a fixed beam, and across beam sizes with a fixed batch (the RAN paper's Fig. 3);
* training throughput (target tokens/s) on the same batches, and peak memory on CUDA;
* on CUDA, the largest ``data.max_tokens`` whose training step fits (paper 004 Table 3).

Output: a table on stdout, ``benchmark.json`` and ``benchmark.png`` in ``--out``.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ranmt.config import load_config
from ranmt.data.batching import collate, make_batches, pad_sources
from ranmt.inference.decode import search
from ranmt.inference.quantize import is_quantized
from ranmt.inference.translator import Translator, pick_device
from ranmt.model import build_model
from ranmt.runtime.precision import cpu_description
from ranmt.training.train import label_smoothed_loss


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


_GENERIC_PARTS = {"run", "best", "checkpoints", "last"}


def _run_label(checkpoint: str) -> str:
    """A short name for a checkpoint path: its last two meaningful parts.

    Experiment cells all end in ``…/VARIANT/seedN/run``; ``run``, ``best``, ``checkpoints``
    and file names are skipped so that labels tell the systems apart
    (``TransF/seed1/run`` -> ``TransF/seed1``, ``runs/transf-small`` -> ``runs/transf-small``).
    """
    path = Path(checkpoint)
    parts = [part for part in path.parts
             if part != path.anchor and part not in _GENERIC_PARTS
             and Path(part).suffix != ".safetensors"]
    return "/".join(parts[-2:]) or Path(checkpoint).name


def load_systems(checkpoints: list[str], archs: list[str], preset: str, vocab_size: int,
                 device: torch.device, quantize: tuple[str, ...] = ("none",)
                 ) -> list[tuple[str, Translator | None, object, object]]:
    """(label, translator or None, model, config) per system and mode: ``none`` (fp32),
    ``int8`` (dynamic quantization) or ``bf16`` (weights and activations in bf16); the
    copies are labelled ``… int8`` / ``… bf16``."""
    from ranmt.inference.quantize import quantize_model
    from ranmt.runtime.precision import avoid_cudnn_attention

    if device.type == "cuda":
        avoid_cudnn_attention()  # as Translator.load does
    systems = []
    for mode in quantize:
        suffix = "" if mode == "none" else f" {mode}"
        precision = "bf16" if mode == "bf16" else "fp32"
        quantization = "none" if mode == "bf16" else mode
        for checkpoint in checkpoints:
            translator = Translator.load(checkpoint, device=str(device),
                                         quantize=quantization, precision=precision)
            label = f"{translator.config.model.arch}:{_run_label(checkpoint)}{suffix}"
            systems.append((label, translator, translator.model, translator.config))
        for arch in archs:
            cfg = load_config(None, {"model.preset": preset, "model.arch": arch,
                                     "model.src_vocab_size": str(vocab_size),
                                     "model.tgt_vocab_size": str(vocab_size),
                                     "model.joint_vocab": "true"})
            torch.manual_seed(0)
            model = quantize_model(build_model(cfg.model).to(device).eval(), quantization)
            if precision == "bf16":
                model = model.to(torch.bfloat16)
            systems.append((f"{arch}:{preset}{suffix}", None, model, cfg))
    if not systems:
        raise ValueError("give at least one --checkpoint or --arch")
    return systems


def _inputs(systems, data: str | None, split: str, count: int, vocab_size: int
            ) -> list[list[int]]:
    """Source token ids: the split's sentences (encoded with the first system's vocabulary)
    or random ids of realistic lengths."""
    if data:
        from ranmt.data.corpus import load_split

        encoded = load_split(data, split)
        return [list(map(int, s)) for s in encoded.src[:count]]
    rng = np.random.default_rng(0)
    return [rng.integers(4, vocab_size, rng.integers(6, 25)).tolist() for _ in range(count)]


def decode_speed(model, config, sources: list[list[int]], batch: int, beam: int,
                 device: torch.device, fixed_length: int | None = None
                 ) -> tuple[float, float]:
    """(target tokens/s, sentences/s) for decoding ``sources`` (length-sorted batches);
    with ``fixed_length`` every hypothesis has exactly that many tokens."""
    decode = config.decode
    model.eval()
    generated = 0
    synchronize(device)
    start = time.perf_counter()
    lengths = np.array([len(s) for s in sources])
    for rows in make_batches(lengths, lengths, 10 ** 9, batch):
        src = pad_sources([sources[i] for i in rows]).to(device)
        hyps = search(model, src, beam=beam, lenpen=decode.lenpen,
                      lenpen_style=decode.lenpen_style, max_len_a=decode.max_len_a,
                      max_len_b=decode.max_len_b, nbest=1, fixed_length=fixed_length,
                      cuda_graphs=decode.cuda_graphs)
        generated += sum(len(h[0][0]) + 1 for h in hyps)
    synchronize(device)
    seconds = time.perf_counter() - start
    return generated / seconds, len(sources) / seconds


def train_speed(model, config, sources: list[list[int]], max_tokens: int,
                device: torch.device, precision: str = "fp32",
                dropout_masks: str = "torch") -> tuple[float, float | None]:
    """(target tokens/s, peak CUDA memory in MiB or None) of training steps over the inputs
    (each source doubles as its own target: same lengths for every system), in ``precision``
    as the trainer runs it (bf16: autocast and bf16 residual streams, fp32 weights), with
    ``dropout_masks`` as ``train.dropout_masks``."""
    from ranmt.runtime.dropout import fast_masks
    from ranmt.runtime.precision import PrecisionPolicy

    policy = PrecisionPolicy(precision, device.type)
    lengths = np.array([len(s) for s in sources])
    batches = make_batches(lengths, lengths, max_tokens)
    model.train()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-5,
                                 fused=policy.fused_optimizer or None)
    tokens = 0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    synchronize(device)
    start = time.perf_counter()
    for rows in batches:
        arrays = [np.array(sources[i]) for i in rows]
        batch = collate(arrays, arrays, rows).to(device)
        optimizer.zero_grad(set_to_none=True)
        with policy.forward(), fast_masks(dropout_masks == "fast"):
            logits = model(batch.src, batch.tgt_in)
        loss, _ = label_smoothed_loss(logits, batch.tgt_out, 0.1)
        loss.backward()
        optimizer.step()
        tokens += batch.target_tokens
    synchronize(device)
    seconds = time.perf_counter() - start
    model.eval()
    peak = torch.cuda.max_memory_allocated(device) / 2 ** 20 if device.type == "cuda" else None
    return tokens / seconds, peak


def max_tokens_that_fit(model, sources, device: torch.device, limit: int = 1 << 20) -> int:
    """Largest tokens-per-batch (doubling, then bisection) whose training step fits (CUDA)."""
    low, high = 0, 1024
    pool = sources * 64

    def fits(max_tokens: int) -> bool:
        try:
            count, total = 0, 0
            while total < max_tokens and count < len(pool):
                total += len(pool[count]) + 1
                count += 1
            train_speed(model, None, pool[:count], max_tokens, device)
            return True
        except torch.cuda.OutOfMemoryError:
            torch.cuda.empty_cache()
            return False

    while high <= limit and fits(high):
        low, high = high, high * 2
    while high - low > 256:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


@dataclass
class BenchmarkSpec:
    """What ``ranmt benchmark`` measures: one field per command-line option."""

    checkpoints: list[str] = field(default_factory=list)
    """Trained systems (runs or checkpoints)."""
    archs: list[str] = field(default_factory=list)
    """Freshly initialised systems of ``preset`` (registry names)."""
    out: str | Path = "benchmark"
    """Output folder: benchmark.json, benchmark.md, benchmark.png."""
    preset: str = "small"
    vocab_size: int = 8000
    """Vocabulary of the ``archs`` systems."""
    data: str | None = None
    """Prepared data whose ``split`` sources are decoded (else random ids)."""
    split: str = "test"
    sentences: int = 200
    batch_sizes: tuple[int, ...] = (1, 10, 50, 100)
    """Batch sizes measured at ``fixed_beam``."""
    beams: tuple[int, ...] = (1, 2, 4, 8)
    """Beam sizes measured at ``fixed_batch``."""
    fixed_beam: int = 4
    fixed_batch: int = 100
    repeats: int = 3
    """Timed rounds (median) after one warm-up round."""
    train_tokens: int = 4096
    """Tokens per training batch of the training rows."""
    device: str = "auto"
    fixed_length: int | None = None
    """Every hypothesis exactly this many tokens (equal work for any two systems)."""
    quantize: tuple[str, ...] = ("none",)
    """Modes: none (fp32), int8, bf16 (bf16 decoding copies and bf16 training rows)."""
    train: bool = True
    """Also measure training throughput."""
    dropout_masks: str = "torch"
    """Dropout masks of the training rows: torch | fast (``train.dropout_masks``)."""


def run_benchmark(spec: BenchmarkSpec, log=print) -> dict:
    """Measure ``spec``'s systems side by side; write and return the results."""
    device = pick_device(spec.device)
    if device.type == "cpu":
        from ranmt.runtime.memory import retain_freed_memory

        retain_freed_memory()  # as the trainer does
    systems = load_systems(spec.checkpoints, spec.archs, spec.preset, spec.vocab_size, device,
                           tuple(spec.quantize))
    sources = _inputs(systems, spec.data, spec.split, spec.sentences, spec.vocab_size)
    limit = min(cfg.model.max_positions for _, _, _, cfg in systems) - 1
    sources = [s[:limit] for s in sources if s]
    results: dict = {"device": str(device), "torch": torch.__version__, "cpu": cpu_description(),
                     "sentences": len(sources), "repeats": spec.repeats, "decode": [],
                     "fixed_length": spec.fixed_length, "threads": torch.get_num_threads(),
                     "train": {}, "systems": [label for label, *_ in systems]}
    settings = [("batch", b, spec.fixed_beam) for b in spec.batch_sizes] + \
               [("beam", spec.fixed_batch, k) for k in spec.beams]
    with torch.no_grad():
        for kind, batch, beam in settings:
            row = _decode_row(systems, sources, kind, batch, beam, spec, device)
            results["decode"].append(row)
            log(f"decode batch {batch:>3} beam {beam}: " + "  ".join(
                f"{label} {v['tokens_per_s']:,.0f} tok/s ({v['ratio']:.2f}x)"
                for label, v in row["systems"].items()))
    if spec.train:
        precisions = ("fp32", "bf16") if "bf16" in spec.quantize else ("fp32",)
        results["dropout_masks"] = spec.dropout_masks
        _train_rows(results, systems, sources, spec.train_tokens, spec.repeats, device, log,
                    precisions, spec.dropout_masks)
    out = Path(spec.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "benchmark.json").write_text(json.dumps(results, indent=1), encoding="utf-8")
    _plot(results, out / "benchmark.png")
    (out / "benchmark.md").write_text(_table(results), encoding="utf-8")
    print(_table(results))
    return results


def _decode_row(systems, sources: list[list[int]], kind: str, batch: int, beam: int,
                spec: BenchmarkSpec, device: torch.device) -> dict:
    """One decoding setting: every system ``spec.repeats`` times after a warm-up round,
    interleaved; medians and ratios to the first system."""
    samples: dict[str, list[tuple[float, float]]] = {label: [] for label, *_ in systems}
    for repeat in range(spec.repeats + 1):  # first round = warm-up
        for label, _, model, cfg in systems:
            value = decode_speed(model, cfg, sources, batch, beam, device, spec.fixed_length)
            if repeat > 0:
                samples[label].append(value)
    row = {"vary": kind, "batch": batch, "beam": beam, "systems": {}}
    first_runs = [v[0] for v in samples[systems[0][0]]]
    for label, *_ in systems:
        runs = [v[0] for v in samples[label]]
        tok = statistics.median(runs)
        sent = statistics.median(v[1] for v in samples[label])
        row["systems"][label] = {
            "tokens_per_s": tok, "sentences_per_s": sent,
            "ratio": tok / statistics.median(first_runs), "runs_tokens_per_s": runs,
            # the ratio within each interleaved round: the noise the median hides
            "ratio_per_run": [a / b for a, b in zip(runs, first_runs)]}
    return row


def _train_rows(results: dict, systems, sources, train_tokens: int, repeats: int,
                device: torch.device, log, precisions: tuple[str, ...] = ("fp32",),
                dropout_masks: str = "torch") -> None:
    """Training throughput of the fp32 systems in each of ``precisions`` (a bf16 row is the
    same model trained as ``train.precision=bf16`` does), interleaved, into results."""
    fp32 = [s for s in systems if not is_quantized(s[2])
            and next(s[2].parameters()).dtype == torch.float32]
    systems = [(label if precision == "fp32" else f"{label} {precision} training", translator,
                model, cfg, precision)
               for precision in precisions for label, translator, model, cfg in fp32]
    train_samples: dict[str, list] = {label: [] for label, *_ in systems}
    for repeat in range(repeats + 1):
        for label, _, model, cfg, precision in systems:
            value = train_speed(model, cfg, sources, train_tokens, device, precision,
                                dropout_masks)
            if repeat > 0:
                train_samples[label].append(value)
    first = None
    for label, _, model, _, _ in systems:
        tok = statistics.median(v[0] for v in train_samples[label])
        first = first or tok
        peaks = [v[1] for v in train_samples[label] if v[1] is not None]
        entry = {"tokens_per_s": tok, "ratio": tok / first,
                 "peak_memory_mib": max(peaks) if peaks else None}
        if device.type == "cuda":
            entry["max_tokens_per_batch"] = max_tokens_that_fit(model, sources, device)
        results["train"][label] = entry
        log(f"train {label}: {tok:,.0f} tgt tok/s ({entry['ratio']:.2f}x)")


def _table(results: dict) -> str:
    names = results["systems"]
    train = results["train"]
    fixed = results.get("fixed_length")
    lines = [f"device {results['device']}, torch {results['torch']}, "
             f"{results.get('threads', '?')} threads, {results['sentences']} sentences, "
             + (f"fixed output length {fixed}, " if fixed else "outputs as the models write, ")
             + f"median of {results['repeats']} runs"
             + (f"; CPU: {results['cpu']}" if results.get("device") == "cpu" else ""), "",
             "| vary | batch | beam | " + " | ".join(f"{name} tok/s (ratio)" for name in names)
             + " |", "|---|---|---|" + "---|" * len(names)]
    for row in results["decode"]:
        cells = [_cell(row["systems"][name], name != names[0]) for name in names]
        lines.append(f"| {row['vary']} | {row['batch']} | {row['beam']} | " + " | ".join(cells)
                     + " |")
    names = [name for name in names if name in train]
    if not names:
        return "\n".join(lines) + "\n"
    lines += ["", "| training | " + " | ".join(names) + " |", "|---|" + "---|" * len(names),
              "| tgt tok/s (ratio) | " + " | ".join(
                  f"{train[name]['tokens_per_s']:,.0f} ({train[name]['ratio']:.2f}x)"
                  for name in names) + " |"]
    if any(train[name]["peak_memory_mib"] for name in names):
        lines.append("| peak memory (MiB) | " + " | ".join(
            f"{train[name]['peak_memory_mib']:.0f}" for name in names) + " |")
    if any("max_tokens_per_batch" in train[name] for name in names):
        lines.append("| max tokens per batch | " + " | ".join(
            str(train[name].get("max_tokens_per_batch", "-")) for name in names) + " |")
    return "\n".join(lines) + "\n"


def _cell(entry: dict, with_range: bool) -> str:
    """``1,586 (1.18x)``, with the per-round ratio range (``1.12-1.25``) when there are
    several rounds."""
    text = f"{entry['tokens_per_s']:,.0f} ({entry['ratio']:.2f}x"
    per_run = entry.get("ratio_per_run") or []
    if with_range and len(per_run) > 1:
        text += f"; {min(per_run):.2f}-{max(per_run):.2f}"
    return text + ")"


def _plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for ax, kind, key in ((axes[0], "batch", "batch"), (axes[1], "beam", "beam")):
        rows = [r for r in results["decode"] if r["vary"] == kind]
        for label in results["systems"]:
            ax.plot([r[key] for r in rows], [r["systems"][label]["tokens_per_s"] for r in rows],
                    marker="o", label=label)
        ax.set_xlabel(f"{key} size")
        ax.set_ylabel("target tokens / s")
        ax.set_xscale("log", base=2)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
