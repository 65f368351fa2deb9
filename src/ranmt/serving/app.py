"""``ranmt serve``: trained models behind an HTTP API (FastAPI + uvicorn), batched dynamically.

Endpoints (bodies and bounds: :mod:`ranmt.serving.schema`, ``/openapi.json``, docs/SERVING.md):

* ``POST /translate`` ``{"text": ["...", ...]}`` plus optional ``model``, ``beam``, ``nbest``,
  ``attention``, ``alignment``, ``prefix`` (one target prefix per line), ``sampling``
  (``topk``/``topp``/``eps`` with ``topk``, ``topp``, ``epsilon``, ``temperature``,
  ``seed``) and ``timeout_s`` -> ``{"model": NAME, "translations": [...]}``, one entry per
  input line in input order: ``{"text", "score"}`` plus ``"nbest"`` when ``nbest`` > 1,
  ``"alignment"`` and ``"attention"`` when asked (``ranmt.analysis.maps``).
* ``POST /score`` ``{"source": [...], "target": [...]}``: the model's log-probabilities of
  given translations (``ranmt.inference.scoring``).
* ``GET /models``, ``GET /health`` (alive), ``GET /ready`` (models loaded, workers running),
  ``GET /metrics`` (Prometheus).
* ``GET /``: the attention explorer (static files shipped in ``ranmt/serving/explorer``).

Each model has one bounded queue and worker (:mod:`ranmt.serving.batching`): admission up to
``max_queued_tokens`` (503 + ``Retry-After`` beyond), deadlines (504), departed clients'
work dropped, and batches formed from the waiting requests in turns, so a small request is
not held behind a burst. Decoding runs in a worker process per model (or a thread), so the
event loop keeps accepting meanwhile. Bad input is refused before it reaches a batch with
a 4xx ``{"error": "..."}`` naming the problem; an error inside decoding fails only the
requests of that batch (500 with the message) and the server keeps serving.

Faults (docs/SERVING.md, "What happens when things fail"): every accepted request ends by
its deadline; each model's scheduling loop runs under a supervisor that answers its jobs
500 and restarts it if it raises; decoding workers are watched and replaced
(:mod:`ranmt.serving.supervisor`); a model that cannot decode refuses at once (503 +
``Retry-After``) and ``/ready``, ``/models`` and ``/metrics`` say which and why. SIGTERM
(and Ctrl-C) start a graceful shutdown: new requests get 503, those in flight have
``--drain-s`` seconds to finish, the rest get a clean 503, then the workers stop and the
process exits 0. The server binds to 127.0.0.1 unless ``--host`` says otherwise.

This module is the HTTP side (routes, middleware, request parsing, answers; the answers'
entries are built by :mod:`ranmt.serving.responses`; ``serve``, the process around the app,
is :mod:`ranmt.serving.server`); what runs behind it (the models, their queues and
supervised workers, draining, metrics) is :mod:`ranmt.serving.runner`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import hmac
import time
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from fastapi.staticfiles import StaticFiles
from starlette.datastructures import Headers

from ranmt.config import decode_conflict
from ranmt.inference.translator import InputTooLongError, Translator
from ranmt.runtime.memory import freeze_startup_heap
from ranmt.serving.batching import UnavailableError, Work
from ranmt.serving.limits import ServeLimits
from ranmt.serving.responses import response_entries
from ranmt.serving.runner import ServedModels, ServeMetrics
from ranmt.serving.schema import (
    ErrorResponse,
    RequestError,
    ScoreResponse,
    TranslateResponse,
    parse_translate,
    request_model,
    score_request_model,
)

# ------------------------------------------------------------------------------ validation

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


def translate_model(limits: ServeLimits):
    """The pydantic model of a ``/translate`` body under ``limits`` (built once per limits
    and declaration of the decoding options)."""
    from ranmt.config import decode_fields

    declared = tuple((spec.name, id(spec)) for spec in decode_fields())
    return _translate_model(limits.max_lines, limits.max_chars, limits.max_beam,
                            limits.request_timeout_s, declared)


@functools.lru_cache(maxsize=8)
def _translate_model(max_lines: int, max_chars: int, max_beam: int, timeout_s: float,
                     declared: tuple):
    """``declared``: DecodeConfig's fields (name, declaration's id) now, a key only: a
    processor that declares an option (``ranmt.inference.processors``) changes it."""
    return request_model(max_lines, max_chars, max_beam, timeout_s)


@functools.lru_cache(maxsize=8)
def _score_model(max_lines: int, max_chars: int, timeout_s: float):
    return score_request_model(max_lines, max_chars, timeout_s)


def score_model(limits: ServeLimits):
    """The pydantic model of a ``/score`` body under ``limits``."""
    return _score_model(limits.max_lines, limits.max_chars, limits.request_timeout_s)


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


def create_app(translators: dict[str, Translator], limits: ServeLimits | None = None,
               api_key: str | None = None, freeze_heap: bool = False):
    """The FastAPI application serving ``translators`` (name -> loaded model); with
    ``api_key`` every endpoint but ``/health`` requires ``Authorization: Bearer KEY``.
    ``freeze_heap``: once the models are warm, :func:`freeze_startup_heap` (``ranmt serve`` does;
    a test process that builds many apps had better not)."""
    if not translators:
        raise ValueError("serve needs at least one model")
    served = ServedModels(translators, limits or ServeLimits())

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await served.start()
        if freeze_heap:
            freeze_startup_heap()
        yield
        served.stop()

    app = FastAPI(title="ranmt", lifespan=lifespan,
                  description="Neural machine translation with pluggable attention. "
                              "Every refused request gets {\"error\": \"...\"}.")
    _document_bodies(app, {"/translate": ("TranslateRequest", translate_model(served.limits)),
                           "/score": ("ScoreRequest", score_model(served.limits))})
    app.state.served = served  # the models, their queues and workers (for introspection)
    _add_refusals_and_metrics(app, served.metrics, api_key)
    _add_status_endpoints(app, served)
    _add_work_endpoints(app, served)
    static = Path(__file__).parent / "explorer"
    if static.is_dir():
        app.mount("/", StaticFiles(directory=static, html=True), name="explorer")
    return app


def _add_refusals_and_metrics(app: FastAPI, metrics: ServeMetrics, api_key: str | None) -> None:
    """Refusals as ``{"error": ...}`` responses, the API key check, and per-endpoint request
    counts and latencies."""

    @app.exception_handler(RequestError)
    async def refused(_request: Request, err: RequestError):
        headers = {"Retry-After": str(err.retry_after)} if isinstance(err, UnavailableError) \
            else None
        return JSONResponse({"error": err.message}, status_code=err.status, headers=headers)

    app.add_middleware(_Gate, metrics=metrics, api_key=api_key)


class _Gate:
    """Plain ASGI middleware in front of every route: 405 for a wrong method (the explorer
    mounted at "/" would answer it with 404), 401 without the API key, and per-endpoint
    request counts and latencies. Starlette's ``@app.middleware("http")`` did the same at
    about 0.75 ms of event loop a request (a task group and memory streams per call), which
    a burst of refusals queues behind (SERVING.md, "Run 5")."""

    def __init__(self, app, metrics: ServeMetrics, api_key: str | None):
        self.app = app
        self.metrics = metrics
        self.api_key = api_key
        self.methods: dict[str, set[str]] = {}  # path -> allowed methods, read once

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        if not self.methods:  # the routes are all added by the first request
            self.methods.update(_allowed_methods(scope["app"]))
        status = 500  # what an exception escaping the app becomes

        async def send_and_note(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        path = scope["path"]
        try:
            refusal = self._refusal(scope)
            if refusal is None:
                await self.app(scope, receive, send_and_note)
            else:
                await refusal(scope, receive, send_and_note)
        finally:
            endpoint = path if path in _ENDPOINTS else "static"
            self.metrics.requests.labels(endpoint, str(status)).inc()
            self.metrics.latency.labels(endpoint).observe(time.perf_counter() - started)

    def _refusal(self, scope) -> JSONResponse | None:
        """The 405 or 401 response a request gets before any route sees it, else None."""
        path, method = scope["path"], scope["method"]
        allowed = self.methods.get(path)
        if allowed and method not in allowed:
            return JSONResponse(
                {"error": f"{method} is not allowed on {path}; use "
                          f"{' or '.join(sorted(allowed))}"},
                status_code=405, headers={"Allow": ", ".join(sorted(allowed))})
        if self.api_key is not None and path != "/health" and \
                not _authorized(Headers(scope=scope).get("authorization"), self.api_key):
            return JSONResponse({"error": "missing or wrong API key: send "
                                          "'Authorization: Bearer KEY'"}, status_code=401,
                                headers={"WWW-Authenticate": "Bearer"})
        return None


def _beam_and_nbest(translator: Translator, parsed, limits: ServeLimits
                    ) -> tuple[int | None, int | None]:
    """A request's beam and nbest: as given, else the checkpoint's ``decode.beam`` /
    ``decode.nbest`` (what ``ranmt translate`` uses), the beam capped at ``--max-beam``;
    nbest above the beam is a 400 (under sampling the beam is not used)."""
    defaults = translator.decode_config
    if parsed.sampling is not None:
        return parsed.beam, parsed.nbest if parsed.nbest is not None else defaults.nbest
    beam = parsed.beam if parsed.beam is not None else min(defaults.beam, limits.max_beam)
    nbest = parsed.nbest if parsed.nbest is not None else min(defaults.nbest, beam)
    shortlist = defaults.shortlist if parsed.shortlist is None else parsed.shortlist
    conflict = decode_conflict(
        dataclasses.replace(defaults, beam=beam, nbest=nbest, shortlist=shortlist),
        lambda name: f"'{name}'")
    if conflict is not None:
        raise RequestError(400, conflict)
    return beam, nbest


def _check_shortlist(name: str, translator: Translator, parsed) -> None:
    """A request asking for the lexical shortlist of a model that has none is a 400 (the
    model's worker would fail on it)."""
    if parsed.shortlist:
        try:
            translator.lexical_shortlist()
        except (FileNotFoundError, ValueError):
            raise RequestError(400, f"'shortlist': model '{name}' has no lexical shortlist "
                                    "(build one with `ranmt shortlist`)") from None


def _decoding_options(parsed) -> dict[str, Any]:
    """The served DecodeConfig fields of a parsed request (their declarations list them):
    those of the sampling group only when it samples, None (the checkpoint's) left out."""
    from ranmt.config import decode_fields

    return {spec.name: getattr(parsed, spec.name) for spec in decode_fields(served=True)
            if parsed.sampling is not None or spec.metadata["group"] != "sampling"}


def _allowed_methods(app: FastAPI) -> dict[str, set[str]]:
    """Path -> the HTTP methods the app's routes (not its mounts) accept there."""
    known: dict[str, set[str]] = {}
    for route in app.routes:
        if getattr(route, "methods", None):
            known.setdefault(route.path, set()).update(route.methods)
    return known


def _add_status_endpoints(app: FastAPI, served: ServedModels) -> None:
    """``GET /health``, ``/ready``, ``/metrics`` and ``/models``."""
    translators, batchers, limits = served.translators, served.batchers, served.limits

    @app.get("/health")
    async def health() -> dict:
        """Alive: the process answers (with request and batch counters)."""
        return {"status": "ok", "models": list(translators),
                "requests": sum(b.requests for b in batchers.values()),
                "batches": sum(b.batches for b in batchers.values()),
                "in_flight": sum(b.in_flight for b in batchers.values())}

    @app.get("/ready", responses={
        200: {"description": "every model can decode"},
        503: {"description": "a model cannot decode now (see 'down'), or the server is "
                             "shutting down"}})
    async def ready():
        """Ready: every model's scheduling loop runs and its decoding worker is ready, and
        the server is not shutting down (else 503); ``down``: model -> why not."""
        running = served.running()
        down = {name: state["reason"] or state["state"]
                for name, state in served.states().items() if not served.model_ready(name)}
        body = {"ready": running, "models": list(batchers), "down": down}
        return JSONResponse(body, status_code=200 if running else 503)

    @app.get("/metrics", response_class=PlainTextResponse, responses={
        200: {"description": "Prometheus text exposition format",
              "content": {"text/plain": {"schema": {"type": "string"}}}}})
    async def prometheus_metrics():
        """The Prometheus metrics (``ranmt_*``)."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(generate_latest(served.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/models")
    async def models() -> dict:
        """The served models, their state (ready, loading, waiting, draining, ...; with the
        reason when not ready) and the request limits."""
        states = served.states()
        return {"default": served.default, "models": [
            {"name": name, "arch": t.config.model.arch,
             "max_positions": t.config.model.max_positions,
             "quantized": _quantized(t), "device": str(t.device), **states.get(name, {})}
            for name, t in translators.items()],
            "limits": {"max_lines": limits.max_lines, "max_chars": limits.max_chars,
                       "max_beam": limits.max_beam,
                       "max_queued_tokens": limits.max_queued_tokens,
                       "request_timeout_s": limits.request_timeout_s}}


_REFUSALS = {
    400: {"model": ErrorResponse, "description": "a field is wrong (named)"},
    401: {"model": ErrorResponse, "description": "missing or wrong API key"},
    404: {"model": ErrorResponse, "description": "unknown model"},
    413: {"model": ErrorResponse, "description": "too many lines or characters"},
    415: {"model": ErrorResponse, "description": "the body is not declared as JSON"},
    500: {"model": ErrorResponse, "description": "decoding failed, or the model's decoding "
                                                 "worker ended while decoding this request"},
    503: {"model": ErrorResponse, "description": "the model's queue is full, the model cannot "
                                                 "decode now, or the server is shutting down; "
                                                 "see Retry-After"},
    504: {"model": ErrorResponse, "description": "the request passed its deadline "
                                                 "(timeout_s or --request-timeout)"}}
"""The refusals ``/translate`` and ``/score`` document in the OpenAPI schema."""


def _add_work_endpoints(app: FastAPI, served: ServedModels) -> None:
    """``POST /translate`` and ``POST /score``: parsed, queued with their model, answered."""
    limits = served.limits

    @app.post("/translate", response_model=None, responses={
        200: {"model": TranslateResponse, "description": "one translation per line"},
        **_REFUSALS})
    async def translate(request: Request):
        parsed = await _read_body(request, limits, translate_model(limits))
        name, translator = served.pick(parsed.model, parsed.text)
        ids = _source_ids(translator, parsed.text)
        prefixes = None
        if parsed.prefix is not None:
            prefixes = _target_ids(translator, parsed.prefix, "prefix")
        beam, nbest = _beam_and_nbest(translator, parsed, limits)
        _check_shortlist(name, translator, parsed)
        parsed = parsed.model_copy(update={"beam": beam, "nbest": nbest})
        work = Work.translate(**_decoding_options(parsed))
        results = await served.run_job(request, name, ids, work, prefixes, parsed.timeout_s)
        if isinstance(results, Response):
            return results
        translations = await asyncio.get_running_loop().run_in_executor(
            served.executor, response_entries, translator, ids, results, parsed)
        return {"model": name, "translations": translations}

    @app.post("/score", response_model=None, responses={
        200: {"model": ScoreResponse, "description": "one score per (source, target) pair"},
        **_REFUSALS})
    async def score(request: Request):
        """The model's log-probabilities of given translations (teacher-forced)."""
        parsed = await _read_body(request, limits, score_model(limits))
        name, translator = served.pick(parsed.model, parsed.source)
        ids = _source_ids(translator, parsed.source)
        targets = _target_ids(translator, parsed.target, "target")
        results = await served.run_job(request, name, ids, Work("score"), targets,
                                       parsed.timeout_s)
        if isinstance(results, Response):
            return results
        pieces = translator.tgt_vocab.processor.id_to_piece
        return {"model": name, "scores": [
            None if pair is None else
            {"normalized": pair.normalized, "total": pair.total,
             "token_logprobs": pair.token_logprobs,
             "tokens": [pieces(i) for i in target] + ["</s>"]}
            for pair, target in zip(results, targets)]}


_ENDPOINTS = {"/translate", "/score", "/models", "/health", "/ready", "/metrics"}


async def _read_body(request: Request, limits: ServeLimits, body_model):
    """The request's body validated by ``body_model`` (4xx :class:`RequestError`s)."""
    _check_content_type(request.headers.get("content-type"))
    declared = request.headers.get("content-length", "0")
    if declared.isdigit():  # refused before the body is read
        check_body_size(int(declared), limits)
    body = await request.body()
    check_body_size(len(body), limits)
    return parse_translate(body, body_model)


def _source_ids(translator: Translator, lines: list[str]) -> list[list[int]]:
    try:
        return translator.check_lengths(translator.encode_sources(lines))
    except InputTooLongError as err:
        raise RequestError(400, str(err)) from None


def _target_ids(translator: Translator, lines: list[str], field: str) -> list[list[int]]:
    """Target-side lines (prefixes, targets to score) as ids, each within the model's limit."""
    ids = translator.encode_targets(lines)
    limit = translator.config.model.max_positions - 1
    for number, seq in enumerate(ids, 1):
        if len(seq) > limit:
            raise RequestError(400, f"'{field}' line {number}: {len(seq)} subwords, longer than "
                                    f"the model's limit of {limit}")
    return ids


def _document_bodies(app: FastAPI, bodies: dict[str, tuple[str, Any]]) -> None:
    """Put the body models (path -> (schema name, pydantic model); read from the raw body by
    :func:`parse_translate`, so FastAPI does not see them) into the app's OpenAPI schema,
    bounds included."""
    from fastapi.openapi.utils import get_openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version,
                                 description=app.description, routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for path, (title, body_model) in bodies.items():
                body = body_model.model_json_schema(
                    ref_template="#/components/schemas/{model}")
                components.update(body.pop("$defs", {}))
                components[title] = body
                schema["paths"][path]["post"]["requestBody"] = {
                    "required": True, "content": {"application/json": {
                        "schema": {"$ref": f"#/components/schemas/{title}"}}}}
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi

API_KEY_ENV = "RANMT_API_KEY"


def _authorized(header: str | None, api_key: str) -> bool:
    """Whether an Authorization header carries ``api_key`` (compared in constant time)."""
    scheme, _, token = (header or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(),
                                                                api_key.encode())


def read_api_key(path: str | None) -> str | None:
    """The API key from ``path`` (first line), else ``$RANMT_API_KEY``, else None."""
    import os

    if path:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
        key = lines[0].strip() if lines else ""
        if not key:
            raise ValueError(f"--api-key-file {path}: the first line is empty")
        return key
    return os.environ.get(API_KEY_ENV) or None


def _check_content_type(header: str | None) -> None:
    """415 for a body declared as anything but JSON (a missing header is taken as JSON)."""
    if header is None:
        return
    media = header.split(";", 1)[0].strip().lower()
    if media != "application/json" and not media.endswith("+json"):
        raise RequestError(415, f"Content-Type '{media}': send the body as application/json")


def _quantized(translator: Translator) -> bool:
    from ranmt.inference.quantize import is_quantized

    return is_quantized(translator.model)
