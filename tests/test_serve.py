"""ranmt serve: every endpoint, every refused input (and a good request right after it),
concurrent requests batched dynamically yet each answered with its own translation, a
decoding error that fails only its batch, SIGTERM with a request in flight, the page."""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import UNNICED

pytest.importorskip("fastapi")
pytest.importorskip("httpx")

from fastapi.testclient import TestClient  # noqa: E402

from ranmt.inference.translator import Translator  # noqa: E402
from ranmt.serving.app import ServeLimits, create_app, model_names  # noqa: E402
from ranmt.serving.launcher import launch_server  # noqa: E402

SENTENCES = ["a b c", "d e f g", "h i", "j k l m n", "o p", "a c e g i", "b d f", "p o n m"]


@pytest.fixture(scope="module")
def client(translators):
    """One app for the module's request tests (starting its decoding workers takes ~0.9 s):
    each refused input is followed by a good request, so the same server keeps serving
    through all of them. Tests that break or reconfigure a server make their own."""
    limits = ServeLimits(max_lines=10, max_chars=200, max_beam=8, batch_window_ms=30)
    with TestClient(create_app(translators, limits)) as test_client:
        yield test_client


def _good(client):
    response = client.post("/translate", json={"text": ["a b c"]})
    assert response.status_code == 200, response.text
    return response.json()


def test_health_and_models(client):
    health = client.get("/health").json()
    assert health["status"] == "ok" and health["models"] == ["transf", "ran-all"]
    models = client.get("/models").json()
    assert [m["name"] for m in models["models"]] == ["transf", "ran-all"]
    assert models["default"] == "transf" and models["models"][1]["arch"] == "ran-all"
    assert models["limits"]["max_lines"] == 10


def test_translate_matches_the_python_api(client, translators):
    for name in ("transf", "ran-all"):
        response = client.post("/translate", json={"text": SENTENCES + [""], "model": name})
        body = response.json()
        assert response.status_code == 200, body
        assert body["model"] == name
        expected = translators[name].translate_nbest(SENTENCES + [""])
        got = [entry["text"] for entry in body["translations"]]
        assert got == [hyps[0][0] for hyps in expected]
        assert body["translations"][-1] == {"text": "", "score": 0.0}


def test_nbest_and_attention(client, translators):
    body = client.post("/translate", json={"text": ["a b c d"], "model": "ran-all", "beam": 4,
                                           "nbest": 3, "attention": True}).json()
    entry = body["translations"][0]
    assert 1 <= len(entry["nbest"]) <= 3 and entry["nbest"][0]["text"] == entry["text"]
    attention = entry["attention"]
    rows, cols = len(attention["target_tokens"]), len(attention["source_tokens"])
    assert attention["source_tokens"][-1] == "</s>"
    config = translators["ran-all"].config.model
    assert len(attention["cross"]) == config.decoder.layers
    for layer in attention["cross"]:
        assert len(layer) == config.heads and len(layer[0]) == rows and len(layer[0][0]) == cols
        for row in layer[0]:
            assert sum(row) == pytest.approx(1.0, abs=1e-3)
    encoder = attention["encoder_self"][0]
    assert len(encoder[0]) == cols and len(encoder[0][0]) == cols
    decoder = attention["decoder_self"][0]
    assert decoder[0][0][1:] == [0.0] * (rows - 1)  # causal: the first query sees itself only
    assert attention["kinds"] == {"encoder_self": "ran", "decoder_self": "ran", "cross": "dot"}


BAD = [
    (b"{not json", 400, "invalid JSON"),
    (b"[1, 2]", 400, "JSON object"),
    (json.dumps({"txt": ["a"]}).encode(), 400, "unknown field"),
    (json.dumps({"beam": 2}).encode(), 400, "missing field 'text'"),
    (json.dumps({"text": "a b"}).encode(), 400, "list of strings"),
    (json.dumps({"text": ["a", 3]}).encode(), 400, "list of strings"),
    (json.dumps({"text": []}).encode(), 400, "empty"),
    (json.dumps({"text": ["a"] * 11}).encode(), 413, "at most 10"),
    (json.dumps({"text": ["a" * 201]}).encode(), 413, "201 characters"),
    (json.dumps({"text": [" ".join("abcdefghijklmnop") * 2]}).encode(), 400, "limit of 23"),
    (json.dumps({"text": ["a"], "beam": 0}).encode(), 400, "'beam' must be between 1 and 8"),
    (json.dumps({"text": ["a"], "beam": 9}).encode(), 400, "'beam' must be between 1 and 8"),
    (json.dumps({"text": ["a"], "beam": "4"}).encode(), 400, "'beam' must be an integer"),
    (json.dumps({"text": ["a"], "beam": True}).encode(), 400, "'beam' must be an integer"),
    (json.dumps({"text": ["a"], "beam": 2, "nbest": 3}).encode(), 400, "the beam size"),
    (json.dumps({"text": ["a"], "model": "marian"}).encode(), 404, "unknown model 'marian'"),
    (json.dumps({"text": ["a"], "model": 7}).encode(), 400, "'model' must be a string"),
    (json.dumps({"text": ["a"], "attention": "yes"}).encode(), 400, "true or false"),
    (b'{"text": ["' + b"a" * 20000 + b'"]}', 413, "request body of"),
]


