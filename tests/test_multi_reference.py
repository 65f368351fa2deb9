"""Scoring against several references (DialogSum's test set has three): sacreBLEU's
multi-reference BLEU / chrF / TER, and ROUGE per line over the references by a stated rule
(max, as rouge-score's ``score_multi``, or mean); ``ranmt score --ref A B C``."""

from __future__ import annotations

import json

import pytest
from rouge_score import rouge_scorer
from sacrebleu.metrics import BLEU, TER

from ranmt.cli import main
from ranmt.evaluate import ScoreError, score

HYPS = ["the cat sat on the mat", "a man reads a book in the park", "it is raining"]
REFS = [["the cat is on the mat", "a man is reading in a park", "rain falls today"],
        ["a cat sat on a mat", "the man reads a book", "it rains"],
        ["there is a cat on the mat", "someone reads in the park", "it is raining hard"]]


def test_bleu_and_ter_take_every_reference_stream_as_sacrebleu_does():
    got = score(HYPS, REFS[0], ("bleu", "ter"), extra_refs=REFS[1:])
    assert got["bleu"] == pytest.approx(BLEU().corpus_score(HYPS, REFS).score, abs=1e-4)
    assert got["ter"] == pytest.approx(TER().corpus_score(HYPS, REFS).score, abs=1e-4)
    assert got["bleu"] > score(HYPS, REFS[0], ("bleu",))["bleu"]  # more references: higher
    assert "nrefs:3" in got["signature"]["bleu"]


@pytest.mark.parametrize("rule", ["max", "mean"])
def test_rouge_over_references_is_the_lines_best_or_mean_f_measure(rule):
    scorer = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"], use_stemmer=True)
    got = score(HYPS, REFS[0], ("rouge1", "rouge2", "rougeL"), extra_refs=REFS[1:],
                rouge_rule=rule)
    for kind in ("rouge1", "rouge2", "rougeL"):
        per_line = []
        for line, hyp in enumerate(HYPS):
            values = [scorer.score(refs[line], hyp)[kind].fmeasure for refs in REFS]
            per_line.append(max(values) if rule == "max" else sum(values) / 3)
        assert got[kind] == pytest.approx(100 * sum(per_line) / 3, abs=1e-4)
        if rule == "max":  # rouge-score's own multi-reference rule
            best = [scorer.score_multi([r[line] for r in REFS], hyp)[kind].fmeasure
                    for line, hyp in enumerate(HYPS)]
            assert got[kind] == pytest.approx(100 * sum(best) / 3, abs=1e-4)
    assert got["signature"]["rouge1"].endswith(f"|nrefs:3|refs:{rule}")
    one = score(HYPS, REFS[0], ("rouge1",))
    assert got["rouge1"] != one["rouge1"] and "nrefs" not in one["signature"]["rouge1"]


def test_a_short_reference_stream_and_an_unknown_rule_are_errors():
    with pytest.raises(ScoreError, match="reference 2 has 2 lines"):
        score(HYPS, REFS[0], ("bleu",), extra_refs=[REFS[1][:2]])
    with pytest.raises(ScoreError, match="multi-reference rule"):
        score(HYPS, REFS[0], ("rouge1",), extra_refs=REFS[1:], rouge_rule="min")


def test_ranmt_score_with_three_references(tmp_path, capsys):
    paths = []
    for number, refs in enumerate(REFS, start=1):
        paths.append(tmp_path / f"ref{number}")
        paths[-1].write_text("\n".join(refs) + "\n")
    hyp = tmp_path / "hyp"
    hyp.write_text("\n".join(HYPS) + "\n")
    main(["score", "--task", "summarization", "--ref", *map(str, paths), "--hyp", str(hyp),
          "--rouge-references", "mean", "--json"])
    printed = json.loads(capsys.readouterr().out)
    want = score(HYPS, REFS[0], ("rouge1", "rouge2", "rougeL"), extra_refs=REFS[1:],
                 rouge_rule="mean")
    assert {k: printed[k] for k in ("rouge1", "rouge2", "rougeL")} == \
        {k: want[k] for k in ("rouge1", "rouge2", "rougeL")}
    with pytest.raises(SystemExit):
        main(["score", "--ref", *map(str, paths), "--hyp", str(hyp), "--hyp", str(hyp)])
    assert "paired bootstrap takes one reference" in capsys.readouterr().err


def test_a_grid_cell_scores_every_reference_its_prepared_data_holds(tmp_path):
    """The grid's side: a test prefix's PREFIX.TGT2 / .TGT3 are copied beside the prepared
    references (checked line for line), and a cell's decoding scores all of them by its
    dataset's rule."""
    from types import SimpleNamespace

    from ranmt.config import ConfigError
    from ranmt.data.corpus import extra_references
    from ranmt.experiment.cells import decode_tests
    from ranmt.experiment.preparation import copy_extra_references

    prepared, corpus = tmp_path / "data", tmp_path / "corpus"
    prepared.mkdir()
    corpus.mkdir()
    (prepared / "meta.json").write_text(json.dumps({"tgt_lang": "summary"}))
    (prepared / "test.src.txt").write_text("\n".join(f"dialogue {i}" for i in range(3)) + "\n")
    (prepared / "test.tgt.txt").write_text("\n".join(REFS[0]) + "\n")
    for number in (2, 3):
        (corpus / f"test.summary{number}").write_text("\n".join(REFS[number - 1]) + "\n")
    copy_extra_references(prepared, {"test": str(corpus / "test")}, "summary", lambda _m: None)
    assert extra_references(prepared, "test") == REFS[1:]
    (corpus / "short.summary2").write_text("one line\n")
    (prepared / "short.tgt.txt").write_text("a\nb\n")
    with pytest.raises(ConfigError, match="1 lines, the test set short has 2"):
        copy_extra_references(prepared, {"short": str(corpus / "short")}, "summary",
                              lambda _m: None)
    dataset = SimpleNamespace(tests={"test": "test"}, task="summarization",
                              rouge_references="mean")
    cell = SimpleNamespace(dataset=dataset, dir=tmp_path)
    translator = SimpleNamespace(translate=lambda sources: list(HYPS),
                                 tgt_vocab=SimpleNamespace(encode=lambda hyps: [[1]] * 3))
    got = decode_tests(cell, prepared, translator)["test"]
    want = score(HYPS, REFS[0], ("rouge1", "rouge2", "rougeL"), extra_refs=REFS[1:],
                 rouge_rule="mean")
    assert {k: got[k] for k in ("rouge1", "rougeL")} == {k: want[k] for k in ("rouge1", "rougeL")}
    assert got["signature"]["rouge1"].endswith("|nrefs:3|refs:mean")


def test_a_grid_names_its_multi_reference_rule_or_is_refused(tmp_path):
    from ranmt.config import ConfigError
    from ranmt.experiment.loading import load_experiment

    grid = tmp_path / "grid.yaml"
    grid.write_text("name: g\nbase_config: null\nseeds: [1]\nbaseline: A\n"
                    "datasets:\n  - {name: d, src: dialogue, tgt: summary, train: t, valid: v,"
                    " tests: {test: x}, task: summarization, rouge_references: min}\n"
                    "variants:\n  - {name: A, overrides: {}}\n")
    with pytest.raises(ConfigError, match="rouge_references must be one of max, mean"):
        load_experiment(grid)
