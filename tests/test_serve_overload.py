"""ranmt serve under overload and attack: a bounded queue (503 + Retry-After), deadlines
(504), clients that leave, hostile JSON, Prometheus metrics and readiness."""

from __future__ import annotations

import asyncio
import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")

from fastapi.testclient import TestClient  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from ranmt.inference.translator import Translator  # noqa: E402
from ranmt.serving.app import ServeLimits, create_app  # noqa: E402
from ranmt.serving.batching import (  # noqa: E402
    Batcher,
    QueueFullError,
    RequestError,
    Work,
    wait_for_job,
)


@pytest.fixture()
def slow_decoding(monkeypatch):
    """Every batch (batch-level batching) and every decoding step (step-level) takes at
    least 0.15 s: a burst piles up in the queue. Returns an event set when the first batch
    or step starts decoding."""
    import threading

    from ranmt.inference.continuous import ContinuousDecoder

    original_ids, original_step = Translator.translate_ids, ContinuousDecoder.step
    decoding = threading.Event()

    def slow_ids(self, ids, *args, **kwargs):
        decoding.set()
        time.sleep(0.15)
        return original_ids(self, ids, *args, **kwargs)

    def slow_step(self):
        decoding.set()
        time.sleep(0.15)
        return original_step(self)

    monkeypatch.setattr(Translator, "translate_ids", slow_ids)
    monkeypatch.setattr(ContinuousDecoder, "step", slow_step)
    return decoding


def _metric(client, name: str, **labels) -> float:
    return _metric_with(client, {}, name, **labels)


def test_a_full_queue_answers_503_with_retry_after_and_serves_again(translators,
                                                                    slow_decoding):
    limits = ServeLimits(batch_window_ms=1, max_queued_tokens=12, workers="thread")
    expected = translators["transf"].translate(["a b c"])[0]
    with TestClient(create_app(translators, limits)) as client:
        def ask(_):
            return client.post("/translate", json={"text": ["a b c"]})

        with ThreadPoolExecutor(12) as pool:
            answers = list(pool.map(ask, range(12)))
        refused = [r for r in answers if r.status_code == 503]
        accepted = [r for r in answers if r.status_code == 200]
        assert refused and accepted and len(refused) + len(accepted) == 12
        for response in refused:
            assert int(response.headers["Retry-After"]) >= 1
            assert "busy" in response.json()["error"]
        assert all(r.json()["translations"][0]["text"] == expected for r in accepted)
        # Refused requests were never queued: only the accepted ones reached a batch.
        assert client.get("/health").json()["requests"] == len(accepted)
        good = client.post("/translate", json={"text": ["a b c"]})
        assert good.status_code == 200
        assert _metric(client, "ranmt_errors_total", model="transf", kind="overload") == \
            len(refused)
        assert _metric(client, "ranmt_queue_tokens", model="transf") == 0


def test_a_request_whose_batch_has_not_started_by_its_deadline_gets_504(translators,
                                                                         slow_decoding):
    limits = ServeLimits(batch_window_ms=1, request_timeout_s=5, workers="thread")
    with TestClient(create_app(translators, limits)) as client, ThreadPoolExecutor(2) as pool:
        first = pool.submit(client.post, "/translate", json={"text": ["a b c"]})
        assert slow_decoding.wait(30)  # the first batch is decoding (0.15 s a step)
        late = client.post("/translate", json={"text": ["d e f"], "timeout_s": 0.05})
        assert late.status_code == 504 and "deadline" in late.json()["error"]
        assert first.result().status_code == 200
        assert client.post("/translate", json={"text": ["a"], "timeout_s": 9}).status_code == 400


GREEDY = Work.translate(beam=1, nbest=1)


def _job_batcher(calls: list) -> Batcher:
    class Recorder:
        def translate_ids(self, ids, prefixes=None, **overrides):
            calls.append(ids)
            return [[([1], 0.0)] for _ in ids]

    import concurrent.futures

    return Batcher(Recorder(), ServeLimits(batch_window_ms=1),
                   concurrent.futures.ThreadPoolExecutor(1))


def test_a_client_that_leaves_has_its_queued_work_dropped():
    """The client of the first job disconnects while it waits: it leaves the queue totals
    at once and the worker never decodes it; the next job is decoded alone."""
    calls: list = []

    async def scenario():
        batcher = _job_batcher(calls)
        gone = batcher.submit([[5, 6, 7]], GREEDY, timeout_s=30)
        kept = batcher.submit([[8, 9]], GREEDY, timeout_s=30)
        assert batcher.queued_tokens == 7 and batcher.queued_requests == 2

        async def disconnected():
            return True

        assert await wait_for_job(batcher, gone, disconnected) is None
        assert gone.dropped and batcher.queued_tokens == 3 and batcher.queued_requests == 1
        worker = asyncio.create_task(batcher.run())

        async def connected():
            return False

        results = await wait_for_job(batcher, kept, connected)
        worker.cancel()
        return results

    assert asyncio.run(scenario()) == [[([1], 0.0)]]
    assert calls == [[[8, 9]]]


