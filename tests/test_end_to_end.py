"""End to end on a synthetic task: the tiny model learns to reverse strings (BLEU >= 90)."""

from __future__ import annotations

import json

from ranmt.cli import main
from ranmt.config import load_config
from ranmt.data.corpus import raw_text
from ranmt.evaluate import score
from ranmt.train import train
from ranmt.translator import Translator


def test_reverse_task_reaches_bleu_90(reverse_data, tmp_path, capsys):
    cfg = load_config(None, {
        "model.preset": "tiny", "model.dropout": "0.0", "train.lr": "0.003",
        "train.warmup_steps": "150", "train.max_time": "80", "train.max_steps": "1500",
        "train.validate_every": "500", "train.valid_max_sentences": "100",
        "train.progress": "false", "train.tensorboard": "false", "data.max_tokens": "1500"})
    train(cfg, reverse_data, tmp_path / "run")
    translator = Translator.load(tmp_path / "run", device="cpu", beam=4)
    sources = raw_text(reverse_data, "test", "src")
    references = raw_text(reverse_data, "test", "tgt")
    hyps = translator.translate(sources)
    assert len(hyps) == len(sources)
    bleu = score(hyps, references, metrics=("bleu",))["bleu"]
    assert bleu >= 90, f"BLEU {bleu} on held-out reversal strings"

    # The CLI evaluates the same checkpoint to the same score.
    main(["evaluate", "--checkpoint", str(tmp_path / "run"), "--data", str(reverse_data),
          "--split", "test", "--beam", "4", "--json", "--device", "cpu"])
    result = json.loads(capsys.readouterr().out)
    assert result["bleu"] == bleu and "nrefs:1" in result["signature"]["bleu"]

    # int8 (dynamic quantization of the linear layers) keeps the trained model's quality.
    main(["evaluate", "--checkpoint", str(tmp_path / "run"), "--data", str(reverse_data),
          "--split", "test", "--beam", "4", "--json", "--device", "cpu", "--quantize", "int8"])
    int8 = json.loads(capsys.readouterr().out)["bleu"]
    assert abs(int8 - bleu) <= 1.0, f"int8 BLEU {int8} vs fp32 {bleu}"
