"""``ranmt serve``: trained models behind an HTTP API (FastAPI + uvicorn), batched dynamically.

Endpoints:

* ``POST /translate`` ``{"text": ["...", ...], "model": NAME, "beam": 4, "nbest": 1,
  "attention": false}`` (only ``text`` required) -> ``{"model": NAME, "translations": [...]}``,
  one entry per input line in input order: ``{"text", "score"}`` plus ``"nbest"`` (a list of
  ``{"text", "score"}``) when ``nbest`` > 1 and ``"attention"`` when asked (see
  :func:`attention_maps`).
* ``GET /models``: the loaded models by name, with their architecture and limits.
* ``GET /health``: ``{"status": "ok", ...}`` with request and batch counters.
* ``GET /``: the attention explorer (static files shipped in ``ranmt/explorer``).

Dynamic batching: each model has one queue. A worker takes the first waiting request, keeps
collecting requests for ``batch_window_ms`` milliseconds (or until ``max_batch_tokens``
source tokens), decodes requests with the same beam and n-best as one batch in a worker
thread (the event loop keeps accepting meanwhile, so the next batch forms during decoding),
and hands every request its own lines back. Bad input is refused before it reaches a batch
with a 4xx ``{"error": "..."}`` naming the problem; an error inside decoding fails only the
requests of that batch (500 with the message) and the server keeps serving. SIGTERM (and
Ctrl-C) stop accepting connections, finish the requests in flight and exit 0 (uvicorn's
graceful shutdown). The server binds to 127.0.0.1 unless ``--host`` says otherwise.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from fastapi.staticfiles import StaticFiles

from ranmt.data.batching import pad_sources
from ranmt.model import BOS_ID
from ranmt.translator import InputTooLongError, Translator


@dataclass
class ServeLimits:
    """What one request may ask for, and how requests are batched."""

    max_lines: int = 64
    max_chars: int = 2000
    """Characters per input line."""
    max_beam: int = 16
    batch_window_ms: float = 5.0
    """How long a batch keeps collecting requests after its first one arrived."""
    max_batch_tokens: int = 8000
    """Source tokens per dynamic batch (a larger single request still decodes alone)."""


class RequestError(Exception):
    """A request the server refuses: HTTP ``status`` and a message naming the problem."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


# ------------------------------------------------------------------------------ validation

_FIELDS = {"text", "model", "beam", "nbest", "attention"}


@dataclass
class TranslateRequest:
    text: list[str]
    model: str | None = None
    beam: int = 4
    nbest: int = 1
    attention: bool = False


def max_body_bytes(limits: ServeLimits) -> int:
    """The largest body a valid request can have (4 bytes per character of UTF-8, JSON
    escaping of every character, room for the other fields)."""
    return limits.max_lines * (limits.max_chars * 6 + 16) + 4096


def check_body_size(size: int, limits: ServeLimits) -> None:
    """:class:`RequestError` (413) for a body larger than any valid request."""
    if size > max_body_bytes(limits):
        raise RequestError(413, f"request body of {size} bytes; at most "
                                f"{max_body_bytes(limits)} for {limits.max_lines} lines of "
                                f"{limits.max_chars} characters")


