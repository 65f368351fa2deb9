"""What keeps ``ranmt serve``'s refusals fast under a burst (SERVING.md, "Run 5"): a request
that cannot fit is refused from a lower bound of its tokens before it is tokenized
(:func:`ranmt.serving.batching.fewest_tokens`, which must never exceed the real count), the
plain-ASGI gate in front of the routes (405, 401, metrics, also for a route that fails),
and the served process's heap frozen once the models are warm."""

from __future__ import annotations

import gc
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("fastapi")

from fastapi.testclient import TestClient  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from ranmt.data.vocab import Vocab, train_sentencepiece  # noqa: E402
from ranmt.inference.translator import Translator, _encode_lines  # noqa: E402
from ranmt.serving.app import ServeLimits, create_app  # noqa: E402
from ranmt.serving.batching import (  # noqa: E402
    Batcher,
    Job,
    QueueFullError,  # noqa: E402
    Work,
    fewest_tokens,
)

WORDS = ["the", "dog", "runs", "über", "straße", "grün", "café", "Tokyo", "東京", "42",
         "snake_case", "naïve", "Ωmega", "ﬁsh"]


@pytest.fixture(scope="module")
def word_vocab(tmp_path_factory) -> Vocab:
    """A SentencePiece model (ranmt's options) whose pieces are whole words: the case where
    a run of letters yields exactly one subword, so the bound is tight."""
    rng = random.Random(0)
    lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 12)))
             for _ in range(3000)]
    path = tmp_path_factory.mktemp("vocab") / "words.model"
    train_sentencepiece(lines, path, vocab_size=120)
    vocab = Vocab(path)
    assert len(vocab.encode(["the dog runs"])[0]) == 3  # whole words are single pieces
    return vocab


def _job_tokens(vocab: Vocab, lines: list[str]) -> int:
    """What the queue counts for ``lines`` once tokenized as the server tokenizes them."""
    return Job(_encode_lines(vocab, lines), Work("score"), None, None, 0.0).tokens


def test_fewest_tokens_exact_values():
    assert fewest_tokens([]) == 0
    assert fewest_tokens(["", "   "]) == 2  # an EOS each
    assert fewest_tokens(["a b c"]) == 4
    assert fewest_tokens(["  a   b  ", "c"]) == 3 + 2
    assert fewest_tokens([". , !"]) == 1  # no letter or digit: perhaps no subword of its own
    assert fewest_tokens(["x\x1fy", "x\u00a0y", "x\ty"]) == 3 * 2  # only ASCII spaces split
    assert fewest_tokens(["snake_case 42 ü"]) == 1 + 3


def test_fewest_tokens_is_tight_for_whole_word_pieces(word_vocab):
    lines = ["the dog runs", "über straße 42", "東京 café"]
    assert fewest_tokens(lines) == _job_tokens(word_vocab, lines) == 3 + 3 + 3 + 2


_SPACES = " \t\n\r\x0b\x0c\x1c\x1f\x85\xa0\u1680\u2000\u2028\u2029\u202f\u3000"
_ODD = "\x00\x01\x7f\u200b\u200d\ufeff\u00ad\u0301\u0308.,;!?-_'\"()"
_LINE = st.lists(st.one_of(st.sampled_from(WORDS), st.sampled_from(list(_SPACES)),
                           st.sampled_from(list(_ODD)), st.text(max_size=3)),
                 max_size=12).map("".join)


@settings(max_examples=300, deadline=None)
@given(st.lists(_LINE, max_size=4))
def test_fewest_tokens_never_exceeds_the_tokenized_count(word_vocab, lines):
    """Whole-word pieces, every kind of Unicode space, control and format characters,
    combining marks, compatibility forms (``ﬁ``), random text: the bound holds."""
    assert fewest_tokens(lines) <= _job_tokens(word_vocab, lines)


def test_fewest_tokens_never_exceeds_the_count_of_the_served_models(translators):
    vocab = translators["transf"].src_vocab
    rng = random.Random(1)
    lines = [" ".join(rng.choice(WORDS + ["a", "b c", "d"]) for _ in range(rng.randint(0, 9)))
             for _ in range(200)]
    for start in range(0, 200, 10):
        chunk = lines[start:start + 10]
        assert fewest_tokens(chunk) <= _job_tokens(vocab, chunk)


