"""The prepared GPU call of issue 68 (``benchmarks/gpu_step.py``) runs end to end at test
sizes on the CPU (``--dry-run``), so a lent GPU's minutes go to measuring, not debugging:
every section writes its rows, no row or section is an error, every number is positive."""

from __future__ import annotations

import json
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def test_the_gpu_step_dry_run_writes_every_section(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    sys.modules.pop("gpu_step", None)
    import gpu_step

    out = tmp_path / "gpu_step.json"
    gpu_step.main(["--dry-run", "--device", "cpu", "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["dry_run"] is True and result["device"] == "cpu"
    for name in gpu_step.SECTIONS:
        assert "error" not in result[name], (name, result[name])
    modes = {row["mode"] for row in result["step"]}
    assert modes == {"fp32", "fp32-compiled", "bf16", "bf16-compiled", "bf16-weights",
                     "bf16-weights-compiled"}
    assert [(row["arch"], row["mode"]) for row in result["ran_kernel"]] == [
        ("ran-all,model.ran.kernel=explicit", "bf16"),
        ("ran-all,model.ran.kernel=explicit", "bf16-compiled")]
    for row in result["step"] + result["big"] + result["marian"] + result["ran_kernel"]:
        assert "error" not in row, row
        assert row["seconds_per_step"] > 0 and row["target_tokens_per_s"] > 0
        assert row["mfu"] is None  # no peak known for a CPU
    assert {row["mode"] for row in result["marian"]} == {"marian-fp32", "marian-bf16"}
    assert [row["batch"] for row in result["decode"]] == [1, 4]
    assert all(row["ranmt_over_marian"] > 0 for row in result["decode"])
    assert set(result["profile"]) == {"fp32", "fp32-compiled"}
    assert all("Self CPU time total" in table for table in result["profile"].values())
