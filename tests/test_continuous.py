"""Step-level batching (``ranmt.inference.continuous``): lines joining a running batch
between steps and leaving it as they finish get what they get decoded alone.

For every decoder-side attention: lines that join after 0, 2 and 5 steps, with sources
longer and shorter than those already running, give each the n-best tokens (identical) and
scores (within 1e-4) of the shrinking search run on that line alone, in greedy and beam
search; prefixes, ensembles and int8/bf16 copies too; sampling with a generator per request
draws the same samples alone, in company and as :func:`ranmt.inference.sampling.sample`.
"""

from __future__ import annotations

import pytest
import torch

from conftest import assert_same_hypotheses, tiny_model
from ranmt.data.batching import pad_sources
from ranmt.inference.continuous import ContinuousDecoder, merge_caches
from ranmt.inference.decode import search
from ranmt.inference.sampling import Sampler, sample
from ranmt.model import EOS_ID
from test_fast_decode import DECODERS, SELF, _model


def _lines(count: int, seed: int, min_len: int = 2, max_len: int = 12) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (count,), generator=gen).tolist()
    return [torch.randint(4, 40, (length,), generator=gen).tolist() for length in lengths]


def _alone(model, ids, prefix=None, **args):
    prefix_tensor = None if not prefix else torch.tensor([prefix])
    return search(model, pad_sources([ids]), prefix=prefix_tensor, **args)[0]


def _staggered(decoder: ContinuousDecoder, waves: list[list[list[int]]], gap: int,
               prefixes: dict | None = None) -> dict:
    """Add wave w of lines after w * gap steps; step to the end; results by line id."""
    results, number = {}, 0
    for wave in waves:
        for ids in wave:
            decoder.add(number, ids, (prefixes or {}).get(number))
            number += 1
        for _ in range(gap):
            results.update(dict(decoder.step()))
    results.update(dict(decoder.run()))
    return results


@pytest.mark.parametrize(("self_attention", "cross"), DECODERS)
def test_joining_lines_get_their_decoding_alone(self_attention, cross):
    model = _model(self_attention, cross, 0)
    # A first wave of mid-length lines, then lines longer and shorter than those running.
    waves = [_lines(3, 1, 5, 8), _lines(2, 2, 10, 14), _lines(3, 3, 1, 3)]
    flat = [ids for wave in waves for ids in wave]
    for beam, gap in ((1, 2), (3, 2), (4, 5)):
        args = dict(beam=beam, lenpen=0.6, max_len_a=1.5, max_len_b=4, nbest=beam)
        decoder = ContinuousDecoder(model, **args)
        results = _staggered(decoder, waves, gap)
        assert sorted(results) == list(range(len(flat)))
        for number, ids in enumerate(flat):
            assert_same_hypotheses([results[number]], [_alone(model, ids, **args)], tolerance=1e-4)
        assert decoder.idle() and decoder.cache is None


@pytest.mark.parametrize("arch", ["transf", "ran-all", "ran-d", "hc-all", "sh-x", "syn-r",
                                  "aan-d", "ssru-d"])
def test_joining_with_early_eos_prefixes_and_fairseq_penalty(arch):
    """Hypotheses ending at many different steps (EOS likelier), forced prefixes on some
    lines of each wave, a line joining every step."""
    model, _ = tiny_model(seed=3, **{"model.arch": arch})
    with torch.no_grad():
        model.decoder.embedder.tokens.weight[EOS_ID] *= 4.0  # tied output: EOS likelier
    waves = [[ids] for ids in _lines(7, 4, 2, 11)]
    prefixes = {1: [5, 6, 7], 4: [9], 5: [11, 12]}
    for beam, style in ((1, "gnmt"), (3, "fairseq")):
        args = dict(beam=beam, lenpen=0.6, lenpen_style=style, max_len_a=1.2, max_len_b=6,
                    nbest=beam)
        results = _staggered(ContinuousDecoder(model, **args), waves, 1, prefixes)
        lengths = set()
        for number, ids in enumerate(ids for wave in waves for ids in wave):
            alone = _alone(model, ids, prefixes.get(number), **args)
            assert_same_hypotheses([results[number]], [alone], tolerance=1e-4)
            lengths |= {len(tokens) for tokens, _ in alone}
        assert len(lengths) > 2
        assert results[1][0][0][:3] == [5, 6, 7] and results[5][0][0][:2] == [11, 12]