@pytest.mark.parametrize(("body", "status", "message"), BAD)
def test_bad_input_is_refused_and_the_server_keeps_serving(client, body, status, message):
    response = client.post("/translate", content=body,
                           headers={"Content-Type": "application/json"})
    assert response.status_code == status
    assert message in response.json()["error"]
    _good(client)


@pytest.mark.parametrize("batching", ["step", "batch"])
def test_a_decoding_error_fails_its_request_only(translators, monkeypatch, batching):
    """A failing decoding step (step-level batching) or batch (batch-level) answers 500 to
    the request decoding in it; the server goes on serving."""
    from ranmt.inference.continuous import ContinuousDecoder

    original_ids, original_step = Translator.translate_ids, ContinuousDecoder.step

    def broken_ids(self, ids, *args, **kwargs):
        if any(len(seq) == 7 for seq in ids):  # the poisoned request below
            raise RuntimeError("simulated kernel failure")
        return original_ids(self, ids, *args, **kwargs)

    def broken_step(self):
        if any(len(ids) == 7 for _, ids, _, _ in self.waiting):
            raise RuntimeError("simulated kernel failure")
        return original_step(self)

    monkeypatch.setattr(Translator, "translate_ids", broken_ids)
    monkeypatch.setattr(ContinuousDecoder, "step", broken_step)
    limits = ServeLimits(max_lines=10, max_chars=200, max_beam=8, batch_window_ms=30,
                         batching=batching, workers="thread")  # the patch is in this process
    with TestClient(create_app(translators, limits)) as client:
        response = client.post("/translate", json={"text": ["a b c d e f g"]})
        assert response.status_code == 500
        assert "simulated kernel failure" in response.json()["error"]
        assert _good(client)["translations"][0]["text"] == translators["transf"].translate(
            ["a b c"])[0]


def test_concurrent_requests_are_batched_and_answered_in_order(client, translators):
    expected = {s: t for s, t in zip(SENTENCES, translators["transf"].translate(SENTENCES))}
    before = client.get("/health").json()

    def ask(index: int):
        lines = [SENTENCES[index % len(SENTENCES)], SENTENCES[(index * 3 + 1) % len(SENTENCES)]]
        body = client.post("/translate", json={"text": lines}).json()
        return lines, [entry["text"] for entry in body["translations"]]

    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(ask, range(32)))
    for lines, texts in answers:
        assert texts == [expected[line] for line in lines]
    after = client.get("/health").json()
    requests = after["requests"] - before["requests"]
    batches = after["batches"] - before["batches"]
    assert requests == 32
    assert batches < requests  # requests arriving together shared batches


def test_page_and_script_are_served(client):
    page = client.get("/")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    assert '<script src="explorer.js">' in page.text and "http" not in page.text.split(
        "<body>")[1].replace("http-equiv", "")  # nothing fetched from other hosts
    script = client.get("/explorer.js")
    assert script.status_code == 200 and "fetch(\"translate\"" in script.text
    assert client.get("/explorer.css").status_code == 200


def test_a_wrong_method_is_405_not_404(client):
    """The explorer is mounted at "/", which once answered GET /translate with 404."""
    for method, path in (("GET", "/translate"), ("GET", "/score"), ("PUT", "/translate"),
                         ("POST", "/health"), ("DELETE", "/models")):
        response = client.request(method, path)
        assert response.status_code == 405, (method, path)
        assert method in response.json()["error"] and response.headers["allow"]
    assert "POST" in client.request("GET", "/translate").headers["allow"]
    assert client.request("HEAD", "/health").status_code == 405  # FastAPI routes: no HEAD
    assert client.get("/no-such-page").status_code == 404
    assert client.get("/").status_code == 200


def test_model_names():
    assert model_names(["runs/transf/best", "ran=runs/x"]) == {"transf": "runs/transf/best",
                                                               "ran": "runs/x"}
    with pytest.raises(ValueError, match="two models"):
        model_names(["a/run", "b/run"])


@pytest.mark.parametrize(("http", "loop"), [("auto", "auto"), ("h11", "asyncio"),
                                            ("httptools", "uvloop")])
