"""Load test of ``ranmt serve`` on loopback: concurrent clients, nothing lost, every response
with its request, throughput and latency, dynamic batching against one request at a time.

For each mode the script starts ``ranmt serve`` on a free loopback port with the given
checkpoint, then ``--clients`` threads each send ``--requests`` requests of one sentence
(distinct sentences of ``--split``, cycled) and check every answer against the translation
the Python API gives for that sentence (same model, same beam). Modes:

* ``dynamic``: the server's default batching (step-level: a request joins the decoding
  batch at the next step);
* ``batch-level``: ``--batching batch`` (requests arriving within ``--batch-window-ms``
  decode as one batch, decoded to its end);
* ``one-at-a-time``: ``--batch-window-ms 0 --max-batch-tokens 1``, every request its own
  batch.

Printed (and written to ``--json``): requests/s, sentences/s, p50/p99 latency in ms, lost
and mismatched responses, batches formed, and the throughput ratio dynamic / one-at-a-time.

    python benchmarks/serve_load.py --checkpoint RUN --data DATA --split test_2016_flickr \\
        --clients 16 --requests 50

``--scenario burst`` compares step- and batch-level batching (``--batching``) under the
burst of issue 46: ``--burst-requests`` (60) requests of ``--burst-lines`` lines at beam
``--burst-beam`` at once, a one-line request 0.5 s later (sent again every 50 ms while it is
refused because the burst fills the queue; its latency from the first send against its
latency on the idle server), ``/health`` every 50 ms meanwhile (p50/p99), refusals (p50/p99), burst
throughput (accepted lines / seconds to the last accepted answer), peak memory, and every
accepted line checked against the Python API.

    python benchmarks/serve_load.py --scenario burst --checkpoint RUN --data DATA \
        --burst-lines 64 --burst-beam 16

``--scenario overload`` instead runs two bursts against one server started with
``--max-queued-tokens Q`` (``--queue-tokens``), each request ``--burst-lines`` lines at beam
``--burst-beam`` sent at once from as many threads:

* **fairness**: a burst that fits the queue, then (once the first batch decodes) a one-line
  request: its latency against the burst's, i.e. whether it waited for the whole burst;
* **overload**: a burst of 4x the queue limit: refusals (503) and how fast they come (p50/p99
  ms), every accepted request checked line by line against the Python API, and the server's
  resident memory (Linux /proc) before, at its peak during, and after the burst.

    python benchmarks/serve_load.py --scenario overload --checkpoint RUN --data DATA
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ranmt.data.corpus import raw_text
from ranmt.inference.translator import Translator
from ranmt.serving.launcher import launch_server

MODES = {"dynamic": [], "batch-level": ["--batching", "batch"],
         "one-at-a-time": ["--batch-window-ms", "0", "--max-batch-tokens", "1",
                           "--express-rows", "0"]}


def _post(url: str, payload: dict, timeout: float = 120) -> dict:
    request = urllib.request.Request(url, data=json.dumps(payload).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def run_mode(args, mode: str, sentences: list[str], expected: dict[str, str]) -> dict:
    server, base = launch_server(["--checkpoint", args.checkpoint, "--device", "cpu",
                                  "--max-lines", "1"] + MODES[mode], wait_s=60,
                                 env=_server_env(args))
    try:
        latencies: list[float] = []
        failures = {"lost": 0, "mismatched": 0}
        lock = threading.Lock()

        def client(index: int) -> None:
            for number in range(args.requests):
                sentence = sentences[(index * args.requests + number) % len(sentences)]
                start = time.perf_counter()
                try:
                    body = _post(f"{base}/translate", {"text": [sentence], "beam": args.beam})
                    text = body["translations"][0]["text"]
                except Exception:  # noqa: BLE001 (counted as lost)
                    with lock:
                        failures["lost"] += 1
                    continue
                with lock:
                    latencies.append(time.perf_counter() - start)
                    failures["mismatched"] += text != expected[sentence]

        threads = [threading.Thread(target=client, args=(i,)) for i in range(args.clients)]
        start = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        elapsed = time.perf_counter() - start
        health = json.loads(urllib.request.urlopen(f"{base}/health", timeout=5).read())
    finally:
        server.terminate()
        server.wait(60)
    latencies.sort()
    total = args.clients * args.requests
    return {"requests": total, "seconds": elapsed, "requests_per_s": len(latencies) / elapsed,
            "p50_ms": 1000 * statistics.median(latencies),
            "p99_ms": 1000 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
            "batches": health["batches"], **failures}


REFUSED = threading.Event()  # set at the first 503 a burst gets


def _timed_post(url: str, payload: dict) -> tuple[int, float, dict]:
    """(status, seconds, body) of one POST; HTTP errors are answers too."""
    start = time.perf_counter()
    try:
        body = _post(url, payload, timeout=600)
        status = 200
    except urllib.error.HTTPError as err:
        status, body = err.code, json.loads(err.read() or b"{}")
        if status == 503:
            REFUSED.set()
    return status, time.perf_counter() - start, body


def _rss_mb(pid: int) -> float:
    """Resident memory of process ``pid`` and all its descendants (the server's decoding
    workers and their forkserver), in MB."""
    total = 0.0
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1]) / 1024
        for task in Path(f"/proc/{pid}/task").iterdir():
            children = (task / "children").read_text().split()
            total += sum(_rss_mb(int(child)) for child in children)
    except (FileNotFoundError, ProcessLookupError):
        pass
    return total


def _percentile(values: list[float], share: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(share * len(values)))] if values else float("nan")


def _burst(base: str, requests: list[list[str]], beam: int, server_pid: int,
           during=None) -> dict:
    """Send every request at once (one thread each); ``during(base)`` runs meanwhile once the
    server has started decoding. Returns the answers and the server's peak memory."""
    peak = [_rss_mb(server_pid)]
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            peak.append(_rss_mb(server_pid))
            time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    extra = None
    with ThreadPoolExecutor(len(requests) + 1) as pool:
        futures = [pool.submit(_timed_post, f"{base}/translate", {"text": lines, "beam": beam})
                   for lines in requests]
        if during is not None:
            extra = during(base)
        answers = [future.result() for future in futures]
    done.set()
    watcher.join()
    return {"answers": answers, "peak_rss_mb": max(peak), "extra": extra}


