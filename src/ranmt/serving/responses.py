"""The entries of a ``POST /translate`` answer (:class:`ranmt.serving.schema.Translation`):
each line's best translation and score, its n best, word alignments and attention maps
(the last two computed here, after decoding, by teacher-forced passes over the outputs).
Runs in the server's decoding thread."""

from __future__ import annotations

from typing import Any

from ranmt.analysis.maps import attention_maps
from ranmt.inference.scoring import word_alignment
from ranmt.inference.translator import Translator


def response_entries(translator: Translator, ids: list[list[int]], results: list,
             request) -> list[dict[str, Any]]:
    """The response entries of one request (attention maps and alignments computed here,
    after decoding, by teacher-forced passes over the outputs)."""
    alignments: dict[tuple[int, int], list] = {}
    if request.alignment:
        flat = [(row, rank) for row, hyps in enumerate(results) for rank in range(len(hyps))]
        pairs = translator.align_ids([ids[row] for row, _ in flat],
                                     [results[row][rank][0] for row, rank in flat])
        for (row, rank), subword_pairs in zip(flat, pairs):
            alignments[row, rank] = [list(pair) for pair in word_alignment(
                subword_pairs, pieces(translator.src_vocab, ids[row]),
                pieces(translator.tgt_vocab, results[row][rank][0]))]

    def hypothesis(row: int, rank: int) -> dict[str, Any]:
        tokens, score = results[row][rank]
        out = {"text": translator.tgt_vocab.decode([tokens])[0], "score": finite_or_none(score)}
        if request.alignment:
            out["alignment"] = alignments[row, rank]
        return out

    entries = []
    for row, (src_ids, hyps) in enumerate(zip(ids, results)):
        entry = hypothesis(row, 0)
        if request.nbest > 1:
            entry["nbest"] = [hypothesis(row, rank) for rank in range(len(hyps))]
        if request.attention:
            entry["attention"] = (attention_maps(translator, src_ids, hyps[0][0])
                                  if src_ids else None)
        entries.append(entry)
    return entries


def pieces(vocab, ids: list[int]) -> list[str]:
    return [vocab.processor.id_to_piece(i) for i in ids]


def finite_or_none(score: float) -> float | None:
    return score if score == score and abs(score) != float("inf") else None