def test_the_http_parser_and_event_loop_reach_uvicorn(runs, monkeypatch, http, loop):
    """--http / --loop (ServeLimits) are what uvicorn is configured with; ``auto`` lets it
    take httptools and uvloop, which ranmt installs."""
    import uvicorn

    from ranmt.serving.server import serve

    configs = []

    class Recording:
        def __init__(self, config):
            configs.append(config)
            self.should_exit = False

        def run(self):
            configs[-1].load()  # resolves the parser and loop classes as uvicorn would

    monkeypatch.setattr(uvicorn, "Server", Recording)
    serve([str(runs["transf"])], device="cpu", limits=ServeLimits(http=http, loop=loop))
    (config,) = configs
    assert (config.http, config.loop) == (http, loop)
    protocol = config.http_protocol_class.__name__
    assert protocol == ("H11Protocol" if http == "h11" else "HttpToolsProtocol")
    with pytest.raises(ValueError, match="--http"):
        ServeLimits(http="fast")

def _start_server(*args: str) -> tuple[subprocess.Popen, str]:
    """``ranmt serve ARGS`` on the CPU and a free loopback port, once it answers /health."""
    return launch_server(["--device", "cpu", *UNNICED, *args])


def test_launch_server_raises_with_the_error_when_the_server_cannot_start(tmp_path):
    with pytest.raises(RuntimeError, match="did not answer /health") as error:
        launch_server(["--device", "cpu", "--checkpoint", str(tmp_path / "missing")])
    assert "missing" in str(error.value)  # the server's own error message is passed on


def test_sigterm_finishes_the_request_in_flight_and_exits_0(runs):
    server, url = _start_server("--checkpoint", str(runs["transf"]), "--batch-window-ms", "1500")
    try:
        result = {}

        def ask():
            request = urllib.request.Request(
                f"{url}/translate", data=json.dumps({"text": ["a b c"]}).encode(),
                headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=30) as response:
                result["status"] = response.status
                result["body"] = json.loads(response.read())

        thread = threading.Thread(target=ask)
        thread.start()
        time.sleep(0.5)  # the request now waits in its 1.5 s batch window: in flight
        server.send_signal(signal.SIGTERM)
        thread.join(30)
        assert server.wait(30) == 0
    finally:
        if server.poll() is None:
            server.kill()
    assert result["status"] == 200 and len(result["body"]["translations"]) == 1


def _chromium() -> str | None:
    import shutil

    return shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(_chromium() is None, reason="Debian's chromium is not installed "
                    "(.ci/run installs it)")
def test_explorer_renders_heat_maps_in_headless_chromium(runs, tmp_path):
    """The page, opened in headless Chromium with a sentence (?text=... submits the form),
    renders both models' translations and non-blank heat maps; a screenshot is saved."""
    import re
    import urllib.parse

    server, base = _start_server("--checkpoint", f"TransF={runs['transf']}",
                                 "--checkpoint", f"RAN-ALL={runs['ran-all']}")
    url = f"{base}/?text=" + urllib.parse.quote("a b c d e")
    try:
        browser = [_chromium(), "--headless", "--no-sandbox", "--disable-gpu",
                   "--disable-dev-shm-usage", "--virtual-time-budget=20000"]
        dom = subprocess.run(browser + ["--dump-dom", url], capture_output=True, text=True,
                             timeout=120).stdout
        screenshot = tmp_path / "explorer.png"
        subprocess.run(browser + [f"--screenshot={screenshot}", "--window-size=1600,2400", url],
                       capture_output=True, timeout=120)
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(30)
    assert 'data-state="rendered"' in dom
    assert 'data-model="TransF"' in dom and 'data-model="RAN-ALL"' in dom
    painted = [int(n) for n in re.findall(r'data-painted="(\d+)"', dom)]
    # per model: cross, encoder self and decoder self maps, each with coloured cells
    assert len(painted) == 6 and min(painted) > 0
    assert screenshot.read_bytes().startswith(b"\x89PNG")


@pytest.mark.parametrize("batching, said", [("step", "not used by step-level batching"),
                                            ("batch", "compiles each new batch shape")])
def test_a_checkpoint_asking_for_the_compiled_step_is_told_what_serving_does_with_it(
        translators, monkeypatch, caplog, batching, said):
    """``decode.compile_step`` in a served checkpoint's settings: the server says at start
    that step-level batching decodes eagerly, or that batch-level batching compiles on the
    requests that bring new shapes; a checkpoint without it hears nothing."""
    import dataclasses
    import logging

    translator = translators["transf"]
    limits = ServeLimits(batching=batching, workers="thread")
    with caplog.at_level(logging.WARNING, logger="ranmt.serving.app"), \
            TestClient(create_app({"transf": translator}, limits)):
        pass
    assert "compile_step" not in caplog.text
    monkeypatch.setattr(translator, "decode_config",
                        dataclasses.replace(translator.decode_config, compile_step=True))
    with caplog.at_level(logging.WARNING, logger="ranmt.serving.app"), \
            TestClient(create_app({"transf": translator}, limits)):
        pass
    assert said in caplog.text
