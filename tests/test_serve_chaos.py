"""A short chaos run against a real ``ranmt serve`` (issue 99): mixed requests (greedy, beam,
n-best, prefixes, sampling, scoring; deadlines from 0.3 to 4 s) from three clients while the
model's decoding worker is, in turn, killed (SIGKILL), stopped (SIGSTOP: the watchdog's
case) and made unloadable (its weights a FIFO nobody writes, then killed: the load timeout's
and the back-off's case, until the weights come back). Every request must end by its
deadline (plus :data:`LATE_S`) with an intended status (200; 500 naming the worker's end;
503 while no worker can decode; 504 at the deadline), ``/health`` must never take longer
than :data:`HEALTH_BOUND_S`, and the model must serve again at the end."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from conftest import UNNICED

pytest.importorskip("fastapi")

LATE_S = 1.0
"""How far past its deadline a request may be answered (as tests/test_serve_faults.py)."""
HEALTH_BOUND_S = 0.75
"""The longest ``/health`` may take, whatever the worker is going through: below the 1 s
stall the watchdog waits out (``--worker-stall-s 1``), so a ``/health`` that waited on the
stopped worker would exceed it, with room for scheduling noise on a 2-core machine running
the server, its worker and four client threads (0.25 s failed a CI run at 0.2514 s)."""
INTENDED = {200, 500, 503, 504}


def _call(url: str, path: str, body: dict | None, timeout: float):
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(f"{url}{path}", data=data,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def _mixed_request(rng: random.Random) -> tuple[str, dict]:
    """A random request of the kinds a client sends, with its own deadline."""
    words = ["a", "b", "c", "d", "e", "f", "g", "h", "i", "j"]
    lines = [" ".join(rng.choices(words, k=rng.randint(1, 8))) for _ in range(rng.randint(1, 4))]
    timeout_s = round(rng.uniform(0.3, 4.0), 2)
    kind = rng.choice(["greedy", "beam", "nbest", "prefix", "sampling", "score"])
    if kind == "score":
        return "/score", {"source": lines, "target": lines[::-1], "timeout_s": timeout_s}
    body: dict = {"text": lines, "timeout_s": timeout_s}
    if kind == "greedy":
        body["beam"] = 1
    elif kind == "beam":
        body["beam"] = rng.randint(2, 4)
    elif kind == "nbest":
        body.update(beam=4, nbest=rng.randint(2, 4))
    elif kind == "prefix":
        body["prefix"] = [line.split()[0] for line in lines]
    else:
        body.update(sampling="topk", topk=5, seed=rng.randint(0, 99))
    return "/translate", body


class _Load:
    """Clients that send mixed requests until told to stop, and a prober of ``/health``."""

    def __init__(self, url: str, clients: int = 3):
        self.url = url
        self.stopping = threading.Event()
        self.results: list[tuple[str, dict, int, float, bytes]] = []
        self.health_s: list[float] = []
        self.threads = [threading.Thread(target=self._client, args=(seed,), daemon=True)
                        for seed in range(clients)]
        self.threads.append(threading.Thread(target=self._probe, daemon=True))

    def __enter__(self):
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc):
        self.stopping.set()
        for thread in self.threads:
            thread.join(timeout=30)

    def _client(self, seed: int) -> None:
        rng = random.Random(seed)
        while not self.stopping.is_set():
            path, body = _mixed_request(rng)
            started = time.monotonic()
            status, answer = _call(self.url, path, body, timeout=30)
            self.results.append((path, body, status, time.monotonic() - started, answer))
            time.sleep(rng.uniform(0.0, 0.05))

    def _probe(self) -> None:
        while not self.stopping.is_set():
            started = time.monotonic()
            status, _ = _call(self.url, "/health", None, timeout=10)
            assert status == 200
            self.health_s.append(time.monotonic() - started)
            time.sleep(0.05)


def _until(condition, seconds: float = 30.0) -> float:
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < seconds, "timed out"
        time.sleep(0.02)
    return time.monotonic() - start


def _ready(url: str) -> bool:
    try:
        return _call(url, "/ready", None, timeout=2)[0] == 200
    except OSError:
        return False


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds the workers through /proc")
def test_chaos_every_request_ends_by_its_deadline_with_an_intended_status(runs, tmp_path):
    from ranmt.serving.launcher import decoding_workers, launch_server, running

    folder = tmp_path / "model"
    shutil.copytree(runs["transf"], folder)
    weights = folder / "model.safetensors"
    process, url = launch_server(
        ["--checkpoint", f"T={folder}", "--batch-window-ms", "1", "--max-lines", "8",
         "--worker-stall-s", "1", "--worker-load-timeout", "2", "--restart-backoff-max", "1",
         *UNNICED], wait_s=60, errors_to=tmp_path / "serve.log")
    faults = []
    try:
        _until(lambda: _ready(url), 60)
        with _Load(url) as load:
            time.sleep(3)
            for fault in ("kill", "stop", "unloadable"):
                [worker] = decoding_workers(process.pid)
                if fault == "unloadable":
                    weights.rename(folder / "weights.kept")
                    os.mkfifo(weights)
                os.kill(worker, signal.SIGSTOP if fault == "stop" else signal.SIGKILL)
                _until(lambda: not _ready(url), 15)
                if fault == "unloadable":
                    time.sleep(5)  # load timeouts and back-off while the weights are gone
                    weights.unlink()
                    (folder / "weights.kept").rename(weights)
                faults.append((fault, _until(lambda: _ready(url), 30)))
                _until(lambda pid=worker: not running(pid), 10)
                time.sleep(3)
        log = (tmp_path / "serve.log").read_text()
        statuses = [status for _, _, status, _, _ in load.results]
        assert set(statuses) <= INTENDED, (statuses, log[-3000:])
        for path, body, status, seconds, answer in load.results:
            assert seconds <= body["timeout_s"] + LATE_S, (path, body, status, seconds, answer)
            if status == 500:
                assert b"decoding worker" in answer, answer
        assert statuses.count(200) >= 20 and {503, 504} & set(statuses), statuses
        assert max(load.health_s) <= HEALTH_BOUND_S, sorted(load.health_s)[-5:]
        assert "did not load within 2 s" in log and "stalled" in log, log[-3000:]
        after = _call(url, "/translate", {"text": ["a b c"]}, timeout=30)
        assert after[0] == 200, after
        assert "Traceback" not in log, log[-3000:]
        print("statuses:", {status: statuses.count(status) for status in sorted(set(statuses))},
              f"/health at most {max(load.health_s) * 1000:.0f} ms of {len(load.health_s)}")
    finally:
        print("faults and recovery times:", faults)
        process.terminate()
        process.wait(timeout=30)
