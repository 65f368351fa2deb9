"""Collect the numbers behind the papers' figures for one or more trained systems.

For each checkpoint, real sentences of the chosen split are run teacher-forced with
``need_weights=True`` and the weights *returned by the attention modules* are summarised:

* entropy per layer and head, averaged over all valid timesteps, then over heads
  (paper 000 Eq. 5 / Fig. 4), for encoder self-, decoder self- and cross-attention;
* histograms of the attention weights of each layer (Fig. 5), over valid query rows and the
  keys each query may attend to;
* Jensen-Shannon divergence between every pair of layers of a component, on head-averaged
  distributions of the same query rows (Fig. 7);
* per head, the mean distance between a query position and the argmax of its attention
  (paper 004 Fig. 2), for the self-attentions;
* per sentence, decoder self-attention off-diagonality (paper 004 Sec. 6);
* the learned matrices of input-agnostic variants (RAN, Syn-R, hard-coded) over the first
  80 x 80 positions, read as the weights returned for an 80-token input (Fig. 6).

The split is also translated, for BLEU by source/reference length (paper 000 Fig. 8) and,
when a dot-product system is among those analysed, BLEU by off-diagonality bins measured on
the first such system (paper 004 Fig. 6).
"""

from __future__ import annotations

import json
import sys
from itertools import combinations
from pathlib import Path

import numpy as np
import torch
from sacrebleu.metrics import BLEU
from tqdm.auto import tqdm

from ranmt.analysis.stats import argmax_distance, js_divergence, off_diagonality, row_entropy
from ranmt.data.batching import batch_from_split, make_batches
from ranmt.data.corpus import load_split, raw_text
from ranmt.evaluate import bleu_by_bins, bleu_by_length
from ranmt.inference.translator import Translator
from ranmt.model import PAD_ID, component_weights

COMPONENTS = ("encoder_self", "decoder_self", "cross")
HIST_BINS = np.linspace(0.0, 1.0, 51)
OFFDIAG_EDGES = (0.0, 0.2, 0.4, 0.6, 0.8)


class _Accumulator:
    """Running sums for one component of one system."""

    def __init__(self):
        self.entropy: dict[int, np.ndarray] = {}  # layer -> (H,) sums
        self.rows: dict[int, float] = {}  # layer -> valid query rows
        self.hist: dict[int, np.ndarray] = {}
        self.distance: dict[int, np.ndarray] = {}
        self.js_sum: dict[tuple[int, int], float] = {}
        self.js_rows: dict[tuple[int, int], float] = {}

    def add(self, layer: int, weights: torch.Tensor, query_valid: torch.Tensor,
            allowed: torch.Tensor, self_attention: bool) -> None:
        """weights (B, H, T, S); query_valid (B, T); allowed (B, T, S) keys each row may see."""
        rows = query_valid[:, None, :].float()  # (B, 1, T)
        entropy = (row_entropy(weights) * rows).sum((0, 2)).cpu().numpy()  # (H,)
        self.entropy[layer] = self.entropy.get(layer, 0) + entropy
        self.rows[layer] = self.rows.get(layer, 0) + float(query_valid.sum())
        mask = (allowed & query_valid[:, :, None])[:, None].expand_as(weights)
        values = weights[mask].float().cpu().numpy()
        counts, _ = np.histogram(values, bins=HIST_BINS)
        self.hist[layer] = self.hist.get(layer, 0) + counts
        if self_attention:
            distance = (argmax_distance(weights) * rows).sum((0, 2)).cpu().numpy()
            self.distance[layer] = self.distance.get(layer, 0) + distance

    def add_pairs(self, averaged: dict[int, torch.Tensor], query_valid: torch.Tensor) -> None:
        rows = query_valid.float()
        for a, b in combinations(sorted(averaged), 2):
            value = float((js_divergence(averaged[a], averaged[b]) * rows).sum())
            self.js_sum[(a, b)] = self.js_sum.get((a, b), 0.0) + value
            self.js_rows[(a, b)] = self.js_rows.get((a, b), 0.0) + float(rows.sum())

    def result(self, layers: int) -> dict:
        out: dict = {"layers": layers, "entropy": [None] * layers,
                     "entropy_per_head": [None] * layers, "histogram": [None] * layers,
                     "argmax_distance_per_head": [None] * layers,
                     "js_divergence": [[None] * layers for _ in range(layers)]}
        for layer in self.entropy:
            per_head = self.entropy[layer] / max(self.rows[layer], 1)
            out["entropy_per_head"][layer] = per_head.tolist()
            out["entropy"][layer] = float(per_head.mean())
            total = self.hist[layer].sum()
            out["histogram"][layer] = (self.hist[layer] / max(total, 1)).tolist()
            if layer in self.distance:
                out["argmax_distance_per_head"][layer] = (
                    self.distance[layer] / max(self.rows[layer], 1)).tolist()
        for (a, b), value in self.js_sum.items():
            js = value / max(self.js_rows[(a, b)], 1)
            out["js_divergence"][a][b] = out["js_divergence"][b][a] = js
        for layer in self.entropy:
            out["js_divergence"][layer][layer] = 0.0
        out["histogram_bins"] = HIST_BINS.tolist()
        return out


