"""The attention weights of one translation, as the explorer (``ranmt serve``'s ``/``) and
``POST /translate`` with ``"attention": true`` show them: every layer of every component,
teacher-forced on the output, labelled with the tokens of both sides."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ranmt.data.batching import pad_sources
from ranmt.model import BOS_ID, component_weights

if TYPE_CHECKING:
    from ranmt.inference.translator import Translator


def attention_maps(translator: Translator, src_ids: list[int], tgt_ids: list[int]) -> dict:
    """The weights of one translation, teacher-forced on its output: per component a list
    over layers of (H, queries, keys) nested lists (rounded to 4 decimals), with the tokens
    that label the axes. Source keys: the source pieces and ``</s>``; target queries: the
    output pieces and ``</s>`` (query i predicts output token i). Components: ``cross``,
    ``encoder_self``, ``decoder_self`` (a layer without the component gives null). For
    input-agnostic variants (RAN, Syn-R, hard-coded) the self-attention weights are the
    layer's (softmaxed) matrix itself, cut to the sentence."""
    model = translator.model
    src = pad_sources([src_ids]).to(translator.device)  # (1, S) with EOS
    tgt_in = torch.tensor([[BOS_ID] + tgt_ids], device=translator.device)  # (1, T)
    with torch.inference_mode():
        _, weights = model(src, tgt_in, need_weights=True)

    def layers(items: list) -> list:
        return [None if w is None else torch.round(w[0].float(), decimals=4).tolist()
                for w in items]

    src_pieces = translator.src_vocab.processor
    tgt_pieces = translator.tgt_vocab.processor
    cfg = translator.config.model
    return {
        "source_tokens": [src_pieces.id_to_piece(i) for i in src_ids] + ["</s>"],
        "target_tokens": [tgt_pieces.id_to_piece(i) for i in tgt_ids] + ["</s>"],
        **{name: layers(items) for name, items in component_weights(weights).items()},
        "kinds": {"encoder_self": cfg.encoder.self_attention,
                  "decoder_self": cfg.decoder.self_attention,
                  "cross": cfg.decoder.cross_attention},
    }
