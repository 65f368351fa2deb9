"""The fast decoder (static caches, tensorised beam bookkeeping) against the reference one.

For every decoder-side attention of the registry (each registered decoder self-attention:
dot, ran, gaussian, synthesizer, aan, ssru, ...; each cross-attention: dot, gaussian and every
recurrent cross-attention), greedy and
beam search must give token-identical n-best lists with scores within 1e-5; fixed-length
mode must give exactly L tokens per hypothesis.
"""

from __future__ import annotations

import math

import pytest
import torch

from conftest import assert_same_hypotheses, random_batch, tiny_model
from ranmt.attention import reorder_cache
from ranmt.attention.base import cache_append
from ranmt.attention.cache import AttentionCache
from ranmt.attention.registry import names_for
from ranmt.config import DecodeConfig
from ranmt.inference.decode import (
    Finished,
    beam_search,
    beam_search_reference,
    beam_search_sync_free,
    best_candidates,
    first_candidates,
    greedy_search,
    greedy_search_reference,
    greedy_search_sync_free,
    row_topk,
    search,
)
from ranmt.model import EOS_ID

SELF = names_for("decoder_self")
CROSS = ["dot"] + sorted(name for name in names_for("cross") if name != "dot")
DECODERS = [(name, "dot") for name in SELF] + [("dot", name) for name in CROSS[1:]]
BEAM_SEARCHES = {"fast": beam_search, "reference": beam_search_reference,
                 "sync_free": beam_search_sync_free}
EVERY_SEARCH = [*BEAM_SEARCHES.values(), greedy_search, greedy_search_reference,
                greedy_search_sync_free]


def _beam_args(fn, beam: int, nbest: int) -> dict:
    """The beam and n-best keywords for a beam search, none for a greedy one."""
    return {} if fn.__name__.startswith("greedy") else {"beam": beam, "nbest": nbest}


def _model(self_attention: str, cross: str, seed: int):
    return tiny_model(seed=seed, **{"model.decoder.self_attention": self_attention,
                                    "model.decoder.cross_attention": cross})[0]


@pytest.mark.parametrize(("self_attention", "cross"), DECODERS)
def test_fast_greedy_equals_reference(self_attention, cross):
    for seed in (0, 1):
        model = _model(self_attention, cross, seed)
        src, _ = random_batch(batch=5, src_len=9, seed=seed)
        assert_same_hypotheses(greedy_search(model, src, max_len_a=1.5, max_len_b=4),
                               greedy_search_reference(model, src, max_len_a=1.5, max_len_b=4))


@pytest.mark.parametrize(("self_attention", "cross"), DECODERS)
@pytest.mark.parametrize("beam", [2, 5])
def test_fast_beam_equals_reference(self_attention, cross, beam):
    for seed in (0, 1):
        model = _model(self_attention, cross, seed)
        src, _ = random_batch(batch=5, src_len=9, seed=seed)
        args = dict(beam=beam, lenpen=0.6, max_len_a=1.5, max_len_b=4, nbest=beam)
        assert_same_hypotheses(beam_search(model, src, **args),
                               beam_search_reference(model, src, **args))


@pytest.mark.parametrize("arch", ["transf", "ran-all", "hc-all", "sh-x", "syn-r"])
def test_fast_equals_reference_on_archs_with_early_eos(arch):
    """A model biased towards EOS finishes hypotheses at many different steps, which
    exercises the finished-hypothesis bookkeeping and the shrinking batch."""
    model, _ = tiny_model(seed=3, **{"model.arch": arch})
    with torch.no_grad():
        model.decoder.embedder.tokens.weight[EOS_ID] *= 4.0  # tied output: EOS likelier
    src, _ = random_batch(batch=6, src_len=9, seed=3)
    for beam in (1, 3, 4):
        fast = search(model, src, beam=beam, lenpen=0.6, lenpen_style="gnmt", max_len_a=1.2,
                      max_len_b=6, nbest=beam)
        reference = search(model, src, beam=beam, lenpen=0.6, lenpen_style="gnmt", max_len_a=1.2,
                           max_len_b=6, nbest=beam, reference=True)
        lengths = {len(tokens) for hyps in reference for tokens, _ in hyps}
        assert len(lengths) > 1
        assert_same_hypotheses(fast, reference)