def _server_env(args) -> dict | None:
    """--server-src DIR: the server runs that checkout's ranmt (e.g. an older commit in a
    git worktree, to measure before/after), the client this one's."""
    if not args.server_src:
        return None
    import os

    return {**os.environ, "PYTHONPATH": str(Path(args.server_src).resolve())}


def run_overload(args, sentences: list[str], translator) -> dict:
    """The fairness and overload bursts of ``--scenario overload`` (see the docstring)."""
    server, base = launch_server(["--checkpoint", args.checkpoint, "--device", "cpu",
                                  "--max-lines", str(args.burst_lines), "--max-beam", "16",
                                  "--max-queued-tokens", str(args.queue_tokens)], wait_s=60,
                                 env=_server_env(args))
    lines = args.burst_lines
    chunks = [sentences[i: i + lines] for i in range(0, len(sentences) - lines + 1, lines)]
    tokens = [sum(len(ids) + 1 for ids in translator.encode_sources(chunk)) for chunk in chunks]
    try:
        # Fairness: as many requests as fit the queue (90%), then one line during the burst.
        fitting, total = [], 0
        for chunk, count in zip(chunks, tokens):
            if total + count > 0.9 * args.queue_tokens:
                break
            fitting.append(chunk)
            total += count

        def small_request(url: str):
            time.sleep(0.5)
            return _timed_post(f"{url}/translate", {"text": [sentences[-1]],
                                                    "beam": args.burst_beam})

        fair = _burst(base, fitting, args.burst_beam, server.pid, small_request)
        burst_seconds = [seconds for status, seconds, _ in fair["answers"] if status == 200]
        fairness = {"burst_requests": len(fitting), "burst_source_tokens": total,
                    "burst_lines": len(fitting) * lines,
                    "small_status": fair["extra"][0], "small_latency_s": fair["extra"][1],
                    "burst_latency_p50_s": statistics.median(burst_seconds),
                    "burst_latency_max_s": max(burst_seconds)}
        # Overload: 4x the queue limit at once.
        wanted, total, heavy = 4 * args.queue_tokens, 0, []
        for index in range(10_000):
            chunk = chunks[index % len(chunks)]
            heavy.append(chunk)
            total += tokens[index % len(chunks)]
            if total >= wanted:
                break
        def probes(url: str) -> list[tuple[int, float]]:
            """One request after another once the queue is full (the first 503 of the
            burst); one that is accepted gives up after 0.5 s (504) or is translated."""
            REFUSED.wait(120)
            probe = {"text": chunks[0], "beam": args.burst_beam, "timeout_s": 0.5}
            return [_timed_post(f"{url}/translate", probe)[:2] for _ in range(40)]

        before = _rss_mb(server.pid)
        over = _burst(base, heavy, args.burst_beam, server.pid, probes)
        after = _rss_mb(server.pid)
    finally:
        server.terminate()
        server.wait(60)
    refused = [seconds for status, seconds, _ in over["answers"] if status == 503]
    accepted = [(chunk, body) for chunk, (status, _, body) in zip(heavy, over["answers"])
                if status == 200]
    other = [status for status, _, _ in over["answers"] if status not in (200, 503)]
    expected = translator.translate([line for chunk, _ in accepted for line in chunk],
                                    ) if accepted else []
    got = [entry["text"] for _, body in accepted for entry in body["translations"]]
    probe_refused = [seconds for status, seconds in over["extra"] if status == 503]
    overload = {"requests": len(heavy), "source_tokens": total, "refused": len(refused),
                "probe_refused": len(probe_refused), "probes": len(over["extra"]),
                "probe_refusal_p50_ms": 1000 * _percentile(probe_refused, 0.5),
                "probe_refusal_p99_ms": 1000 * _percentile(probe_refused, 0.99),
                "refusal_p50_ms": 1000 * _percentile(refused, 0.5),
                "refusal_p99_ms": 1000 * _percentile(refused, 0.99),
                "accepted": len(accepted), "other_statuses": other,
                "accepted_lines_mismatched": sum(a != b for a, b in zip(got, expected)),
                "accepted_lines": len(got),
                "rss_mb_before": before, "rss_mb_peak": over["peak_rss_mb"],
                "rss_mb_after": after}
    return {"fairness": fairness, "overload": overload}


