"""``ranmt serve`` when its own parts fail: the scenarios of issue 69, timed against a real
server on loopback (docs/SERVING.md, "What happens when things fail").

Each scenario starts ``ranmt serve`` with ``--checkpoint T=RUN`` (a copy of the run, so that
it can be moved away), finds its decoding worker through /proc (Linux), does what an
operator or a fault would, and records every answer's status and time:

* ``kill``: SIGKILL the worker while 8 requests decode (beam 4): their answers, and the
  time until a new request is translated again;
* ``stall``: SIGSTOP the worker, send a request with ``timeout_s`` 3 and one without: when
  each is answered and with what; when ``/ready`` flips to 503 and back (the watchdog's
  replacement);
* ``checkpoint``: move the run's folder away and kill the worker: how fast requests are
  refused and with what; the folder back: how long until the model serves again;
* ``load-hang``: the served checkpoint's weights replaced by a FIFO no one writes and the
  worker killed: its replacement sleeps in ``open()`` and never loads. When ``/ready``
  names ``--worker-load-timeout`` (the watchdog killed it), what a request gets meanwhile,
  and how long after the weights return the model serves again;
* ``sigterm``: SIGTERM while 4 requests of 64 lines at beam 16 decode: their statuses, how
  long the server takes to exit, and whether its log holds a traceback;
* ``starve``: a busy machine, not a fault: the worker (nice 19, as served) shares one CPU
  with ``--hogs`` spinning processes at nice 0 while 4 requests of 2 lines at beam 4 are
  sent one after another: their statuses and times, and how often the watchdog took the
  starved worker for a stalled one (``ranmt_worker_replacements_total{cause="stalled"}``);
  minutes long (the worker gets under 1% of the CPU), so not in the default ``--scenarios``.

    python benchmarks/serve_faults.py --checkpoint RUN --data DATA --json out.json

Prints one JSON object (and writes it to ``--json``)."""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from ranmt.checkpoint import resolve_checkpoint
from ranmt.serving.launcher import decoding_workers, launch_server, running


def _call(url: str, body: dict | None = None, timeout: float = 120) -> tuple[int, dict | str]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            raw = response.read()
            status = response.status
    except urllib.error.HTTPError as err:
        raw, status = err.read(), err.code
    except OSError as err:
        return 0, f"{type(err).__name__}: {err}"
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode("utf-8", "replace")[:200]


def _timed(call, start: float):
    status, body = call()
    error = body.get("error") if isinstance(body, dict) else None
    return {"status": status, "seconds": round(time.monotonic() - start, 3), "error": error}


def _until(condition, limit: float = 120.0, step: float = 0.02) -> float:
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > limit:
            raise TimeoutError("condition not met")
        time.sleep(step)
    return round(time.monotonic() - start, 3)


def _ready(url: str) -> bool:
    return _call(f"{url}/ready", timeout=5)[0] == 200


def _serve(run: Path, extra: list[str], log: Path):
    process, url = launch_server(["--checkpoint", f"T={run}", *extra], wait_s=120,
                                 errors_to=log)
    _until(lambda: _ready(url))
    return process, url


def scenario_kill(run: Path, lines: list[str], log: Path) -> dict:
    process, url = _serve(run, [], log)
    try:
        worker = decoding_workers(process.pid)[0]
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            start = time.monotonic()
            answers = [pool.submit(_timed, lambda i=i: _call(f"{url}/translate", {
                "text": lines[i * 8:(i + 1) * 8], "beam": 4}), start) for i in range(8)]
            time.sleep(0.3)
            killed = time.monotonic()
            os.kill(worker, signal.SIGKILL)
            results = [answer.result() for answer in answers]
        served_again = _until(lambda: _call(f"{url}/translate", {"text": lines[:1]})[0] == 200)
        return {"answers": results, "killed_at_s": round(killed - start, 3),
                "next_success_after_kill_s": round(time.monotonic() - killed, 3),
                "waited_for_success_s": served_again}
    finally:
        process.kill()
        process.wait()


