"""Random Synthesizer (Syn-R; Tay et al., 2020), as described in paper 000 Sec. 3.

One matrix ``R_l`` (H, N, N) **per layer** (H x L matrices in all), xavier-uniform per head,
trainable unless ``synthesizer.fixed``; attention = ``softmax(R_l[:, :T, :S])`` with the same
masking as RAN; no recurrence, no W_q / W_k.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ranmt.attention.base import AttentionSpec, VersionedCache
from ranmt.attention.learned_matrix import (
    LearnedMatrixAttention,
    causal_softmax,
    xavier_per_head_,
)
from ranmt.attention.registry import Arch, check_dropout, register


@dataclass
class SynthesizerConfig:
    """Random Synthesizer options, config keys ``model.synthesizer.*`` (Tay et al., 2020)."""

    fixed: bool = False
    """Keep the per-layer matrices at their random init (not trained)."""
    attention_dropout: float = 0.1
    """Dropout on the synthesizer's attention weights."""

    def validate(self) -> None:
        check_dropout(self.attention_dropout)


@register("synthesizer", options=SynthesizerConfig,
          archs={"syn-r": Arch("synthesizer", "synthesizer")})
class RandomSynthesizerAttention(LearnedMatrixAttention):
    def __init__(self, spec: AttentionSpec):
        options = spec.options["synthesizer"]
        super().__init__(spec, options.attention_dropout)
        size = spec.max_positions
        self.matrix = nn.Parameter(xavier_per_head_(torch.empty(spec.heads, size, size)),
                                   requires_grad=not options.fixed)
        self._causal = VersionedCache()

    def layer_matrix(self, state, rows):
        return self.matrix[:, :rows], None

    def inference_matrix(self):
        return self.matrix

    def inference_causal_probs(self):
        return self._causal.get([self.matrix], lambda: causal_softmax(self.matrix))