def _health_probe(base: str, stop: threading.Event, period_s: float = 0.05) -> list[float]:
    """``GET /health`` every ``period_s`` until ``stop``: each answer's seconds."""
    seconds = []
    while not stop.is_set():
        start = time.perf_counter()
        urllib.request.urlopen(f"{base}/health", timeout=60).read()
        seconds.append(time.perf_counter() - start)
        time.sleep(period_s)
    return seconds


def run_burst(args, sentences: list[str], translator, batching: str) -> dict:
    """``--scenario burst`` against a server with ``--batching batching``: the one-line
    request's latency on the idle server, then ``--burst-requests`` requests of
    ``--burst-lines`` lines at beam ``--burst-beam`` at once and the one-line request 0.5 s
    later, with ``/health`` asked every 50 ms meanwhile."""
    server, base = launch_server(["--checkpoint", args.checkpoint, "--device", "cpu",
                                  "--max-lines", str(args.burst_lines), "--max-beam", "16",
                                  "--max-queued-tokens", str(args.queue_tokens),
                                  "--batching", batching, *args.server_args.split()],
                                 wait_s=60, env=_server_env(args))
    lines = args.burst_lines
    chunks = [sentences[i: i + lines] for i in range(0, len(sentences) - lines + 1, lines)]
    heavy = [chunks[i % len(chunks)] for i in range(args.burst_requests)]
    small = {"text": [sentences[-1]], "beam": args.burst_beam}
    try:
        idle = [_timed_post(f"{base}/translate", small)[1] for _ in range(5)]
        stop = threading.Event()
        with ThreadPoolExecutor(1) as prober:
            health = prober.submit(_health_probe, base, stop)

            def small_request(url: str):
                """Sent 0.5 s into the burst; refused (503: the burst fills the queue), it
                is sent again every 50 ms: (status, seconds from the first send, 503s)."""
                time.sleep(0.5)
                first, refusals = time.perf_counter(), 0
                while True:
                    status, _, body = _timed_post(f"{url}/translate", small)
                    if status != 503 or time.perf_counter() - first > 600:
                        return status, time.perf_counter() - first, refusals
                    refusals += 1
                    time.sleep(0.05)

            start = time.perf_counter()
            burst = _burst(base, heavy, args.burst_beam, server.pid, small_request)
            stop.set()
            health_s = health.result()
    finally:
        server.terminate()
        server.wait(60)
    answers = burst["answers"]
    accepted = [(chunk, body, seconds) for chunk, (status, seconds, body)
                in zip(heavy, answers) if status == 200]
    refused = [seconds for status, seconds, _ in answers if status == 503]
    last = max((seconds for _, _, seconds in accepted), default=float("nan"))
    expected = translator.translate([line for chunk, _, _ in accepted for line in chunk])
    got = [entry["text"] for _, body, _ in accepted for entry in body["translations"]]
    idle_s = statistics.median(idle)
    small_status, small_s, small_refusals = burst["extra"]
    return {"batching": batching, "small_idle_s": idle_s, "small_status": small_status,
            "small_latency_s": small_s, "small_over_idle": small_s / idle_s,
            "small_refusals": small_refusals,
            "requests": len(heavy), "accepted": len(accepted), "refused": len(refused),
            "other_statuses": [s for s, _, _ in answers if s not in (200, 503)],
            "refusal_p50_ms": 1000 * _percentile(refused, 0.5),
            "refusal_p99_ms": 1000 * _percentile(refused, 0.99),
            "health_probes": len(health_s),
            "health_p50_ms": 1000 * _percentile(health_s, 0.5),
            "health_p99_ms": 1000 * _percentile(health_s, 0.99),
            "burst_seconds": last, "burst_lines_per_s": len(got) / last,
            "accepted_lines": len(got),
            "accepted_lines_mismatched": sum(a != b for a, b in zip(got, expected)),
            "rss_mb_peak": burst["peak_rss_mb"], "wall_s": time.perf_counter() - start}