@pytest.mark.parametrize("arch", ["transf", "ran-all"])
@pytest.mark.parametrize("beam", [1, 4])
@pytest.mark.parametrize("implementation", ["fast", "reference", "sync_free"])
def test_fixed_length_gives_exactly_l_tokens(arch, beam, implementation):
    model, _ = tiny_model(seed=2, **{"model.arch": arch})
    with torch.no_grad():
        model.decoder.embedder.tokens.weight[EOS_ID] *= 4.0  # would stop early otherwise
    src, _ = random_batch(batch=4, seed=2)
    for length in (1, 7, 20):
        results = search(model, src, beam=beam, nbest=beam, fixed_length=length,
                         reference=implementation == "reference",
                         sync_free=implementation == "sync_free")
        assert all(len(tokens) == length and EOS_ID not in tokens
                   for hyps in results for tokens, _ in hyps)


def test_fixed_length_beyond_the_model_is_an_error():
    model, _ = tiny_model()
    src, _ = random_batch(batch=2)
    with pytest.raises(ValueError, match="fixed length"):
        search(model, src, beam=2, fixed_length=model.config.max_positions)


def test_static_cache_append_and_reorder():
    """cache_append and reorder_cache on a static cache give the concatenating cache's
    histories, always contiguous and always inside the two buffers allocated at the first
    step (no allocation afterwards); a step beyond the capacity is an error."""
    torch.manual_seed(0)
    static, growing = AttentionCache(capacity=5), AttentionCache()
    steps = [torch.randn(3, 2, 1, 4) for _ in range(5)]
    orders = {0: torch.tensor([2, 0, 0]), 2: torch.tensor([1, 2, 0]), 3: torch.tensor([0, 0])}
    for step, values in enumerate(steps):
        static.step = growing.step = step
        rows = growing.v.shape[0] if growing.v is not None else 3
        out_static = cache_append(static, "v", values[:rows])
        out_growing = cache_append(growing, "v", values[:rows])
        assert torch.equal(out_static, out_growing) and out_static.is_contiguous()
        buffers = static.static["v"].buffers
        assert any(b.data_ptr() <= out_static.data_ptr() < b.data_ptr() + b.numel() * 4
                   for b in buffers)
        if step in orders:
            reorder_cache(static, orders[step])
            reorder_cache(growing, orders[step])
            assert static.static["v"].buffers is buffers  # gathered into the other buffer
    with pytest.raises(ValueError, match="capacity"):
        static.step = 5
        cache_append(static, "v", torch.randn(2, 2, 1, 4))


@pytest.mark.parametrize("cross", CROSS)
@pytest.mark.parametrize("capacity", [None, 8])
def test_cross_attention_caches_its_memory_heads_contiguous(cross, capacity):
    """The keys/values a cross-attention caches from the memory (B, H, S, d_h) are
    contiguous: a transposed view would be copied by every later step's matrix product."""
    model = _model("dot", cross, seed=0).eval()
    src, _ = random_batch(batch=3, seed=0)
    with torch.inference_mode():
        memory, pad_mask, _ = model.encode(src)
        cache = model.init_cache(memory, pad_mask, capacity=capacity)
        for _ in range(2):
            model.decode_step(torch.full((3, 1), 5), cache)
    cached = [tensor for layer in cache.layers
              for tensor in (layer.cross_attention.k, layer.cross_attention.v)
              if tensor is not None]
    assert cached and all(tensor.is_contiguous() for tensor in cached)
    assert all(tensor.shape[0] == 3 and tensor.shape[2] == src.shape[1] for tensor in cached)


