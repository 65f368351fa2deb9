"""The significance rule of every table (``ranmt.evaluate``), checked against independent
computations and at its boundaries: the paired bootstrap's scores, p-values and signature,
Welch's t-test written out, and the seed rule's marks where a comparison is exactly at
alpha, exactly zero or has a seed the scores lack. Written to kill the mutants mutmut left
alive in these functions (docs/MUTATION.md)."""

from __future__ import annotations

import math
import os

import pytest
import sacrebleu
from scipy.stats import t as student_t

from ranmt import evaluate
from ranmt.evaluate import (
    ScoreError,
    compare_over_seeds,
    paired_bootstrap,
    single_run_mark,
    welch_p_value,
)

REFS = [f"the small cat number {i} sat on the red mat today" for i in range(40)]
BAD = [f"a cat {i} sat on mat" for i in range(40)]
GOOD = [f"the small cat number {i} sat on a red mat" for i in range(40)]


def test_paired_bootstrap_scores_p_values_and_signature(monkeypatch):
    monkeypatch.setenv("SACREBLEU_SEED", "1")
    result = paired_bootstrap([("bad", BAD), ("good", GOOD), ("same", list(BAD))], REFS)
    assert os.environ["SACREBLEU_SEED"] == "12345"  # the documented default seed, for sacreBLEU
    baseline, good, same = result["systems"]
    assert [entry["name"] for entry in result["systems"]] == ["bad", "good", "same"]
    for entry, hyps in ((baseline, BAD), (good, GOOD)):
        assert entry["bleu"] == round(sacrebleu.corpus_bleu(hyps, [REFS]).score, 4)
        assert entry["chrf"] == round(sacrebleu.corpus_chrf(hyps, [REFS]).score, 4)
        assert entry["ter"] == round(sacrebleu.corpus_ter(hyps, [REFS]).score, 4)
    assert not any(key.endswith("_p") for key in baseline)  # the baseline has no p-value
    assert all(good[f"{m}_p"] < 0.01 for m in ("bleu", "chrf", "ter"))
    assert all(same[f"{m}_p"] == 1.0 for m in ("bleu", "chrf", "ter"))  # nothing to test
    assert set(result["signature"]) == {"bleu", "chrf", "ter"}
    assert "bs:1000|seed:12345" in result["signature"]["bleu"]
    assert "nc:6" in result["signature"]["chrf"] and "tok:13a" in result["signature"]["bleu"]
    again = paired_bootstrap([("bad", BAD), ("good", GOOD)], REFS)
    assert again["systems"][1]["bleu_p"] == good["bleu_p"]  # same seed, same resamples
    other = paired_bootstrap([("bad", BAD), ("good", GOOD)], REFS, ("bleu",), seed=7)
    assert "seed:7" in other["signature"]["bleu"] and os.environ["SACREBLEU_SEED"] == "7"


def test_paired_bootstrap_metric_choice_and_errors():
    only = paired_bootstrap([("bad", BAD), ("good", GOOD)], REFS, metrics=("ter", "rouge1"))
    assert set(only["systems"][1]) == {"name", "ter", "ter_p"}
    only = paired_bootstrap([("bad", BAD), ("good", GOOD)], REFS, metrics=("chrf",),
                            samples=200)
    assert set(only["systems"][1]) == {"name", "chrf", "chrf_p"}
    assert "bs:200" in only["signature"]["chrf"]
    with pytest.raises(ScoreError, match="^paired bootstrap supports bleu, chrf and ter$"):
        paired_bootstrap([("bad", BAD), ("good", GOOD)], REFS, metrics=("rouge1",))
    with pytest.raises(ScoreError, match="short: 2 lines, reference has 40"):
        paired_bootstrap([("bad", BAD), ("short", BAD[:2])], REFS)


