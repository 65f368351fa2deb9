"""Schemathesis (an OpenAPI fuzzer) against a live ``ranmt serve`` of a tiny model: every
request it generates from the served ``/openapi.json`` — valid and invalid bodies, every
endpoint, with the API key — gets a response the schema declares (status, content type,
body shape), never a 5xx. A bounded number of examples per operation and a fixed seed keep
it short and repeatable."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("schemathesis", reason="schemathesis is not installed (pip install -e "
                    "'.[dev]')")

MAX_EXAMPLES = 25

CONFIG = """
# What the served schema declares beyond what JSON Schema can check:
[checks.not_a_server_error]
# 504: a request's own deadline (timeout_s may be as small as a float allows): declared.
expected-statuses = ["2xx", "3xx", "4xx", "504"]

[checks.positive_data_acceptance]
# 400: the cross-field rules the schema states in words (one prefix per 'text' line, one
# target per 'source' line, nbest <= beam) and limits in subwords, not characters; 504 as
# above.
expected-statuses = ["2xx", "400", "401", "404", "504"]

[checks.negative_data_rejection]
# 413: more lines than maxItems, or a body larger than any valid one: declared.
expected-statuses = ["400", "401", "404", "413", "415", "422"]
"""


@pytest.mark.parametrize("workers", ["process", "thread"])
def test_the_served_schema_holds_under_fuzzing(runs, tmp_path, workers):
    """With decoding in the model's worker process (the default) and in the server's
    decoding thread."""
    from ranmt.serving.launcher import launch_server

    (tmp_path / "schemathesis.toml").write_text(CONFIG)
    key = tmp_path / "key"
    key.write_text("fuzz-key\n")
    process, url = launch_server(["--checkpoint", f"T={runs['transf']}", "--api-key-file",
                                  str(key), "--max-lines", "8", "--max-chars", "200",
                                  "--workers", workers], wait_s=60)
    try:
        command = [sys.executable, "-m", "schemathesis.cli", "--config-file",
                   str(tmp_path / "schemathesis.toml"), "run",
                   f"{url}/openapi.json", "--checks", "all", "-n", str(MAX_EXAMPLES),
                   "--seed", "1", "-H", "Authorization: Bearer fuzz-key",
                   "--request-timeout", "30", "--continue-on-failure"]
        result = subprocess.run(command, capture_output=True, text=True, timeout=300,
                                cwd=tmp_path)
        print(result.stdout[-6000:], file=sys.stderr)
        assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    finally:
        process.terminate()
        process.wait(timeout=30)
