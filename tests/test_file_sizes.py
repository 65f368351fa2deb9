"""The size rules the issues set for packages (issue 99: no file in ``inference/`` or
``serving/`` over 500 lines; issue 100: none in ``experiment/`` over 350): a file past its
limit is a module that wants splitting into named pieces."""

from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "ranmt"
LIMITS = {"inference": 500, "serving": 500, "experiment": 350}


@pytest.mark.parametrize("package", sorted(LIMITS))
def test_no_module_of_a_package_passes_its_line_limit(package):
    limit = LIMITS[package]
    files = sorted((PACKAGE / package).glob("*.py"))
    assert files, f"no modules found in {PACKAGE / package}"
    too_long = {f.name: n for f in files
                if (n := len(f.read_text(encoding="utf-8").splitlines())) > limit}
    assert not too_long, f"{package}/ files over {limit} lines: {too_long}"
