"""Decoding beyond beam search: target prefixes, sampling, scoring, alignments, ensembles.

Invariants: scoring a beam output gives back the search's score; greedy with a prefix that
greedy wrote itself changes nothing; fast and reference paths agree with prefixes; samples are
reproducible with a seed and follow their truncation rule; an ensemble of one model is that
model, and of two identical models decodes the same.
"""

from __future__ import annotations

import math

import pytest
import torch

from conftest import random_batch, tiny_model
from ranmt.inference.decode import (
    beam_search,
    beam_search_reference,
    greedy_search,
    greedy_search_reference,
    search,
)
from ranmt.inference.ensemble import Ensemble
from ranmt.inference.sampling import Sampler, sample
from ranmt.inference.scoring import (
    align,
    format_alignment,
    score_targets,
    word_alignment,
    word_indices,
)
from ranmt.model import EOS_ID, PAD_ID

ARCHS = ["transf", "ran-all", "hc-all", "syn-r", "sh-x", "rc"]
RECURRENT_CROSS = "concat-prev-accum-weight"  # a recurrent cross-attention (Rosendahl et al.)


def _model(arch: str, seed: int):
    """A tiny model; ``rc``: TransF with a recurrent cross-attention."""
    if arch == "rc":
        return tiny_model(seed=seed, **{"model.decoder.cross_attention": RECURRENT_CROSS})[0]
    return tiny_model(seed=seed, **{"model.arch": arch})[0]


