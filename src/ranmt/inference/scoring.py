"""Scoring given translations and aligning words: two teacher-forced passes.

**Scoring** (fairseq's ``--score-reference``, CTranslate2's ``score_batch``): for a source x
and a target y of |y| subwords, the log-probability of each target token given the ones
before, EOS included: ``log p(y_t | y_<t, x)`` for t = 1..|y|+1; their sum (the total), and
the total divided by the length penalty of |y|+1 tokens, the score beam search ranks
finished hypotheses by (:func:`ranmt.inference.decode.length_penalty`) — so scoring a beam output
gives back the score the search gave it.

**Alignment** (Marian's ``--alignment``, CTranslate2's ``return_attention``): each target
subword is aligned to the source subword its cross-attention weighs most, in one decoder
layer, averaged over heads (EOS on either side left out). The default layer is the
penultimate one: Garg et al. (2019, "Jointly Learning to Align and Translate with
Transformer Models") found the penultimate layer's head-averaged attention the best aligner
of a 6-layer Transformer; ``layer`` picks another (negative counts from the top). Layers
without cross-attention (SH-X) are skipped to the nearest lower one that has it. The
subword pairs become word pairs (Moses' ``i-j``: source word i, target word j, 0-based) by
the SentencePiece word boundaries (a piece starting with "▁" starts a word), which are the
whitespace-separated words of the input line and of the detokenized output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ranmt.inference.decode import length_penalty
from ranmt.inference.ensemble import members, teacher_forced_logprobs
from ranmt.model import BOS_ID, EOS_ID, PAD_ID

WORD_START = "\u2581"


@dataclass
class PairScore:
    """The model's scores of one (source, target) pair."""

    token_logprobs: list[float]
    """log p of each target subword given the ones before, then of EOS (|y| + 1 values)."""
    total: float
    """Their sum: log p(y | x)."""
    normalized: float
    """``total`` / length penalty of |y| + 1 tokens: the beam search score."""


def _target_batch(targets: list[list[int]], device) -> tuple[Tensor, Tensor]:
    """Targets -> (tgt_in (B, T) = BOS y, tgt_out (B, T) = y EOS), right-padded."""
    width = max(len(t) for t in targets) + 1
    tgt_in = torch.full((len(targets), width), PAD_ID, dtype=torch.long, device=device)
    tgt_out = torch.full_like(tgt_in, PAD_ID)
    for row, ids in enumerate(targets):
        tgt_in[row, : len(ids) + 1] = torch.tensor([BOS_ID] + ids)
        tgt_out[row, : len(ids) + 1] = torch.tensor(ids + [EOS_ID])
    return tgt_in, tgt_out


@torch.inference_mode()
def score_targets(model, src: Tensor, targets: list[list[int]], lenpen: float = 0.6,
                  lenpen_style: str = "gnmt") -> list[PairScore]:
    """Score targets (subword ids without BOS/EOS) given src (B, S) (one target per row)."""
    if len(targets) != src.shape[0]:
        raise ValueError(f"{src.shape[0]} sources but {len(targets)} targets")
    tgt_in, tgt_out = _target_batch(targets, src.device)
    logprobs = teacher_forced_logprobs(model, src, tgt_in)  # (B, T, V)
    picked = logprobs.gather(2, tgt_out[..., None]).squeeze(2)  # (B, T)
    results = []
    for row, ids in enumerate(targets):
        values = picked[row, : len(ids) + 1].tolist()
        total = float(sum(values))
        results.append(PairScore(values, total,
                                 total / length_penalty(len(ids) + 1, lenpen, lenpen_style)))
    return results


def _cross_layer(model, layer: int | None) -> int:
    """Index of the decoder layer whose cross-attention aligns (see the module docstring)."""
    decoder_layers = members(model)[0].decoder.layers
    count = len(decoder_layers)
    index = count - 2 if layer is None else layer
    index = index + count if index < 0 else index
    if not 0 <= index < count:
        raise ValueError(f"alignment layer {layer} is out of range for {count} decoder layers")
    with_cross = [i for i in range(count) if decoder_layers[i].cross_attention is not None]
    if not with_cross:
        raise ValueError("the model has no cross-attention to align with")
    lower = [i for i in with_cross if i <= index]
    return lower[-1] if lower else with_cross[0]


@torch.inference_mode()
def align(model, src: Tensor, targets: list[list[int]], layer: int | None = None
          ) -> list[list[tuple[int, int]]]:
    """Subword alignments: per row of src (B, S) and its target, one ``(source index, target
    index)`` pair per target subword (EOS left out on both sides), best source first."""
    index = _cross_layer(model, layer)
    tgt_in, _ = _target_batch(targets, src.device)
    attention = None
    for member in members(model):  # an ensemble aligns with its members' mean attention
        _, weights = member(src, tgt_in, need_weights=True)
        cross = weights["decoder"][index]["cross"].float().mean(1)  # (B, T, S)
        attention = cross if attention is None else attention + cross
    source_len = src.ne(PAD_ID).sum(1) - 1  # without EOS
    results = []
    for row, ids in enumerate(targets):
        n_src = int(source_len[row])
        if n_src <= 0 or not ids:
            results.append([])
            continue
        best = attention[row, : len(ids), :n_src].argmax(-1).tolist()
        results.append([(source, target) for target, source in enumerate(best)])
    return results


def word_indices(pieces: list[str]) -> list[int]:
    """The word (0-based) each SentencePiece piece belongs to."""
    words, current = [], -1
    for piece in pieces:
        if piece.startswith(WORD_START) or current < 0:
            current += 1
        words.append(current)
    return words


def word_alignment(pairs: list[tuple[int, int]], src_pieces: list[str],
                   tgt_pieces: list[str]) -> list[tuple[int, int]]:
    """Subword pairs -> sorted, distinct word pairs (source word, target word)."""
    src_words, tgt_words = word_indices(src_pieces), word_indices(tgt_pieces)
    return sorted({(src_words[i], tgt_words[j]) for i, j in pairs})


def format_alignment(pairs: list[tuple[int, int]]) -> str:
    """Moses/Pharaoh format: ``0-0 1-2 ...``."""
    return " ".join(f"{i}-{j}" for i, j in pairs)
