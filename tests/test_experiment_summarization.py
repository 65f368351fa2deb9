"""A summarization grid end to end (issue 100 item 5): its cells choose their best checkpoint
by the validation decode's ROUGE-L (``train.valid_metric: rougeL``, as
configs/experiments/dialogsum.yaml does), and its tables say so."""

from __future__ import annotations

import json

import yaml

from conftest import reverse_task, write_parallel
from ranmt.experiment import run_experiment


def _summarization_grid(tmp_path) -> object:
    """A toy "summary": the first half of the reversed source."""
    for name, count, seed in (("train", 2000, 0), ("valid", 40, 1), ("test", 30, 2)):
        src, tgt = reverse_task(count, seed, min_len=4, max_len=10)
        tgt = [" ".join(t.split()[: max(1, len(t.split()) // 2)]) for t in tgt]
        write_parallel(tmp_path / name, src, tgt, "dialogue", "summary")
    config = {
        "name": "tiny-summaries", "out": str(tmp_path / "exp"), "seeds": [1],
        "baseline": "TransF",
        "overrides": {"model.preset": "tiny", "train.max_steps": 30, "train.lr": 0.003,
                      "train.warmup_steps": 10, "train.validate_every": 10,
                      "train.validate_bleu": True, "train.valid_metric": "rougeL",
                      "train.progress": False, "train.tensorboard": False,
                      "data.max_tokens": 600},
        "decode": {"beam": 1, "device": "cpu"},
        "datasets": [{"name": "toy", "src": "dialogue", "tgt": "summary",
                      "task": "summarization",
                      "train": str(tmp_path / "train"), "valid": str(tmp_path / "valid"),
                      "tests": {"test": str(tmp_path / "test")}, "vocab_size": 40,
                      "max_positions": 64}],
        "variants": [{"name": "TransF", "overrides": {"model.arch": "transf"}}],
    }
    path = tmp_path / "grid.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_a_summarization_grid_chooses_and_reports_its_best_step_by_rouge_l(tmp_path):
    run_experiment(_summarization_grid(tmp_path), log=lambda _m: None)
    exp = tmp_path / "exp"
    cell = json.loads((exp / "runs/toy/TransF/seed1/cell.json").read_text())
    train = cell["train"]
    scores = {v["step"]: v["valid_rougeL"] for v in train["validations"]}
    assert sorted(scores) == [10, 20, 30]
    assert train["valid_metric"] == "rougeL" and train["best_valid_bleu"] is None
    assert train["best_valid_score"] == max(scores.values())
    assert train["best_step"] == max(scores, key=lambda step: (scores[step], -step))
    table = (exp / "results.md").read_text()
    assert "| best valid ROUGE-L |" in table
    row = next(line for line in table.splitlines() if line.startswith("| TransF | 1 |"))
    assert f"| {train['best_valid_score']:.2f} |" in row
    assert "ROUGE-L per seed" in table