def _prefix_tensor(prefixes: list[list[int]]) -> torch.Tensor:
    width = max(1, max(len(p) for p in prefixes))
    out = torch.full((len(prefixes), width), PAD_ID, dtype=torch.long)
    for row, ids in enumerate(prefixes):
        out[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
    return out


# ------------------------------------------------------------------------------ prefixes


@pytest.mark.parametrize("arch", ["transf", "ran-all", "sh-x"])
def test_greedy_with_its_own_prefix_is_greedy(arch):
    model, _ = tiny_model(seed=1, **{"model.arch": arch})
    src, _ = random_batch(batch=4, seed=1)
    free = greedy_search(model, src, max_len_a=1.0, max_len_b=5)
    prefixes = [hyp[0][0][: k] for hyp, k in zip(free, [0, 1, 2, 3])]
    forced = greedy_search(model, src, max_len_a=1.0, max_len_b=5, prefix=_prefix_tensor(prefixes))
    for f, g in zip(forced, free):
        assert f[0][0] == g[0][0]
        assert f[0][1] == pytest.approx(g[0][1], abs=1e-5)


@pytest.mark.parametrize("arch", ["transf", "ran-all"])
def test_outputs_start_with_any_prefix_and_paths_agree(arch):
    model, _ = tiny_model(seed=2, **{"model.arch": arch})
    src, _ = random_batch(batch=3, seed=2)
    prefixes = [[5, 6, 7], [], [9]]
    prefix = _prefix_tensor(prefixes)
    for beam in (1, 3):
        fast = search(model, src, beam=beam, max_len_a=1.0, max_len_b=4, nbest=beam,
                      prefix=prefix)
        ref = search(model, src, beam=beam, max_len_a=1.0, max_len_b=4, nbest=beam,
                     prefix=prefix, reference=True)
        for hyps_fast, hyps_ref, wanted in zip(fast, ref, prefixes):
            assert [h[0] for h in hyps_fast] == [h[0] for h in hyps_ref]
            for (tokens, score), (_, score_ref) in zip(hyps_fast, hyps_ref):
                assert tokens[: len(wanted)] == wanted
                assert score == pytest.approx(score_ref, abs=1e-4)


def test_prefix_score_counts_the_forced_tokens():
    """Greedy with a prefix: the score is the sum of the log-probs of the whole output."""
    model, _ = tiny_model(seed=3)
    src, _ = random_batch(batch=2, seed=3)
    prefixes = [[11, 12], [13]]
    hyps = greedy_search(model, src, max_len_a=1.0, max_len_b=4, prefix=_prefix_tensor(prefixes))
    scored = score_targets(model, src, [h[0][0] for h in hyps], lenpen=0.0)
    for hyp, pair in zip(hyps, scored):
        assert hyp[0][1] == pytest.approx(pair.total, abs=1e-4)


def test_prefix_longer_than_the_limit_is_an_error():
    model, _ = tiny_model()
    src, _ = random_batch(batch=1)
    with pytest.raises(ValueError, match="longer than the model's output limit"):
        greedy_search(model, src, prefix=torch.full((1, 70), 5, dtype=torch.long))
    with pytest.raises(ValueError, match="may not contain EOS"):
        greedy_search(model, src, prefix=torch.tensor([[5, EOS_ID]]))


# ------------------------------------------------------------------------------ scoring


@pytest.mark.parametrize("arch", ARCHS)
def test_scoring_a_beam_output_gives_the_beam_score(arch):
    model = _model(arch, seed=4)
    src, _ = random_batch(batch=3, seed=4)
    for style, alpha in (("gnmt", 0.6), ("fairseq", 1.0)):
        hyps = beam_search(model, src, beam=3, lenpen=alpha, lenpen_style=style,
                           max_len_a=1.0, max_len_b=4)
        scored = score_targets(model, src, [h[0][0] for h in hyps], alpha, style)
        for hyp, pair in zip(hyps, scored):
            assert pair.normalized == pytest.approx(hyp[0][1], abs=1e-4)
            assert len(pair.token_logprobs) == len(hyp[0][0]) + 1
            assert pair.total == pytest.approx(sum(pair.token_logprobs))


def test_score_is_the_log_probability_of_the_target():
    """Teacher forcing, by hand: log p(y) = sum_t log softmax(logits_t)[y_t]."""
    model, _ = tiny_model(seed=5)
    src, _ = random_batch(batch=1, seed=5, pad_rows=False)
    target = [7, 8, 9]
    with torch.no_grad():
        logits = model(src, torch.tensor([[2, 7, 8, 9]]))
    logprobs = torch.log_softmax(logits.float(), -1)[0]
    expected = sum(float(logprobs[t, y]) for t, y in enumerate(target + [EOS_ID]))
    (pair,) = score_targets(model, src, [target], lenpen=0.0)
    assert pair.total == pytest.approx(expected, abs=1e-5)
    assert all(value <= 0 for value in pair.token_logprobs)


# ------------------------------------------------------------------------------ sampling


def test_sampling_is_reproducible_and_differs_across_seeds():
    model, _ = tiny_model(seed=6)
    src, _ = random_batch(batch=3, seed=6)
    sampler = Sampler("topk", topk=0, temperature=1.5)
    first = sample(model, src, sampler, samples=4, seed=11, max_len_a=1.0, max_len_b=5)
    again = sample(model, src, sampler, samples=4, seed=11, max_len_a=1.0, max_len_b=5)
    other = sample(model, src, sampler, samples=4, seed=12, max_len_a=1.0, max_len_b=5)
    assert first == again
    assert [len(hyps) for hyps in first] == [4, 4, 4]
    tokens = lambda result: [h[0] for hyps in result for h in hyps]  # noqa: E731
    assert tokens(first) != tokens(other)
    # The score of a sample is its log-probability under the (untempered) model.
    rows = [(b, h) for b, hyps in enumerate(first) for h in hyps]
    scored = score_targets(model, src[[b for b, _ in rows]], [h[0] for _, h in rows], 0.0)
    for (_, hyp), pair in zip(rows, scored):
        assert hyp[1] == pytest.approx(pair.total, abs=1e-4)


def test_topk_one_is_greedy():
    model, _ = tiny_model(seed=7, **{"model.arch": "ran-all"})
    src, _ = random_batch(batch=3, seed=7)
    greedy = greedy_search(model, src, max_len_a=1.0, max_len_b=5)
    sampled = sample(model, src, Sampler("topk", topk=1), samples=2, seed=3,
                     max_len_a=1.0, max_len_b=5)
    for g, hyps in zip(greedy, sampled):
        assert all(h[0] == g[0][0] for h in hyps)


def test_truncation_rules_keep_the_right_tokens():
    logprobs = torch.log(torch.tensor([[0.5, 0.25, 0.15, 0.07, 0.03]]))
    kept = lambda sampler: torch.isfinite(sampler.truncate(logprobs))[0].tolist()  # noqa: E731
    assert kept(Sampler("topk", topk=2)) == [True, True, False, False, False]
    assert kept(Sampler("topp", topp=0.7)) == [True, True, False, False, False]
    assert kept(Sampler("topp", topp=0.75)) == [True, True, False, False, False]
    assert kept(Sampler("topp", topp=0.76)) == [True, True, True, False, False]
    assert kept(Sampler("topp", topp=0.01)) == [True, False, False, False, False]
    assert kept(Sampler("eps", epsilon=0.1)) == [True, True, True, False, False]
    assert kept(Sampler("eps", epsilon=0.9)) == [True, False, False, False, False]
    tempered = Sampler("topk", temperature=2.0).truncate(logprobs)
    assert torch.allclose(torch.softmax(tempered, -1),
                          torch.softmax(logprobs / 2.0, -1))
    with pytest.raises(ValueError, match="unknown sampling method"):
        Sampler("beam")


def test_sampling_draws_from_the_distribution():
    """Frequencies of the first token over many samples follow the model's probabilities."""
    model, _ = tiny_model(seed=8)
    src, _ = random_batch(batch=1, seed=8, pad_rows=False)
    memory, pad_mask, _ = model.encode(src)
    first = model.decode_step(torch.tensor([[2]]), model.init_cache(memory, pad_mask))[0]
    probs = torch.softmax(first, -1)
    drawn = sample(model, src, Sampler("topk", topk=0), samples=4000, seed=0,
                   max_len_a=0.0, max_len_b=1)
    counts = torch.zeros_like(probs)
    for tokens, _ in drawn[0]:
        counts[tokens[0] if tokens else EOS_ID] += 1
    top = probs.topk(3).indices
    for token in top.tolist():
        expected = float(probs[token]) * 4000
        assert abs(counts[token] - expected) < 5 * math.sqrt(expected) + 5


# ------------------------------------------------------------------------------ alignments


@pytest.mark.parametrize("arch", ["transf", "ran-all", "sh-x", "hc-all"])
def test_alignments_one_pair_per_target_token(arch):
    model, _ = tiny_model(seed=9, **{"model.arch": arch})
    src, _ = random_batch(batch=3, seed=9)
    targets = [[5, 6, 7, 8], [9], [10, 11]]
    source_lengths = (src.ne(PAD_ID).sum(1) - 1).tolist()
    for layer in (None, 0, -1):
        pairs = align(model, src, targets, layer)
        for row_pairs, target, n_src in zip(pairs, targets, source_lengths):
            assert [j for _, j in row_pairs] == list(range(len(target)))
            assert all(0 <= i < n_src for i, _ in row_pairs)


def test_alignment_follows_the_attention():
    """The aligned source position is the arg-max of the head-averaged cross-attention."""
    model, _ = tiny_model(seed=10)
    src, _ = random_batch(batch=1, seed=10, pad_rows=False)
    target = [5, 6, 7]
    with torch.no_grad():
        _, weights = model(src, torch.tensor([[2] + target]), need_weights=True)
    cross = weights["decoder"][0]["cross"][0].mean(0)  # (T, S); tiny has 2 layers: 0 = penult.
    expected = [(int(cross[j, : src.shape[1] - 1].argmax()), j) for j in range(len(target))]
    assert align(model, src, [target])[0] == expected


def test_word_alignment_from_subwords():
    assert word_indices(["▁a", "b", "▁c", "▁", ","]) == [0, 0, 1, 2, 2]
    pairs = [(0, 0), (1, 1), (2, 1), (2, 2)]
    src_pieces = ["▁Ein", "▁Mann", "es"]  # words: Ein, Mannes
    tgt_pieces = ["▁A", "▁m", "an"]  # words: A, man
    assert word_alignment(pairs, src_pieces, tgt_pieces) == [(0, 0), (1, 1)]
    assert format_alignment([(0, 0), (1, 1)]) == "0-0 1-1"


# ------------------------------------------------------------------------------ ensembles


@pytest.mark.parametrize("arch", ["transf", "ran-all", "rc", "hc-all"])
def test_ensemble_of_one_is_the_model(arch):
    model = _model(arch, seed=11)
    src, _ = random_batch(batch=3, seed=11)
    alone = beam_search(model, src, beam=3, nbest=2, max_len_a=1.0, max_len_b=4)
    ensemble = Ensemble([model])
    assert beam_search(ensemble, src, beam=3, nbest=2, max_len_a=1.0, max_len_b=4) == alone
    assert greedy_search(ensemble, src, max_len_a=1.0, max_len_b=4) == greedy_search(model, src,
                         max_len_a=1.0, max_len_b=4)


@pytest.mark.parametrize("arch", ["transf", "ran-all"])
def test_ensemble_of_two_identical_models_decodes_the_same(arch):
    model, _ = tiny_model(seed=12, **{"model.arch": arch})
    twin, _ = tiny_model(seed=12, **{"model.arch": arch})
    src, _ = random_batch(batch=3, seed=12)
    ensemble = Ensemble([model, twin])
    for beam in (1, 4):
        alone = search(model, src, beam=beam, max_len_a=1.0, max_len_b=4)
        both = search(ensemble, src, beam=beam, max_len_a=1.0, max_len_b=4)
        assert [h[0][0] for h in both] == [h[0][0] for h in alone]
        for a, b in zip(alone, both):
            assert b[0][1] == pytest.approx(a[0][1], abs=1e-5)


def test_ensemble_of_different_models_averages_log_probs():
    first, _ = tiny_model(seed=13, **{"model.arch": "transf"})
    second, _ = tiny_model(seed=14, **{"model.arch": "ran-all"})
    src, _ = random_batch(batch=2, seed=13)
    ensemble = Ensemble([first, second])
    (hyp_a, hyp_b) = greedy_search(ensemble, src, max_len_a=1.0, max_len_b=3)
    targets = [hyp_a[0][0], hyp_b[0][0]]
    mean_total = [(a.total + b.total) / 2 for a, b in zip(score_targets(first, src, targets, 0.0),
                                                          score_targets(second, src, targets, 0.0))]
    ensemble_scores = score_targets(ensemble, src, targets, 0.0)
    for hyp, pair, expected in zip((hyp_a, hyp_b), ensemble_scores, mean_total):
        assert pair.total == pytest.approx(expected, abs=1e-4)
        assert hyp[0][1] == pytest.approx(expected, abs=1e-4)
    # beam search through both members' caches equals the reference path
    fast = beam_search(ensemble, src, beam=3, max_len_a=1.0, max_len_b=4)
    ref = beam_search_reference(ensemble, src, beam=3, max_len_a=1.0, max_len_b=4)
    assert [h[0][0] for h in fast] == [h[0][0] for h in ref]
    assert greedy_search_reference(ensemble, src, max_len_a=1.0,
                                   max_len_b=3)[0][0][0] == hyp_a[0][0]


def test_ensemble_members_must_share_vocabularies():
    first, _ = tiny_model(seed=1)
    second, _ = tiny_model(seed=1, **{"model.tgt_vocab_size": 41})
    with pytest.raises(ValueError, match="share source and target vocabularies"):
        Ensemble([first, second])


def test_lines_are_tokenized_as_one_by_one(translators):
    """encode_sources / encode_targets tokenize all lines in one SentencePiece call (a call
    per line was 30x slower): the same ids as line by line, blank lines []."""
    translator = translators["transf"]
    lines = ["a b c", "", "  d e f g  ", "   ", "h"]
    one_by_one = [translator.src_vocab.encode([line.strip()])[0] if line.strip() else []
                  for line in lines]
    assert translator.encode_sources(lines) == one_by_one
    assert translator.encode_targets(lines) == [
        translator.tgt_vocab.encode([line.strip()])[0] if line.strip() else []
        for line in lines]
    assert translator.encode_sources([]) == [] and translator.encode_sources([""]) == [[]]
