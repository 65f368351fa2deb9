"""The significance rule of every table (``ranmt.evaluate``), checked against independent
computations and at its boundaries: the paired bootstrap's scores, p-values and signature,
Welch's t-test written out, and the seed rule's marks where a comparison is exactly at
alpha, exactly zero or has a seed the scores lack. Written to kill the mutants mutmut left
alive in these functions (docs/MUTATION.md)."""

from __future__ import annotations

import math
import os
import re

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


def test_bleu_by_length_bins_labels_and_scores():
    """Each bin's label, size and BLEU against sacreBLEU on exactly its sentences; by the
    source or the reference length; edges checked."""
    from ranmt.evaluate import bleu_by_length, length_bins

    sources = ["a b", "a b c d e", "a", "a b c d e f g h"]       # 2, 5, 1, 8 words
    refs = ["x y z", "the cat sat", "one two three four five six", "p q"]  # 3, 3, 6, 2
    hyps = ["x y z", "the cat sat", "one two", "p q"]
    rows = bleu_by_length(hyps, refs, sources, edges=(0, 3, 6))
    assert [row["bin"] for row in rows] == ["0-2", "3-5", "6+"]
    assert [row["sentences"] for row in rows] == [2, 1, 1]
    first = sacrebleu.corpus_bleu(["x y z", "one two"], [["x y z", "one two three four five six"]])
    assert rows[0]["bleu"] == first.score
    assert rows[2]["bleu"] == sacrebleu.corpus_bleu(["p q"], [["p q"]]).score
    by_reference = bleu_by_length(hyps, refs, sources, by="reference", edges=(0, 3, 6))
    assert [row["sentences"] for row in by_reference] == [1, 2, 1]
    empty = bleu_by_length(hyps, refs, sources, edges=(0, 3, 6, 20))
    assert empty[-1] == {"bin": "20+", "sentences": 0, "bleu": None}
    with pytest.raises(ScoreError, match="^by must be source or reference$"):
        bleu_by_length(hyps, refs, sources, by="target")
    assert length_bins([0, 1, 5], edges=(1, 5)) == [[0, 1], [2]]  # below the first edge: bin 0
    with pytest.raises(ScoreError, match="increase strictly"):
        length_bins([1], edges=(0, 5, 5))


def test_every_metric_against_its_library():
    """score(): each metric is its library's corpus score on exactly these lines, rounded to
    4 decimals, with its signature; tokenized BLEU is sacreBLEU without tokenization over
    sacremoses' tokens (hyphenated compounds split with ##AT## when asked)."""
    from rouge_score import rouge_scorer
    from sacremoses import MosesTokenizer

    from ranmt.evaluate import moses_tokenize, score

    refs = ["Ein Mann fährt ein rot-weißes Fahrrad, schnell.", "Zwei Hunde spielen im Schnee!",
            "Eine Frau liest ein Buch."]
    hyps = ["Ein Mann fährt ein rot-weißes Rad schnell.", "Zwei Hunde spielen draußen!",
            "Eine Frau liest."]
    result = score(hyps, refs, ("bleu", "chrf", "ter", "tok_bleu", "rouge1", "rougeL"),
                   tgt_lang="de", compound_split=True)
    assert result["bleu"] == round(sacrebleu.corpus_bleu(hyps, [refs]).score, 4)
    assert result["chrf"] == round(sacrebleu.corpus_chrf(hyps, [refs]).score, 4)
    assert result["ter"] == round(sacrebleu.corpus_ter(hyps, [refs]).score, 4)
    moses = MosesTokenizer(lang="de")
    split = [[re.sub(r"(\S)-(\S)", r"\1 ##AT##-##AT## \2",
                     moses.tokenize(line, escape=False, return_str=True)) for line in side]
             for side in (hyps, refs)]
    assert moses_tokenize(refs, "de", compound_split=True) == split[1]
    assert "##AT##-##AT##" in split[1][0] and " ," in split[1][0]
    tok = sacrebleu.corpus_bleu(split[0], [split[1]], tokenize="none", force=True).score
    assert result["tok_bleu"] == round(tok, 4) and result["tok_bleu"] != result["bleu"]
    assert result["signature"]["tok_bleu"].startswith("moses-tok:de|compound-split:yes|")
    plain = score(hyps, refs, ("tok_bleu",), tgt_lang="de")
    assert plain["signature"]["tok_bleu"].startswith("moses-tok:de|compound-split:no|")
    assert plain["tok_bleu"] != result["tok_bleu"]  # the split compound changes the n-grams
    scorer = rouge_scorer.RougeScorer(["rouge1", "rougeL"], use_stemmer=True)
    for kind in ("rouge1", "rougeL"):
        mean = sum(scorer.score(r, h)[kind].fmeasure for h, r in zip(hyps, refs)) / 3
        assert result[kind] == round(100 * mean, 4)
        assert result["signature"][kind] == "rouge-score|stemmer:yes|fmeasure"
    assert set(result["signature"]) == {"bleu", "chrf", "ter", "tok_bleu", "rouge1", "rougeL"}
    assert "nrefs:1" in result["signature"]["bleu"]
    with pytest.raises(ScoreError, match="^hypothesis has 2 lines, reference has 3$"):
        score(hyps[:2], refs)
    with pytest.raises(ScoreError, match="^the reference is empty: nothing to score$"):
        score([], [])
    with pytest.raises(ScoreError, match=r"unknown metric\(s\) \['meteor'\]"):
        score(hyps, refs, ("bleu", "meteor"))