def scenario_stall(run: Path, lines: list[str], log: Path, stall_s: float) -> dict:
    process, url = _serve(run, ["--worker-stall-s", str(stall_s)], log)
    try:
        worker = decoding_workers(process.pid)[0]
        os.kill(worker, signal.SIGSTOP)
        start = time.monotonic()
        flips = {}
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            short = pool.submit(_timed, lambda: _call(f"{url}/translate", {
                "text": lines[:4], "timeout_s": 3}), start)
            long = pool.submit(_timed, lambda: _call(f"{url}/translate", {
                "text": lines[4:8]}), start)
            flips["ready_503_at_s"] = round(_until(lambda: not _ready(url)), 3)
            flips["ready_200_again_at_s"] = round(time.monotonic() - start + _until(
                lambda: _ready(url)), 3)
            results = {"timeout_s_3": short.result(), "no_timeout": long.result()}
        after = _timed(lambda: _call(f"{url}/translate", {"text": lines[:1]}), time.monotonic())
        return {"worker_stall_s": stall_s, **results, **flips, "next_request": after}
    finally:
        process.kill()
        process.wait()


def scenario_checkpoint(run: Path, lines: list[str], log: Path, backoff_max: float) -> dict:
    process, url = _serve(run, ["--restart-backoff-max", str(backoff_max)], log)
    moved = run.with_name(run.name + ".moved")
    try:
        worker = decoding_workers(process.pid)[0]
        run.rename(moved)
        os.kill(worker, signal.SIGKILL)
        time.sleep(3)
        start = time.monotonic()
        refused = _call(f"{url}/translate", {"text": lines[:1]})
        refusal_ms = round((time.monotonic() - start) * 1000, 1)
        ready = _call(f"{url}/ready")
        models = _call(f"{url}/models")[1]["models"][0]
        time.sleep(20)  # it keeps trying meanwhile
        moved.rename(run)
        back = time.monotonic()
        came_back = _until(lambda: _ready(url))
        served = _call(f"{url}/translate", {"text": lines[:1]})[0]
        return {"restart_backoff_max_s": backoff_max,
                "refused": {"status": refused[0], "ms": refusal_ms, "body": refused[1]},
                "ready": {"status": ready[0], "body": ready[1]},
                "models_entry": {k: models.get(k) for k in ("state", "reason", "restarts")},
                "serving_again_after_checkpoint_returned_s": round(time.monotonic() - back, 3),
                "ready_after_s": came_back, "status_after": served}
    finally:
        if moved.exists():
            moved.rename(run)
        process.kill()
        process.wait()


def scenario_load_hang(run: Path, lines: list[str], log: Path, load_timeout_s: float) -> dict:
    process, url = _serve(run, ["--worker-load-timeout", str(load_timeout_s)], log)
    weights = resolve_checkpoint(run) / "model.safetensors"
    kept = weights.with_name("model.safetensors.kept")
    try:
        worker = decoding_workers(process.pid)[0]
        weights.rename(kept)
        os.mkfifo(weights)
        os.kill(worker, signal.SIGKILL)
        named = _until(lambda: "did not load" in json.dumps(_call(f"{url}/ready")[1]))
        ready = _call(f"{url}/ready")
        refused = _timed(lambda: _call(f"{url}/translate", {"text": lines[:1]}),
                         time.monotonic())
        kept.replace(weights)  # over the FIFO
        came_back = _until(lambda: _ready(url))
        served = _call(f"{url}/translate", {"text": lines[:1]})[0]
        return {"worker_load_timeout_s": load_timeout_s,
                "ready_names_the_timeout_after_kill_s": round(named, 3),
                "ready": {"status": ready[0], "body": ready[1]}, "request_meanwhile": refused,
                "serving_again_after_weights_returned_s": round(came_back, 3),
                "status_after": served,
                "load_timeout_kills_in_log": log.read_text(errors="replace").count(
                    "killing the decoding worker of model 'T': it did not load")}
    finally:
        if kept.exists():
            kept.replace(weights)
        process.kill()
        process.wait()


