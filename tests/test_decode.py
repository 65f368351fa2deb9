"""Decoding: beam 1 equals greedy, length limits, length penalty, beam search sanity."""

from __future__ import annotations

import pytest
import torch

from conftest import random_batch, tiny_model
from ranmt.inference.decode import beam_search, greedy_search, length_penalty, max_lengths
from ranmt.model import EOS_ID


def test_length_penalty_formulas():
    assert length_penalty(10, 0.6, "gnmt") == pytest.approx(((5 + 10) / 6) ** 0.6)
    assert length_penalty(10, 0.6, "fairseq") == pytest.approx(10 ** 0.6)
    assert length_penalty(7, 0.0, "gnmt") == 1.0
    with pytest.raises(ValueError, match=r"^unknown length penalty style 'x' \(gnmt \| fairseq\)$"):
        length_penalty(7, 0.6, "x")


def test_max_lengths():
    src, _ = random_batch(batch=2)  # row 0: 6 tokens + EOS; row 1: 3 tokens + EOS + pad
    assert max_lengths(src, 1.5, 2, 100).tolist() == [11, 6]
    assert max_lengths(src, 1.5, 2, 8).tolist() == [8, 6]
    assert max_lengths(src, 0.0, 0, 8).tolist() == [1, 1]  # at least one token


@pytest.mark.parametrize("arch", ["transf", "ran-all", "syn-r", "hc-all", "sh-x"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_beam_one_equals_greedy(seed, arch):
    model, _ = tiny_model(seed=seed, **{"model.arch": arch})
    src, _ = random_batch(batch=4, seed=seed)
    greedy = greedy_search(model, src, max_len_a=1.0, max_len_b=5)
    beam = beam_search(model, src, beam=1, lenpen=0.6, max_len_a=1.0, max_len_b=5)
    assert [g[0][0] for g in greedy] == [b[0][0] for b in beam]


def test_beam_respects_length_limit_and_is_sorted():
    model, _ = tiny_model()
    src, _ = random_batch(batch=3)
    caps = max_lengths(src, 0.5, 1, 63).tolist()
    results = beam_search(model, src, beam=4, lenpen=0.6, max_len_a=0.5, max_len_b=1, nbest=4)
    for hyps, cap in zip(results, caps):
        assert 1 <= len(hyps) <= 4
        scores = [score for _, score in hyps]
        assert scores == sorted(scores, reverse=True)
        assert all(len(tokens) <= cap and EOS_ID not in tokens for tokens, _ in hyps)


def test_beam_finds_at_least_greedy_model_score():
    """With alpha = 0 the beam's best log-probability is >= greedy's (beam explores more)."""
    model, _ = tiny_model(seed=3)
    src, _ = random_batch(batch=4, seed=3)
    greedy = greedy_search(model, src, max_len_a=1.0, max_len_b=5)
    beam = beam_search(model, src, beam=5, lenpen=0.0, max_len_a=1.0, max_len_b=5)
    for g, b in zip(greedy, beam):
        assert b[0][1] >= g[0][1] - 1e-4


def test_batch_and_single_decoding_agree():
    model, _ = tiny_model(seed=4)
    src, _ = random_batch(batch=3, seed=4)
    together = beam_search(model, src, beam=3)
    for row in range(3):
        single = src[row: row + 1]
        single = single[:, : int(single.ne(0).sum())]
        alone = beam_search(model, single, beam=3)
        assert alone[0][0][0] == together[row][0][0]
        assert alone[0][0][1] == pytest.approx(together[row][0][1], abs=1e-4)


def test_scores_are_normalised_log_probabilities():
    model, _ = tiny_model(seed=5)
    src, _ = random_batch(batch=1, pad_rows=False, seed=5)
    [[(tokens, score)]] = beam_search(model, src, beam=2, lenpen=0.6)
    tgt = torch.tensor([[2] + tokens])
    out = torch.tensor([tokens + [EOS_ID]])
    with torch.no_grad():
        logprobs = torch.log_softmax(model(src, tgt), -1).gather(-1, out[..., None]).sum()
    assert score == pytest.approx(float(logprobs) / length_penalty(len(tokens) + 1, 0.6),
                                  abs=1e-4)


@pytest.mark.parametrize("arch", ["transf", "ran-all", "sh-x"])
def test_grouped_cross_cache_equals_expanded_cache(arch, monkeypatch):
    """Fast path: beam search with the memory side of the cache kept per sentence gives the
    hypotheses and scores of the reference path (memory expanded to every beam row)."""
    model, _ = tiny_model(seed=3, **{"model.arch": arch})
    src, _ = random_batch(batch=6, seed=3)
    fast = beam_search(model, src, beam=4, lenpen=0.6, max_len_a=1.0, max_len_b=4, nbest=4)
    memory, pad_mask, _ = model.encode(src)
    assert model.init_cache(memory, pad_mask, group=4).group == 4
    for layer in model.decoder.layers:
        if layer.cross_attention is not None:
            monkeypatch.setattr(layer.cross_attention, "grouped_memory", False)
    assert model.init_cache(memory, pad_mask, group=4).group == 1
    reference = beam_search(model, src, beam=4, lenpen=0.6, max_len_a=1.0, max_len_b=4,
                            nbest=4)
    assert [[h[0] for h in hyps] for hyps in fast] == [[h[0] for h in hyps] for hyps in reference]
    for hyps_fast, hyps_ref in zip(fast, reference):
        assert [h[1] for h in hyps_fast] == pytest.approx([h[1] for h in hyps_ref], abs=1e-5)


def test_grouped_cache_step_logprobs_and_sentence_drop():
    """decode_step on a grouped cache equals the expanded cache, also after a reorder that
    shuffles beams and drops a sentence; mixed groups are refused."""
    model, _ = tiny_model(seed=4)
    src, _ = random_batch(batch=3, seed=4)
    memory, pad_mask, _ = model.encode(src)
    expand = torch.arange(3).repeat_interleave(2)
    grouped = model.init_cache(memory, pad_mask, group=2)
    flat = model.init_cache(memory.index_select(0, expand), pad_mask.index_select(0, expand))
    prev = torch.tensor([[2]] * 6)
    for order in (torch.tensor([1, 0, 2, 2, 5, 4]), torch.tensor([5, 4, 0, 0])):
        torch.testing.assert_close(model.decode_step(prev, grouped),
                                   model.decode_step(prev, flat))
        model.reorder_cache(grouped, order)
        model.reorder_cache(flat, order)
        prev = torch.randint(4, 20, (order.numel(), 1))
    assert grouped.memory.shape[0] == 2  # sentences 2 and 0 are left
    torch.testing.assert_close(model.decode_step(prev, grouped), model.decode_step(prev, flat))
    with pytest.raises(ValueError, match="one sentence"):
        model.reorder_cache(grouped, torch.tensor([0, 2, 1, 3]))