def test_deadline_and_admission_in_the_batcher():
    async def scenario():
        batcher = _job_batcher([])
        batcher.limits.max_queued_tokens = 5
        job = batcher.submit([[1, 2, 3]], GREEDY, timeout_s=0.05)
        with pytest.raises(QueueFullError) as full:
            batcher.submit([[4, 5]], GREEDY, timeout_s=1)
        assert full.value.status == 503 and full.value.retry_after >= 1

        async def connected():
            return False

        with pytest.raises(RequestError) as late:
            await wait_for_job(batcher, job, connected)
        assert late.value.status == 504 and batcher.queued_tokens == 0
        big = batcher.submit([[1] * 20], GREEDY, timeout_s=1)  # alone in an empty queue: taken
        assert big.tokens == 21

    asyncio.run(scenario())


HOSTILE = [
    (b"[" * 50000 + b"]" * 50000, 400, "nested too deeply"),
    (b'{"text": ["a"], "beam": ' + b"7" * 5000 + b"}", 400, "invalid JSON"),
    (b'{"text": ["a"], "timeout_s": -1}', 400, "'timeout_s'"),
]


@pytest.fixture(scope="module")
def roomy_client(translators):
    """One app with room for the hostile bodies (200,000 characters), shared by their tests:
    each checks that the server still answers a good request after its body."""
    limits = ServeLimits(max_lines=10, max_chars=200000)
    with TestClient(create_app(translators, limits)) as client:
        yield client


@pytest.mark.parametrize(("body", "status", "message"), HOSTILE)
def test_hostile_bodies_are_4xx(roomy_client, body, status, message):
    client = roomy_client
    response = client.post("/translate", content=body,
                           headers={"Content-Type": "application/json"})
    assert response.status_code == status and message in response.json()["error"]
    plain = client.post("/translate", content=b'{"text": ["a"]}',
                        headers={"Content-Type": "text/plain"})
    assert plain.status_code == 415
    assert client.post("/translate", json={"text": ["a"]}).status_code == 200


def test_metrics_health_and_readiness(translators):
    with TestClient(create_app(translators, ServeLimits(batch_window_ms=1))) as client:
        assert client.get("/ready").json() == {"ready": True, "models": ["transf", "ran-all"],
                                               "down": {}}
        assert client.get("/health").status_code == 200
        before = _metric(client, "ranmt_requests_total", endpoint="/translate", status="200")
        for _ in range(3):
            client.post("/translate", json={"text": ["a b c", "d e"]})
        client.post("/translate", json={"text": []})
        families = {f.name: f for f in text_string_to_metric_families(client.get("/metrics").text)}
        assert {"ranmt_requests", "ranmt_request_seconds", "ranmt_queue_requests",
                "ranmt_queue_tokens", "ranmt_batch_sentences", "ranmt_decoded_tokens",
                "ranmt_errors", "ranmt_model_ready", "ranmt_worker_replacements",
                "ranmt_event_loop_lag_seconds", "ranmt_event_loop_lag_max_seconds"
                } <= set(families)
        assert _metric(client, "ranmt_model_ready", model="ran-all") == 1
        assert _metric(client, "ranmt_requests_total", endpoint="/translate",
                       status="200") == before + 3
        assert _metric(client, "ranmt_requests_total", endpoint="/translate",
                       status="400") == 1
        assert _metric(client, "ranmt_batch_sentences_count", model="transf") >= 1
        assert _metric(client, "ranmt_decoded_tokens_total", model="transf") >= 6
        assert _metric(client, "ranmt_request_seconds_count", endpoint="/translate") >= 4
        listed = json.loads(client.get("/models").text)
        assert listed["limits"]["max_queued_tokens"] == 32000
        assert [model["state"] for model in listed["models"]] == ["ready", "ready"]