@pytest.mark.parametrize(("rows", "width", "k"), [(7, 8000, 8), (5, 2050, 4), (3, 1000, 2),
                                                  (4, 100, 8)])
def test_row_topk_equals_topk(rows, width, k):
    torch.manual_seed(width)
    scores = torch.log_softmax(torch.randn(rows, width) * 3, dim=-1)
    scores[0, :] = float("-inf")  # a forced row: one finite entry
    scores[0, 3] = -0.5
    values, ids = row_topk(scores, k)
    expected_values, expected_ids = scores.topk(k, dim=1)
    assert torch.equal(values, expected_values)
    assert torch.equal(ids[1:], expected_ids[1:]) and ids[0, 0] == 3


def test_row_topk_finds_the_best_in_the_columns_after_the_last_block():
    """2,050 columns: 32 blocks of 64 and two columns after them, which hold the best."""
    torch.manual_seed(0)
    scores = torch.randn(3, 2050)
    scores[:, 2049] = 50.0
    scores[1, 2048] = 40.0
    values, ids = row_topk(scores, 4)
    expected_values, expected_ids = scores.topk(4, dim=1)
    assert torch.equal(values, expected_values) and torch.equal(ids, expected_ids)
    assert ids[:, 0].tolist() == [2049] * 3 and ids[1, 1] == 2048


@pytest.mark.parametrize("beam", [2, 4, 16])
@pytest.mark.parametrize("vocab", [20, 2050])
def test_first_candidates_equal_best_candidates_of_the_repeated_rows(beam, vocab):
    """A first step with one row a sentence gives the candidates of its rows repeated per
    beam with scores (0, -inf, ...), exactly: scores, beams and tokens, -inf rows too
    (20 columns: fewer than 2k at beam 16; 2,050: the blocked top-k)."""
    torch.manual_seed(vocab + beam)
    logprobs = torch.log_softmax(torch.randn(5, vocab) * 3, dim=-1)
    logprobs[1, :] = float("-inf")  # a row at its limit: EOS only
    logprobs[1, 2] = -0.7
    beam_scores = torch.full((5, beam), float("-inf"))
    beam_scores[:, 0] = 0.0
    expected = best_candidates(logprobs.repeat_interleave(beam, 0), beam_scores, beam)
    for got, want in zip(first_candidates(logprobs, beam), expected):
        assert torch.equal(got, want)


@pytest.mark.parametrize("arch", ["transf", "ran-all"])
def test_fast_equals_reference_with_a_wide_vocabulary(arch):
    """A 3,000-token vocabulary: the fast beam search selects with the blocked top-k."""
    model, _ = tiny_model(seed=5, **{"model.arch": arch, "model.src_vocab_size": 3000,
                                     "model.tgt_vocab_size": 3000})
    src, _ = random_batch(batch=4, src_len=8, vocab=3000, seed=5)
    for beam in (2, 4):
        args = dict(beam=beam, lenpen=0.6, max_len_a=1.2, max_len_b=4, nbest=beam)
        assert_same_hypotheses(beam_search(model, src, **args),
                               beam_search_reference(model, src, **args))


@pytest.mark.parametrize("self_attention", ["dot", "ran"])
def test_fast_decoder_step_traces_as_one_graph(self_attention):
    """The fast decoder's step (after the first, which allocates the caches, and after a
    reorder into the other buffer) traces into one graph without breaks: what
    decode.compile_step needs to compile it (no pointer comparisons, no integer
    indexing by the step)."""
    model = _model(self_attention, "dot", 0).eval()
    src, _ = random_batch(batch=3, src_len=7, seed=0)
    with torch.inference_mode():
        memory, pad_mask, _ = model.encode(src)
        cache = model.init_cache(memory, pad_mask, group=2, capacity=6)
        prev = torch.full((6, 1), 1, dtype=torch.long)
        model.decode_step(prev, cache)
        model.reorder_cache(cache, torch.tensor([1, 0, 2, 3, 5, 4]))
        explained = torch._dynamo.explain(model.decode_step)(prev, cache)
    torch._dynamo.reset()
    assert explained.graph_count == 1
    assert explained.graph_break_count == 0


