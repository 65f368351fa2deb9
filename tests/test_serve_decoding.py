"""ranmt serve's decoding features (POST /score, prefixes, alignments, sampling) and the
fairness of its batches (a small request is not held behind a burst)."""

from __future__ import annotations

import asyncio
import concurrent.futures

import pytest

from conftest import assert_same_translations

pytest.importorskip("fastapi")

from fastapi.testclient import TestClient  # noqa: E402

from ranmt.serving.app import ServeLimits, create_app  # noqa: E402
from ranmt.serving.batching import Batcher, Work  # noqa: E402

LINES = ["a b c d", "e f", "g h i j k"]


@pytest.fixture(scope="module")
def client(translators):
    """One app for the module's request tests (its decoding workers start once)."""
    limits = ServeLimits(max_lines=10, max_chars=200, max_beam=8, batch_window_ms=1)
    with TestClient(create_app(translators, limits)) as test_client:
        yield test_client


def test_score_gives_back_the_translation_scores(client, translators):
    translated = client.post("/translate", json={"text": LINES, "beam": 3}).json()
    targets = [entry["text"] for entry in translated["translations"]]
    scored = client.post("/score", json={"source": LINES, "target": targets}).json()
    translator = translators["transf"]
    python = translator.score(LINES, targets)
    decoded = translator.translate_detailed(LINES)
    for entry, pair, expected, target, hyps in zip(translated["translations"], scored["scores"],
                                                   python, targets, decoded):
        if not target:
            assert pair is None
            continue
        assert pair["total"] == pytest.approx(expected.total, abs=1e-5)
        assert pair["normalized"] == pytest.approx(expected.normalized, abs=1e-5)
        if translator.encode_targets([target])[0] == hyps[0].tokens:  # same segmentation
            assert pair["normalized"] == pytest.approx(entry["score"], abs=2e-4)
        assert pair["tokens"][-1] == "</s>"
        assert len(pair["tokens"]) == len(pair["token_logprobs"])


def test_prefix_alignment_and_sampling_in_a_request(client, translators):
    prefixes = ["d c", "", "k"]
    body = client.post("/translate", json={"text": LINES, "prefix": prefixes, "beam": 4,
                                           "nbest": 2, "alignment": True}).json()
    expected = translators["transf"].translate_detailed(LINES, prefixes=prefixes)
    for entry, hyps, line in zip(body["translations"], expected, LINES):
        assert entry["text"] == hyps[0].text
        for hypothesis in entry["nbest"]:
            words = hypothesis["text"].split()
            assert {j for _, j in hypothesis["alignment"]} == set(range(len(words)))
            assert all(0 <= i < len(line.split()) for i, _ in hypothesis["alignment"])
    sample = {"text": LINES, "sampling": "topk", "temperature": 1.5, "nbest": 3, "seed": 4}
    first = client.post("/translate", json=sample).json()
    again = client.post("/translate", json=sample).json()
    other = client.post("/translate", json={**sample, "seed": 5}).json()
    assert_same_translations(first, again)  # same seed, same samples
    assert first != other
    assert [len(entry["nbest"]) for entry in first["translations"]] == [3, 3, 3]


@pytest.mark.parametrize(("body", "message"), [
    ({"text": ["a"], "prefix": ["x", "y"]}, "'prefix' has 2 lines but 'text' has 1"),
    ({"text": ["a"], "sampling": "beam"}, "'sampling'"),
    ({"text": ["a"], "sampling": "topp", "topp": 1.5}, "'topp'"),
    ({"text": ["a"], "sampling": "topk", "temperature": 0}, "'temperature'"),
    ({"text": ["a"], "alignment": "yes"}, "'alignment'"),
    ({"text": ["a"], "seed": -1}, "'seed'"),
])
def test_bad_decoding_fields_are_named(client, body, message):
    response = client.post("/translate", json=body)
    assert response.status_code == 400
    assert message in response.json()["error"]


@pytest.mark.parametrize(("body", "status", "message"), [
    ({"source": ["a"], "target": ["x", "y"]}, 400, "'source' has 1 lines but 'target' has 2"),
    ({"source": ["a"]}, 400, "missing field 'target'"),
    ({"source": ["a"] * 11, "target": ["a"] * 11}, 413, "at most 10"),
    ({"source": ["a"], "target": ["a" * 201]}, 413, "'target' line 1 has 201 characters"),
    ({"source": ["a"], "target": ["a"], "beam": 2}, 400, "unknown field"),
])
def test_bad_score_bodies(client, body, status, message):
    response = client.post("/score", json=body)
    assert response.status_code == status
    assert message in response.json()["error"]


def test_openapi_lists_the_new_fields(client):
    schema = client.get("/openapi.json").json()
    translate = schema["components"]["schemas"]["TranslateRequest"]["properties"]
    assert {"prefix", "alignment", "sampling", "topk", "topp", "epsilon", "temperature",
            "seed"} <= set(translate)
    assert translate["topp"]["maximum"] == 1
    score = schema["components"]["schemas"]["ScoreRequest"]["properties"]
    assert {"source", "target", "model", "timeout_s"} <= set(score)
    assert "/score" in schema["paths"]


