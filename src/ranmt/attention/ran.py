"""Recurrent Attention (RAN): Zeng et al., EMNLP 2021 (paper 000), Sec. 2.2-2.3, Eq. 2-4.

Per stack (encoder or decoder), shared by all its layers and heads (:class:`RANShared`):

* Initial Attention Matrices ``A_0`` (H, N, N), trainable unless ``ran.fixed_initial``
  (Table 3 ablation). ``ran.init``: ``xavier_whole`` (default) draws one xavier-uniform over
  the whole (H, N, N) tensor as the authors' released code does (bound
  ``sqrt(6 / (N*N + H*N))``, about 0.0094 for N = 256, H = 8); ``xavier_per_head`` draws
  each (N, N) head separately (bound ``sqrt(6 / 2N)``, about 0.108 for N = 256).
* the Recurrent Transition Module, acting on the key dimension of every row:

  - ``paper`` (Eq. 3-4):    ``A_l = LN(tanh(A_{l-1} W^T + b)) + A_{l-1}``
  - ``no_ln_res`` (Table 3): ``A_l = tanh(A_{l-1} W^T + b)``

  and the transitions of the authors' released code (github lemon0830/RAN, ``thseq``
  encoder/decoder, option ``rec_func``), all with the residual and none with Eq. 3's LN:

  - ``released_code`` (``rec_func 0``, their default):
    ``A_l = A_{l-1} + W_2 relu(W_1 A_{l-1} + b_1) + b_2`` (N -> ``ran.released_hidden`` -> N)
  - ``released_tanh`` (``rec_func 1``): ``A_l = A_{l-1} + tanh(A_{l-1} W^T + b)``
  - ``released_relu`` (``rec_func 2``): ``A_l = A_{l-1} + relu(A_{l-1} W^T + b)``
  - ``released_ln_ffn`` (``rec_func 3``):
    ``A_l = A_{l-1} + W_2 relu(W_1 LN(A_{l-1}) + b_1) + b_2``

  Initialisation follows the same code: xavier-uniform weights and zero biases for the
  paper's linear and the feed-forward transitions; PyTorch's default ``nn.Linear`` init
  for ``released_tanh`` / ``released_relu`` (their code leaves those at the default).

Layer l attends with ``softmax(A_l[:, :T, :S])`` (Eq. 2) over values ``x W_v``; the decoder
uses the lower triangle only. ``A_l`` travels up the stack as the attention's ``state``.
Because the transition is row-wise, a layer only needs rows ``:T`` of ``A_{l-1}``.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor, nn

from ranmt.attention.base import AttentionSpec, VersionedCache
from ranmt.attention.learned_matrix import (
    KERNELS,
    LearnedMatrixAttention,
    MatrixKernel,
    causal_softmax,
    xavier_per_head_,
)
from ranmt.attention.registry import Arch, check_dropout, register

RanTransition = Literal["paper", "no_ln_res", "released_code", "released_tanh",
                        "released_relu", "released_ln_ffn"]
RanInit = Literal["xavier_whole", "xavier_per_head"]
TRANSITIONS: tuple[str, ...] = typing.get_args(RanTransition)
INITS: tuple[str, ...] = typing.get_args(RanInit)


@dataclass
class RANConfig:
    """Recurrent Attention options, config keys ``model.ran.*`` (paper 000)."""

    transition: RanTransition = "paper"
    """Recurrent Transition Module: paper (Eq. 3-4) | no_ln_res (Table 3) | the released
    code's released_code (rec_func 0) | released_tanh (1) | released_relu (2) |
    released_ln_ffn (3); formulas in the module docstring."""
    init: RanInit = "xavier_whole"
    """Initialisation of A_0: xavier_whole (one xavier-uniform over the (H, N, N) tensor, as
    the authors' code) | xavier_per_head (each (N, N) head separately, 11x larger bound at
    N = 256, H = 8)."""
    fixed_initial: bool = False
    """Keep the Initial Attention Matrices A_0 at their random init (Table 3 ablation)."""
    released_hidden: int = 1024
    """Hidden size of the released code's feed-forward transition."""
    attention_dropout: float = 0.2
    """Dropout on RAN's attention weights (the paper uses 0.2)."""
    kernel: MatrixKernel = "auto"
    """How a full pass computes softmax(A_l + mask) x W_v: sdpa (the matrix and the padding
    as one additive bias into scaled_dot_product_attention: one fused kernel) | explicit
    (softmax, dropout and product apart) | auto (sdpa on CUDA, explicit elsewhere)."""

    def validate(self) -> None:
        check_dropout(self.attention_dropout)
        if self.kernel not in KERNELS:
            raise ValueError(f"model.ran.kernel '{self.kernel}' unknown; choose from {KERNELS}")

