"""Ensembles: several models decoding as one.

At every step each member computes its next-token log-probabilities from its own encoder
memory and incremental cache (any attention variant: RAN's matrices, Gaussian, recurrent
cross-attention all keep their own caches), and the ensemble's log-probabilities are their
mean, ``log p(y) = (1/M) sum_m log p_m(y)`` (a weighted product of the members'
distributions, renormalised). Search (greedy, beam, sampling, prefixes) sees one model: the
:class:`Ensemble` has the interface of :class:`ranmt.model.Seq2Seq` the searches use
(``encode``, ``init_cache``, ``decode_step``, ``reorder_cache``, ``config``).

Members must share their source and target vocabularies (the same SentencePiece models; the
Translator checks the files) and thus the special ids; they may differ in architecture,
size and ``max_positions`` (the smallest one limits the ensemble).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor, nn

from ranmt.attention.cache import EnsembleCache
from ranmt.model import Seq2Seq


class Ensemble(nn.Module):
    """Models averaged in log-probability space; decodes like one :class:`Seq2Seq`."""

    def __init__(self, members: list[Seq2Seq]):
        super().__init__()
        if not members:
            raise ValueError("an ensemble needs at least one model")
        sizes = {(m.config.src_vocab_size, m.config.tgt_vocab_size) for m in members}
        if len(sizes) > 1:
            raise ValueError("ensemble members must share source and target vocabularies; "
                             f"their (source, target) vocabulary sizes are {sorted(sizes)}")
        self.members = nn.ModuleList(members)
        limit = min(m.config.max_positions for m in members)
        self.config = dataclasses.replace(members[0].config, max_positions=limit)
        self.pad_id, self.bos_id, self.eos_id = members[0].pad_id, members[0].bos_id, \
            members[0].eos_id

    def encode(self, src: Tensor, need_weights: bool = False):
        """src (B, S) -> (per-member memories [(B, S, d_m)], pad mask (B, S), None)."""
        memories = [member.encode(src)[0] for member in self.members]
        return memories, src.eq(self.pad_id), None

    def init_cache(self, memories: list[Tensor], pad_mask: Tensor, group: int = 1,
                   capacity: int | None = None) -> EnsembleCache:
        return EnsembleCache([member.init_cache(memory, pad_mask, group, capacity)
                              for member, memory in zip(self.members, memories)])

    def decode_step(self, prev_tokens: Tensor, cache: EnsembleCache) -> Tensor:
        """prev_tokens (B, 1) -> mean of the members' log-probs (B, V) (float32)."""
        total = None
        for member, member_cache in zip(self.members, cache.members):
            logprobs = member.decode_step(prev_tokens, member_cache)
            total = logprobs if total is None else total + logprobs
        return total / len(self.members)

    def reorder_cache(self, cache: EnsembleCache, order: Tensor,
                      within_groups: bool = False) -> None:
        for member, member_cache in zip(self.members, cache.members):
            member.reorder_cache(member_cache, order, within_groups)

    def forward_logprobs(self, src: Tensor, tgt_in: Tensor) -> Tensor:
        """Teacher-forced mean log-probs (B, T, V) of tgt_in (B, T) given src (B, S)."""
        return torch.stack([teacher_forced_logprobs(member, src, tgt_in)
                            for member in self.members]).mean(0)


def teacher_forced_logprobs(model, src: Tensor, tgt_in: Tensor) -> Tensor:
    """Log-probs (B, T, V) (float32) of the next token after each prefix of tgt_in (B, T),
    for a model or an :class:`Ensemble`."""
    if isinstance(model, Ensemble):
        return model.forward_logprobs(src, tgt_in)
    return torch.log_softmax(model(src, tgt_in).float(), dim=-1)


def members(model) -> list[Seq2Seq]:
    """The models inside ``model`` (itself when it is not an ensemble)."""
    return list(model.members) if isinstance(model, Ensemble) else [model]