@torch.no_grad()
def collect_attention(model, split, count: int, max_tokens: int = 2000,
                      progress: bool = False) -> dict:
    """Attention statistics over the first ``count`` sentences of an encoded split
    (``progress``: a bar on stderr)."""
    model.eval()
    lengths = (np.array([len(s) for s in split.src[:count]]),
               np.array([len(t) for t in split.tgt[:count]]))
    accumulators = {name: _Accumulator() for name in COMPONENTS}
    offdiag = np.zeros(count)
    device = next(model.parameters()).device
    limit = model.config.max_positions
    batches = make_batches(*lengths, max_tokens)
    bar = tqdm(total=count, unit="sent", desc="attention", file=sys.stderr,
               disable=not progress or len(batches) <= 1)
    for indices in batches:
        bar.update(len(indices))
        batch = batch_from_split(split, indices, limit).to(device)
        _, weights = model(batch.src, batch.tgt_in, need_weights=True)
        src_valid, tgt_valid = batch.src.ne(PAD_ID), batch.tgt_out.ne(PAD_ID)
        length_t = batch.tgt_in.shape[1]
        causal = torch.ones(length_t, length_t, dtype=torch.bool, device=device).tril()
        setup = {
            "encoder_self": (src_valid, src_valid[:, None, :].expand(-1, src_valid.shape[1], -1),
                             True),
            "decoder_self": (tgt_valid, causal[None].expand(len(indices), -1, -1), True),
            "cross": (tgt_valid, src_valid[:, None, :].expand(-1, length_t, -1), False),
        }
        for name, layer_weights in component_weights(weights).items():
            query_valid, allowed, is_self = setup[name]
            averaged = {}
            for layer, w in enumerate(layer_weights):
                if w is None:
                    continue
                accumulators[name].add(layer, w, query_valid, allowed, is_self)
                averaged[layer] = w.float().mean(1)  # (B, T, S) head average
            accumulators[name].add_pairs(averaged, query_valid)
            if name == "decoder_self" and averaged:
                mean = torch.stack(list(averaged.values())).mean(0)
                offdiag[indices] = off_diagonality(mean, tgt_valid).cpu().numpy()
    bar.close()
    layers = {"encoder_self": model.config.encoder.layers,
              "decoder_self": model.config.decoder.layers,
              "cross": model.config.decoder.layers}
    result = {name: acc.result(layers[name]) for name, acc in accumulators.items()}
    result["offdiagonality"] = offdiag.tolist()
    return result


