"""The server's side of a model's decoding worker process (``ranmt serve --workers process``,
the default): :class:`ProcessDecoding` starts the worker (:mod:`ranmt.serving.worker`, the
child's side), sends it lines and drops, reads what it reports (the messages of
:mod:`ranmt.serving.messages`) from the event loop, and supervises it (docs/SERVING.md, "What
happens when things fail"):

- a worker that exits (killed, out of memory) is replaced at once; the lines it held are
  answered 500;
- a **watchdog** kills a worker that holds lines and reports no step for
  ``--worker-stall-s`` seconds past the slowest step it has taken (its first step's grace:
  the time its warm-up decode took), or that has not loaded within
  ``--worker-load-timeout``; it is then replaced as above. On Linux the time a worker
  waited for a CPU (a thread runnable but not running: ``/proc/PID/task/TID/stat`` and
  ``schedstat``) counts neither as silence nor as loading time: a worker starved on a busy
  machine is slow, not hung, and is left to decode or load (its requests' deadlines still
  hold); a stopped, deadlocked or spinning one is killed as before;
- a worker that exits before it is ready (its checkpoint unreadable, say) is tried again
  after 1, 2, 4, ... seconds, at most ``--restart-backoff-max``, for as long as the server
  runs, so the model comes back by itself once its checkpoint does; only the server's very
  first worker of a model fails the server's start instead.

Its state (:attr:`ProcessDecoding.state`: starting, ready, loading, waiting, stopped) and the
reason it is not ready are what ``/ready``, ``/models`` and ``/metrics`` report. Readiness is
that state: :meth:`ProcessDecoding.wait_ready` waits until the state is ``ready`` (or
``stopped``), and anything that ends a worker (a kill, its pipe's end) leaves ``ready``
at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import sys
from collections.abc import Callable

from ranmt.serving.lines import OnDone, OnFailed, OnSteps
from ranmt.serving.messages import (
    AddLine,
    CancelAcknowledged,
    CancelLines,
    FromWorker,
    LinesFailed,
    LoadFailed,
    Ready,
    Stepped,
    Stop,
    ToWorker,
)
from ranmt.serving.worker import worker_main

OnDown = Callable[[str, float], None]


def thread_activity(pid: int) -> dict[int, tuple[bool, int]] | None:
    """By thread id of process ``pid``: (whether it is runnable, nanoseconds it has spent on
    a CPU since it started), from ``/proc/PID/task/TID/stat`` (state ``R``: running or
    waiting on a run queue for a CPU) and ``.../schedstat`` (its first field); None where
    the kernel does not say (not Linux, the process gone). A stopped thread (SIGSTOP) is
    ``T``, one that sleeps (a lock, a read) ``S`` or ``D``: not runnable."""
    threads = {}
    try:
        for task in os.scandir(f"/proc/{pid}/task"):
            with contextlib.suppress(FileNotFoundError):  # a thread that just ended
                state = _read_small(f"{task.path}/stat").rsplit(b")", 1)[1].split()[0]
                on_cpu_ns = int(_read_small(f"{task.path}/schedstat").split()[0])
                threads[int(task.name)] = (state == b"R", on_cpu_ns)
    except (OSError, ValueError, IndexError):
        return None
    return threads or None


def _read_small(path: str) -> bytes:
    """One read of a small file (2.4x faster than ``open().read()`` for /proc's, which the
    watchdog reads 10 times a second per thread of a busy worker)."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        return os.read(descriptor, 4096)
    finally:
        os.close(descriptor)


def silent_share(seconds: float, then: dict[int, tuple[bool, int]],
                 now: dict[int, tuple[bool, int]]) -> float:
    """Of ``seconds`` between two :func:`thread_activity` samples, those that count as a
    worker's silence: all of them while none of its threads is runnable (stopped, asleep,
    deadlocked), else the CPU time of its least served runnable thread (a thread that
    spins counts in full; one starved on a busy machine only for the time it got a CPU).
    A decoding step waits for its slowest thread, the one that drives it or one that
    computes a share of an operation. Judged by the threads' state at ``now``."""
    served = [(on_cpu - then.get(tid, (False, 0))[1]) / 1e9
              for tid, (runnable, on_cpu) in now.items() if runnable]
    return min([seconds, *served]) if served else seconds


def _waited_for_cpu(seconds: float) -> str:
    """The watchdog's note of the time a worker it kills waited for a CPU (not counted)."""
    return f" ({seconds:.1f} s more waiting for a CPU)" if seconds >= 0.1 else ""


class WorkerDiedError(RuntimeError):
    """The decoding worker process exited (or was killed as stalled) while it held lines."""


