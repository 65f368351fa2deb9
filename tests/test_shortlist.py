"""The lexical shortlist: built by hand-countable co-occurrence, and decoding restricted to it
gives what the full output layer gives whenever the full choice is in the list."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from conftest import assert_same_hypotheses, random_batch, tiny_model
from ranmt.cli import main
from ranmt.data.corpus import raw_text
from ranmt.inference.decode import search
from ranmt.inference.shortlist import (
    SHORTLIST_FILE,
    RestrictedOutput,
    Shortlist,
    shortlist_from_pairs,
)
from ranmt.inference.translator import Translator


def _pairs(*pairs):
    return [(np.array(src), np.array(tgt)) for src, tgt in pairs]


def test_shortlist_of_a_hand_made_corpus_equals_the_hand_count():
    # source 5 occurs in pairs 1-3, target 7 in 1-3, target 8 in 1 and 4, target 9 in 2.
    corpus = _pairs(([5, 6], [7, 8]), ([5, 5], [7, 9]), ([5], [7]), ([6], [8, 8]))
    shortlist = shortlist_from_pairs(corpus, src_vocab=8, tgt_vocab=10, k=2, frequent=1)
    # Dice(5, t) = 2 c(5, t) / (c(5) + c(t)): t=7: 2*3/(3+3) = 1; t=8: 2*1/(3+2) = 0.4;
    # t=9: 2*1/(3+1) = 0.5 -> 7 then 9.
    assert shortlist.candidates[5].tolist() == [7, 9]
    # Dice(6, 8) = 2*2/(2+2) = 1, Dice(6, 7) = 2*1/(2+3) = 0.4; nothing else.
    assert shortlist.candidates[6].tolist() == [8, 7]
    assert shortlist.candidates[0].tolist() == [-1, -1]  # never seen
    assert shortlist.frequent.tolist() == [7]  # in 3 pairs (8 in 2)
    vocabulary = shortlist.vocabulary(torch.tensor([[6, 0, 0]]))
    assert vocabulary.tolist() == [0, 1, 2, 3, 7, 8]  # specials first, then sorted


def test_restricted_output_has_the_full_argmax_when_the_list_holds_it():
    model, _ = tiny_model()
    src, _ = random_batch(batch=3)
    memory, pad_mask, _ = model.encode(src)
    full = model.decode_step(torch.full((3, 1), 2), model.init_cache(memory, pad_mask))
    best = full.argmax(-1)
    vocabulary = torch.unique(torch.cat([torch.arange(4), best, torch.tensor([10, 20, 30])]))
    restricted = RestrictedOutput(model, vocabulary)
    picked = restricted.decode_step(torch.full((3, 1), 2),
                                    restricted.init_cache(memory, pad_mask))
    assert torch.equal(vocabulary[picked.argmax(-1)], best)
    # the restricted scores are the full logits renormalised over the list
    logits = torch.log_softmax(full[:, vocabulary], -1)
    torch.testing.assert_close(picked, logits)
    # and without the best token the restricted choice is another one
    without = vocabulary[vocabulary != best[0]]
    other = RestrictedOutput(model, without)
    step = other.decode_step(torch.full((3, 1), 2), other.init_cache(memory, pad_mask))
    assert without[step[0].argmax()] != best[0]


def test_greedy_search_over_a_list_holding_its_path_is_the_full_search(reverse_run,
                                                                       reverse_data):
    """Every step's full argmax is in the list, so each restricted step picks it: the same
    output, fed back as indices into the list (which here differ from the ids)."""
    translator = Translator.load(reverse_run, device="cpu")
    lines = translator.encode_sources(raw_text(reverse_data, "test", "src")[:8])
    src = torch.nn.utils.rnn.pad_sequence([torch.tensor(ids + [3]) for ids in lines],
                                          batch_first=True)
    full = search(translator.model, src, beam=1)
    path = {token for sentence in full for token in sentence[0][0]}
    assert len(path) >= 5
    vocabulary = torch.tensor(sorted(set(range(4)) | path))
    assert vocabulary.tolist() != list(range(len(vocabulary)))
    restricted = search(RestrictedOutput(translator.model, vocabulary), src, beam=1)
    ids = vocabulary.tolist()
    assert [[ids[t] for t in sentence[0][0]] for sentence in restricted] == \
        [sentence[0][0] for sentence in full]


@pytest.mark.parametrize("beam", [1, 4])
def test_a_shortlist_of_every_token_decodes_exactly_as_the_full_layer(beam):
    model, _ = tiny_model(seed=2)
    src, _ = random_batch(batch=4, src_len=8, seed=3)
    everything = RestrictedOutput(model, torch.arange(40))
    args = dict(beam=beam, max_len_a=1.5, max_len_b=4, nbest=beam)
    assert_same_hypotheses(search(everything, src, **args), search(model, src, **args), 1e-5)


def test_translate_with_the_shortlist_of_the_training_data(reverse_run, reverse_data,
                                                           tmp_path):
    """Greedy search with the shortlist gives the full layer's output for every line whose
    full output lies in the line's shortlist (the batch's vocabulary holds the line's); the
    shortlist built from the training data holds nearly all of them."""
    shortlisted = tmp_path / "shortlisted"
    shutil.copytree(reverse_run, shortlisted, symlinks=True)
    main(["shortlist", "--data", str(reverse_data), "--out", str(shortlisted), "--k", "6",
          "--frequent", "4"])
    shortlist = Shortlist.load(shortlisted / SHORTLIST_FILE)
    assert shortlist.candidates.shape[1] == 6 and len(shortlist.frequent) == 4
    full = Translator.load(shortlisted, device="cpu", beam=1)
    restricted = Translator.load(shortlisted, device="cpu", beam=1, shortlist=True)
    sources = full.encode_sources(raw_text(reverse_data, "test", "src")[:60])
    expected = full.translate_ids(sources)
    got = restricted.translate_ids(sources)
    covered = 0
    for source, want, have in zip(sources, expected, got):
        allowed = set(shortlist.vocabulary(torch.tensor([source])).tolist())
        if set(want[0][0]) <= allowed:
            covered += 1
            assert have[0][0] == want[0][0]
    assert covered >= 54, covered  # the test is not vacuous
    run = tmp_path / "no-shortlist"
    run.symlink_to(reverse_run, target_is_directory=True)
    with pytest.raises(FileNotFoundError, match="ranmt shortlist"):
        Translator.load(run, device="cpu", shortlist=True).translate(["a b"])


@pytest.mark.parametrize("kind", ["tied", "untied", "int8", "int8 int_mm"])
def test_restricted_output_layer_equals_the_full_layers_columns(kind):
    """The restricted output layer (weight rows taken and packed once per batch: oneDNN for
    float32, fbgemm for int8; the traced int8 form takes the rows) gives the full layer's
    logits at the listed ids: the int8 one exactly (same int8 rows, same scales,
    activations quantized alike), float32 up to summation order."""
    import contextlib

    from ranmt.inference.quantize import int8_kernel, quantize_model

    model, _ = tiny_model(seed=4, **({"model.tie_output": "false"} if kind == "untied" else {}))
    model.eval()
    if kind.startswith("int8"):
        model = quantize_model(model, "int8")
    decoder = model.decoder
    assert (decoder.output is None) == (kind == "tied")
    vocabulary = torch.tensor([0, 1, 2, 3, 9, 17, 18, 33])
    hidden = torch.randn(5, 2, model.config.d_model)
    kernel = int8_kernel("int_mm") if kind == "int8 int_mm" else contextlib.nullcontext()
    with torch.inference_mode(), kernel:
        full = decoder.project(hidden)[..., vocabulary]
        restricted = decoder.restricted_output(vocabulary)(hidden)
    assert restricted.shape == (5, 2, len(vocabulary))
    if kind.startswith("int8"):
        assert torch.equal(restricted, full)
    else:
        torch.testing.assert_close(restricted, full, rtol=1e-5, atol=1e-5)


def test_the_server_decodes_with_the_shortlist_when_asked(reverse_run, reverse_data, tmp_path,
                                                          monkeypatch):
    """`shortlist` is a request field (declared served in DecodeConfig): asked for, the
    model's step-level decoder gets its shortlist and greedy answers keep the full layer's
    output wherever a line's list holds it; asked of a model without one, a 400 naming it."""
    from fastapi.testclient import TestClient

    import ranmt.inference.translator as translator_module
    from ranmt.serving.app import ServeLimits, create_app

    shortlisted = tmp_path / "shortlisted"
    shutil.copytree(reverse_run, shortlisted, symlinks=True)
    main(["shortlist", "--data", str(reverse_data), "--out", str(shortlisted), "--k", "6",
          "--frequent", "4"])
    translators = {"listed": Translator.load(shortlisted, device="cpu", beam=1),
                   "bare": Translator.load(reverse_run, device="cpu", beam=1)}
    given = []
    real = translator_module.ContinuousDecoder
    monkeypatch.setattr(translator_module, "ContinuousDecoder",
                        lambda model, options, **k: given.append(k.get("lexical_shortlist"))
                        or real(model, options, **k))
    lines = raw_text(reverse_data, "test", "src")[:20]
    limits = ServeLimits(workers="thread", batch_window_ms=1)
    with TestClient(create_app(translators, limits)) as client:
        full = client.post("/translate", json={"text": lines, "model": "listed"}).json()
        listed = client.post("/translate", json={"text": lines, "model": "listed",
                                                 "shortlist": True}).json()
        refused = client.post("/translate", json={"text": ["a b"], "model": "bare",
                                                  "shortlist": True})
    assert given[0] is None and isinstance(given[-1], Shortlist)
    shortlist = Shortlist.load(shortlisted / SHORTLIST_FILE)
    src_vocab, tgt_vocab = translators["listed"].src_vocab, translators["listed"].tgt_vocab
    covered = 0
    for line, want, have in zip(lines, full["translations"], listed["translations"]):
        allowed = set(shortlist.vocabulary(torch.tensor([src_vocab.encode([line])[0]])).tolist())
        if set(tgt_vocab.encode([want["text"]])[0]) <= allowed:
            covered += 1
            assert have["text"] == want["text"]
    assert covered >= 15, covered
    assert refused.status_code == 400
    assert refused.json()["error"].startswith("'shortlist': model 'bare' has no lexical")
