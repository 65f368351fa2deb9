"""Choosing a decoding option on valid (ranmt.inference.sweep, ``ranmt evaluate --sweep``):
the values parsed and bounded, the best chosen by the right direction with ties to the first,
the translator's settings restored, and each row equal to a plain ``ranmt evaluate``."""

from __future__ import annotations

import json

import pytest

from ranmt.cli import main
from ranmt.config import ConfigError, DecodeConfig
from ranmt.evaluate import score
from ranmt.inference.sweep import (
    best_hypotheses,
    combinations,
    is_better,
    parse_sweep,
    sweep,
    sweepable_fields,
)

REFERENCES = ["a b c d e f", "g h i j", "k l m n o"]


class WordCutter:
    """A stand-in translator: the reference cut to ``round(lenpen * 2)`` words (lenpen 3.0
    and above: the whole reference), to its first word with beam 1, so that each setting
    gives a known output."""

    def __init__(self, fail_at: float | None = None):
        self.decode_config = DecodeConfig()
        self.fail_at = fail_at
        self.seen: list[float] = []

    def translate(self, sources: list[str]) -> list[str]:
        lenpen, beam = self.decode_config.lenpen, self.decode_config.beam
        self.seen.append(lenpen if beam == 4 else (beam, lenpen))
        if lenpen == self.fail_at:
            raise RuntimeError("decode failed")
        words = round(lenpen * 2) if beam > 1 else 1
        return [" ".join(ref.split()[:words]) for ref in REFERENCES]


def test_parse_sweep_types_bounds_and_names():
    assert parse_sweep("lenpen=0.6,1,2") == {"lenpen": [0.6, 1.0, 2.0]}
    assert parse_sweep("beam=1, 4") == {"beam": [1, 4]}
    assert parse_sweep("max-len-a=1.5") == {"max_len_a": [1.5]}
    assert parse_sweep(["beam=4,8", "lenpen=1"]) == {"beam": [4, 8], "lenpen": [1.0]}
    assert set(sweepable_fields()) == {"beam", "lenpen", "max_len_a", "max_len_b"}
    for bad in ("beam=0,4", "beam=2.5", "lenpen", "batch_size=8,16", "lenpen=1,1",
                "lenpen=x", "temperature=1,2", ["lenpen=1", "lenpen=2"]):
        with pytest.raises(ConfigError):
            parse_sweep(bad)


def test_combinations_vary_the_first_field_slowest():
    assert combinations({"beam": [4, 8], "lenpen": [0.6, 1.0]}) == [
        {"beam": 4, "lenpen": 0.6}, {"beam": 4, "lenpen": 1.0},
        {"beam": 8, "lenpen": 0.6}, {"beam": 8, "lenpen": 1.0}]
    assert combinations({"lenpen": [2.0, 1.0]}) == [{"lenpen": 2.0}, {"lenpen": 1.0}]


def test_ties_go_to_the_first_and_ter_is_lower_better():
    assert is_better("bleu", 30.13, 30.11) is True
    assert is_better("bleu", 30.112, 30.109) is False  # both 30.11: a tie
    assert is_better("ter", 50.0, 51.0) is True
    assert is_better("ter", 51.0, 50.0) is False
    assert is_better("chrf", 51.0, 50.0) is True


def test_sweep_scores_each_value_and_keeps_the_best():
    translator = WordCutter()
    before = translator.decode_config
    result = sweep(translator, ["x"] * 3, REFERENCES, {"lenpen": [1.0, 3.0, 4.0, 0.5]},
                   ["bleu", "ter"])
    assert translator.seen == [1.0, 3.0, 4.0, 0.5]
    assert translator.decode_config is before
    assert [row["values"] for row in result["rows"]] == \
        [{"lenpen": v} for v in (1.0, 3.0, 4.0, 0.5)]
    for row, hyps in zip(result["rows"], result["hypotheses"]):
        expected = score(hyps, REFERENCES, ("bleu", "ter"))
        assert row["bleu"] == expected["bleu"] and row["ter"] == expected["ter"]
        words = sum(len(h.split()) for h in hyps) / sum(len(r.split()) for r in REFERENCES)
        assert row["length_ratio"] == pytest.approx(words, abs=1e-4)
    # 3.0 and 4.0 both give the whole reference (BLEU 100): the tie goes to 3.0, listed first
    assert result["best"] == {"lenpen": 3.0} and result["select"] == "bleu"
    assert best_hypotheses(result) == REFERENCES
    by_ter = sweep(WordCutter(), ["x"] * 3, REFERENCES, {"lenpen": [0.5, 1.0]},
                   ["bleu", "ter"], select="ter")
    assert by_ter["best"] == {"lenpen": 1.0}  # fewer words missing: the lower TER