def test_ensemble_lines_join_and_leave():
    from ranmt.inference.ensemble import Ensemble

    ensemble = Ensemble([_model("ran", "dot", 0), _model("dot", "dot", 1)])
    waves = [_lines(2, 5), _lines(2, 6, 9, 13)]
    for beam in (1, 3):
        args = dict(beam=beam, nbest=beam, max_len_b=4)
        results = _staggered(ContinuousDecoder(ensemble, **args), waves, 3)
        for number, ids in enumerate(ids for wave in waves for ids in wave):
            assert_same_hypotheses([results[number]], [_alone(ensemble, ids, **args)],
                                   tolerance=1e-4)


@pytest.mark.parametrize("arch", ["transf", "ran-all"])
def test_bf16_copies_join_and_leave(arch):
    """The inference copy of ``--precision bf16``: joining lines get the hypotheses the
    same copy gives them alone; scores within 0.05 (bf16 rows round differently in other
    matrix shapes)."""
    model, _ = tiny_model(seed=2, **{"model.arch": arch})
    model = model.to(torch.bfloat16)
    waves = [_lines(3, 10, 4, 8), _lines(2, 11, 9, 12), _lines(2, 12, 1, 3)]
    args = dict(beam=3, nbest=2, max_len_b=4)
    results = _staggered(ContinuousDecoder(model, **args), waves, 2)
    for number, ids in enumerate(ids for wave in waves for ids in wave):
        assert_same_hypotheses([results[number]], [_alone(model, ids, **args)], tolerance=0.05)


def test_int8_copy_decodes_a_line_as_alone(reverse_run):
    """The inference copy of ``--quantize int8``: a line alone in the step-level decoder
    gets what the batch-level search gives it alone (the same fused int8 products: with
    the keys and values of the cross-attention quantized apart, it once did not). In
    company no equality is promised: dynamic int8 quantizes each product's activations with
    one scale for all its rows, so a line's output depends on what it is decoded with, in
    batch-level decoding as well."""
    from ranmt.inference.translator import Translator

    translator = Translator.load(reverse_run, device="cpu", quantize="int8")
    for text in ("abcde", "hgf", "gfedcbah", "ab"):
        ids = translator.encode_sources([text])[0]
        decoder, _ = translator.continuous_decoder(beam=4, nbest=2)
        decoder.add(0, ids)
        assert_same_hypotheses([decoder.run()[0][1]],
                               translator.translate_ids([ids], beam=4, nbest=2), tolerance=1e-4)
    decoder, _ = translator.continuous_decoder(beam=4)
    results = _staggered(decoder, [translator.encode_sources(["abcde", "hgf"]),
                                   translator.encode_sources(["gfedcbah", "ab"])], 2)
    assert sorted(results) == [0, 1, 2, 3]


def test_sampling_draws_per_request_whatever_the_company():
    model = _model("ran", "dot", 0)
    sampler = Sampler("topk", topk=5)
    lines = _lines(3, 7)
    # Alone: each sample of a line is a row drawn with the request's generator, as sample().
    decoder = ContinuousDecoder(model, beam=1, max_len_b=4, pick=sampler.pick)
    generator = torch.Generator().manual_seed(11)
    for number, ids in enumerate(lines):
        for draw in range(2):
            decoder.add((number, draw), ids, generator=generator)
    alone = dict(decoder.run())
    expected = sample(model, pad_sources(lines), sampler, samples=2, seed=11, max_len_b=4)
    for number in range(len(lines)):
        assert_same_hypotheses([[alone[number, 0][0], alone[number, 1][0]]], [expected[number]])
    # In company: other requests join before and after; the first request's draws stay.
    decoder = ContinuousDecoder(model, beam=1, max_len_b=4, pick=sampler.pick)
    decoder.add("other", _lines(1, 8)[0], generator=torch.Generator().manual_seed(1))
    decoder.step()
    generator = torch.Generator().manual_seed(11)
    for number, ids in enumerate(lines):
        for draw in range(2):
            decoder.add((number, draw), ids, generator=generator)
    decoder.add("late", _lines(1, 9)[0], generator=torch.Generator().manual_seed(2))
    company = dict(decoder.run())
    for key, hyps in alone.items():
        assert_same_hypotheses([company[key]], [hyps])


