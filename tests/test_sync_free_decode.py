"""The sync-free search (every row kept to the end, masks instead of a shrinking batch) and
the host-sync counter that measures it.

The sync-free greedy and beam searches must give the shrinking fast search's n-best tokens
(identical) and scores (within 1e-5, as the fast search against the reference) for every
decoder-side attention, with early EOS, prefixes, fixed lengths and any ``check_every``; and
no step may read a device value on the host except the every-``check_every``-steps check.
"""

from __future__ import annotations

import pytest
import torch

from conftest import assert_same_hypotheses, random_batch, tiny_model
from ranmt.inference.decode import beam_search_sync_free, greedy_search_sync_free, search
from ranmt.model import EOS_ID, PAD_ID
from ranmt.runtime.host_syncs import SyncCounter
from test_fast_decode import DECODERS, _model


@pytest.mark.parametrize(("self_attention", "cross"), DECODERS)
def test_sync_free_equals_shrinking_search(self_attention, cross):
    for seed in (0, 1):
        model = _model(self_attention, cross, seed)
        src, _ = random_batch(batch=5, src_len=9, seed=seed)
        for beam in (1, 2, 5):
            args = dict(beam=beam, lenpen=0.6, max_len_a=1.5, max_len_b=4, nbest=beam)
            assert_same_hypotheses(search(model, src, sync_free=True, **args),
                                   search(model, src, sync_free=False, **args))


@pytest.mark.parametrize("arch", ["transf", "ran-all", "ran-d", "hc-all", "sh-x", "syn-r",
                                  "aan-d", "ssru-d"])
@pytest.mark.parametrize("check_every", [1, 3, 8])
def test_sync_free_with_early_eos_and_any_check_interval(arch, check_every):
    """Hypotheses that finish at many different steps (EOS made likelier) and sentences that
    are done long before the others: their frozen rows must not change anything."""
    model, _ = tiny_model(seed=3, **{"model.arch": arch})
    with torch.no_grad():
        model.decoder.embedder.tokens.weight[EOS_ID] *= 4.0  # tied output: EOS likelier
    src, _ = random_batch(batch=6, src_len=9, seed=3)
    for beam, lenpen_style in ((1, "gnmt"), (3, "gnmt"), (4, "fairseq")):
        args = dict(beam=beam, lenpen=0.6, lenpen_style=lenpen_style, max_len_a=1.2,
                    max_len_b=6, nbest=beam)
        shrinking = search(model, src, sync_free=False, **args)
        lengths = {len(tokens) for hyps in shrinking for tokens, _ in hyps}
        assert len(lengths) > 1
        assert_same_hypotheses(search(model, src, sync_free=True, check_every=check_every, **args),
                               shrinking)


@pytest.mark.parametrize("arch", ["transf", "ran-all"])
def test_sync_free_with_prefixes_and_fixed_length(arch):
    model, _ = tiny_model(seed=4, **{"model.arch": arch})
    src, _ = random_batch(batch=4, src_len=8, seed=4)
    prefix = torch.tensor([[5, 6, 7], [9, PAD_ID, PAD_ID], [PAD_ID] * 3, [11, 12, PAD_ID]])
    for beam in (1, 3):
        args = dict(beam=beam, nbest=beam, max_len_b=3, prefix=prefix)
        free = search(model, src, sync_free=True, **args)
        assert_same_hypotheses(free, search(model, src, sync_free=False, **args))
        assert free[0][0][0][:3] == [5, 6, 7] and free[1][0][0][:1] == [9]
        fixed = search(model, src, beam=beam, nbest=beam, fixed_length=9, sync_free=True)
        shrinking = search(model, src, beam=beam, nbest=beam, fixed_length=9, sync_free=False)
        assert_same_hypotheses(fixed, shrinking)
        assert all(len(tokens) == 9 for hyps in fixed for tokens, _ in hyps)


