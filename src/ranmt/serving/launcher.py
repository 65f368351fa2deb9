"""A real ``ranmt serve`` in a child process on a free loopback port: what tests, the load
benchmark (``benchmarks/serve_load.py``) and scripts use to drive a server over HTTP."""

from __future__ import annotations

import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path


def launch_server(args: list[str], wait_s: float = 20.0, env: dict | None = None,
                  errors_to: Path | None = None) -> tuple[subprocess.Popen, str]:
    """Start ``ranmt serve ARGS`` in a child process on a free loopback port and wait (up to
    ``wait_s``) until it answers ``GET /health``. Returns (process, base URL); the caller
    stops the process. For tests, load benchmarks and scripts that drive a real server.
    ``env``: the child's environment (default: this process'); ``errors_to``: a file that
    keeps the server's error output (its log) for the caller to read.

    Raises ``RuntimeError`` (with the end of the server's error output) when the server
    exits or does not answer in time; the process is then stopped."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    # stderr goes to a file, not a pipe that nobody would drain while the server runs; the
    # child keeps its own handle when this one closes.
    with (open(errors_to, "w+b") if errors_to else tempfile.TemporaryFile()) as errors:
        process = subprocess.Popen([sys.executable, "-m", "ranmt", "serve", "--port",
                                    str(port), *args], stdout=subprocess.DEVNULL, stderr=errors,
                                   env=env)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and process.poll() is None:
            try:
                urllib.request.urlopen(f"{url}/health", timeout=1)
                return process, url
            except OSError:
                time.sleep(0.1)
        if process.poll() is None:
            process.kill()
        process.wait()
        errors.seek(0)
        tail = errors.read().decode("utf-8", "replace")[-2000:]
    raise RuntimeError(f"`ranmt serve {' '.join(args)}` did not answer /health within "
                       f"{wait_s:.0f} s (exit status {process.returncode}):\n{tail}")