@torch.no_grad()
def learned_matrices(model, size: int = 80) -> dict:
    """Weights of input-agnostic self-attentions for a ``size``-token input (H, n, n) per layer.

    For RAN / Syn-R these are the softmaxed learned matrices (causal in the decoder); other
    variants are skipped (their weights depend on the input).
    """
    model.eval()
    size = min(size, model.config.max_positions - 1)
    device = next(model.parameters()).device
    out: dict = {}
    encoder_agnostic = all(layer.self_attention is not None and layer.self_attention
                           .input_agnostic for layer in model.encoder.layers)
    decoder_agnostic = all(layer.self_attention is not None and layer.self_attention
                           .input_agnostic for layer in model.decoder.layers)
    tokens = torch.full((1, size), 4, dtype=torch.long, device=device)
    memory, pad_mask, enc_weights = model.encode(tokens, need_weights=True)
    if encoder_agnostic:
        out["encoder_self"] = [np.round(w[0].float().cpu().numpy(), 5).tolist()
                               for w in enc_weights]
    if decoder_agnostic:
        _, dec_weights = model.decoder(tokens, memory, pad_mask, need_weights=True)
        out["decoder_self"] = [np.round(layer["self"][0].float().cpu().numpy(), 5).tolist()
                               for layer in dec_weights]
    return out


def analyze(checkpoints: list[str | Path], data_dir: str | Path, split: str,
            out_dir: str | Path, max_sentences: int = 0, beam: int | None = None,
            device: str = "auto", log=print, histogram_layers: list[int] | None = None,
            progress: bool = False) -> dict:
    """Analyse one or more systems; write ``analysis.json`` and the PNG figures to ``out_dir``
    (``progress``: bars on stderr for the attention pass and the translations)."""
    from ranmt.analysis.plots import write_figures

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    encoded = load_split(data_dir, split)
    sources, references = raw_text(data_dir, split, "src"), raw_text(data_dir, split, "tgt")
    count = min(max_sentences or len(encoded), len(encoded))
    systems = []
    labels_seen: dict[str, int] = {}
    for checkpoint in checkpoints:
        translator = Translator.load(checkpoint, device=device, beam=beam, truncate_long=True)
        cfg = translator.config
        label = cfg.model.arch
        labels_seen[label] = labels_seen.get(label, 0) + 1
        if labels_seen[label] > 1:
            label = f"{label}#{labels_seen[label]}"
        log(f"analysing {label} ({translator.checkpoint_dir}) on {count} sentences of {split}")
        translator.progress = progress
        stats = collect_attention(translator.model, encoded, count, progress=progress)
        hyps = translator.translate(sources[:count])
        system = {"label": label, "checkpoint": str(translator.checkpoint_dir),
                  "arch": cfg.model.arch, "beam": translator.decode_config.beam,
                  "bleu": BLEU().corpus_score(hyps, [references[:count]]).score,
                  "bleu_by_source_length": bleu_by_length(hyps, references[:count],
                                                          sources[:count]),
                  "bleu_by_reference_length": bleu_by_length(hyps, references[:count],
                                                             sources[:count], "reference"),
                  "attention": stats, "learned_matrices": learned_matrices(translator.model),
                  "cross_attention_name": cfg.model.decoder.cross_attention,
                  "decoder_self_attention_name": cfg.model.decoder.self_attention,
                  "_hyps": hyps}
        systems.append(system)
    reference_system = next((s for s in systems if s["decoder_self_attention_name"] == "dot"),
                            None)
    if reference_system is not None:
        values = reference_system["attention"]["offdiagonality"]
        for system in systems:
            system["bleu_by_offdiagonality"] = bleu_by_bins(
                system["_hyps"], references[:count], values, OFFDIAG_EDGES,
                lambda low, high: f"{low:.1f}-{1.0 if high is None else high:.1f}")
            system["offdiagonality_measured_on"] = reference_system["label"]
    for system in systems:
        del system["_hyps"]
    result = {"split": split, "sentences": count, "systems": systems,
              "histogram_layers": histogram_layers}
    figures = write_figures(result, out_dir)
    result["figures"] = figures
    (out_dir / "analysis.json").write_text(json.dumps(result), encoding="utf-8")
    log(f"wrote {out_dir / 'analysis.json'} and {len(figures)} figures")
    return result
