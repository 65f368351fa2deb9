"""Checkpoints of the distilled students' other decoders (RAN-D, AAN, SSRU) for
``benchmarks/peers.py --student`` at equal work (issue 99 item 5; one-off record): the
``student`` preset with each decoder, freshly initialised (``torch.manual_seed(0)``, as
``benchmarks/students.py`` builds them: at a fixed output length trained and untrained
weights decode at the same speed), saved with the prepared data's vocabularies and the
trained TransF student's lexical shortlist beside them (same vocabularies, so the same
lists apply).

    python docs/performance/engine/untrained_students.py DATA TRANSF_RUN OUT
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import torch

from ranmt.checkpoint import save_checkpoint
from ranmt.config import load_config
from ranmt.data.corpus import fill_config_from_data
from ranmt.inference.shortlist import SHORTLIST_FILE
from ranmt.model import build_model

ARCHS = {"RAN-D": "ran-d", "AAN": "aan-d", "SSRU": "ssru-d"}


def main() -> None:
    data, transf_run, out = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    for name, arch in ARCHS.items():
        cfg = load_config(None, {"model.preset": "student", "model.arch": arch})
        fill_config_from_data(cfg, data)
        torch.manual_seed(0)
        model = build_model(cfg.model).eval()
        run = out / f"Student-{name}"
        save_checkpoint(run / "best", model, cfg, {"src": Path(data) / "spm.src.model",
                                                   "tgt": Path(data) / "spm.tgt.model"})
        shutil.copyfile(transf_run / SHORTLIST_FILE, run / SHORTLIST_FILE)
        print(f"{name}: {run / 'best'}")


if __name__ == "__main__":
    main()