def test_a_mistyped_cache_part_is_an_error():
    """The decoding cache has typed parts (ranmt.attention.cache): a misspelt part is an
    error, not a new entry that nobody reads."""
    model, _ = tiny_model(seed=0)
    src, _ = random_batch(batch=2, seed=0)
    memory, pad_mask, _ = model.encode(src)
    cache = model.init_cache(memory, pad_mask, capacity=4)
    with pytest.raises(AttributeError):
        cache.stpe = 1
    with pytest.raises(AttributeError):
        cache.layers[0].self_attention.histroy = memory
    with pytest.raises(KeyError, match="'k' and 'v'"):
        cache_append(cache.layers[0].self_attention, "q", torch.zeros(2, 1, 1, 4))
    model.decode_step(torch.full((2, 1), 2), cache)
    assert cache.step == 1 and cache.layers[0].self_attention.k.shape[2] == 1


def test_fixed_length_up_to_the_models_last_position():
    """``fixed_length`` may be ``max_positions - 1``, the longest output a model can write;
    the fast searches equal the reference there."""
    model, _ = tiny_model(seed=2, **{"model.max_positions": 24})
    src, _ = random_batch(batch=2, seed=2)
    length = model.config.max_positions - 1
    for beam in (1, 3):
        fast = search(model, src, beam=beam, nbest=beam, fixed_length=length)
        assert_same_hypotheses(fast, search(model, src, beam=beam, nbest=beam, fixed_length=length,
                                            reference=True))
        assert all(len(tokens) == length for hyps in fast for tokens, _ in hyps)


def test_an_explicit_length_limit_caps_the_fast_searches_as_the_reference():
    """``limit`` below the model's: no hypothesis longer, and the same hypotheses as the
    reference searches with that limit (without it some are longer); the sync-free
    searches too."""
    model, _ = tiny_model(seed=4)
    src, _ = random_batch(batch=3, seed=4)
    args = dict(max_len_a=2.0, max_len_b=6)
    free = beam_search(model, src, beam=3, nbest=3, **args)
    assert max(len(tokens) for hyps in free for tokens, _ in hyps) > 3
    capped = beam_search(model, src, beam=3, nbest=3, limit=3, **args)
    assert max(len(tokens) for hyps in capped for tokens, _ in hyps) <= 3
    assert_same_hypotheses(capped, beam_search_reference(model, src, beam=3, nbest=3, limit=3,
                                                         **args))
    greedy = greedy_search(model, src, limit=2, **args)
    assert max(len(tokens) for hyps in greedy for tokens, _ in hyps) <= 2
    assert_same_hypotheses(greedy, greedy_search_reference(model, src, limit=2, **args))
    assert_same_hypotheses(beam_search_sync_free(model, src, beam=3, nbest=3, limit=3, **args),
                           capped)
    assert_same_hypotheses(greedy_search_sync_free(model, src, limit=2, **args), greedy)


def test_finished_nbest_of_a_sentence_without_hypotheses():
    """A sentence that finished nothing gets one empty hypothesis at -inf (as the reference
    search answers it), the others theirs, best first."""
    finished = Finished(2, 3, 5, torch.device("cpu"))
    finished.add(torch.tensor([0, 0]), torch.tensor([0, 1]), torch.tensor([-2.5, -1.5]),
                 torch.tensor([[7, 8], [9, 10]]))
    finished.counts[0] = 2
    assert finished.nbest(3) == [[([9, 10], -1.5), ([7, 8], -2.5)], [([], -math.inf)]]


