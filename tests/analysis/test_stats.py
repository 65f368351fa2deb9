"""Attention statistics against hand-computed values; length bins; bootstrap p-values."""

from __future__ import annotations

import math

import pytest
import torch

from ranmt.analysis.stats import argmax_distance, js_divergence, off_diagonality, row_entropy
from ranmt.evaluate import bleu_by_length, length_bins, paired_bootstrap


def test_entropy_hand_values():
    weights = torch.tensor([[0.5, 0.5, 0.0], [1.0, 0.0, 0.0], [0.25, 0.25, 0.5]])
    expected = [math.log(2), 0.0, -(2 * 0.25 * math.log(0.25) + 0.5 * math.log(0.5))]
    assert row_entropy(weights).tolist() == pytest.approx(expected)


def test_js_divergence_hand_values():
    p = torch.tensor([[1.0, 0.0], [0.5, 0.5], [0.3, 0.7]])
    q = torch.tensor([[0.0, 1.0], [1.0, 0.0], [0.3, 0.7]])
    m = [0.75, 0.25]
    kl_p = 0.5 * math.log(0.5 / m[0]) + 0.5 * math.log(0.5 / m[1])
    kl_q = math.log(1 / m[0])
    assert js_divergence(p, q).tolist() == pytest.approx([math.log(2), 0.5 * (kl_p + kl_q), 0.0],
                                                         abs=1e-6)


def test_argmax_distance_and_off_diagonality():
    weights = torch.tensor([[[0.9, 0.1, 0.0, 0.0],  # query 0 -> key 0: 0
                             [0.1, 0.2, 0.0, 0.7],  # query 1 -> key 3: 2
                             [0.0, 0.6, 0.4, 0.0],  # query 2 -> key 1: 1
                             [1.0, 0.0, 0.0, 0.0]]])  # query 3 -> key 0: 3
    assert argmax_distance(weights).tolist() == [[0.0, 2.0, 1.0, 3.0]]
    valid = torch.tensor([[True, True, True, False]])
    assert off_diagonality(weights, valid).tolist() == pytest.approx([1 / 3])


def test_length_bins_partition_the_set():
    lengths = [0, 3, 9, 10, 19, 25, 61, 200, 59, 40]
    bins = length_bins(lengths)
    assert len(bins) == 7
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert bins[0] == [0, 1, 2] and bins[6] == [6, 7]
    rows = bleu_by_length(["a b c"] * 3, ["a b c"] * 3, ["x", "y " * 12, "z " * 70])
    assert [r["sentences"] for r in rows] == [1, 1, 0, 0, 0, 0, 1]
    with pytest.raises(ValueError):
        length_bins([1], edges=(0, 5, 5))


def test_bootstrap_p_values():
    refs = [f"the small cat number {i} sat on the red mat today" for i in range(60)]
    good = list(refs)
    bad = [f"a cat {i} sat mat" for i in range(60)]
    better = paired_bootstrap([("bad", bad), ("good", good)], refs, ("bleu",), samples=300)
    assert better["systems"][1]["bleu_p"] < 0.01
    itself = paired_bootstrap([("bad", bad), ("same", list(bad))], refs, ("bleu",), samples=300)
    assert itself["systems"][1]["bleu_p"] > 0.05
    # nearly the same system (two sentences changed): no significant difference either
    near = list(bad)
    near[3], near[40] = "a cat 3 sat on mat", "the cat 40 sat mat"
    close = paired_bootstrap([("bad", bad), ("near", near)], refs, ("bleu",), samples=300)
    assert close["systems"][1]["bleu_p"] > 0.05
