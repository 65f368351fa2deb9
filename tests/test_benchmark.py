"""`ranmt benchmark` on the tiny preset: runs in seconds and writes its table, JSON and plot."""

from __future__ import annotations

import json

import pytest

from ranmt.cli import main
from ranmt.runtime.precision import cpu_description


def test_benchmark_tiny_writes_outputs(tmp_path, capsys):
    main(["benchmark", "--arch", "transf", "--arch", "ran-all", "--preset", "tiny",
          "--vocab-size", "50", "--sentences", "12", "--batch-sizes", "1", "4", "--beams", "1",
          "2", "--batch", "4", "--beam", "2", "--repeats", "2", "--train-tokens", "200",
          "--out", str(tmp_path), "--device", "cpu"])
    result = json.loads((tmp_path / "benchmark.json").read_text())
    assert result["systems"] == ["transf:tiny", "ran-all:tiny"]
    assert len(result["decode"]) == 4
    first = result["decode"][0]["systems"]
    assert first["transf:tiny"]["ratio"] == 1.0 and first["ran-all:tiny"]["tokens_per_s"] > 0
    assert result["train"]["ran-all:tiny"]["tokens_per_s"] > 0
    ran = first["ran-all:tiny"]
    assert len(ran["runs_tokens_per_s"]) == 2 and ran["tokens_per_s"] == (
        sum(ran["runs_tokens_per_s"]) / 2)  # median of two runs
    base_runs = first["transf:tiny"]["runs_tokens_per_s"]
    assert ran["ratio_per_run"] == [r / b for r, b in zip(ran["runs_tokens_per_s"], base_runs)]
    assert first["transf:tiny"]["ratio_per_run"] == [1.0, 1.0]
    assert (tmp_path / "benchmark.png").read_bytes().startswith(b"\x89PNG")
    table = (tmp_path / "benchmark.md").read_text()
    assert "| batch | 4 | 2 |" in table and "x; " in table  # per-round ratio range
    assert result["cpu"] == cpu_description() and f"CPU: {result['cpu']}" in table
    assert "tok/s (ratio)" in capsys.readouterr().out


def test_checkpoint_labels_tell_experiment_cells_apart():
    from ranmt.benchmark import _run_label

    cells = "results/grid/runs/multi30k-en-de/{}/seed1/run"
    assert _run_label(cells.format("TransF")) == "TransF/seed1"
    assert _run_label(cells.format("RAN-ALL")) == "RAN-ALL/seed1"
    assert _run_label("runs/transf-small") == "runs/transf-small"
    assert _run_label("runs/x/checkpoints/step_00001000") == "x/step_00001000"
    assert _run_label("/abs/run") == "abs"


def test_benchmark_fixed_length_and_int8(tmp_path):
    """With --fixed-length every system generates exactly L tokens + EOS per sentence, so
    tokens/s = (L + 1) x sentences/s for each, the int8 copies included."""
    length = 6
    main(["benchmark", "--arch", "transf", "--arch", "ran-all", "--preset", "tiny",
          "--vocab-size", "50", "--sentences", "10", "--batch-sizes", "4", "--beams", "2",
          "--batch", "4", "--beam", "2", "--repeats", "1", "--no-train", "--fixed-length",
          str(length), "--quantize", "none", "int8", "--out", str(tmp_path), "--device", "cpu"])
    result = json.loads((tmp_path / "benchmark.json").read_text())
    assert result["systems"] == ["transf:tiny", "ran-all:tiny", "transf:tiny int8",
                                 "ran-all:tiny int8"]
    assert result["fixed_length"] == length and result["train"] == {}
    for row in result["decode"]:
        for entry in row["systems"].values():
            assert entry["tokens_per_s"] == pytest.approx((length + 1) * entry["sentences_per_s"])
    assert "fixed output length 6" in (tmp_path / "benchmark.md").read_text()


def test_benchmark_bf16_decoding_and_training_rows(tmp_path):
    """--quantize none bf16: bf16 copies decode the same fixed-length work, and every fp32
    system gets a bf16 training row beside its fp32 one."""
    main(["benchmark", "--arch", "transf", "--preset", "tiny", "--vocab-size", "50",
          "--sentences", "8", "--batch-sizes", "4", "--beams", "2", "--batch", "4", "--beam",
          "2", "--repeats", "1", "--fixed-length", "4", "--quantize", "none", "bf16",
          "--out", str(tmp_path), "--device", "cpu"])
    result = json.loads((tmp_path / "benchmark.json").read_text())
    assert result["systems"] == ["transf:tiny", "transf:tiny bf16"]
    assert set(result["train"]) == {"transf:tiny", "transf:tiny bf16 training"}
    assert all(entry["tokens_per_s"] > 0 for entry in result["train"].values())


@pytest.mark.parametrize("masks", ["torch", "fast"])
def test_benchmark_training_rows_use_the_dropout_masks_asked_for(tmp_path, monkeypatch, masks):
    import ranmt.runtime.dropout as dropout_module

    drawn = []
    original = dropout_module.keep_mask
    monkeypatch.setattr(dropout_module, "keep_mask",
                        lambda *a, **k: drawn.append(1) or original(*a, **k))
    main(["benchmark", "--arch", "transf", "--preset", "tiny", "--vocab-size", "50",
          "--sentences", "8", "--batch-sizes", "4", "--beams", "2", "--batch", "4", "--beam",
          "2", "--repeats", "1", "--fixed-length", "4", "--dropout-masks", masks,
          "--out", str(tmp_path), "--device", "cpu"])
    result = json.loads((tmp_path / "benchmark.json").read_text())
    assert result["dropout_masks"] == masks
    assert result["train"]["transf:tiny"]["tokens_per_s"] > 0
    assert bool(drawn) == (masks == "fast")


def test_speeds_are_the_work_done_over_the_time_taken(monkeypatch):
    """train_speed and decode_speed against a fake clock (2 s between start and end): the
    tokens counted are the targets trained on (each source + EOS) and the hypotheses
    decoded (each + EOS, as the search returns them), not just some positive number."""
    import types

    import numpy as np
    import torch

    import ranmt.benchmark as benchmark
    from conftest import tiny_model
    from ranmt.inference.decode import search

    model, cfg = tiny_model(seed=0)
    sources = [[5, 6, 7], [8, 9], [10, 11, 12, 13, 14], [15]]
    ticks = iter([10.0, 12.0, 20.0, 22.0])
    monkeypatch.setattr(benchmark, "time", types.SimpleNamespace(perf_counter=lambda: next(ticks)))
    tokens_per_s, _ = benchmark.train_speed(model, cfg, sources, 64, torch.device("cpu"))
    assert tokens_per_s == sum(len(s) + 1 for s in sources) / 2.0
    tokens_per_s, sentences_per_s = benchmark.decode_speed(model, cfg, sources, 2, 3,
                                                           torch.device("cpu"))
    expected = 0
    lengths = np.array([len(s) for s in sources])
    for batch in benchmark.make_batches(lengths, lengths, 10 ** 9, 2):  # as decode_speed
        src = benchmark.pad_sources([sources[i] for i in batch])
        d = cfg.decode
        hyps = search(model, src, beam=3, lenpen=d.lenpen, lenpen_style=d.lenpen_style,
                      max_len_a=d.max_len_a, max_len_b=d.max_len_b, nbest=1)
        expected += sum(len(h[0][0]) + 1 for h in hyps)
    assert (tokens_per_s, sentences_per_s) == (expected / 2.0, len(sources) / 2.0)