def test_search_runs_the_documented_implementation_with_every_option(monkeypatch):
    """``search`` on a CPU: the search loop (greedy for beam 1, beam otherwise) in its
    shrinking form, the reference with ``reference``, the loop's static (sync-free) form
    with ``sync_free`` or ``graphs``; the prefix, the n-best count and the sync-free
    options reach the implementation."""
    from ranmt.inference import decode

    calls = []
    names = ("run_search", "greedy_search_reference", "beam_search_reference")

    def spying(name, implementation):
        def spy(model, src, options, **kwargs):
            calls.append((name, (options, kwargs)))
            return implementation(model, src, options, **kwargs)
        return spy

    for name in names:
        monkeypatch.setattr(decode, name, spying(name, getattr(decode, name)))
    model, _ = tiny_model(seed=1)
    src, _ = random_batch(batch=2, seed=1)
    prefix = torch.tensor([[5, 6], [7, 0]])
    cases = [(dict(beam=1), "run_search", {"static": False}),
             (dict(beam=2), "run_search", {"static": False}),
             (dict(beam=1, reference=True), "greedy_search_reference", {}),
             (dict(beam=3, reference=True), "beam_search_reference", {}),
             (dict(beam=1, sync_free=True, check_every=3), "run_search",
              {"static": True, "check_every": 3}),
             (dict(beam=3, cuda_graphs=True), "run_search",
              {"static": True, "check_every": None})]  # run_search: 8 on CUDA, else 1
    for args, name, forwarded in cases:
        calls.clear()
        results = decode.search(model, src, prefix=prefix, **args)
        assert [called for called, _ in calls] == [name]
        options, kwargs = calls[0][1]
        assert kwargs["prefix"] is prefix
        assert {key: kwargs.get(key) for key in forwarded} == forwarded
        # one options object: the caller's overrides on DecodeConfig's declared defaults
        assert options.beam == args["beam"] and options.lenpen == DecodeConfig().lenpen
        assert options.cuda_graphs == args.get("cuda_graphs", False)
        assert [len(hyps) for hyps in results] == [1, 1]  # nbest 1 by default
        assert [hyps[0][0][:1] for hyps in results] == [[5], [7]]


def test_on_a_cpu_the_sync_free_search_stops_at_the_step_after_the_last_eos(monkeypatch):
    """By default the sync-free search reads whether every sentence is done after each
    step on a CPU (a read costs nothing there): it decodes exactly as many steps as the
    shrinking search, where every 8th step would waste up to 7; on CUDA it reads every 8."""
    model, _ = tiny_model(seed=1)
    src, _ = random_batch(batch=3, seed=1)
    steps = []
    plain = model.decode_step

    def ending_at_step_10(prev, cache):  # every row writes EOS at its 11th step
        logprobs = plain(prev, cache)
        steps.append(len(prev))
        if len(steps) % 11 == 0:
            logprobs[:, EOS_ID] = 0.0
        return logprobs

    monkeypatch.setattr(model, "decode_step", ending_at_step_10)
    shrinking = search(model, src, beam=1, max_len_a=0.0, max_len_b=30)
    longest = max(len(hyps[0][0]) for hyps in shrinking)
    assert len(steps) == longest + 1 == 11
    steps.clear()
    assert search(model, src, beam=1, sync_free=True, max_len_a=0.0, max_len_b=30) == shrinking
    assert len(steps) == longest + 1
    steps.clear()
    search(model, src, beam=1, sync_free=True, max_len_a=0.0, max_len_b=30, check_every=8)
    assert len(steps) == 16


def test_graphs_go_only_with_the_sync_free_search():
    model, _ = tiny_model()
    src, _ = random_batch(batch=2)
    message = ("graphs replay the sync-free search's step: not with the reference or the "
               "shrinking search")
    for options in (dict(reference=True), dict(sync_free=False)):
        with pytest.raises(ValueError, match=f"^{message}$"):
            search(model, src, beam=2, cuda_graphs=True, **options)


