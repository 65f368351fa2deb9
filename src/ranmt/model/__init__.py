"""Model package: layers and the encoder-decoder; ``build_model(cfg)`` builds from a config."""

from ranmt.model.seq2seq import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    UNK_ID,
    Seq2Seq,
    build_model,
    component_weights,
    count_parameters,
)

__all__ = ["BOS_ID", "EOS_ID", "PAD_ID", "UNK_ID", "Seq2Seq", "build_model",
           "component_weights", "count_parameters"]