def test_sacrebleu_metrics_by_name():
    assert type(evaluate._sacrebleu_metric("bleu", "zh").tokenizer).__name__ == "TokenizerZh"
    assert isinstance(evaluate._sacrebleu_metric("chrf"), sacrebleu.metrics.CHRF)
    assert isinstance(evaluate._sacrebleu_metric("ter"), sacrebleu.metrics.TER)
    with pytest.raises(ScoreError, match="'meteor' is not a sacreBLEU metric"):
        evaluate._sacrebleu_metric("meteor")


def _welch_by_hand(first: list[float], second: list[float]) -> float:
    """Welch's two-sided p written out: t over the unpooled standard error, the
    Welch-Satterthwaite degrees of freedom."""
    def mean_var(xs):
        mean = sum(xs) / len(xs)
        return mean, sum((x - mean) ** 2 for x in xs) / (len(xs) - 1)

    (m1, v1), (m2, v2) = mean_var(first), mean_var(second)
    a, b = v1 / len(first), v2 / len(second)
    t = (m1 - m2) / math.sqrt(a + b)
    df = (a + b) ** 2 / (a ** 2 / (len(first) - 1) + b ** 2 / (len(second) - 1))
    return 2 * student_t.sf(abs(t), df)


@pytest.mark.parametrize(("first", "second"), [
    ([30.1, 30.9, 31.4], [29.0, 29.6]),
    ([1.0, 2.0, 3.0], [5.0, 5.0]),      # one side without spread (stdev 1 on the other)
    ([5.0, 5.0, 5.0], [1.0, 2.0, 3.0]),
    ([20.0, 21.0], [20.5, 22.5]),        # two seeds each: defined
])
def test_welch_p_value_is_welchs_test(first, second):
    assert welch_p_value(first, second) == pytest.approx(_welch_by_hand(first, second),
                                                         rel=1e-9)


def test_welch_p_value_edge_cases():
    assert welch_p_value([30.0], [29.0, 28.0]) is None  # one seed: no spread to test against
    assert welch_p_value([30.0, 29.0], [28.0]) is None
    assert welch_p_value([30.0, 30.0], [30.0, 30.0]) == 1.0  # no spread, no difference
    assert welch_p_value([30.0, 30.0], [29.0, 29.0]) == 0.0  # no spread, a difference


def test_seed_rule_at_its_boundaries(monkeypatch):
    baseline, variant = {1: 30.0, 2: 31.0, 3: 30.5}, {1: 31.0, 2: 31.5, 3: 31.3}
    significant = {1: 0.001, 2: 0.002, 3: 0.003}
    result = compare_over_seeds(baseline, variant, {**significant, 9: 0.0}, 0.05)
    assert result["seeds"] == [1, 2, 3]  # seed 9 has a p-value but no scores
    assert result["dagger"] and result["per_seed_delta"] == pytest.approx([1.0, 0.5, 0.8])
    # p exactly alpha is not below it
    assert not compare_over_seeds(baseline, variant, {**significant, 2: 0.05}, 0.05)["dagger"]
    # a seed without a difference breaks "every seed in the same direction"
    tied = {**variant, 2: 31.0}
    assert not compare_over_seeds(baseline, tied, significant, 0.05)["dagger"]
    assert not compare_over_seeds(baseline, baseline, significant, 0.05)["dagger"]
    # small gains (below one point) in every seed still count
    small = {seed: score + 0.3 for seed, score in baseline.items()}
    assert compare_over_seeds(baseline, small, significant, 0.05)["dagger"]
    # Welch's p exactly alpha is not below it either
    monkeypatch.setattr(evaluate, "welch_p_value", lambda first, second: 0.05)
    assert not compare_over_seeds(baseline, variant, significant, 0.05)["double_dagger"]
    monkeypatch.setattr(evaluate, "welch_p_value", lambda first, second: 0.049)
    assert compare_over_seeds(baseline, variant, significant, 0.05)["double_dagger"]


def test_single_run_mark():
    assert single_run_mark(0.049) == "†" and single_run_mark(0.049, alpha=0.01) == ""
    assert single_run_mark(0.05) == "" and single_run_mark(None) == ""