def parse_request(body: bytes, limits: ServeLimits) -> TranslateRequest:
    """Validate a ``/translate`` body field by field; :class:`RequestError` (400) otherwise."""
    check_body_size(len(body), limits)
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise RequestError(400, f"invalid JSON: {err}") from None
    if not isinstance(data, dict):
        raise RequestError(400, "the body must be a JSON object with a 'text' list")
    unknown = sorted(set(data) - _FIELDS)
    if unknown:
        raise RequestError(400, f"unknown field(s) {unknown}; allowed: {sorted(_FIELDS)}")
    if "text" not in data:
        raise RequestError(400, "missing field 'text' (a list of lines to translate)")
    text = data["text"]
    if not isinstance(text, list) or not all(isinstance(line, str) for line in text):
        raise RequestError(400, "'text' must be a list of strings")
    if not text:
        raise RequestError(400, "'text' is empty: give at least one line")
    if len(text) > limits.max_lines:
        raise RequestError(413, f"'text' has {len(text)} lines; at most {limits.max_lines} "
                                "per request")
    for number, line in enumerate(text, 1):
        if len(line) > limits.max_chars:
            raise RequestError(413, f"line {number} has {len(line)} characters; at most "
                                    f"{limits.max_chars}")
    model = data.get("model")
    if model is not None and not isinstance(model, str):
        raise RequestError(400, "'model' must be a string (a name from GET /models)")
    beam = _integer(data, "beam", 4, 1, limits.max_beam)
    nbest = _integer(data, "nbest", 1, 1, beam)
    attention = data.get("attention", False)
    if not isinstance(attention, bool):
        raise RequestError(400, "'attention' must be true or false")
    return TranslateRequest(text, model, beam, nbest, attention)


def _integer(data: dict, name: str, default: int, low: int, high: int) -> int:
    value = data.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(400, f"'{name}' must be an integer")
    if not low <= value <= high:
        bound = "the beam size" if name == "nbest" else str(high)
        raise RequestError(400, f"'{name}' must be between {low} and {bound}, not {value}")
    return value


# ------------------------------------------------------------------------------ attention


def attention_maps(translator: Translator, src_ids: list[int], tgt_ids: list[int]) -> dict:
    """The weights of one translation, teacher-forced on its output: per component a list
    over layers of (H, queries, keys) nested lists (rounded to 4 decimals), with the tokens
    that label the axes. Source keys: the source pieces and ``</s>``; target queries: the
    output pieces and ``</s>`` (query i predicts output token i). Components: ``cross``,
    ``encoder_self``, ``decoder_self`` (a layer without the component gives null). For
    input-agnostic variants (RAN, Syn-R, hard-coded) the self-attention weights are the
    layer's (softmaxed) matrix itself, cut to the sentence."""
    model = translator.model
    src = pad_sources([src_ids]).to(translator.device)  # (1, S) with EOS
    tgt_in = torch.tensor([[BOS_ID] + tgt_ids], device=translator.device)  # (1, T)
    with torch.inference_mode():
        _, weights = model(src, tgt_in, need_weights=True)

    def layers(items: list) -> list:
        return [None if w is None else torch.round(w[0].float(), decimals=4).tolist()
                for w in items]

    src_pieces = translator.src_vocab.processor
    tgt_pieces = translator.tgt_vocab.processor
    cfg = translator.config.model
    return {
        "source_tokens": [src_pieces.id_to_piece(i) for i in src_ids] + ["</s>"],
        "target_tokens": [tgt_pieces.id_to_piece(i) for i in tgt_ids] + ["</s>"],
        "encoder_self": layers(weights["encoder"]),
        "decoder_self": layers([w.get("self") for w in weights["decoder"]]),
        "cross": layers([w.get("cross") for w in weights["decoder"]]),
        "kinds": {"encoder_self": cfg.encoder.self_attention,
                  "decoder_self": cfg.decoder.self_attention,
                  "cross": cfg.decoder.cross_attention},
    }


# ------------------------------------------------------------------------------ batching


@dataclass
class _Job:
    ids: list[list[int]]
    beam: int
    nbest: int
    future: asyncio.Future
    tokens: int = field(init=False)

    def __post_init__(self):
        self.tokens = sum(len(seq) + 1 for seq in self.ids)


