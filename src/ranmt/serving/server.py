"""``ranmt serve`` as a process: load the models, put the app (:func:`ranmt.serving.app.
create_app`) behind uvicorn, and run until SIGTERM / Ctrl-C with a graceful drain."""

from __future__ import annotations

import contextlib
import logging
import signal

from ranmt.inference.translator import Translator
from ranmt.serving.app import API_KEY_ENV, create_app, model_names
from ranmt.serving.limits import ServeLimits
from ranmt.serving.runner import ServedModels


def serve(checkpoints: list[str], host: str = "127.0.0.1", port: int = 8080,
          device: str = "auto", quantize: str = "none", limits: ServeLimits | None = None,
          log_level: str = "info", api_key: str | None = None, precision: str = "fp32") -> None:
    """Load the models and serve them until SIGTERM / Ctrl-C."""
    import ipaddress

    import uvicorn

    limits = limits or ServeLimits()
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback and api_key is None:
        logging.getLogger("ranmt.serving.app").warning(
            "serving on %s without an API key: anyone who can reach this address can use "
            "the models and their compute (--api-key-file or $%s)", host, API_KEY_ENV)

    translators = {name: Translator.load(path, device=device, quantize=quantize,
                                         precision=precision)
                   for name, path in model_names(checkpoints).items()}
    app = create_app(translators, limits, api_key, freeze_heap=True)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                           timeout_graceful_shutdown=5, http=limits.http,
                                           loop=limits.loop))
    run_until_signalled(server, app.state.served)


def run_until_signalled(server, served: ServedModels) -> None:
    """Run a uvicorn server in a thread until SIGTERM / SIGINT in the main thread: the first
    starts the graceful shutdown in the event loop (:meth:`ServedModels.begin_drain`: new
    requests 503, those in flight finish within ``--drain-s`` or get 503), which then asks
    uvicorn to stop (``should_exit``: stop accepting, finish writing answers); a second
    signal stops at once. Then return (exit 0). uvicorn captures signals only in the main
    thread, so it neither sees nor re-raises them here: no reliance on its internals."""
    import threading

    def exit_now() -> None:
        server.should_exit = True

    def stop(_signum, _frame) -> None:
        loop = served.loop
        if loop is None or loop.is_closed() or server.should_exit:
            exit_now()  # not serving yet (or a second signal after the drain)
            return
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
            loop.call_soon_threadsafe(served.begin_drain, exit_now)

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    thread = threading.Thread(target=server.run, name="ranmt-serve")
    thread.start()
    try:
        while thread.is_alive():
            thread.join(0.2)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
