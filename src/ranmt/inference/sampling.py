"""Sampling instead of search: n translations per input drawn from the model, for
back-translation (Edunov et al., 2018: sampled back-translations beat beam ones) and for
diverse outputs.

At each step the next token is drawn from the model's distribution, sharpened or flattened
by a temperature T (log-probs / T) and truncated by one rule:

- ``topk``: the k most probable tokens (k = 0: the whole vocabulary, i.e. plain sampling);
- ``topp`` (nucleus sampling, Holtzman et al., 2020): the smallest set of most probable
  tokens whose probability sums to at least p;
- ``eps`` (epsilon sampling, Hewitt et al., 2022): the tokens of probability at least
  epsilon (the most probable token always stays).

Truncation is applied to the tempered distribution, which is then renormalised. The score of
a sample is the sum of the untempered, untruncated log-probabilities of its tokens (EOS
included): what the model gives the sample, comparable with a beam search score before
length normalisation. Draws come from one ``torch.Generator`` seeded per call, so the same
inputs, settings and seed give the same samples (on the same device and batch layout).
Length limits, forced EOS and target prefixes are those of greedy search
(:func:`ranmt.inference.decode.greedy_search` with this module's ``pick``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ranmt.config import DecodeConfig, check_sampling
from ranmt.inference.decode import greedy_search

METHODS = ("topk", "topp", "eps")


@dataclass(frozen=True)
class Sampler:
    """One truncation rule and temperature; ``pick`` draws a token per row."""

    method: str = "topk"
    topk: int = 0
    """topk: tokens kept (0 = all)."""
    topp: float = 0.9
    """topp: probability mass kept."""
    epsilon: float = 0.02
    """eps: smallest probability kept."""
    temperature: float = 1.0

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"unknown sampling method '{self.method}' ({' | '.join(METHODS)})")
        check_sampling(self.topk, self.topp, self.epsilon, self.temperature)

    def truncate(self, logprobs: Tensor) -> Tensor:
        """Log-probs (n, V) -> tempered, truncated log-weights (n, V) (-inf = never drawn)."""
        weights = logprobs / self.temperature
        if self.method == "topk":
            if 0 < self.topk < weights.shape[-1]:
                kth = weights.topk(self.topk, dim=-1).values[:, -1:]  # (n, 1)
                weights = weights.masked_fill(weights < kth, float("-inf"))
            return weights
        probs = torch.softmax(weights, dim=-1)
        if self.method == "topp":
            sorted_probs, order = probs.sort(dim=-1, descending=True)
            mass_before = sorted_probs.cumsum(-1) - sorted_probs  # (n, V)
            drop_sorted = mass_before >= self.topp  # the first token is always kept
            drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
            return weights.masked_fill(drop, float("-inf"))
        best = probs.argmax(dim=-1, keepdim=True)
        drop = probs < self.epsilon
        drop.scatter_(-1, best, False)
        return weights.masked_fill(drop, float("-inf"))

    def pick(self, generator: torch.Generator):
        """The ``pick`` of :func:`greedy_search`: log-probs (n, V) -> (the drawn tokens'
        model log-probs (n,), tokens (n,))."""

        def draw(logprobs: Tensor) -> tuple[Tensor, Tensor]:
            probs = torch.softmax(self.truncate(logprobs), dim=-1)
            tokens = torch.multinomial(probs, 1, generator=generator)  # (n, 1)
            return logprobs.gather(1, tokens).squeeze(1), tokens.squeeze(1)

        return draw


def sample(model, src: Tensor, sampler: Sampler, samples: int = 1, seed: int = 0,
           max_len_a: float = 1.2, max_len_b: int = 10, prefix: Tensor | None = None,
           options: DecodeConfig | None = None) -> list[list[tuple[list[int], float]]]:
    """Draw ``samples`` translations of each sentence of src (B, S) -> per sentence a list of
    ``samples`` ``(tokens, logprob)`` in the order drawn (not sorted). ``prefix`` (B, P):
    target prefixes every sample starts with. ``options``: the decoding options whose step
    processors (``ranmt.inference.processors``) apply (their length limits replaced by
    ``max_len_a``/``max_len_b``)."""
    if samples < 1:
        raise ValueError(f"samples must be >= 1, not {samples}")
    generator = torch.Generator(device=src.device).manual_seed(seed)
    rows = src.repeat_interleave(samples, dim=0)  # sample j of sentence b: row b*samples + j
    row_prefix = None if prefix is None else prefix.repeat_interleave(samples, dim=0)
    drawn = greedy_search(model, rows, options, max_len_a=max_len_a, max_len_b=max_len_b,
                          prefix=row_prefix, pick=sampler.pick(generator))
    return [[hyp for row in drawn[b * samples: (b + 1) * samples] for hyp in row]
            for b in range(src.shape[0])]