def test_refuse_if_full_applies_submits_rule_to_the_bound():
    batcher = Batcher(object(), ServeLimits(max_queued_tokens=10), None, None, name="m")
    batcher.refuse_if_full(50)  # an empty queue takes anything
    batcher.queued_tokens = 5
    batcher.refuse_if_full(5)  # 5 + 5 = 10: fits exactly
    with pytest.raises(QueueFullError) as refused:
        batcher.refuse_if_full(6)
    assert refused.value.status == 503 and "5 source tokens queued" in refused.value.message
    batcher.queued_tokens = 10
    with pytest.raises(QueueFullError):
        batcher.refuse_if_full()  # at the limit, even with no bound


def test_a_request_that_cannot_fit_is_refused_before_it_is_tokenized(translators, monkeypatch):
    """The queue holds a request the slow decoder has not started; a second request whose
    bound alone overflows the queue gets 503 without being tokenized, one that fits is
    tokenized and queued."""
    from ranmt.serving import app as served_app

    started, release = threading.Event(), threading.Event()
    original = Translator.translate_ids

    def held(self, ids, *args, **kwargs):
        started.set()
        release.wait(30)
        return original(self, ids, *args, **kwargs)

    tokenized: list[list[str]] = []
    source_ids = served_app._source_ids

    def counting(translator, lines):
        tokenized.append(lines)
        return source_ids(translator, lines)

    monkeypatch.setattr(Translator, "translate_ids", held)
    monkeypatch.setattr(served_app, "_source_ids", counting)
    limits = ServeLimits(batch_window_ms=1, max_queued_tokens=12, batching="batch")
    app = create_app({"m": translators["transf"]}, limits)
    # three threads: the first two requests block theirs until the release
    with TestClient(app) as client, ThreadPoolExecutor(3) as pool:
        batcher = app.state.served.batchers["m"]
        first = pool.submit(client.post, "/translate", json={"text": ["a b"]})
        assert started.wait(30)  # the first batch decodes (held); the queue is empty again
        second = pool.submit(client.post, "/translate", json={"text": ["a b c"]})  # 4 queued
        deadline = time.monotonic() + 30
        while batcher.queued_tokens == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(tokenized) == 2
        big = client.post("/translate", json={"text": ["a b c d e f g h i"]})  # >= 10 > 8
        assert big.status_code == 503 and int(big.headers["Retry-After"]) >= 1
        assert len(tokenized) == 2  # refused from the bound: never tokenized
        fits = pool.submit(client.post, "/translate", json={"text": ["d e"]})  # 4 + 3 <= 12
        deadline = time.monotonic() + 30
        while len(tokenized) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(tokenized) == 3  # tokenized while the first batch still decodes
        release.set()
        assert [f.result().status_code for f in (first, second, fits)] == [200, 200, 200]
        assert len(tokenized) == 3


def _requests_total(client, **labels) -> float:
    for family in text_string_to_metric_families(client.get("/metrics").text):
        for sample in family.samples:
            if sample.name == "ranmt_requests_total" and all(
                    sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0


def test_a_route_that_fails_is_answered_500_and_counted(translators, monkeypatch):
    from ranmt.serving import app as served_app

    def broken(*_args, **_kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(served_app, "_source_ids", broken)
    app = create_app({"m": translators["transf"]}, ServeLimits(batch_window_ms=1))
    with TestClient(app, raise_server_exceptions=False) as client:
        assert client.post("/translate", json={"text": ["a b"]}).status_code == 500
        assert _requests_total(client, endpoint="/translate", status="500") == 1
        assert client.get("/translate").status_code == 405
        assert _requests_total(client, endpoint="/translate", status="405") == 1
        assert client.get("/nowhere.css").status_code == 404
        assert _requests_total(client, endpoint="static", status="404") == 1


def test_the_heap_is_frozen_once_the_models_are_warm_only_when_asked(translators):
    gc.unfreeze()
    try:
        with TestClient(create_app(translators, ServeLimits(batch_window_ms=1))) as client:
            assert client.get("/ready").status_code == 200
            assert gc.get_freeze_count() == 0
        app = create_app(translators, ServeLimits(batch_window_ms=1), freeze_heap=True)
        with TestClient(app) as client:
            assert client.get("/ready").status_code == 200
            assert gc.get_freeze_count() > 1000  # the models, the libraries, the app
            assert client.post("/translate", json={"text": ["a b c"]}).status_code == 200
    finally:
        gc.unfreeze()