def _print_burst(args, results: dict) -> None:
    print(f"{args.burst_requests} requests x {args.burst_lines} lines at beam "
          f"{args.burst_beam} at once, a one-line request 0.5 s later, /health every 50 ms; "
          f"queue limit {args.queue_tokens} source tokens, loopback {args.server_args}")
    print("| batching | 1-line idle s | 1-line in burst s (its 503s) | x idle | 503 p50 / p99 "
          "ms | /health p50 / p99 ms | accepted | burst lines/s | mismatched | peak MB |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results.values():
        print(f"| {r['batching']} | {r['small_idle_s']:.2f} | {r['small_latency_s']:.2f} "
              f"({r['small_refusals']}) | {r['small_over_idle']:.1f} | "
              f"{r['refusal_p50_ms']:.0f} / "
              f"{r['refusal_p99_ms']:.0f} | {r['health_p50_ms']:.0f} / "
              f"{r['health_p99_ms']:.0f} | {r['accepted']} of {r['requests']} | "
              f"{r['burst_lines_per_s']:.1f} | {r['accepted_lines_mismatched']} of "
              f"{r['accepted_lines']} | {r['rss_mb_peak']:.0f} |")
    if len(results) == 2:
        step, batch = results["step"], results["batch"]
        print(f"step / batch burst throughput: "
              f"{step['burst_lines_per_s'] / batch['burst_lines_per_s']:.2f}x")


def _print_overload(args, results: dict) -> None:
    fair, over = results["fairness"], results["overload"]
    print(f"queue limit {args.queue_tokens} source tokens; requests of {args.burst_lines} "
          f"lines at beam {args.burst_beam}, loopback")
    print(f"fairness: a 1-line request 0.5 s into a burst of {fair['burst_requests']} requests "
          f"({fair['burst_lines']} lines): {fair['small_latency_s']:.2f} s (status "
          f"{fair['small_status']}); burst requests p50 {fair['burst_latency_p50_s']:.2f} s, "
          f"last {fair['burst_latency_max_s']:.2f} s")
    print(f"overload: {over['requests']} requests ({over['source_tokens']} source tokens, 4x the "
          f"queue): {over['refused']} refused with 503 (p50 {over['refusal_p50_ms']:.1f} ms, p99 "
          f"{over['refusal_p99_ms']:.1f} ms), {over['accepted']} accepted, "
          f"{over['accepted_lines_mismatched']} of {over['accepted_lines']} accepted lines "
          f"differ from the Python API, other statuses {over['other_statuses']}")
    print(f"probes (one request after another while the queue is full): "
          f"{over['probe_refused']} of {over['probes']} refused, p50 "
          f"{over['probe_refusal_p50_ms']:.1f} ms, p99 {over['probe_refusal_p99_ms']:.1f} ms")
    print(f"server memory: {over['rss_mb_before']:.0f} MB before, {over['rss_mb_peak']:.0f} MB "
          f"peak, {over['rss_mb_after']:.0f} MB after")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--data", required=True, help="prepared data directory")
    p.add_argument("--split", default="test_2016_flickr")
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--requests", type=int, default=50, help="requests per client")
    p.add_argument("--beam", type=int, default=4)
    p.add_argument("--json", help="write the results here")
    p.add_argument("--scenario", default="clients", choices=["clients", "overload", "burst"],
                   help="clients: many one-line clients, dynamic vs one at a time; overload: "
                        "the fairness and 4x-the-queue bursts; burst: a burst and a one-line "
                        "request behind it, step- against batch-level batching")
    p.add_argument("--burst-requests", type=int, default=60,
                   help="burst: requests sent at once")
    p.add_argument("--server-args", default="",
                   help="burst: more ranmt serve options for every server, e.g. "
                        "'--max-batch-lines 16'")
    p.add_argument("--batching", nargs="+", default=["step", "batch"],
                   choices=["step", "batch"], help="burst: the servers' --batching to compare")
    p.add_argument("--queue-tokens", type=int, default=32000,
                   help="overload: the server's --max-queued-tokens")
    p.add_argument("--burst-lines", type=int, default=32, help="overload: lines per request")
    p.add_argument("--burst-beam", type=int, default=8, help="overload: beam of the bursts")
    p.add_argument("--server-src", metavar="DIR",
                   help="run the server from this src/ folder (another checkout, for "
                        "before/after measurements)")
    args = p.parse_args(argv)
    if args.scenario == "burst":
        translator = Translator.load(args.checkpoint, device="cpu", beam=args.burst_beam)
        sentences = raw_text(args.data, args.split, "src")
        results = {mode: run_burst(args, sentences, translator, mode) for mode in args.batching}
        _print_burst(args, results)
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1), encoding="utf-8")
        return
    if args.scenario == "overload":
        translator = Translator.load(args.checkpoint, device="cpu", beam=args.burst_beam)
        results = run_overload(args, raw_text(args.data, args.split, "src"), translator)
        _print_overload(args, results)
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1), encoding="utf-8")
        return
    if args.clients < 1 or args.requests < 1 or args.clients * args.requests > 20000:
        raise SystemExit("--clients and --requests must be >= 1 (at most 20,000 requests)")
    sentences = raw_text(args.data, args.split, "src")[: args.clients * args.requests]
    translator = Translator.load(args.checkpoint, device="cpu", beam=args.beam)
    expected = dict(zip(sentences, translator.translate(sentences)))
    results = {mode: run_mode(args, mode, sentences, expected) for mode in MODES}
    results["throughput_ratio_dynamic_over_one_at_a_time"] = (
        results["dynamic"]["requests_per_s"] / results["one-at-a-time"]["requests_per_s"])
    print(f"{args.clients} clients x {args.requests} requests (one sentence each, beam "
          f"{args.beam}), loopback")
    print("| mode | requests/s | p50 ms | p99 ms | batches | lost | mismatched |")
    print("|---|---|---|---|---|---|---|")
    for mode in MODES:
        r = results[mode]
        print(f"| {mode} | {r['requests_per_s']:.1f} | {r['p50_ms']:.0f} | {r['p99_ms']:.0f} | "
              f"{r['batches']} | {r['lost']} | {r['mismatched']} |")
    results["throughput_ratio_dynamic_over_batch_level"] = (
        results["dynamic"]["requests_per_s"] / results["batch-level"]["requests_per_s"])
    print(f"dynamic / one-at-a-time throughput: "
          f"{results['throughput_ratio_dynamic_over_one_at_a_time']:.2f}x; dynamic (step-level "
          f"batching) / batch-level: {results['throughput_ratio_dynamic_over_batch_level']:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1), encoding="utf-8")


if __name__ == "__main__":
    main()