class ProcessDecoding:
    """Step-level decoding in a supervised process of its own (see the module docstring).

    ``load``: the keyword arguments of :meth:`ranmt.inference.translator.Translator.load`
    that give the served model (:attr:`ranmt.inference.translator.Translator.load_options`);
    ``limits``: the :class:`ranmt.serving.limits.ServeLimits` (niceness, watchdog, back-off);
    ``on_down(reason, retry_after_s)``: a replacement failed to load (the queue refuses what
    waits for it)."""

    def __init__(self, load: dict, name: str, on_done: OnDone, on_failed: OnFailed,
                 on_steps: OnSteps, limits=None, on_down: OnDown | None = None):
        from ranmt.serving.limits import ServeLimits

        self.load = load
        self.limits = limits or ServeLimits()
        self.name = name
        self.on_done, self.on_failed, self.on_steps = on_done, on_failed, on_steps
        self.on_down = on_down
        self.process = None
        self.connection = None
        self._became_ready = asyncio.Event()  # set exactly while state is ready or stopped
        self.state = "starting"
        self.reason: str | None = None  # why the model is not ready (or was last replaced)
        self.error: str | None = None  # the first worker could not start: the server fails
        self.ever_ready = False
        self._loaded = False  # the current worker said it was ready
        self.restarts = 0
        self.failed_starts = 0  # workers in a row that exited before they were ready
        self.causes: dict[str, int] = {"exited": 0, "stalled": 0, "load-failed": 0}
        self.held: set[int] = set()  # keys sent and not answered
        self.unacknowledged = 0  # drops sent that the worker has not confirmed
        self.slowest_step_s = 0.0  # of the current worker; its warm-up's time until it steps
        self.last_news = 0.0  # event-loop time of the worker's last report
        self.spawned_at = 0.0
        self.retry_at = 0.0  # while waiting: when the next worker starts
        self._kill_reason: str | None = None  # set by the watchdog before it kills
        # the watchdog's count of silence since last_news (while it loads: since spawned_at)
        self._silent_s = 0.0
        self._activity: dict[int, tuple[bool, int]] | None = None  # its last thread_activity
        self._sampled_at = 0.0  # when it was taken
        self._load_error: str | None = None  # what the worker said before it exited
        self._news = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: set[asyncio.Task] = set()

    @property
    def state(self) -> str:
        """starting (the server's first worker) | ready | loading (a replacement) | waiting
        (back-off before the next try) | stopped. Readiness is this state: setting it sets
        or clears what :meth:`wait_ready` waits for."""
        return self._state

    @state.setter
    def state(self, value: str) -> None:
        self._state = value
        if value in ("ready", "stopped"):
            self._became_ready.set()
        else:
            self._became_ready.clear()

    @property
    def ready(self) -> bool:
        return self.state == "ready"

    async def start(self) -> None:
        """Start the worker and wait until it has loaded the model and decoded once;
        RuntimeError (with the worker's reason) if it cannot."""
        self._loop = asyncio.get_running_loop()
        self._spawn()
        self._background(self._watch())
        await self._became_ready.wait()
        if self.error is not None:
            raise RuntimeError(self.error)

    def _background(self, coroutine) -> None:
        task = self._loop.create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _spawn(self) -> None:
        context = worker_context()
        parent, child = context.Pipe()
        self.process = context.Process(target=worker_main,
                                       args=(child, self.load, self.limits.worker_nice),
                                       name=f"ranmt-decode-{self.name}", daemon=True)
        self.process.start()
        child.close()
        self.connection = parent
        if self.state != "starting":
            self.state = "loading"
        self.spawned_at = self.last_news = self._loop.time()
        self._silent_s, self._activity = 0.0, None
        self._kill_reason = self._load_error = None
        self._loaded = False
        self.unacknowledged = 0
        self.slowest_step_s = 0.0  # a new worker: its own steps (and warm-up) from here
        self._loop.add_reader(parent.fileno(), self._readable)

    def stop(self) -> None:
        """Stop the worker (the server is shutting down)."""
        self.state = "stopped"
        for task in list(self._tasks):
            task.cancel()
        if self.connection is not None:
            self._loop.remove_reader(self.connection.fileno())
            self._send(Stop())
            self.connection.close()
            self.connection = None
        if self.process is not None:
            self.process.join(2)
            if self.process.is_alive():
                self.process.kill()
                self.process.join(2)

    def retry_after(self) -> float:
        """Seconds until a worker may be ready again (0 when ready)."""
        if self.state == "ready":
            return 0.0
        if self.state == "waiting":
            return max(self.retry_at - self._loop.time(), 0.0) + 1.0
        return 1.0

    # ------------------------------------------------------------------ lines in
    def add(self, key: int, options: tuple, ids: list[int], prefix, line: int,
            express: bool = False) -> None:
        if not self.busy():
            self.last_news = self._loop.time()  # the watchdog counts from here
            self._silent_s, self._activity = 0.0, None
        self.held.add(key)
        if self.connection is None:  # no worker right now: fail it from the event loop
            self.held.discard(key)
            self._loop.call_soon(self.on_failed, [key], WorkerDiedError(
                f"the decoding worker of model '{self.name}' is not running"))
            return
        self._send(AddLine(key, options, ids, prefix, line, express))

    def cancel(self, keys: list[int]) -> None:
        """Drop lines ``keys`` from the worker's batch (never answered)."""
        keys = [key for key in keys if key in self.held]
        self.held.difference_update(keys)
        if keys and self.connection is not None:
            self.unacknowledged += 1  # the watchdog waits for the worker to confirm
            self._send(CancelLines(keys))

    def _send(self, message: ToWorker) -> None:
        """Send to the worker; a broken pipe never raises into the caller: the worker is
        killed, and its end (the pipe's EOF) fails what it held and replaces it."""
        try:
            self.connection.send(message)
        except (OSError, ValueError) as err:
            if not isinstance(message, Stop) and self.process is not None:
                self._kill(f"the pipe to it broke ({type(err).__name__}: {err})")

    async def wait_ready(self) -> None:
        """Until a worker is ready (or the model stopped); RuntimeError when the first one
        could not start. A worker that is killed or ends is not ready from that moment, so
        this waits again until its replacement is."""
        await self._became_ready.wait()
        if self.error is not None:
            raise RuntimeError(self.error)

    async def advance(self, arrival: asyncio.Event) -> None:
        """Until the worker reports (finished lines arrive from it as it decodes), a new
        request arrives, or 50 ms pass (deadlines of waiting requests)."""
        if not self._news.is_set():
            waits = [asyncio.ensure_future(self._news.wait()),
                     asyncio.ensure_future(arrival.wait())]
            await asyncio.wait(waits, timeout=0.05, return_when=asyncio.FIRST_COMPLETED)
            for waiting in waits:
                waiting.cancel()
        self._news.clear()

    # ------------------------------------------------------------------ news from it
    def _readable(self) -> None:
        """The event loop's callback when the pipe has data (or was closed)."""
        try:
            while self.connection.poll():
                self._handle(self.connection.recv())
        except (EOFError, OSError):
            self._died()
        self._news.set()

    def _handle(self, message: FromWorker) -> None:
        self.last_news = self._loop.time()
        self._silent_s = 0.0
        if isinstance(message, Stepped):
            self.slowest_step_s = max(self.slowest_step_s, message.slowest_s)
            self.on_steps(message.steps, message.sentences)
            for key, hyps in message.finished:
                if key in self.held:  # else dropped meanwhile (deadline, client gone)
                    self.held.discard(key)
                    self.on_done(key, hyps)
        elif isinstance(message, LinesFailed):
            keys = [key for key in message.keys if key in self.held]
            self.held.difference_update(keys)
            if keys:
                self.on_failed(keys, RuntimeError(message.error))
        elif isinstance(message, CancelAcknowledged):
            self.unacknowledged = max(self.unacknowledged - 1, 0)
        elif isinstance(message, Ready):
            self.reason = None
            # the first step's grace: a real decode on this machine, lazy set-up included
            self.slowest_step_s = max(self.slowest_step_s, message.warmup_s)
            self.ever_ready = self._loaded = True
            self.failed_starts = 0
            self.state = "ready"
        elif isinstance(message, LoadFailed):
            self._load_error = message.error

    # ------------------------------------------------------------------ supervision
    def busy(self) -> bool:
        """The worker owes an answer: lines in flight, or a drop not yet confirmed."""
        return bool(self.held) or self.unacknowledged > 0

    def stall_limit_s(self) -> float:
        """How long a worker holding lines may report nothing before it is killed: the
        limit past its slowest step so far (before its first step, past the time its
        warm-up decode took)."""
        return self.limits.worker_stall_s + self.slowest_step_s

    def silent_s(self, now: float) -> float:
        """Seconds since the worker's last report that count as silence (see
        :func:`silent_share`; without the kernel's thread statistics, all of them). Called
        by the watchdog every 100 ms."""
        activity = self.thread_activity(self.process.pid) if self.process is not None \
            else None
        since = max(self.last_news, self._sampled_at)
        if activity is None or self._activity is None:
            self._silent_s += now - since
        else:
            self._silent_s += max(silent_share(now - since, self._activity, activity), 0.0)
        self._activity, self._sampled_at = activity, now
        return self._silent_s

    thread_activity = staticmethod(thread_activity)  # tests replace it on an instance

    async def _watch(self) -> None:
        """The watchdog (every 100 ms): kill a worker that holds lines and reports no
        step, or that does not finish loading."""
        while True:
            await asyncio.sleep(0.1)
            now = self._loop.time()
            if self.state == "ready" and self.busy():
                silent = self.silent_s(now)
                if silent > self.stall_limit_s():
                    waited = _waited_for_cpu(now - self.last_news - silent)
                    self._kill(f"it was stalled: no decoding step for {silent:.1f} s{waited} "
                               f"with {len(self.held)} lines in flight", cause="stalled")
            elif self.state in ("starting", "loading") and self.process is not None and \
                    self._kill_reason is None:
                # it reports nothing until it is ready: its silence since it was spawned is
                # its loading time, less what it waited for a CPU (a worker at nice 19
                # loads slowly on a busy machine; one asleep on a read, stopped or
                # deadlocked counts in full)
                loading_s = self.silent_s(now)
                if loading_s > self.limits.worker_load_timeout_s:
                    waited = _waited_for_cpu(now - self.spawned_at - loading_s)
                    self._kill(f"it did not load within "
                               f"{self.limits.worker_load_timeout_s:g} s{waited}",
                               cause="load-failed")

    def _kill(self, reason: str, cause: str = "exited") -> None:
        """Kill the worker (its pipe's EOF then fails what it held and replaces it)."""
        if self._kill_reason is not None:
            return
        self._kill_reason = reason
        self.causes[cause] += 1
        print(f"ranmt serve: killing the decoding worker of model '{self.name}': {reason}",
              file=sys.stderr)
        if self.state == "ready":
            self.state = "loading"  # not ready from now on (/ready, wait_ready)
            self.reason = reason
        with contextlib.suppress(OSError, ValueError, AttributeError):
            self.process.kill()

    def _died(self) -> None:
        """The worker's pipe closed: it exited or was killed. Reap it, fail the lines it
        held and replace it, without blocking the event loop."""
        self._loop.remove_reader(self.connection.fileno())
        self.connection.close()
        self.connection = None
        process, self.process = self.process, None
        if self.state == "ready":  # not ready from its end on, until a replacement is
            self.state = "loading"
            self.reason = "its decoding worker ended; a new one is starting"
        if self.state != "stopped":
            self._background(self._recover(process, self._loaded))

    async def _recover(self, process, loaded: bool) -> None:
        """After a worker's end (``loaded``: it had become ready): fail what it held, then
        start a new one, at once after a crash or a stall, after a back-off after a failed
        load."""
        await asyncio.to_thread(process.join, 5)
        if process.is_alive():
            process.kill()
            await asyncio.to_thread(process.join, 5)
        code = process.exitcode
        why = self._kill_reason or self._load_error or f"it exited (code {code})"
        keys, self.held = sorted(self.held), set()
        if keys:
            self.on_failed(keys, WorkerDiedError(
                f"the decoding worker of model '{self.name}' ended while decoding this "
                f"request: {why}"))
        if self.state == "stopped":
            return
        if not self.ever_ready:  # the server's first worker: the server does not start
            self.state = "stopped"  # wakes start(), which raises (no await before error)
            self.error = (f"the decoding worker of model '{self.name}' exited (code {code}) "
                          f"before it was ready: {why}")
            print(f"ranmt serve: {self.error}", file=sys.stderr)
            return
        if not loaded:
            self.failed_starts += 1
            self.causes["load-failed"] += self._kill_reason is None
        elif self._kill_reason is None:
            self.causes["exited"] += 1
        delay = 0.0 if not self.failed_starts else \
            min(self.limits.restart_backoff_max_s, 2.0 ** (self.failed_starts - 1))
        self.reason = f"its decoding worker {'failed to load' if not loaded else 'ended'}: {why}"
        print(f"ranmt serve: model '{self.name}': {self.reason}; starting a new worker"
              + (f" in {delay:g} s" if delay else ""), file=sys.stderr)
        if delay:
            self.state = "waiting"
            self.retry_at = self._loop.time() + delay
            if self.on_down is not None:
                self.on_down(self.reason, delay)
            await asyncio.sleep(delay)
            if self.state == "stopped":
                return
        self.restarts += 1
        self.state = "loading"
        self._spawn()



def worker_context():
    """Workers are forked from a clean server process that has imported torch and ranmt
    but run nothing (``forkserver``): they start in a fraction of a second, and no thread
    pool of the serving process is copied into them (``spawn`` where there is no
    forkserver)."""
    if "forkserver" not in multiprocessing.get_all_start_methods():  # Windows: spawn
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["ranmt.serving.worker", "ranmt.inference.translator"])
    return context