def test_searches_take_one_options_object_and_repeat_no_default():
    """The searches and the step-level decoder take a DecodeConfig (``options``) and keyword
    overrides of its fields: none of their signatures repeats a decoding default (the one
    declaration is DecodeConfig's), options and the same keywords decode alike, and an
    unknown or out-of-bounds keyword is the config's error."""
    import inspect

    from ranmt.config import ConfigError, decode_fields, decode_with
    from ranmt.inference import decode
    from ranmt.inference.continuous import ContinuousDecoder

    declared = {spec.name for spec in decode_fields()}
    functions = [decode.search, decode.beam_search, decode.beam_search_reference,
                 decode.beam_search_sync_free, decode.greedy_search,
                 decode.greedy_search_reference, decode.greedy_search_sync_free,
                 ContinuousDecoder.__init__]
    for function in functions:
        parameters = inspect.signature(function).parameters
        assert "options" in parameters and not declared & set(parameters), function.__name__
    model, _ = tiny_model(seed=2)
    src, _ = random_batch(batch=3, seed=2)
    options = decode_with(DecodeConfig(), beam=3, nbest=2, lenpen=1.0, max_len_b=5)
    for function in functions[1:4]:
        assert function(model, src, options) == function(model, src, beam=3, nbest=2,
                                                         lenpen=1.0, max_len_b=5)
        assert function(model, src, options) != function(model, src, options, max_len_b=2)
    with pytest.raises(ConfigError, match="unknown decoding option 'lenpn'; did you mean "
                                          "lenpen"):
        decode.search(model, src, lenpn=1.0)
    with pytest.raises(ConfigError, match="decode.nbest must be between 1 and the beam size"):
        decode.search(model, src, beam=2, nbest=3)


@pytest.mark.parametrize("implementation", ["fast", "reference", "sync_free"])
def test_a_prefix_longer_than_the_length_limit_is_written_whole(implementation):
    """The length limit is raised to the prefix length (every search): with a * |src| + b
    = 2 tokens, a 4-token prefix is written whole, in beam and greedy search."""
    model, _ = tiny_model(seed=6)
    src, _ = random_batch(batch=2, seed=6)
    prefix = torch.tensor([[5, 6, 7, 8], [9, 0, 0, 0]])
    for beam in (1, 3):
        results = search(model, src, beam=beam, nbest=beam, max_len_a=0.0, max_len_b=2,
                         prefix=prefix, reference=implementation == "reference",
                         sync_free=implementation == "sync_free")
        assert all(tokens[:4] == [5, 6, 7, 8] for tokens, _ in results[0])
        assert all(tokens[:1] == [9] and len(tokens) <= 2 for tokens, _ in results[1])


@pytest.mark.parametrize("reference", [False, True])
def test_fixed_length_past_the_model_is_an_error_in_every_search(reference):
    model, _ = tiny_model()
    src, _ = random_batch(batch=2)
    for beam in (1, 2):
        with pytest.raises(ValueError, match="fixed length"):
            search(model, src, beam=beam, fixed_length=model.config.max_positions,
                   reference=reference)


def test_a_beam_below_one_is_an_error():
    model, _ = tiny_model()
    src, _ = random_batch(batch=1)
    with pytest.raises(ValueError, match="^decode.beam must be >= 1, not 0$"):
        search(model, src, beam=0)


@pytest.mark.parametrize("implementation", ["fast", "reference", "sync_free"])
def test_beam_one_called_directly_is_greedy(implementation):
    """``search`` sends beam 1 to greedy decoding; the beam searches themselves, given beam 1,
    pick the same tokens, and without a length penalty the same scores (the summed
    log-probabilities)."""
    for arch in ("transf", "ran-all"):
        model, _ = tiny_model(seed=6, **{"model.arch": arch})
        with torch.no_grad():
            model.decoder.embedder.tokens.weight[EOS_ID] *= 3.0  # lengths differ
        src, _ = random_batch(batch=5, src_len=9, seed=6)
        greedy = greedy_search_reference(model, src, max_len_a=1.5, max_len_b=4)
        assert len({len(hyps[0][0]) for hyps in greedy}) > 1
        assert_same_hypotheses(BEAM_SEARCHES[implementation](model, src, beam=1, lenpen=0.0,
                                                        max_len_a=1.5, max_len_b=4),
                               greedy)