def test_sweep_of_two_fields_decodes_every_combination():
    translator = WordCutter()
    result = sweep(translator, ["x"] * 3, REFERENCES, {"beam": [1, 4], "lenpen": [1.0, 3.0]},
                   ["bleu"])
    assert translator.seen == [(1, 1.0), (1, 3.0), 1.0, 3.0]
    assert result["fields"] == ["beam", "lenpen"]
    assert result["best"] == {"beam": 4, "lenpen": 3.0}
    assert [row["bleu"] for row in result["rows"]][:2] == [result["rows"][0]["bleu"]] * 2


def test_sweep_restores_the_settings_when_a_decode_fails():
    translator = WordCutter(fail_at=2.0)
    before = translator.decode_config
    with pytest.raises(RuntimeError):
        sweep(translator, ["x"] * 3, REFERENCES, {"lenpen": [1.0, 2.0]}, ["bleu"])
    assert translator.decode_config is before
    with pytest.raises(ConfigError):
        sweep(WordCutter(), ["x"] * 3, REFERENCES, {"lenpen": [1.0]}, ["bleu"], select="ter")


def test_score_length_ratio_counts_bleu_words():
    result = score(["a b", "c"], ["a b c d", "e f"], ("chrf",), length_ratio=True)
    assert result["length_ratio"] == 0.5 and "bleu" not in result
    assert score(["a b"], ["a b c d"], ("bleu",), length_ratio=True)["length_ratio"] == 0.5
    assert "length_ratio" not in score(["a b"], ["a b c d"], ("bleu",))


def _evaluate_json(run, data, capsys, *argv):
    main(["evaluate", "--checkpoint", str(run), "--data", str(data), "--split", "valid",
          "--device", "cpu", "--metrics", "bleu", "chrf", "--json", *argv])
    return json.loads(capsys.readouterr().out)


def test_evaluate_sweep_rows_equal_plain_evaluations(reverse_run, reverse_data, capsys,
                                                     tmp_path):
    """Each row of ``--sweep max_len_a=0,1.2 --sweep beam=1,2`` (with --max-len-b 2: at most
    two subwords at 0) is the plain ``evaluate`` of that combination; the best is a
    full-length one and --output holds its translations."""
    swept = _evaluate_json(reverse_run, reverse_data, capsys, "--max-len-b", "2",
                           "--sweep", "max_len_a=0,1.2", "--sweep", "beam=1,2",
                           "--output", str(tmp_path / "best"))
    rows = swept["sweep"]["rows"]
    assert [tuple(row["values"].values()) for row in rows] == \
        [(0.0, 1), (0.0, 2), (1.2, 1), (1.2, 2)]
    for row in rows:
        a, beam = row["values"]["max_len_a"], row["values"]["beam"]
        plain = _evaluate_json(reverse_run, reverse_data, capsys, "--max-len-b", "2",
                               "--max-len-a", str(a), "--beam", str(beam),
                               "--output", str(tmp_path / f"plain{a}-{beam}"))
        assert (row["bleu"], row["chrf"]) == (plain["bleu"], plain["chrf"])
    assert rows[0]["length_ratio"] < 0.6 < rows[3]["length_ratio"]
    best = swept["sweep"]["best"]
    assert best["max_len_a"] == 1.2 and rows[3]["bleu"] > rows[0]["bleu"]
    assert (tmp_path / "best").read_text() == \
        (tmp_path / f"plain1.2-{best['beam']}").read_text()


@pytest.mark.parametrize("argv", [["--sweep", "lenpen=1,2", "--lenpen", "1"],
                                  ["--select", "bleu"],
                                  ["--sweep", "lenpen=1,2", "--select", "ter"],
                                  ["--sweep", "nbest=1,2"]])
def test_evaluate_sweep_refuses_contradictions(reverse_run, reverse_data, capsys, argv):
    with pytest.raises(SystemExit) as exit_info:
        _evaluate_json(reverse_run, reverse_data, capsys, *argv)
    assert exit_info.value.code != 0
    message = capsys.readouterr().err
    assert "--sweep" in message or "--select" in message, message


def test_evaluate_sweep_prints_the_table_and_the_best_with_its_signature(
        reverse_run, reverse_data, capsys):
    main(["evaluate", "--checkpoint", str(reverse_run), "--data", str(reverse_data),
          "--split", "valid", "--device", "cpu", "--metrics", "bleu", "--sweep",
          "lenpen=0.6,1.5", "--quiet"])
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["lenpen", "bleu", "ratio", "seconds"]
    assert [line.split()[0] for line in out[1:3]] == ["0.6", "1.5"]
    assert sum(line.endswith(" *") for line in out[1:3]) == 1
    assert out[3].startswith("best on valid: lenpen=")
    assert out[4].startswith("valid BLEU = ") and "nrefs:1" in out[4]
