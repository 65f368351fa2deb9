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


def _parent_of(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def processes_below(pid: int) -> set[int]:
    """The processes descended from ``pid`` (Linux, through /proc; empty elsewhere)."""
    proc = Path("/proc")
    if not proc.is_dir():
        return set()
    children: dict[int, list[int]] = {}
    for entry in proc.iterdir():
        if entry.name.isdigit():
            parent = _parent_of(int(entry.name))
            if parent is not None:
                children.setdefault(parent, []).append(int(entry.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def decoding_workers(server_pid: int) -> list[int]:
    """The decoding worker processes of a ``ranmt serve`` (``--workers process``): the
    children of its forkserver (Linux), for tests and benchmarks that stop or kill them."""
    workers = []
    for pid in processes_below(server_pid):
        parent = _parent_of(pid)
        try:
            if parent is not None and b"forkserver" in Path(f"/proc/{parent}/cmdline").read_bytes():
                workers.append(pid)
        except OSError:
            continue
    return sorted(workers)


def running(pid: int) -> bool:
    """Whether process ``pid`` runs (one that exited and was not reaped, a zombie, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"
    except (OSError, IndexError):
        return False
