"""A new decoding option is one processor file: the toy option here (``toy_min_len``: no EOS
before that many tokens), a :class:`ranmt.inference.processors.Processor` that declares its
DecodeConfig field and lives only in this test file, reaches ``ranmt translate --help``,
the Python API (beam, greedy, sync-free and sampling searches), the server's OpenAPI schema
and its step-level batching with no other edit of ranmt, and comes off again when
unregistered."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import Tensor

from ranmt.config import DecodeConfig, decode_option
from ranmt.inference.decode import search
from ranmt.inference.processors import (
    PROCESSORS,
    Processor,
    StepRows,
    register_processor,
    unregister_processor,
)
from ranmt.inference.translator import Translator
from ranmt.model import EOS_ID

LINES = ["ab", "ba", "abc", "cab", "a", "bc"]
MIN_LEN = 7
"""Longer than every output of the trained reverse model on LINES, shorter than their limit
(1.2 |src| + 10 subwords)."""


class ToyMinLength(Processor):
    """No EOS while a row has written fewer than ``decode.toy_min_len`` tokens."""

    name, order = "toy_min_len", 15
    declares = {"toy_min_len": (int, decode_option(
        0, "toy: no EOS before this many output tokens (0: off)", ge=0, served=True,
        server_le=100))}

    def __init__(self, length: int):
        self.length = length

    @classmethod
    def build(cls, options: DecodeConfig, fixed_length: int | None) -> ToyMinLength | None:
        return cls(options.toy_min_len) if options.toy_min_len else None

    def __call__(self, logprobs: Tensor, rows: StepRows) -> None:
        early = rows.steps(logprobs.shape[0]).lt(self.length)  # (N,)
        logprobs[:, EOS_ID].masked_fill_(early, float("-inf"))


@pytest.fixture
def toy_option():
    """The toy processor registered for one test, removed afterwards."""
    register_processor(ToyMinLength)
    yield
    unregister_processor("toy_min_len")
    assert "toy_min_len" not in {f.name for f in dataclasses.fields(DecodeConfig)}
    assert "toy_min_len" not in PROCESSORS


def _shortest(hypotheses) -> int:
    return min(len(tokens) for hyps in hypotheses for tokens, _ in hyps)


def test_a_toy_processor_option_reaches_the_python_api(toy_option, reverse_run):
    translator = Translator.load(reverse_run, device="cpu")
    ids = translator.encode_sources(LINES)
    assert _shortest(translator.translate_ids(ids)) < MIN_LEN  # the option changes outputs
    for overrides in ({"beam": 4}, {"beam": 1}, {"beam": 3, "nbest": 3},
                      {"sampling": "topk", "topk": 5, "nbest": 2, "seed": 3}):
        off = translator.translate_ids(ids, **overrides)
        on = translator.translate_ids(ids, toy_min_len=MIN_LEN, **overrides)
        assert _shortest(off) < MIN_LEN and _shortest(on) >= MIN_LEN, overrides
    src = torch.nn.utils.rnn.pad_sequence([torch.tensor(line + [EOS_ID]) for line in ids],
                                          batch_first=True)
    for beam in (1, 3):  # the sync-free searches (a GPU's) apply it alike
        options = dataclasses.replace(translator.decode_config, beam=beam,
                                      toy_min_len=MIN_LEN)
        assert _shortest(search(translator.model, src, options, sync_free=True)) >= MIN_LEN
        assert search(translator.model, src, options, sync_free=True) == \
            search(translator.model, src, options, sync_free=False)


def test_a_toy_processor_option_reaches_step_level_batching(toy_option, reverse_run):
    translator = Translator.load(reverse_run, device="cpu")
    ids = translator.encode_sources(LINES)
    for beam in (1, 4):
        decoder, _ = translator.continuous_decoder(beam=beam, toy_min_len=MIN_LEN)
        for ticket, line in enumerate(ids):
            decoder.add(ticket, line)
            if ticket % 2:
                decoder.step()  # lines join a running batch at their own steps
        done = dict(decoder.run())
        assert _shortest(done.values()) >= MIN_LEN
        expected = translator.translate_ids(ids, beam=beam, toy_min_len=MIN_LEN)
        assert [done[i][0][0] for i in range(len(ids))] == [hyps[0][0] for hyps in expected]


def test_a_toy_processor_option_reaches_the_command_line(toy_option, reverse_run, tmp_path,
                                                          capsys):
    from ranmt.cli import build_parser, main

    with pytest.raises(SystemExit):
        build_parser().parse_args(["translate", "--help"])
    assert "--toy-min-len" in capsys.readouterr().out
    source, out = tmp_path / "in.txt", tmp_path / "out.txt"
    source.write_text("\n".join(LINES) + "\n")
    translator = Translator.load(reverse_run, device="cpu")
    main(["translate", "--checkpoint", str(reverse_run), "--input", str(source), "--output",
          str(out), "--device", "cpu", "--toy-min-len", str(MIN_LEN), "--quiet"])
    ids = translator.encode_sources(LINES)
    expected = translator.translate_ids(ids, toy_min_len=MIN_LEN)
    assert expected != translator.translate_ids(ids)  # the option changes outputs
    assert out.read_text().splitlines() == translator.tgt_vocab.decode(
        [hyps[0][0] for hyps in expected])


def test_a_toy_processor_option_reaches_the_server(toy_option, reverse_run):
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from ranmt.serving.app import ServeLimits, create_app

    translator = Translator.load(reverse_run, device="cpu")
    limits = ServeLimits(max_lines=10, max_chars=200, max_beam=8, batch_window_ms=1,
                         workers="thread")  # the toy processor is registered in this process
    with TestClient(create_app({"reverse": translator}, limits)) as client:
        schema = client.get("/openapi.json").json()["components"]["schemas"]
        field = schema["TranslateRequest"]["properties"]["toy_min_len"]
        assert "no EOS before" in field["description"] and field["maximum"] == 100
        answer = client.post("/translate", json={"text": LINES, "toy_min_len": MIN_LEN})
        assert answer.status_code == 200, answer.text
        ids = translator.encode_sources(LINES)
        expected = translator.translate_ids(ids, toy_min_len=MIN_LEN)
        assert _shortest(expected) >= MIN_LEN > _shortest(translator.translate_ids(ids))
        assert [entry["text"] for entry in answer.json()["translations"]] == \
            translator.tgt_vocab.decode([hyps[0][0] for hyps in expected])
        refused = client.post("/translate", json={"text": LINES, "toy_min_len": -1})
        assert refused.status_code in (400, 422)