def test_metric_defaults_escaping_and_stemming():
    """The defaults the tables rely on: English Moses rules when no language is given, no
    XML escaping (& stays &), compounds kept unless asked, ROUGE with stemming."""
    from rouge_score import rouge_scorer
    from sacremoses import MosesTokenizer

    from ranmt.evaluate import moses_tokenize, rouge, score, tokenized_bleu

    line = "Tom's dog & the cat-flap <3"
    english = MosesTokenizer(lang="en").tokenize(line, escape=False, return_str=True)
    assert moses_tokenize([line], "") == [english] and "&amp;" not in english
    assert "&apos;" in MosesTokenizer(lang="en").tokenize(line, return_str=True)  # the default
    hyps, refs = ["a well-known cat-flap & dog"], ["a well-known cat-flap & dog ."]
    value, signature = tokenized_bleu(hyps, refs, "")
    reference = sacrebleu.metrics.BLEU(tokenize="none", force=True)
    expected = reference.corpus_score(moses_tokenize(hyps, "en"), [moses_tokenize(refs, "en")])
    assert value == expected.score
    assert signature == f"moses-tok:en|compound-split:no|{reference.get_signature()}"
    # German rules where asked: "19." stays one token (English splits it off)
    refs_de, hyps_de = ["Im 19. Jahrhundert lebte er dort."], ["Im 19. Jahrhundert lebte er."]
    assert moses_tokenize(refs_de, "de") == ["Im 19. Jahrhundert lebte er dort ."]
    german = sacrebleu.metrics.BLEU(tokenize="none", force=True).corpus_score(
        ["Im 19. Jahrhundert lebte er ."], [["Im 19. Jahrhundert lebte er dort ."]]).score
    assert tokenized_bleu(hyps_de, refs_de, "de")[0] == german
    assert score(hyps_de, refs_de, ("tok_bleu",), tgt_lang="de")["tok_bleu"] == round(german, 4)
    # ROUGE first in the list, values that need their 4 decimals
    mixed = score(["the dogs were playing in the park"], ["a dog played in a big park"],
                  ("rouge1", "rougeL", "bleu"))
    assert mixed["rouge1"] == round(rouge(["the dogs were playing in the park"],
                                          ["a dog played in a big park"])["rouge1"], 4) == 57.1429
    assert "rougeL" in mixed and "bleu" in mixed and "rouge2" not in mixed  # only those asked
    # the target language reaches sacreBLEU's tokenizer (Chinese: by character)
    zh = score(["猫坐在垫子上"], ["猫坐在红垫子上了"], ("bleu",), tgt_lang="zh")
    assert zh["bleu"] == round(sacrebleu.corpus_bleu(["猫坐在垫子上"], [["猫坐在红垫子上了"]],
                                                     tokenize="zh").score, 4) > 0
    stemmed = rouge(["the dogs were playing"], ["the dog was played"], ("rouge1",))
    scorer = rouge_scorer.RougeScorer(["rouge1"], use_stemmer=True)
    mean = scorer.score("the dog was played", "the dogs were playing")["rouge1"].fmeasure
    assert stemmed["rouge1"] == 100 * mean and mean > 0.7  # dog(s), play(ing|ed) match