def scenario_sigterm(run: Path, lines: list[str], log: Path, drain_s: float) -> dict:
    process, url = _serve(run, ["--drain-s", str(drain_s)], log)
    try:
        workers = decoding_workers(process.pid)
        with concurrent.futures.ThreadPoolExecutor(5) as pool:
            start = time.monotonic()
            answers = [pool.submit(_timed, lambda i=i: _call(f"{url}/translate", {
                "text": lines[i * 64:(i + 1) * 64], "beam": 16}), start) for i in range(4)]
            time.sleep(1.0)
            process.send_signal(signal.SIGTERM)
            term = time.monotonic()
            late = pool.submit(_timed, lambda: _call(f"{url}/translate", {"text": lines[:1]}),
                               start).result()
            results = [answer.result() for answer in answers]
        process.wait(timeout=drain_s + 60)
        exited = round(time.monotonic() - term, 3)
        text = log.read_text(errors="replace")
        time.sleep(1)
        left = [pid for pid in workers if running(pid)]
        return {"drain_s": drain_s, "sigterm_at_s": round(term - start, 3), "answers": results,
                "request_after_sigterm": late, "exit_code": process.returncode,
                "exited_after_sigterm_s": exited, "traceback_in_log": "Traceback" in text,
                "workers_left": left}
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def _stalled_replacements(url: str) -> float:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        text = response.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("ranmt_worker_replacements_total") and 'cause="stalled"' in line)


def scenario_starve(run: Path, lines: list[str], log: Path, stall_s: float, hogs: int) -> dict:
    process, url = _serve(run, ["--worker-stall-s", str(stall_s)], log)
    spinning = []
    try:
        cpu = min(os.sched_getaffinity(0))
        os.sched_setaffinity(decoding_workers(process.pid)[0], {cpu})
        for _ in range(hogs):
            hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
            os.sched_setaffinity(hog.pid, {cpu})
            spinning.append(hog)
        start = time.monotonic()
        answers = [_timed(lambda i=i: _call(f"{url}/translate", {
            "text": lines[i * 2:(i + 1) * 2], "beam": 4}), start) for i in range(4)]
        for hog in spinning:
            hog.kill()
        return {"worker_stall_s": stall_s, "hogs_at_nice_0": hogs, "answers": answers,
                "statuses": [answer["status"] for answer in answers],
                "stalled_replacements": _stalled_replacements(url),
                "kills_in_log": log.read_text(errors="replace").count("killing the decoding")}
    finally:
        for hog in spinning:
            hog.kill()
            hog.wait()
        process.kill()
        process.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True, help="a run folder (copied)")
    parser.add_argument("--data", required=True, help="prepared data (source sentences)")
    parser.add_argument("--split", default="test_2016_flickr")
    parser.add_argument("--scenarios", default="kill,stall,checkpoint,load-hang,sigterm")
    parser.add_argument("--worker-stall-s", type=float, default=5.0)
    parser.add_argument("--restart-backoff-max", type=float, default=30.0)
    parser.add_argument("--drain-s", type=float, default=20.0)
    parser.add_argument("--worker-load-timeout", type=float, default=5.0,
                        help="load-hang: the server's --worker-load-timeout")
    parser.add_argument("--hogs", type=int, default=4,
                        help="starve: spinning processes on the worker's CPU")
    parser.add_argument("--json")
    args = parser.parse_args()
    lines = (Path(args.data) / f"{args.split}.src.txt").read_text().splitlines()
    import torch

    out = {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
           "torch": torch.__version__, "checkpoint": args.checkpoint, "scenarios": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.scenarios.split(","):
            run = Path(tmp) / f"run-{name}"
            shutil.copytree(args.checkpoint, run, ignore=shutil.ignore_patterns(
                "checkpoints", "tensorboard"))
            log = Path(tmp) / f"{name}.log"
            if name == "kill":
                result = scenario_kill(run, lines, log)
            elif name == "stall":
                result = scenario_stall(run, lines, log, args.worker_stall_s)
            elif name == "checkpoint":
                result = scenario_checkpoint(run, lines, log, args.restart_backoff_max)
            elif name == "load-hang":
                result = scenario_load_hang(run, lines, log, args.worker_load_timeout)
            elif name == "starve":
                result = scenario_starve(run, lines, log, args.worker_stall_s, args.hogs)
            else:
                result = scenario_sigterm(run, lines, log, args.drain_s)
            result["log_tail"] = log.read_text(errors="replace")[-1500:]
            out["scenarios"][name] = result
            print(f"{name}: done", file=sys.stderr)
    text = json.dumps(out, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")


if __name__ == "__main__":
    main()