def test_sync_free_ensemble_equals_shrinking():
    from ranmt.inference.ensemble import Ensemble

    ensemble = Ensemble([_model("ran", "dot", 0), _model("dot", "dot", 1)])
    src, _ = random_batch(batch=4, src_len=8, seed=2)
    for beam in (1, 3):
        args = dict(beam=beam, nbest=beam, max_len_b=4)
        assert_same_hypotheses(search(ensemble, src, sync_free=True, **args),
                               search(ensemble, src, sync_free=False, **args))


def _syncs(run) -> SyncCounter:
    with SyncCounter() as counter:
        run()
    return counter


@pytest.mark.parametrize(("self_attention", "cross"), DECODERS)
@pytest.mark.parametrize("beam", [1, 4])
def test_sync_free_search_reads_nothing_on_the_host_inside_its_steps(self_attention, cross,
                                                                     beam):
    """Syncs per step measured as the difference between two fixed lengths (what a search
    does once, before and after its steps, cancels): the shrinking search makes at least
    two a step, the sync-free one none with the check beyond the last step and one every
    ``check_every`` steps otherwise."""
    model = _model(self_attention, cross, 0)
    src, _ = random_batch(batch=5, src_len=9)

    def per_step(**options) -> float:
        short = _syncs(lambda: search(model, src, beam=beam, fixed_length=8, **options))
        long = _syncs(lambda: search(model, src, beam=beam, fixed_length=24, **options))
        return (long.total - short.total) / 16

    assert per_step(sync_free=False) >= 2
    assert per_step(sync_free=True, check_every=64) == 0
    # checks after steps 8 and 16 of 24 (none after the last), none in 8 steps
    assert per_step(sync_free=True, check_every=8) == pytest.approx(2 / 16)
    assert per_step(sync_free=True, check_every=4) <= 0.25


def test_sync_free_check_every_must_be_positive():
    model, _ = tiny_model()
    src, _ = random_batch(batch=2)
    with pytest.raises(ValueError, match="check_every"):
        beam_search_sync_free(model, src, beam=2, check_every=0)
    with pytest.raises(ValueError, match="check_every"):
        greedy_search_sync_free(model, src, check_every=0)


def test_search_picks_the_sync_free_path_off_the_cpu(monkeypatch):
    """``sync_free=None``: the shrinking search on the CPU, the sync-free one elsewhere (the
    device type is faked; the search itself runs on the CPU)."""
    import ranmt.inference.decode as decode

    called = []
    monkeypatch.setattr(decode, "run_search", lambda *a, static, **k: called.append(
        "sync-free" if static else "shrinking"))

    class FakeCuda:
        device = torch.device("meta")

    model, _ = tiny_model()
    src, _ = random_batch(batch=2)
    decode.search(model, src, beam=2)
    decode.search(model, FakeCuda(), beam=2)
    decode.search(model, src, beam=2, sync_free=True)
    assert called == ["shrinking", "sync-free", "sync-free"]


def test_sync_counter_counts_host_reads_and_data_dependent_ops():
    values = torch.tensor([0.0, 1.0, 2.0])
    before = {name: torch.Tensor.__dict__.get(name) for name in ("__bool__", "item", "tolist")}
    for inference in (False, True):
        with torch.inference_mode(inference), SyncCounter() as counter:
            bool(values.gt(0).any())
            values.sum().item()
            values.nonzero()
            values[values.gt(0)]  # boolean-mask indexing
            values.repeat_interleave(torch.tensor([1, 2, 0]))
            values.repeat_interleave(torch.tensor([1, 2, 0]), output_size=3)  # no sync
            values.repeat_interleave(2)  # no sync
            values.index_select(0, torch.tensor([2, 0]))  # no sync
            values.masked_fill(values.gt(1), 0.0)  # no sync
        assert dict(counter.by_op) == {"__bool__": 1, "item": 1, "nonzero": 1, "index": 1,
                                       "repeat_interleave": 1}
        assert counter.ops > counter.total
    assert {name: torch.Tensor.__dict__.get(name) for name in before} == before