@pytest.mark.parametrize("implementation", ["fast", "reference", "sync_free"])
def test_a_sentence_that_can_extend_nothing_gets_the_empty_hypothesis_at_minus_inf(
        implementation, monkeypatch):
    """Every token impossible from the first step (log-probabilities all -inf): no beam
    search invents a hypothesis; each answers ``[([], -inf)]`` per sentence."""
    model, _ = tiny_model(seed=7)
    real_step = model.decode_step

    def impossible(prev, cache):
        logprobs = real_step(prev, cache)
        return torch.full_like(logprobs, float("-inf"))
    monkeypatch.setattr(model, "decode_step", impossible)
    src, _ = random_batch(batch=3, seed=7)
    assert BEAM_SEARCHES[implementation](model, src, beam=3, nbest=2) == [[([], -math.inf)]] * 3


@pytest.mark.parametrize("fn", EVERY_SEARCH, ids=lambda fn: fn.__name__)
def test_every_search_makes_its_tensors_on_the_sources_device(fn):
    """A tensor made on the default device instead of the source's would cost a copy or fail
    on a GPU. With the default device set to ``meta`` (tensors without values, on a device
    of their own) a CPU search that made one would mix devices and fail: every search, over
    every decoder-side variant (and with prefixes and a fixed length), answers as it does
    without."""
    beam = _beam_args(fn, 3, 2)
    src, _ = random_batch(batch=4, seed=8)
    prefix = torch.tensor([[5, 6, 0], [7, 0, 0], [0, 0, 0], [8, 9, 10]])
    for self_attention, cross in DECODERS:
        model = _model(self_attention, cross, seed=8)
        # prefixes and fixed lengths go through code shared by every variant: one is enough
        extra = ({"prefix": prefix}, {"fixed_length": 5}) if self_attention == cross else ()
        for options in ({}, *extra):
            expected = fn(model, src, **beam, **options)
            with torch.device("meta"):
                assert fn(model, src, **beam, **options) == expected


def test_every_search_answers_python_ints_and_floats():
    """Tokens go on to the detokenizer and JSON: ints, not floats that compare equal to
    them (a float history, concatenated with int tokens, would make every token a float)."""
    model, _ = tiny_model(seed=9)
    src, _ = random_batch(batch=3, seed=9)
    for fn in EVERY_SEARCH:
        results = fn(model, src, **_beam_args(fn, 2, 2))
        assert all(type(token) is int and type(score) is float
                   for hyps in results for tokens, score in hyps for token in tokens), fn


def test_prefix_errors_name_the_problem_exactly():
    """A prefix of the wrong shape, holding EOS, or longer than the model's output limit is
    refused with its own message, before decoding, by every search."""
    import re

    model, _ = tiny_model(seed=10)
    src, _ = random_batch(batch=2, seed=10)
    limit = model.config.max_positions - 1
    cases = [(torch.tensor([5, 6]), "prefix must be (batch=2, P) token ids, not (2,)"),
             (torch.tensor([[5, 6]]), "prefix must be (batch=2, P) token ids, not (1, 2)"),
             (torch.tensor([[5, EOS_ID], [6, 0]]), "a target prefix may not contain EOS"),
             (torch.full((2, limit + 1), 5),
              f"a target prefix of {limit + 1} tokens is longer than the model's output "
              f"limit of {limit} tokens")]
    for fn in EVERY_SEARCH:
        for prefix, message in cases:
            with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
                fn(model, src, prefix=prefix)


def test_row_topk_makes_its_tensors_on_the_scores_device():
    """The blocked top-k (wide rows) under a ``meta`` default device: the same answer (a
    block offset or tail id made on the default device would mix devices)."""
    scores = torch.randn(3, 2050, generator=torch.Generator().manual_seed(0))
    expected = row_topk(scores, 4)
    with torch.device("meta"):
        top, ids = row_topk(scores, 4)
    assert torch.equal(top, expected[0]) and torch.equal(ids, expected[1])