class Batcher:
    """One model's queue and worker: requests arriving within the batch window decode as
    one batch (per beam/n-best setting), in the single decoding thread."""

    def __init__(self, translator: Translator, limits: ServeLimits,
                 executor: concurrent.futures.Executor):
        self.translator = translator
        self.limits = limits
        self.executor = executor
        self.queue: asyncio.Queue[_Job] = asyncio.Queue()
        self.batches = 0
        self.requests = 0
        self.in_flight = 0

    async def submit(self, ids: list[list[int]], beam: int, nbest: int) -> list:
        """Queue token ids; returns their n-best lists, in order, once their batch is done."""
        job = _Job(ids, beam, nbest, asyncio.get_running_loop().create_future())
        self.in_flight += 1
        try:
            await self.queue.put(job)
            return await job.future
        finally:
            self.in_flight -= 1

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            jobs = [await self.queue.get()]
            tokens = jobs[0].tokens
            deadline = loop.time() + self.limits.batch_window_ms / 1000
            while tokens < self.limits.max_batch_tokens:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    break
                try:
                    job = await asyncio.wait_for(self.queue.get(), remaining)
                except asyncio.TimeoutError:
                    break
                jobs.append(job)
                tokens += job.tokens
            groups: dict[tuple[int, int], list[_Job]] = {}
            for job in jobs:
                groups.setdefault((job.beam, job.nbest), []).append(job)
            for (beam, nbest), group in groups.items():
                await self._decode(loop, group, beam, nbest)

    async def _decode(self, loop, group: list[_Job], beam: int, nbest: int) -> None:
        flat = [seq for job in group for seq in job.ids]
        try:
            results = await loop.run_in_executor(
                self.executor, lambda: self.translator.translate_ids(flat, beam=beam,
                                                                     nbest=nbest))
        except Exception as err:  # noqa: BLE001 (reported to the requests of this batch)
            for job in group:
                if not job.future.done():
                    job.future.set_exception(err)
            return
        self.batches += 1
        self.requests += len(group)
        start = 0
        for job in group:
            if not job.future.done():
                job.future.set_result(results[start: start + len(job.ids)])
            start += len(job.ids)


# ------------------------------------------------------------------------------ the app


def model_names(checkpoints: list[str]) -> dict[str, str]:
    """``NAME=PATH`` or ``PATH`` (named after its folder, or the folder above a checkpoint
    folder such as ``best``) -> {name: path}; duplicate names are an error."""
    names: dict[str, str] = {}
    for spec in checkpoints:
        name, sep, path = spec.partition("=")
        if not sep:
            path = spec
            parts = [p for p in Path(spec).parts if p not in ("best", "last", "checkpoints")]
            name = parts[-1] if parts else spec
        if name in names:
            raise ValueError(f"two models are named '{name}': name them with NAME=PATH")
        names[name] = path
    return names


def create_app(translators: dict[str, Translator], limits: ServeLimits | None = None):
    """The FastAPI application serving ``translators`` (name -> loaded model)."""
    if not translators:
        raise ValueError("serve needs at least one model")
    limits = limits or ServeLimits()
    executor = concurrent.futures.ThreadPoolExecutor(max_workers=1,
                                                     thread_name_prefix="ranmt-decode")
    batchers: dict[str, Batcher] = {}
    default_model = next(iter(translators))

    @contextlib.asynccontextmanager
    async def lifespan(app):
        for name, translator in translators.items():
            batchers[name] = Batcher(translator, limits, executor)
        workers = [asyncio.create_task(b.run()) for b in batchers.values()]
        yield
        for worker in workers:
            worker.cancel()
        executor.shutdown(wait=True)

    app = FastAPI(title="ranmt", lifespan=lifespan)

    @app.exception_handler(RequestError)
    async def refused(_request: Request, err: RequestError):
        return JSONResponse({"error": err.message}, status_code=err.status)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "models": list(translators),
                "requests": sum(b.requests for b in batchers.values()),
                "batches": sum(b.batches for b in batchers.values()),
                "in_flight": sum(b.in_flight for b in batchers.values())}

    @app.get("/models")
    async def models() -> dict:
        return {"default": default_model, "models": [
            {"name": name, "arch": t.config.model.arch,
             "max_positions": t.config.model.max_positions,
             "quantized": _quantized(t), "device": str(t.device)}
            for name, t in translators.items()],
            "limits": {"max_lines": limits.max_lines, "max_chars": limits.max_chars,
                       "max_beam": limits.max_beam}}

    @app.post("/translate")
    async def translate(request: Request):
        declared = request.headers.get("content-length", "0")
        if declared.isdigit():  # refused before the body is read
            check_body_size(int(declared), limits)
        parsed = parse_request(await request.body(), limits)
        name = parsed.model or default_model
        if name not in translators:
            raise RequestError(404, f"unknown model '{name}'; loaded: {sorted(translators)}")
        translator = translators[name]
        try:
            ids = translator.check_lengths(
                [translator.src_vocab.encode([line.strip()])[0] if line.strip() else []
                 for line in parsed.text])
        except InputTooLongError as err:
            raise RequestError(400, str(err)) from None
        try:
            results = await batchers[name].submit(ids, parsed.beam, parsed.nbest)
            translations = await asyncio.get_running_loop().run_in_executor(
                executor, _entries, translator, ids, results, parsed)
        except Exception as err:  # noqa: BLE001 (decoding failed: this request only)
            return JSONResponse({"error": f"decoding failed: {type(err).__name__}: {err}"},
                                status_code=500)
        return {"model": name, "translations": translations}

    static = Path(__file__).parent / "explorer"
    if static.is_dir():
        app.mount("/", StaticFiles(directory=static, html=True), name="explorer")
    return app


