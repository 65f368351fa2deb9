"""Load test of ``ranmt serve`` on loopback: concurrent clients, nothing lost, every response
with its request, throughput and latency, dynamic batching against one request at a time.

For each mode the script starts ``ranmt serve`` on a free loopback port with the given
checkpoint, then ``--clients`` threads each send ``--requests`` requests of one sentence
(distinct sentences of ``--split``, cycled) and check every answer against the translation
the Python API gives for that sentence (same model, same beam). Modes:

* ``dynamic``: the server's default batching (requests arriving within
  ``--batch-window-ms`` decode as one batch);
* ``one-at-a-time``: ``--batch-window-ms 0 --max-batch-tokens 1``, every request its own
  batch.

Printed (and written to ``--json``): requests/s, sentences/s, p50/p99 latency in ms, lost
and mismatched responses, batches formed, and the throughput ratio dynamic / one-at-a-time.

    python benchmarks/serve_load.py --checkpoint RUN --data DATA --split test_2016_flickr \\
        --clients 16 --requests 50
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
import urllib.request
from pathlib import Path

from ranmt.data.corpus import raw_text
from ranmt.serve import launch_server
from ranmt.translator import Translator

MODES = {"dynamic": [], "one-at-a-time": ["--batch-window-ms", "0", "--max-batch-tokens", "1"]}


def _post(url: str, payload: dict, timeout: float = 120) -> dict:
    request = urllib.request.Request(url, data=json.dumps(payload).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def run_mode(args, mode: str, sentences: list[str], expected: dict[str, str]) -> dict:
    server, base = launch_server(["--checkpoint", args.checkpoint, "--device", "cpu",
                                  "--max-lines", "1"] + MODES[mode], wait_s=60)
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


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--data", required=True, help="prepared data directory")
    p.add_argument("--split", default="test_2016_flickr")
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--requests", type=int, default=50, help="requests per client")
    p.add_argument("--beam", type=int, default=4)
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
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
    print(f"dynamic / one-at-a-time throughput: "
          f"{results['throughput_ratio_dynamic_over_one_at_a_time']:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1), encoding="utf-8")


if __name__ == "__main__":
    main()
