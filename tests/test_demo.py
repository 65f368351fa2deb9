"""`make demo`'s script on a tiny budget: data, two trainings, evaluation with significance,
a translation (serving is covered by tests/test_serve.py). Slow: about a minute."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
@pytest.mark.ci
@pytest.mark.data
def test_demo_script_on_a_tiny_budget(multi30k_dir, tmp_path):
    # A 3-second budget (a step or two: the plumbing is tested, not the model); an untrained
    # model decodes to the length limit, so validation (200 lines) and the greedy evaluation
    # (1000 lines twice) stop after 4 tokens (the limit a trained model is given is 1.2 x
    # the source + 10).
    env = dict(os.environ, BUDGET="3s", DEMO=str(tmp_path / "demo"), SERVE="0",
               TRAIN_FLAGS="decode.max_len_a=0 decode.max_len_b=4",
               EVAL_FLAGS="--beam 1 --max-len-a 0 --max-len-b 4",
               BIN=str(Path(sys.executable).parent), RANMT_DATA_DIR=str(multi30k_dir.parent))
    done = subprocess.run(["bash", str(ROOT / "scripts" / "demo.sh")], env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    for arch in ("transf", "ran-all"):
        hyps = (tmp_path / "demo" / f"{arch}.test_2016_flickr.hyp").read_text().splitlines()
        assert len(hyps) == 1000
        assert (tmp_path / "demo" / arch / "best" / "model.safetensors").is_file()
    assert "== 4/5 one sentence" in done.stdout
    summary = done.stdout[done.stdout.index("== the demo's models after 3s"):]
    assert "RAN-ALL against TransF: paired bootstrap p = " in summary
    assert "Trained to convergence" in summary  # the committed grid's BLEU beside them