def test_queue_checks_and_cache_merge_errors():
    model = _model("dot", "dot", 0)
    decoder = ContinuousDecoder(model, beam=2)
    with pytest.raises(ValueError, match="empty line"):
        decoder.add(0, [])
    with pytest.raises(ValueError, match="generator"):
        decoder.add(0, [5, 6], generator=torch.Generator())
    assert decoder.step() == [] and decoder.idle()
    with pytest.raises(ValueError, match="cannot merge"):
        merge_caches({"k": torch.zeros(1)}, {"v": torch.zeros(1)})


def test_queued_lines_wait_at_most_join_wait_steps_for_company():
    """join_wait 2: a line queued behind a running batch joins at the second step (one
    cache copy for lines that arrive a step apart); with lines for a quarter of the batch
    queued it joins at once; an empty batch takes a line at once."""
    model = _model("dot", "dot", 0)
    decoder = ContinuousDecoder(model, beam=2, max_len_b=30, fixed_length=20, join_wait=2)
    for number, ids in enumerate(_lines(8, 13, 5, 8)):
        decoder.add(number, ids)
    decoder.step()
    assert decoder.decoding == 8 and not decoder.waiting  # an empty batch: at once
    decoder.add("late", [5, 6, 7])
    decoder.step()
    assert decoder.decoding == 8 and len(decoder.waiting) == 1  # waits one step
    decoder.step()
    assert decoder.decoding == 9 and not decoder.waiting
    for name in "abc":  # lines for a quarter of the batch or more: at once
        decoder.add(name, [5, 6])
    decoder.step()
    assert decoder.decoding == 12 and not decoder.waiting


@pytest.mark.parametrize("self_attention", SELF)
def test_histories_up_to_the_models_last_position(self_attention):
    """Outputs forced to the model's longest (``fixed_length`` = max_positions - 1), lines
    joining 3 steps apart: the histories reach and pass the learned matrices' length
    (beam search trims a history to span + 1 slots at each reorder; greedy search grows
    it 8 slots at a time) and every line still gets its decoding alone."""
    model = tiny_model(0, **{"model.decoder.self_attention": self_attention,
                             "model.max_positions": 20})[0]
    waves = [_lines(2, 4, 3, 6), _lines(2, 5, 8, 12)]
    flat = [ids for wave in waves for ids in wave]
    for beam in (1, 3):
        args = dict(beam=beam, max_len_b=40, fixed_length=19, nbest=beam)
        results = _staggered(ContinuousDecoder(model, **args), waves, 3)
        for number, ids in enumerate(flat):
            assert len(results[number][0][0]) == 19
            assert_same_hypotheses([results[number]], [_alone(model, ids, **args)],
                                   tolerance=1e-4)


def test_fixed_length_and_prefixes_past_the_length_limit():
    """A fixed length, and forced prefixes, longer than ``max_len_a * |src| + max_len_b``:
    the line's output limit is the fixed length (or grows to hold the prefix), as decoded
    alone."""
    model = _model("ran", "dot", 0)
    lines = _lines(4, 8, 2, 4)
    prefixes = {0: [5, 6, 7, 8, 9, 10, 11], 2: [12, 13, 14, 15, 16, 17]}
    for beam in (1, 3):
        for fixed_length, extra in ((9, {}), (None, {"prefixes": prefixes})):
            args = dict(beam=beam, max_len_a=0.0, max_len_b=2, fixed_length=fixed_length,
                        nbest=beam)
            results = _staggered(ContinuousDecoder(model, **args), [lines[:2], lines[2:]], 2,
                                 extra.get("prefixes"))
            for number, ids in enumerate(lines):
                prefix = extra.get("prefixes", {}).get(number)
                alone = _alone(model, ids, prefix, **args)
                assert_same_hypotheses([results[number]], [alone], tolerance=1e-4)
                longest = max(len(tokens) for tokens, _ in alone)
                if fixed_length:
                    assert longest == 9
                elif prefix:
                    assert longest >= len(prefix) > 2


def test_beam_reorders_keep_histories_to_what_the_next_step_reads():
    """After every beam-search step (a line joining or not) each self-attention history
    holds the kept sentences' longest history + 1 slots: room for every row's next
    position, and no more (not the step's span + 1 once the oldest line has left)."""
    model = _model("dot", "dot", 0)
    decoder = ContinuousDecoder(model, beam=3, max_len_b=8, join_wait=1)
    lines = _lines(6, 9, 3, 9)
    checked = 0
    for step in range(40):
        if step % 3 == 0 and lines:
            decoder.add(step, lines.pop())
        decoder.step()
        if decoder.sentences is None:
            continue
        slots = int(decoder.sentences.steps.max()) + 1
        for layer in decoder.cache.layers:
            assert {tensor.shape[2] for _, tensor in layer.self_attention.row_tensors()} == {slots}
        checked += 1
    assert checked > 10 and decoder.idle()