# ------------------------------------------------------------------------------ fairness


def _recording_batcher(max_batch_tokens: int) -> tuple[Batcher, list]:
    calls: list = []

    class Recorder:
        def translate_ids(self, ids, prefixes=None, **overrides):
            calls.append([seq[0] for seq in ids])
            return [[(list(seq), -1.0)] for seq in ids]

    limits = ServeLimits(batch_window_ms=0, max_batch_tokens=max_batch_tokens,
                         max_queued_tokens=10_000)
    return Batcher(Recorder(), limits, concurrent.futures.ThreadPoolExecutor(1)), calls


def test_a_small_request_is_not_held_behind_a_burst():
    """Eight requests of 10 lines, then one of 1 line; a batch holds 4 lines (2 tokens
    each). In turns, the small request is in the third batch (before: after all 80 lines,
    the 21st), and every line comes back to its own request at its own position."""

    async def scenario():
        batcher, calls = _recording_batcher(max_batch_tokens=8)
        work = Work.translate(beam=1)
        burst = [batcher.submit([[100 * r + i] for i in range(10)], work, 60)
                 for r in range(8)]
        small = batcher.submit([[999]], work, 60)
        worker = asyncio.create_task(batcher.run())
        answer = await small.future
        results = [await job.future for job in burst]
        worker.cancel()
        return answer, results, calls

    answer, results, calls = asyncio.run(scenario())
    assert answer == [[([999], -1.0)]]
    assert [999 in call for call in calls].index(True) == 2  # the third batch
    assert calls[0] == [0, 100, 200, 300] and calls[1] == [400, 500, 600, 700]
    assert calls[2] == [999, 1, 101, 201]
    for r, job_results in enumerate(results):
        assert job_results == [[([100 * r + i], -1.0)] for i in range(10)]
    assert sum(len(call) for call in calls) == 81


def test_a_lone_request_still_decodes_in_one_batch_and_works_do_not_mix():
    async def scenario():
        batcher, calls = _recording_batcher(max_batch_tokens=100)
        lone = batcher.submit([[i] for i in range(20)], Work.translate(beam=1), 60)
        other = batcher.submit([[50], [51]], Work.translate(beam=2), 60)
        worker = asyncio.create_task(batcher.run())
        await lone.future
        await other.future
        worker.cancel()
        return calls, batcher.queued_tokens, batcher.queued_requests

    calls, tokens, requests = asyncio.run(scenario())
    assert calls == [list(range(20)), [50, 51]]
    assert tokens == 0 and requests == 0


def test_the_server_uses_the_checkpoints_decoding_defaults(runs, reverse_data, tmp_path,
                                                           monkeypatch):
    """A checkpoint whose decode.beam is 2 and decode.nbest 2: without beam/nbest in the
    request the server decodes as `ranmt translate` does (beam 2, two hypotheses), with
    them it follows the request; its literal beam 4 once overrode the checkpoint's."""
    import ranmt.inference.translator as translator_module
    from ranmt.checkpoint import load_checkpoint, save_checkpoint
    from ranmt.inference.decode import search_options
    from ranmt.inference.translator import Translator

    model, cfg, _, _ = load_checkpoint(runs["transf"])
    cfg.decode.beam, cfg.decode.nbest = 2, 2
    save_checkpoint(tmp_path / "beam2", model, cfg, {"src": reverse_data / "spm.src.model",
                                                     "tgt": reverse_data / "spm.tgt.model"})
    translator = Translator.load(tmp_path / "beam2", device="cpu")
    beams = []
    real_decoder = translator_module.ContinuousDecoder  # the server's step-level batching
    monkeypatch.setattr(translator_module, "ContinuousDecoder",
                        lambda model, options, **k: beams.append(
                            search_options(options, k).beam)
                        or real_decoder(model, options, **k))
    limits = ServeLimits(max_lines=10, max_chars=200, max_beam=8, batch_window_ms=1,
                         workers="thread")  # the spy is in this process
    with TestClient(create_app({"beam2": translator}, limits)) as client:
        default = client.post("/translate", json={"text": LINES}).json()
        assert beams and set(beams) == {2}
        assert all(len(entry["nbest"]) == 2 for entry in default["translations"])
        assert [entry["text"] for entry in default["translations"]] == \
            translator.translate(LINES)
        beams.clear()
        asked = client.post("/translate", json={"text": LINES, "beam": 5, "nbest": 1}).json()
        assert set(beams) == {5} and "nbest" not in asked["translations"][0]
        refused = client.post("/translate", json={"text": LINES, "nbest": 3})
        assert refused.status_code == 400
        assert "the beam size ('beam' = 2)" in refused.json()["error"]
