"""`ranmt benchmark` on the tiny preset: runs in seconds and writes its table, JSON and plot."""

from __future__ import annotations

import json

from ranmt.cli import main


def test_benchmark_tiny_writes_outputs(tmp_path, capsys):
    main(["benchmark", "--arch", "transf", "--arch", "ran-all", "--preset", "tiny",
          "--vocab-size", "50", "--sentences", "12", "--batch-sizes", "1", "4", "--beams", "1",
          "2", "--batch", "4", "--beam", "2", "--repeats", "1", "--train-tokens", "200",
          "--out", str(tmp_path), "--device", "cpu"])
    result = json.loads((tmp_path / "benchmark.json").read_text())
    assert result["systems"] == ["transf:tiny", "ran-all:tiny"]
    assert len(result["decode"]) == 4
    first = result["decode"][0]["systems"]
    assert first["transf:tiny"]["ratio"] == 1.0 and first["ran-all:tiny"]["tokens_per_s"] > 0
    assert result["train"]["ran-all:tiny"]["tokens_per_s"] > 0
    assert (tmp_path / "benchmark.png").read_bytes().startswith(b"\x89PNG")
    assert "| batch | 4 | 2 |" in (tmp_path / "benchmark.md").read_text()
    assert "tok/s (ratio)" in capsys.readouterr().out


def test_checkpoint_labels_tell_experiment_cells_apart():
    from ranmt.benchmark import _run_label

    cells = "results/grid/runs/multi30k-en-de/{}/seed1/run"
    assert _run_label(cells.format("TransF")) == "TransF/seed1"
    assert _run_label(cells.format("RAN-ALL")) == "RAN-ALL/seed1"
    assert _run_label("runs/transf-small") == "runs/transf-small"
    assert _run_label("runs/x/checkpoints/step_00001000") == "x/step_00001000"
    assert _run_label("/abs/run") == "abs"
