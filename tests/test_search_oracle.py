"""An oracle for the searches that shares none of their code: exhaustive enumeration.

A model with a 6-token vocabulary and an output limit of 3 tokens has 156 possible outputs
(every sequence of 0-3 non-EOS tokens, then EOS; at the limit only EOS is allowed). Their
log-probabilities are computed here by walking the tree of all prefixes, one
``decode_step`` per level with the reference (growing) cache, and each output's score is
its log-probability divided by the length penalty written out below. A beam wide enough to
hold every live prefix and every finished output (160 >= 156) must then return exactly
the enumeration's ranking — the best output and the whole n-best list, tokens identical,
scores within 1e-5 — for the fast, the sync-free and the reference beam search, under both
length-penalty styles; and greedy search must follow the tree's arg-max path.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from conftest import random_batch, tiny_model
from ranmt.inference.decode import search
from ranmt.model import BOS_ID, EOS_ID
from test_fast_decode import DECODERS

VOCAB, LIMIT = 6, 3
CONTINUE = [token for token in range(VOCAB) if token != EOS_ID]  # every non-EOS token


def _penalty(length: int, alpha: float, style: str) -> float:
    """Written out independently of ranmt.inference.decode.length_penalty."""
    return ((5 + length) / 6) ** alpha if style == "gnmt" else float(length) ** alpha


@torch.no_grad()
def _enumerate(model, src: torch.Tensor, prefixes_out: dict | None = None
               ) -> dict[tuple[int, ...], float]:
    """Every output (tokens without EOS) of one source (1, S) -> its log-probability;
    ``prefixes_out`` receives every prefix's log-probability (without EOS)."""
    memory, pad_mask, _ = model.encode(src)
    cache = model.init_cache(memory, pad_mask)  # the reference cache: grows by concatenation
    prefixes: list[tuple[int, ...]] = [()]
    prefix_logprob = {(): 0.0}
    outputs: dict[tuple[int, ...], float] = {}
    prev = torch.full((1, 1), BOS_ID, dtype=torch.long)
    for step in range(LIMIT + 1):
        logprobs = model.decode_step(prev, cache)  # (len(prefixes), V)
        for row, prefix in enumerate(prefixes):
            outputs[prefix] = prefix_logprob[prefix] + float(logprobs[row, EOS_ID])
        if step == LIMIT:  # at the limit only EOS: nothing is extended
            break
        extended = [(row, token) for row in range(len(prefixes)) for token in CONTINUE]
        for row, token in extended:
            prefix_logprob[prefixes[row] + (token,)] = (
                prefix_logprob[prefixes[row]] + float(logprobs[row, token]))
        model.reorder_cache(cache, torch.tensor([row for row, _ in extended]))
        prefixes = [prefixes[row] + (token,) for row, token in extended]
        prev = torch.tensor([[token] for _, token in extended])
    if prefixes_out is not None:
        prefixes_out.update(prefix_logprob)
    return outputs


def _ranking(outputs: dict, alpha: float, style: str) -> list[tuple[list[int], float]]:
    scored = [(list(tokens), logprob / _penalty(len(tokens) + 1, alpha, style))
              for tokens, logprob in outputs.items()]
    return sorted(scored, key=lambda item: -item[1])


def _model(self_attention: str, cross: str, seed: int):
    return tiny_model(seed=seed, **{"model.decoder.self_attention": self_attention,
                                    "model.decoder.cross_attention": cross,
                                    "model.src_vocab_size": VOCAB,
                                    "model.tgt_vocab_size": VOCAB})[0]


def test_the_enumeration_covers_every_output():
    model = _model("dot", "dot", 0)
    src, _ = random_batch(batch=1, src_len=5, vocab=VOCAB)
    prefixes: dict = {}
    outputs = _enumerate(model, src, prefixes)
    assert len(outputs) == sum(len(CONTINUE) ** k for k in range(LIMIT + 1)) == 156
    # the model's probability mass is all accounted for: outputs that end before the limit,
    # and the prefixes that reach it (where EOS is forced, keeping its own probability)
    mass = [lp for tokens, lp in outputs.items() if len(tokens) < LIMIT]
    mass += [lp for tokens, lp in prefixes.items() if len(tokens) == LIMIT]
    assert float(torch.tensor(mass).exp().sum()) == pytest.approx(1.0, abs=1e-4)


@pytest.mark.parametrize(("self_attention", "cross"), DECODERS)
def test_a_beam_covering_every_output_returns_the_exhaustive_ranking(self_attention, cross):
    model = _model(self_attention, cross, 1)
    src, _ = random_batch(batch=2, src_len=6, vocab=VOCAB, seed=1)
    rankings = [_enumerate(model, src[row: row + 1, : int(src[row].ne(0).sum())])
                for row in range(2)]
    for (alpha, style), (reference, sync_free) in itertools.product(
            [(0.6, "gnmt"), (1.0, "fairseq"), (0.0, "gnmt")],
            [(False, False), (False, True), (True, False)]):
        results = search(model, src, beam=160, lenpen=alpha, lenpen_style=style, max_len_a=0.0,
                         max_len_b=LIMIT,
                         nbest=156, reference=reference, sync_free=sync_free)
        for outputs, hypotheses in zip(rankings, results):
            expected = _ranking(outputs, alpha, style)
            assert hypotheses[0][0] == expected[0][0]
            assert [tokens for tokens, _ in hypotheses[:20]] == \
                [tokens for tokens, _ in expected[:20]]
            assert [score for _, score in hypotheses] == pytest.approx(
                [score for _, score in expected], abs=1e-5)


@pytest.mark.parametrize(("self_attention", "cross"), DECODERS[:4])
def test_greedy_follows_the_arg_max_path(self_attention, cross):
    model = _model(self_attention, cross, 2)
    src, _ = random_batch(batch=1, src_len=6, vocab=VOCAB, seed=2)
    prefixes: dict = {}
    outputs = _enumerate(model, src, prefixes)
    path: tuple[int, ...] = ()
    while len(path) < LIMIT:  # the most probable next token given the path, EOS included:
        # P(t | path) is P(path + t) / P(path), so compare the joint log-probabilities
        best = max(CONTINUE, key=lambda token: prefixes[path + (token,)])
        if outputs[path] >= prefixes[path + (best,)]:
            break  # EOS
        path = path + (best,)
    for reference, sync_free in [(False, False), (False, True), (True, False)]:
        (tokens, _), = search(model, src, beam=1, max_len_a=0.0, max_len_b=LIMIT,
                              reference=reference, sync_free=sync_free)[0]
        assert tuple(tokens) == path