def test_api_key_guards_every_endpoint_but_health(translators, tmp_path, monkeypatch):
    from ranmt.serving.app import read_api_key

    (tmp_path / "key").write_text("s3cret-key\n")
    key = read_api_key(str(tmp_path / "key"))
    assert key == "s3cret-key"
    monkeypatch.setenv("RANMT_API_KEY", "from-env")
    assert read_api_key(None) == "from-env"
    with TestClient(create_app(translators, ServeLimits(), api_key=key)) as client:
        assert client.get("/health").status_code == 200
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": key}):
            response = client.post("/translate", json={"text": ["a"]}, headers=headers)
            assert response.status_code == 401 and "API key" in response.json()["error"]
            assert client.get("/models", headers=headers).status_code == 401
        good = {"Authorization": f"Bearer {key}"}
        assert client.post("/translate", json={"text": ["a"]}, headers=good).status_code == 200
        assert client.get("/metrics", headers=good).status_code == 200
        assert _metric_with(client, good, "ranmt_requests_total", endpoint="/translate",
                            status="401") == 3


def _metric_with(client, headers, name: str, **labels) -> float:
    text = client.get("/metrics", headers=headers).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0


def test_openapi_lists_every_request_field_with_the_servers_bounds(translators):
    from ranmt.config import decode_fields

    limits = ServeLimits(max_lines=10, max_chars=200, max_beam=8, request_timeout_s=30)
    with TestClient(create_app(translators, limits)) as client:
        schema = client.get("/openapi.json").json()
        assert client.get("/docs").status_code == 200
    body = schema["paths"]["/translate"]["post"]["requestBody"]["content"]["application/json"]
    request = schema["components"]["schemas"][body["schema"]["$ref"].split("/")[-1]]
    fields = request["properties"]
    served = {"beam", "nbest", "sampling", "topk", "topp", "epsilon", "temperature", "seed",
              "shortlist"}  # DecodeConfig's fields declared served
    assert served == {spec.name for spec in decode_fields(served=True)}
    assert set(fields) == {"text", "model", "attention", "timeout_s", "prefix",
                           "alignment"} | served
    assert request["required"] == ["text"] and request["additionalProperties"] is False
    assert fields["text"]["maxItems"] == 10 and fields["text"]["minItems"] == 1
    assert fields["text"]["items"]["maxLength"] == 200
    beam = fields["beam"]["anyOf"][0]  # an integer, or null: the checkpoint's decode.beam
    assert (beam["minimum"], beam["maximum"], fields["beam"]["default"]) == (1, 8, None)
    assert fields["timeout_s"]["anyOf"][0]["maximum"] == 30
    responses = schema["paths"]["/translate"]["post"]["responses"]
    assert {"200", "400", "413", "503", "504"} <= set(responses)
    translation = schema["components"]["schemas"]["Translation"]["properties"]
    assert {"text", "score", "nbest", "attention"} <= set(translation)


def test_server_limits_are_declared_once(capsys):
    """`ranmt serve`'s limit options are ServeLimits' fields (flags, defaults), parsed into
    the same ServeLimits, and a limit out of its bound is refused by the class itself, from
    the command line and from Python alike."""
    import dataclasses

    from ranmt.cli import build_parser, main

    args = build_parser().parse_args(["serve", "--checkpoint", "x"])
    assert ServeLimits.from_args(args) == ServeLimits()
    args = build_parser().parse_args(["serve", "--checkpoint", "x", "--max-beam", "4",
                                      "--request-timeout", "2.5"])
    assert ServeLimits.from_args(args) == ServeLimits(max_beam=4, request_timeout_s=2.5)
    for spec in dataclasses.fields(ServeLimits):
        if "choices" in spec.metadata:
            wrong = "sometimes"
        else:
            low = 0 if spec.name == "request_timeout_s" else spec.metadata["low"] - 1
            wrong = low if spec.name != "batch_window_ms" else -1
        with pytest.raises(ValueError, match=spec.metadata["flag"]):
            ServeLimits(**{spec.name: wrong})
        if spec.metadata.get("high") is not None:
            with pytest.raises(ValueError, match="at most"):
                ServeLimits(**{spec.name: spec.metadata["high"] + 1})
            ServeLimits(**{spec.name: spec.metadata["high"]})
    assert ServeLimits().worker_nice == 19
    args = build_parser().parse_args(["serve", "--checkpoint", "x", "--worker-nice", "5"])
    assert ServeLimits.from_args(args).worker_nice == 5
    args = build_parser().parse_args(["serve", "--checkpoint", "x", "--batching", "batch"])
    assert ServeLimits.from_args(args) == ServeLimits(batching="batch")
    with pytest.raises(SystemExit):
        main(["serve", "--checkpoint", "x", "--max-batch-lines", "0"])
    assert "--max-batch-lines (max_batch_lines) must be at least 1, not 0" in \
        capsys.readouterr().err