@pytest.mark.parametrize("self_attention", SELF)
def test_history_slots_past_a_rows_position_are_never_read(self_attention, monkeypatch):
    """Reorders copy each row's written slots only (``history_plan``) and leave the others
    as the buffer held them: with those slots filled with a large value instead of an
    earlier history's, every line still gets its decoding alone (no variant reads a slot
    past its row's position), and the histories were cut to runs (fewer slots copied)."""
    from ranmt.attention import base

    gathered, runs = base._gathered_view, []

    def poisoned(cache, name, shape, like):
        return gathered(cache, name, shape, like).fill_(1e4)

    planned = base.history_plan

    def recorded(*args, **kwargs):
        plan = planned(*args, **kwargs)
        runs.append(plan)
        return plan

    monkeypatch.setattr(base, "_gathered_view", poisoned)
    monkeypatch.setattr(base, "HISTORY_RUN_WASTE", 0)  # a run per position: most slots left
    monkeypatch.setattr("ranmt.inference.continuous.history_plan", recorded)
    model = _model(self_attention, "dot", 0)
    waves = [_lines(3, 1, 5, 8), _lines(2, 2, 10, 14), _lines(3, 3, 1, 3)]
    args = dict(beam=3, lenpen=0.6, max_len_a=1.5, max_len_b=4, nbest=3)
    results = _staggered(ContinuousDecoder(model, **args), waves, 2)
    for number, ids in enumerate(ids for wave in waves for ids in wave):
        assert_same_hypotheses([results[number]], [_alone(model, ids, **args)], tolerance=1e-4)
    short = [plan for plan in runs if any(slots < plan.length - 1 for *_, slots in plan.runs)]
    assert len(short) > 10


def test_ran_weights_of_rows_at_their_own_positions():
    """RAN's decoder self-attention, rows at positions p_r (step-level batching): weights
    (B, H, 1, span) are rows p_r of the causal matrices, up to the span; the output equals
    each row's step alone."""
    from ranmt.attention.cache import AttentionCache

    model = _model("ran", "dot", 0)
    attention = model.decoder.layers[1].self_attention
    positions = torch.tensor([2, 0, 3, 1])
    cache = AttentionCache(positions=positions, span=4)
    values = torch.randn(4, 1, model.config.d_model)
    with torch.no_grad():
        for step in range(4):  # histories written at every row's slots up to its position
            cache.positions = torch.minimum(positions, torch.tensor(step))
            out = attention(values, values, cache=cache, need_weights=True)
    probs = attention.inference_causal_probs()
    assert out.weights.shape == (4, probs.shape[0], 1, 4)
    for row, position in enumerate(positions.tolist()):
        assert torch.equal(out.weights[row, :, 0], probs[:, position, :4])


@pytest.mark.parametrize("beam", [1, 3])
def test_step_level_decoding_makes_its_tensors_on_the_models_device(beam):
    """As for the searches (``test_fast_decode``): with the default device set to ``meta``
    a tensor made on it instead of the model's device would mix devices and fail; lines
    joining, leaving, with prefixes and a fixed length decode as they do without, over
    every decoder-side variant."""
    waves = [_lines(3, 11, 4, 8), _lines(3, 12, 1, 10)]
    for self_attention, cross in DECODERS:
        model = _model(self_attention, cross, 5)
        for options in ({}, {"fixed_length": 6}):
            args = dict(beam=beam, max_len_a=1.5, max_len_b=4, nbest=beam, join_wait=1,
                        **options)
            prefixes = {1: [5, 6], 4: [7]}
            expected = _staggered(ContinuousDecoder(model, **args), waves, 2, prefixes)
            with torch.device("meta"):
                got = _staggered(ContinuousDecoder(model, **args), waves, 2, prefixes)
            assert got == expected


@pytest.mark.parametrize(("self_attention", "cross"), [("dot", "dot"), ("ran", "dot"),
                                                       ("dot", "gaussian")])