_FEED_FORWARD = ("released_code", "released_ln_ffn")


def initial_matrices(heads: int, size: int, init: str) -> Tensor:
    """A_0 (H, N, N) drawn as ``ran.init`` says (see the module docstring)."""
    if init not in INITS:
        raise ValueError(f"ran.init '{init}' unknown; choose from {INITS}")
    matrix = torch.empty(heads, size, size)
    if init == "xavier_per_head":
        return xavier_per_head_(matrix)
    with torch.no_grad():
        # fan_in = N * N, fan_out = H * N for a 3-D tensor: the released code's bound.
        nn.init.xavier_uniform_(matrix)
    return matrix


class RANShared(nn.Module):
    """A_0 and the Recurrent Transition Module of one stack; caches A_1..A_L for inference."""

    def __init__(self, heads: int, size: int, layers: int, transition: str = "paper",
                 fixed_initial: bool = False, released_hidden: int = 1024,
                 init: str = "xavier_whole"):
        super().__init__()
        if transition not in TRANSITIONS:
            raise ValueError(f"ran.transition '{transition}' unknown; choose from {TRANSITIONS}")
        self.kind = transition
        self.layers = layers
        self.initial_attention = nn.Parameter(initial_matrices(heads, size, init),
                                              requires_grad=not fixed_initial)
        if transition in _FEED_FORWARD:
            self.transition_in = nn.Linear(size, released_hidden)
            self.transition_out = nn.Linear(released_hidden, size)
            xavier_modules = (self.transition_in, self.transition_out)
        else:
            self.transition = nn.Linear(size, size)
            xavier_modules = (self.transition,) if transition in ("paper", "no_ln_res") else ()
        if transition in ("paper", "released_ln_ffn"):
            self.norm = nn.LayerNorm(size)
        for module in xavier_modules:
            nn.init.xavier_uniform_(module.weight)
            nn.init.zeros_(module.bias)
        self._matrices = VersionedCache()
        self._causal = VersionedCache()

    def step(self, previous: Tensor) -> Tensor:
        """One application of the transition: A_{l-1} (H, R, N) -> A_l (H, R, N)."""
        kind = self.kind
        if kind == "paper":
            return self.norm(torch.tanh(self.transition(previous))) + previous  # Eq. 3-4
        if kind == "no_ln_res":
            return torch.tanh(self.transition(previous))
        if kind == "released_tanh":
            return previous + torch.tanh(self.transition(previous))
        if kind == "released_relu":
            return previous + torch.relu(self.transition(previous))
        normed = self.norm(previous) if kind == "released_ln_ffn" else previous
        return previous + self.transition_out(torch.relu(self.transition_in(normed)))

    def _all_layers(self) -> list[Tensor]:
        matrices, current = [], self.initial_attention
        for _ in range(self.layers):
            current = self.step(current)
            matrices.append(current)
        return matrices

    def matrices(self) -> list[Tensor]:
        """[A_1, ..., A_L] (each (H, N, N)), recomputed only when parameters change."""
        return self._matrices.get(list(self.parameters()), self._all_layers)

    def causal_probs(self) -> list[Tensor]:
        """Causal softmax of each A_l, cached likewise."""
        return self._causal.get(list(self.parameters()),
                                lambda: [causal_softmax(m) for m in self.matrices()])


@register("ran", options=RANConfig, archs={"ran-e": Arch("ran", "dot"),
                                           "ran-d": Arch("dot", "ran"),
                                           "ran-all": Arch("ran", "ran")})
class RecurrentAttention(LearnedMatrixAttention):
    """One layer's RAN self-attention: no W_q / W_k; the matrix comes from the shared module."""

    def __init__(self, spec: AttentionSpec):
        options = spec.options["ran"]
        super().__init__(spec, options.attention_dropout, options.kernel)
        if spec.shared is None:
            raise ValueError("RAN needs the stack's shared module (built by build_shared)")
        self.shared = spec.shared

    @staticmethod
    def build_shared(spec: AttentionSpec) -> RANShared:
        options = spec.options["ran"]
        return RANShared(spec.heads, spec.max_positions, spec.num_layers, options.transition,
                         options.fixed_initial, options.released_hidden, options.init)

    def initial_state(self) -> Tensor:
        return self.shared.initial_attention  # A_0 (H, N, N)

    def layer_matrix(self, state, rows):
        if state is None:
            raise ValueError("RAN layer received no A_{l-1}; pass the previous layer's state")
        current = self.shared.step(state[:, :rows])  # (H, T, N)
        return current, current

    def inference_matrix(self):
        return self.shared.matrices()[self.layer_index]

    def inference_causal_probs(self):
        return self.shared.causal_probs()[self.layer_index]
