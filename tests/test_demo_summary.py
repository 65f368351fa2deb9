"""scripts/demo_summary.py: the demo's last words read as a result (issue 101) — each model's
SacreBLEU with the bootstrap's mark, its steps and demo sentence, and the converged models'
BLEU read from the committed grid."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _script():
    spec = importlib.util.spec_from_file_location("demo_summary",
                                                  ROOT / "scripts/demo_summary.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(tmp_path: Path, name: str, steps: int) -> Path:
    run = tmp_path / name
    run.mkdir()
    (run / "train.log").write_text(f"step {steps}\ndone: time budget reached; {steps} steps, "
                                   f"2,000 target tokens/s, best valid BLEU 12.0 at step "
                                   f"{steps}\n")
    return run


@pytest.mark.parametrize("p_value, marked", [(0.004, True), (0.2, False)])
def test_the_summary_marks_a_significant_difference_only(tmp_path, p_value, marked):
    scores = {"systems": [{"name": "a", "bleu": 15.24},
                          {"name": "b", "bleu": 16.71, "bleu_p": p_value}]}
    models = [("TransF", _run(tmp_path, "t", 512), "Ein Mann mit Hut."),
              ("RAN-ALL", _run(tmp_path, "r", 498), "Ein Mann mit einem Hut.")]
    lines = _script().summary(scores, models, "3m").splitlines()
    assert lines[0] == "== the demo's models after 3m of training each " \
                       "(test_2016_flickr, SacreBLEU)"
    assert lines[1].split() == ["TransF", "15.2", "512", "steps", "Ein", "Mann", "mit",
                                "Hut."]
    assert lines[2].split()[:3] == ["RAN-ALL", "16.7", "†" if marked else "498"]
    verdict = "a significant" if marked else "no significant"
    assert f"paired bootstrap p = {p_value:.3f}, {verdict} difference" in lines[3]


def test_the_converged_bleu_is_the_committed_grids_mean(tmp_path):
    committed = json.loads((ROOT / "docs/results/multi30k_converged/results.json").read_text())
    scores = committed["datasets"]["multi30k-en-de"]["tests"]["test_2016_flickr"]["scores"]
    transf = sum(scores["TransF"]["bleu"]["per_seed"].values()) / 3
    ran = sum(scores["RAN-ALL"]["bleu"]["per_seed"].values()) / 3
    module = _script()
    assert module.converged_bleu(module.CONVERGED, "TransF") == pytest.approx((transf, 3))
    text = module.summary(
        {"systems": [{"bleu": 1.0}, {"bleu": 2.0, "bleu_p": 0.5}]},
        [("TransF", tmp_path, "x"), ("RAN-ALL", tmp_path, "y")], "3m")
    assert f"reach TransF {transf:.1f} and RAN-ALL {ran:.1f}" in " ".join(text.split())
    assert "mean of 3 seeds" in " ".join(text.split())
    # no committed grid (a copy of the scripts elsewhere): no converged line, no error
    assert "Trained to convergence" not in module.summary(
        {"systems": [{"bleu": 1.0}]}, [("TransF", tmp_path, "x")], "3m",
        tmp_path / "missing.json")


def test_the_demo_recipe_reaches_its_peak_learning_rate_early_in_its_budget():
    """configs/multi30k_demo.yaml's warm-up ends within the first quarter of the updates its
    budget allows on the slow case (fp32, 2 cores: the fewest steps of the committed
    `make demo` run, docs/results/demo_recipe/make_demo_fp32.log), and the rate it reaches
    there is the configured peak."""
    import re

    from ranmt.config import load_config
    from ranmt.training.train import inverse_sqrt_lr

    config = load_config(ROOT / "configs/multi30k_demo.yaml")
    log = (ROOT / "docs/results/demo_recipe/make_demo_fp32.log").read_text()
    steps = [int(n) for n in re.findall(r"done: max_time=(?:\S+) reached; (\d+) steps", log)]
    assert len(steps) == 2 and config.train.max_time == "3m"  # both models, the same budget
    train = config.train
    rates = [inverse_sqrt_lr(step, train.lr, train.warmup_steps, train.warmup_init_lr)
             for step in range(1, min(steps) + 1)]
    peak_step = rates.index(max(rates)) + 1
    assert max(rates) == pytest.approx(train.lr)
    assert peak_step <= min(steps) / 4, (peak_step, min(steps))