def test_cancelled_lines_leave_and_the_others_decode_as_alone(self_attention, cross):
    """Lines dropped mid-decoding (the server's deadline) leave the batch between two steps
    (queued ones too); every other line still gets its decoding alone, and a batch whose
    lines are all dropped is empty."""
    model = _model(self_attention, cross, 0)
    lines = _lines(5, 7, 4, 10)
    for beam in (1, 3):
        args = dict(beam=beam, lenpen=0.6, max_len_a=1.5, max_len_b=4, nbest=beam)
        decoder = ContinuousDecoder(model, **args)
        for number, ids in enumerate(lines[:4]):
            decoder.add(number, ids)
        results = dict(decoder.step())
        results.update(decoder.step())
        decoder.add(4, lines[4])  # queued: dropped before it joins
        assert decoder.cancel({1, 3, 4, 99}) == 3
        assert decoder.decoding == 2 and not decoder.waiting
        results.update(decoder.run())
        assert sorted(results) == [0, 2]
        for number in (0, 2):
            assert_same_hypotheses([results[number]], [_alone(model, lines[number], **args)],
                                   tolerance=1e-4)
        decoder.add(0, lines[0])
        decoder.step()
        assert decoder.cancel({0}) == 1 and decoder.idle() and decoder.cache is None


@pytest.mark.parametrize(("self_attention", "cross"), [("dot", "dot"), ("ran", "dot")])
def test_a_shortlist_holding_each_lines_path_decodes_as_the_full_layer(self_attention, cross):
    """Step-level batching with a lexical shortlist: the batch's output layer is restricted
    to its lines' lists, which grow as lines join (ids appended, so the indices the search
    state holds are not ids). Greedy search over a list holding a line's full-layer path
    picks that path (the arg-max of a subset holding the full arg-max): every line, joined
    early or late, prefixed or not, gets exactly the tokens it gets without a shortlist."""
    import numpy as np

    from ranmt.inference.shortlist import Shortlist

    model = _model(self_attention, cross, 0)
    waves = [_lines(3, 1, 5, 8), _lines(2, 2, 10, 14), _lines(3, 3, 1, 3)]
    flat = [ids for wave in waves for ids in wave]
    prefixes = {1: [7, 8], 5: [9]}
    args = dict(beam=1, max_len_a=1.5, max_len_b=8)
    full = _staggered(ContinuousDecoder(model, **args), waves, 2, prefixes)
    candidates = [set() for _ in range(model.config.src_vocab_size)]
    for number, ids in enumerate(flat):  # a source token's list: itself (so that lines'
        for token in ids:                  # lists differ) and the paths of its lines
            candidates[token] |= set(full[number][0][0]) | {token}
    table = np.full((len(candidates), max(map(len, candidates))), -1, dtype=np.int32)
    for token, listed in enumerate(candidates):
        table[token, : len(listed)] = sorted(listed)
    shortlist = Shortlist(table, np.zeros(0, dtype=np.int32), model.config.tgt_vocab_size)
    decoder = ContinuousDecoder(model, **args, lexical_shortlist=shortlist)
    grown = []
    growing = decoder._grow_vocabulary

    def spy(*a):
        growing(*a)
        grown.append(decoder.vocabulary.tolist())

    decoder._grow_vocabulary = spy
    listed = _staggered(decoder, waves, 2, prefixes)
    assert {n: hyps[0][0] for n, hyps in listed.items()} == \
        {n: hyps[0][0] for n, hyps in full.items()}
    assert len(grown) >= 2 and any(ids != sorted(ids) for ids in grown)  # appended ids
    assert len(grown[-1]) < model.config.tgt_vocab_size  # restricted, not everything
    assert decoder.vocabulary is None  # the emptied batch dropped it


def test_a_shortlist_of_every_token_gives_the_full_beam_search():
    """A list of every target id restricts nothing: the step-level beam search with it gives
    the n-best tokens and scores of the one without."""
    import numpy as np

    from ranmt.inference.shortlist import Shortlist

    model = _model("dot", "dot", 1)
    vocab = model.config.tgt_vocab_size
    everything = Shortlist(np.tile(np.arange(vocab, dtype=np.int32), (vocab, 1)),
                           np.zeros(0, dtype=np.int32), vocab)
    waves = [_lines(2, 4, 3, 9), _lines(3, 5, 2, 12)]
    args = dict(beam=3, nbest=3, max_len_a=1.5, max_len_b=4)
    plain = _staggered(ContinuousDecoder(model, **args), waves, 2)
    listed = _staggered(ContinuousDecoder(model, **args, lexical_shortlist=everything), waves, 2)
    for number, hyps in plain.items():
        assert_same_hypotheses([listed[number]], [hyps], 1e-5)
