"""End to end on a 2,000-pair slice of the real Multi30k copy: prepare -> train -> translate
-> score, asserting that the validation loss fell."""

from __future__ import annotations

import json

import pytest
import sacrebleu

from ranmt.cli import main
from ranmt.data.text import read_lines, write_lines


def test_multi30k_slice_pipeline(multi30k_dir, tmp_path, capsys):
    raw = tmp_path / "raw"
    main(["download", "multi30k", "--pair", "en-de", "--out", str(raw), "--from",
          str(multi30k_dir.parent)])
    for lang in ("en", "de"):
        write_lines(tmp_path / f"train2k.{lang}", read_lines(raw / f"train.{lang}")[:2000])
        write_lines(tmp_path / f"val200.{lang}", read_lines(raw / f"val.{lang}")[:200])
        write_lines(tmp_path / f"test100.{lang}",
                    read_lines(raw / f"test_2016_flickr.{lang}")[:100])
    data = tmp_path / "data"
    main(["prepare", "--src", "en", "--tgt", "de", "--train", str(tmp_path / "train2k"),
          "--valid", str(tmp_path / "val200"), "--test", f"test={tmp_path / 'test100'}",
          "--vocab-size", "1000", "--out", str(data)])
    run = tmp_path / "run"
    main(["train", "--data", str(data), "--out", str(run), "model.preset=tiny",
          "model.max_positions=128", "train.max_steps=300", "train.validate_every=100",
          "train.valid_max_sentences=50", "train.lr=0.003", "train.warmup_steps=100",
          "train.progress=false", "train.tensorboard=false", "data.max_tokens=2000"])
    capsys.readouterr()
    log = (run / "train.log").read_text().splitlines()
    losses = [float(line.split("valid_loss ")[1].split(",")[0]) for line in log
              if line.startswith("validate")]
    assert len(losses) == 3 and losses[-1] < losses[0] - 0.5, losses

    main(["translate", "--checkpoint", str(run), "--input", str(tmp_path / "test100.en"),
          "--output", str(tmp_path / "hyp.de"), "--beam", "2", "--device", "cpu"])
    assert len(read_lines(tmp_path / "hyp.de")) == 100
    main(["score", "--ref", str(tmp_path / "test100.de"), "--hyp", str(tmp_path / "hyp.de"),
          "--json"])
    result = json.loads(capsys.readouterr().out)
    # the CLI's scores are sacreBLEU's on the files, and the translations belong to their
    # sources: the same lines paired with the wrong references score lower
    hyps, refs = read_lines(tmp_path / "hyp.de"), read_lines(tmp_path / "test100.de")
    assert result["bleu"] == pytest.approx(sacrebleu.corpus_bleu(hyps, [refs]).score, abs=5e-5)
    assert result["chrf"] == pytest.approx(sacrebleu.corpus_chrf(hyps, [refs]).score, abs=5e-5)
    shifted = sacrebleu.corpus_chrf(hyps[1:] + hyps[:1], [refs]).score
    assert result["chrf"] > shifted + 2.0, (result["chrf"], shifted)  # 25.1 vs 14.8 (Zen 4)