def _quantized(translator: Translator) -> bool:
    from ranmt.quantize import is_quantized

    return is_quantized(translator.model)


def _entries(translator: Translator, ids: list[list[int]], results: list,
             request: TranslateRequest) -> list[dict[str, Any]]:
    """The response entries of one request (attention maps computed here, after decoding)."""
    entries = []
    for src_ids, hyps in zip(ids, results):
        texts = [(translator.tgt_vocab.decode([tokens])[0], score) for tokens, score in hyps]
        entry: dict[str, Any] = {"text": texts[0][0], "score": _finite(texts[0][1])}
        if request.nbest > 1:
            entry["nbest"] = [{"text": text, "score": _finite(score)} for text, score in texts]
        if request.attention:
            entry["attention"] = (attention_maps(translator, src_ids, hyps[0][0])
                                  if src_ids else None)
        entries.append(entry)
    return entries


def _finite(score: float) -> float | None:
    return score if score == score and abs(score) != float("inf") else None


def launch_server(args: list[str], wait_s: float = 20.0) -> tuple[subprocess.Popen, str]:
    """Start ``ranmt serve ARGS`` in a child process on a free loopback port and wait (up to
    ``wait_s``) until it answers ``GET /health``. Returns (process, base URL); the caller
    stops the process. For tests, load benchmarks and scripts that drive a real server.

    Raises ``RuntimeError`` (with the end of the server's error output) when the server
    exits or does not answer in time; the process is then stopped."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    # stderr goes to a file, not a pipe that nobody would drain while the server runs; the
    # child keeps its own handle when this one closes.
    with tempfile.TemporaryFile() as errors:
        process = subprocess.Popen([sys.executable, "-m", "ranmt", "serve", "--port",
                                    str(port), *args], stdout=subprocess.DEVNULL, stderr=errors)
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


def serve(checkpoints: list[str], host: str = "127.0.0.1", port: int = 8080,
          device: str = "auto", quantize: str = "none", limits: ServeLimits | None = None,
          log_level: str = "info") -> None:
    """Load the models and serve them until SIGTERM / Ctrl-C."""
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn re-raises a captured SIGTERM after its graceful shutdown (the process
        then dies of the signal); a requested stop of a finished shutdown exits 0."""

        def handle_exit(self, sig, frame) -> None:
            super().handle_exit(sig, frame)
            captured = getattr(self, "_captured_signals", None)
            if sig == signal.SIGTERM and captured and captured[-1] == sig:
                captured.pop()

    translators = {name: Translator.load(path, device=device, quantize=quantize)
                   for name, path in model_names(checkpoints).items()}
    app = create_app(translators, limits)
    Server(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                          timeout_graceful_shutdown=30)).run()
