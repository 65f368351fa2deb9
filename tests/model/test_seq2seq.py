"""The encoder-decoder: incremental decoding equals the full pass, masks, variants of layout."""

from __future__ import annotations

import pytest
import torch

from conftest import random_batch, tiny_model
from ranmt.model import count_parameters

ARCHS = ["transf", "ran-e", "ran-d", "ran-all", "syn-r", "hc-sa", "hc-all", "sh-x", "transf-sa",
         "hc-sa-ff", "aan-d", "ssru-d"]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("norm,positions", [("pre", "sinusoidal"), ("post", "learned"),
                                            ("pre", "none")])
def test_incremental_logits_equal_full_forward(arch, norm, positions):
    model, _ = tiny_model(**{"model.arch": arch, "model.norm": norm,
                             "model.positions": positions})
    src, tgt = random_batch()
    full = model(src, tgt)  # (B, T, V)
    memory, pad_mask, _ = model.encode(src)
    cache = model.init_cache(memory, pad_mask)
    steps = [model.decode_step(tgt[:, t: t + 1], cache) for t in range(tgt.shape[1])]
    torch.testing.assert_close(torch.stack(steps, 1), torch.log_softmax(full, -1),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ARCHS)
def test_source_padding_does_not_change_outputs(arch):
    model, _ = tiny_model(**{"model.arch": arch})
    src, tgt = random_batch(batch=1, pad_rows=False)
    padded = torch.cat([src, torch.zeros(1, 4, dtype=torch.long)], dim=1)
    torch.testing.assert_close(model(src, tgt), model(padded, tgt), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ARCHS)
def test_future_tokens_do_not_change_past_logits(arch):
    model, _ = tiny_model(**{"model.arch": arch})
    src, tgt = random_batch()
    changed = tgt.clone()
    changed[:, -1] = (changed[:, -1] + 1) % 40
    torch.testing.assert_close(model(src, tgt)[:, :-1], model(src, changed)[:, :-1])


def test_weights_are_returned_per_layer():
    model, cfg = tiny_model()
    src, tgt = random_batch()
    _, weights = model(src, tgt, need_weights=True)
    assert len(weights["encoder"]) == cfg.model.encoder.layers
    assert weights["decoder"][0]["cross"].shape == (3, cfg.model.heads, tgt.shape[1],
                                                    src.shape[1])
    # padded source positions of row 1 get zero cross-attention
    assert bool((weights["decoder"][0]["cross"][1, :, :, -3:] == 0).all())


def test_tied_and_shared_embeddings_counted_once():
    tied, _ = tiny_model()
    untied, _ = tiny_model(**{"model.tie_output": "false", "model.share_embeddings": "false"})
    vocab, d = 40, 64
    assert count_parameters(untied)["total"] - count_parameters(tied)["total"] == 2 * vocab * d
