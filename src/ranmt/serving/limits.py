"""The server's limits, declared once: what one request may ask for and how requests are
batched (defaults, bounds, and the ``ranmt serve`` options derived from them).

A module of its own without heavy imports, so that building the command line does not load
the server (FastAPI, torch): ``ranmt --help`` stays fast.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields


def _limit(default, flag: str, help: str | None = None, low: float = 1, above: bool = False,
           metavar=None, high: float | None = None):
    """A field of :class:`ServeLimits`: its default, its ``ranmt serve`` flag and help, and
    its bounds: at least ``low`` (above it with ``above``), at most ``high`` if given."""
    return field(default=default, metadata={"flag": flag, "help": help, "low": low,
                                            "above": above, "metavar": metavar, "high": high})


def _choice(default: str, flag: str, choices: tuple[str, ...], help: str):
    """A field of :class:`ServeLimits` that takes one of ``choices``."""
    return field(default=default, metadata={"flag": flag, "help": help, "choices": choices,
                                            "metavar": None})


@dataclass
class ServeLimits:
    """What one request may ask for, and how requests are batched: the one declaration of
    the server's limits (defaults, bounds, and the ``ranmt serve`` options derived from
    them by :func:`add_limit_options`)."""

    max_lines: int = _limit(64, "--max-lines", "lines per request")
    max_chars: int = _limit(2000, "--max-chars", "characters per line")
    """Characters per input line."""
    max_beam: int = _limit(16, "--max-beam")
    batch_window_ms: float = _limit(5.0, "--batch-window-ms",
                                    "how long a batch collects concurrent requests", low=0)
    """How long a batch keeps collecting requests after its first one arrived."""
    max_batch_tokens: int = _limit(8000, "--max-batch-tokens",
                                   "source tokens per dynamic batch")
    """Source tokens per dynamic batch (a larger single request still decodes alone)."""
    max_batch_lines: int = _limit(
        64, "--max-batch-lines", "lines per dynamic batch (default 64, one decoding batch: a "
        "larger batch decodes no faster and delays every request in it)")
    """Lines per dynamic batch: one decoding batch (``decode.batch_size``'s default). A larger
    batch is decoded as several in a row anyway, so it gains no speed and holds every
    request in it until the last one is done; smaller batches let requests take turns."""
    max_queued_tokens: int = _limit(
        32000, "--max-queued-tokens", "source tokens a model's queue may hold; beyond, "
        "requests get 503 with Retry-After at once (default 32000, four full batches)")
    """Source tokens a model's queue may hold (waiting, not yet decoding); a request that
    would go beyond is refused at once with 503 and ``Retry-After`` (a request alone in an
    empty queue is always taken)."""
    request_timeout_s: float = _limit(
        60.0, "--request-timeout", "drop a request (504) whose batch has not started after "
        "this long; a request may ask for less with timeout_s (default 60)", low=0,
        above=True, metavar="SECONDS")
    """A request whose batch has not started this long after it arrived is dropped (504);
    a request may ask for less with ``timeout_s``."""

    batching: str = _choice(
        "step", "--batching", ("step", "batch"),
        "step: lines join the decoding batch between two steps and leave it when they "
        "finish (a new request starts within a step); batch: batches are formed whole and "
        "decoded to their end (default step)")
    """How translations are batched: ``step`` (step-level batching,
    :mod:`ranmt.inference.continuous`:
    a request that arrives while others decode starts at the next step) or ``batch`` (a
    batch is formed from the waiting requests and decoded to its end before the next one
    is formed). Scoring is always batch-level."""

    workers: str = _choice(
        "process", "--workers", ("process", "thread"),
        "step batching: decode each model in a worker process of its own (the HTTP side "
        "never waits for decoding; a worker that dies is restarted) or in a thread of the "
        "server's process (default process)")
    """Where step-level decoding runs (:mod:`ranmt.serving.supervisor`): ``process``, a worker
    process per model that loads its own copy of the model, or ``thread``, the server's
    decoding thread. Scoring, alignments and attention maps run in the server's process."""

    express_rows: int = _limit(
        16, "--express-rows", "step batching: a translation request of at most this many "
        "rows (lines x beam, or x nbest draws when sampling) decodes in an express lane "
        "stepped ahead of the main batch; 0: no express lane (default 16, one line at "
        "beam 16)", low=0)
    """Step-level batching's express lane (:meth:`ranmt.serving.lines.LineDecoding.step`):
    small requests decode apart from the main batch, in steps of their own that come
    first, so that on a CPU (a step's cost grows with its rows) a one-line request behind
    a burst takes short steps, not the burst's. It holds up to ``max_batch_lines`` lines and
    ``max_batch_tokens`` source tokens of its own; while both lanes decode, the main batch
    gets about a third of the time."""

    worker_nice: int = _limit(
        19, "--worker-nice", "scheduling niceness of the decoding worker processes, 0-19: "
        "the higher, the more the HTTP side comes first on a busy machine (default 19)",
        low=0, high=19)
    """``nice`` of each decoding worker process (``--workers process``). Under a burst the
    HTTP side must read, admit or refuse every request while the worker decodes the first
    ones; at 19 the kernel gives the worker the CPU only where the HTTP side leaves it, and
    on 2 cores the burst's refusals came in 63-85 ms p50 against 74-129 ms at 5, the value
    before (SERVING.md, "Run 5")."""

    worker_stall_s: float = _limit(
        5.0, "--worker-stall-s", "a decoding worker that holds lines and reports no step for "
        "this many seconds past its slowest step so far is killed and replaced; its requests "
        "get 500 (default 5)", low=0, above=True, metavar="SECONDS")
    """The watchdog of ``--workers process``: a worker that holds lines reports at least every
    0.25 s while it steps; one that reports nothing for this long plus its slowest step so
    far is hung (a stopped process, a deadlock in a library) and is replaced. On Linux the
    time its threads waited for a CPU does not count (a starved worker is slow, not hung:
    :func:`ranmt.serving.supervisor.silent_share`)."""
    worker_load_timeout_s: float = _limit(
        300.0, "--worker-load-timeout", "a decoding worker that has not loaded its model and "
        "decoded once after this many seconds is killed and tried again (default 300)",
        low=0, above=True, metavar="SECONDS")
    """A worker that has not said it is ready this long after it was started (a read that
    never returns, a stopped or deadlocked process) is replaced. On Linux the time it
    waited for a CPU does not count, as for ``worker_stall_s``: at ``nice`` 19 on a busy
    machine a worker can take minutes of wall time to load and still load."""
    restart_backoff_max_s: float = _limit(
        30.0, "--restart-backoff-max", "a decoding worker that fails to load is tried again "
        "after 1, 2, 4, ... seconds, at most this many (default 30)", low=1,
        metavar="SECONDS")
    """The longest wait between two tries of a worker that cannot load (its checkpoint is
    unreadable, say): the model comes back at most this long after its checkpoint does."""
    drain_s: float = _limit(
        20.0, "--drain-s", "on SIGTERM / Ctrl-C: refuse new requests (503) and give those in "
        "flight this many seconds to finish; the rest get 503 (default 20)", low=0,
        metavar="SECONDS")
    """Graceful shutdown: how long requests in flight may still finish after SIGTERM."""

    http: str = _choice(
        "auto", "--http", ("auto", "httptools", "h11"),
        "HTTP parser: httptools (C; installed with ranmt), h11 (pure "
        "Python, slower per request) or auto, httptools when installed (default auto)")
    """uvicorn's HTTP implementation. Under a burst every request's parsing runs on the
    event loop before its refusal or admission: the C parser keeps that short."""

    loop: str = _choice(
        "auto", "--loop", ("auto", "uvloop", "asyncio"),
        "event loop: uvloop (libuv; installed with ranmt on Linux and macOS), asyncio, or "
        "auto, uvloop when installed (default auto)")
    """uvicorn's event loop implementation."""

    def __post_init__(self):
        for spec in fields(self):
            if "choices" in spec.metadata:
                if getattr(self, spec.name) not in spec.metadata["choices"]:
                    raise ValueError(f"{spec.metadata['flag']} ({spec.name}) must be one of "
                                     f"{', '.join(spec.metadata['choices'])}, not "
                                     f"{getattr(self, spec.name)!r}")
                continue
            value, low, above = (getattr(self, spec.name), spec.metadata["low"],
                                 spec.metadata["above"])
            high = spec.metadata["high"]
            if (value <= low if above else value < low) or (high is not None and value > high):
                bound = f"above {low}" if above else f"at least {low}"
                if high is not None:
                    bound += f" and at most {high}"
                raise ValueError(f"{spec.metadata['flag']} ({spec.name}) must be {bound}, "
                                 f"not {value}")

    @classmethod
    def from_args(cls, args) -> ServeLimits:
        """The limits ``ranmt serve``'s parsed options (:func:`add_limit_options`) give."""
        return cls(**{spec.name: getattr(args, spec.name) for spec in fields(cls)})


def add_limit_options(parser) -> None:
    """One ``ranmt serve`` option per :class:`ServeLimits` field (its flag, type, default,
    help), stored under the field's name."""
    for spec in fields(ServeLimits):
        meta = spec.metadata
        options = {"type": int if spec.type in (int, "int") else float,
                   "default": spec.default, "dest": spec.name}
        if "choices" in meta:
            options.update(type=str, choices=meta["choices"])
        if meta["help"]:
            options["help"] = meta["help"]
        if meta["metavar"]:
            options["metavar"] = meta["metavar"]
        parser.add_argument(meta["flag"], **options)
