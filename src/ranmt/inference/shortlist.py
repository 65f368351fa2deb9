"""A lexical shortlist: the output layer restricted, per batch, to the target tokens the
batch's source tokens are likely to produce (as Marian's and CTranslate2's vocabulary maps).

Built from a prepared training corpus (:func:`build_shortlist`) by co-occurrence: source
token s and target token t co-occur in a pair when both appear in it (counted once per
pair), and each source token keeps the ``k`` target tokens of the highest Dice coefficient
``2 c(s, t) / (c(s) + c(t))`` (ties: the smaller id), where ``c(s)`` / ``c(t)`` count the
pairs holding s / t. The ``frequent`` most frequent target tokens (by pair count) are
always in. Stored beside a checkpoint as ``shortlist.safetensors`` (``candidates``
(V_src, k) int32, -1 where a source token has fewer; ``frequent`` (F,) int32) with its
settings in the file's metadata.

Decoding (:meth:`Shortlist.vocabulary`): a batch's vocabulary is the union of its source
tokens' candidates, the frequent tokens, the special tokens and any forced prefix's
tokens, sorted: the special ids (PAD, UNK, BOS, EOS: 0-3) are always its first four, so
they keep their ids, and the search runs in the restricted vocabulary unchanged (the
decoder embeds ``vocabulary[token]`` and projects onto ``vocabulary`` only,
:attr:`ranmt.attention.cache.DecoderCache.vocabulary`); hypotheses are mapped back to
full ids afterwards.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.numpy import save_file
from torch import Tensor

from ranmt.data.corpus import load_split

SHORTLIST_FILE = "shortlist.safetensors"
SPECIAL_IDS = 4
"""PAD, UNK, BOS, EOS: ids 0-3, always in a shortlist's vocabulary, first."""


@dataclass
class Shortlist:
    """Per source token its candidate target tokens, and the always-allowed frequent ones."""

    candidates: np.ndarray
    """(V_src, k) int32 target ids, -1 padding."""
    frequent: np.ndarray
    """(F,) int32 target ids."""
    target_vocab_size: int

    def vocabulary(self, sources: Tensor, prefixes: Tensor | None = None) -> Tensor:
        """The sorted target ids (V',) int64 a batch may produce: ``sources`` (B, S) source
        ids (padding included: PAD's candidates are none), ``prefixes`` (B, P) forced
        target ids or None. On the sources' device."""
        rows = np.unique(sources.cpu().numpy())
        rows = rows[rows < self.candidates.shape[0]]
        allowed = [np.arange(SPECIAL_IDS), self.frequent, self.candidates[rows].ravel()]
        if prefixes is not None:
            allowed.append(prefixes.cpu().numpy().ravel())
        ids = np.unique(np.concatenate(allowed).astype(np.int64))
        ids = ids[(ids >= 0) & (ids < self.target_vocab_size)]
        return torch.from_numpy(ids).to(sources.device)

    def save(self, path: str | Path, settings: dict) -> None:
        save_file({"candidates": self.candidates, "frequent": self.frequent}, str(path),
                  metadata={"settings": json.dumps(settings),
                            "target_vocab_size": str(self.target_vocab_size)})

    def write_vmap(self, path: str | Path, src_pieces: list[str], tgt_pieces: list[str]
                   ) -> None:
        """The shortlist as CTranslate2's vocabulary map (``vmap.txt``, read with
        ``use_vmap=True``): a line ``source piece<TAB>target pieces`` per source token with
        candidates, and a first line with an empty source holding the special tokens (PAD
        too, which CTranslate2 would leave out: ranmt's lists hold all four) and the frequent
        tokens (always candidates)."""
        always = [*range(SPECIAL_IDS), *self.frequent.tolist()]
        lines = ["\t" + " ".join(tgt_pieces[t] for t in always)]
        for source, row in enumerate(self.candidates):
            targets = [tgt_pieces[t] for t in row if t >= 0]
            if targets and source >= SPECIAL_IDS:
                lines.append(f"{src_pieces[source]}\t{' '.join(targets)}")
        Path(path).write_text("\n".join(lines) + "\n", encoding="utf-8")

    @classmethod
    def read_vmap(cls, path: str | Path, src_pieces: list[str], tgt_pieces: list[str]
                  ) -> Shortlist:
        """A shortlist from a CTranslate2 vocabulary map (``vmap.txt``): its one-piece rules
        become per-token candidates (in the file's order), its empty-source rule the
        frequent tokens. A rule of several source pieces (an n-gram, which a per-token
        shortlist cannot express) or a piece outside the vocabularies is an error."""
        src_ids = {piece: i for i, piece in enumerate(src_pieces)}
        tgt_ids = {piece: i for i, piece in enumerate(tgt_pieces)}
        rules: dict[int, list[int]] = {}
        frequent: list[int] = []
        for number, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            source, _, targets = line.partition("\t")
            unknown = [p for p in targets.split() if p not in tgt_ids]
            if " " in source.strip() or unknown or (source and source not in src_ids):
                what = (f"target pieces {unknown[:3]} not in the target vocabulary" if unknown
                        else f"source '{source}' is not one piece of the source vocabulary")
                raise ValueError(f"{path}:{number}: {what}")
            ids = [tgt_ids[p] for p in targets.split()]
            if source:
                rules[src_ids[source]] = ids
            else:  # the special tokens are in every list anyway
                frequent.extend(i for i in ids if i >= SPECIAL_IDS)
        width = max((len(ids) for ids in rules.values()), default=0)
        candidates = np.full((len(src_pieces), width), -1, dtype=np.int32)
        for source, ids in rules.items():
            candidates[source, : len(ids)] = ids
        return cls(candidates, np.array(frequent, dtype=np.int32), len(tgt_pieces))

    @classmethod
    def load(cls, path: str | Path) -> Shortlist:
        from safetensors import safe_open

        with safe_open(str(path), framework="numpy") as handle:  # one read: tensors + metadata
            return cls(handle.get_tensor("candidates"), handle.get_tensor("frequent"),
                       int((handle.metadata() or {})["target_vocab_size"]))


class RestrictedOutput:
    """A model (or ensemble) whose decoder caches produce ``vocabulary`` (V',) only: what
    the searches run on with a shortlist (everything else is the model's).

    ``blocked`` > 0 (a compiled search, :func:`bucketed_vocabulary`): the last ``blocked``
    entries of ``vocabulary`` are padding whose logits are -inf, and each cache gets its
    output layer built here, outside the compiled step, as a
    :class:`ranmt.model.seq2seq.RestrictedProjection` (its tensors are the graph's inputs,
    so the next batch of the same bucket runs the same graph)."""

    def __init__(self, model, vocabulary: Tensor, blocked: int | None = None):
        self.model = model
        self.vocabulary = vocabulary
        self.blocked = blocked

    def __getattr__(self, name: str):
        return getattr(self.model, name)

    def init_cache(self, *args, **kwargs):
        cache = self.model.init_cache(*args, **kwargs)
        members = cache.members
        models = getattr(self.model, "models", [self.model])
        if self.blocked is not None and len(models) != len(members):
            raise ValueError("a compiled shortlist needs one cache per model")
        for index, member in enumerate(members):
            member.vocabulary = self.vocabulary
            if self.blocked is not None:
                member.output = models[index].decoder.restricted_projection(
                    self.vocabulary, self.blocked)
        return cache


def vocabulary_bucket(size: int) -> int:
    """The bucket a compiled search pads a batch's vocabulary of ``size`` ids to: the
    smallest 2^k or 3 * 2^(k-1) (k >= 6) that holds it -- a file's batches then share a few
    output shapes (a compilation each) at most 1.5x the rows they need."""
    bucket = 64
    while bucket < size:
        bucket = bucket * 3 // 2 if bucket & (bucket - 1) == 0 else bucket * 4 // 3
    return bucket


def bucketed_vocabulary(vocabulary: Tensor, limit: int) -> tuple[Tensor, int]:
    """(V',) sorted ids -> (the ids padded to :func:`vocabulary_bucket` (at most ``limit``,
    the full vocabulary's size) by repeating the last id (still sorted: ``searchsorted``
    finds the real entry first), the number of padding entries)."""
    blocked = max(min(vocabulary_bucket(len(vocabulary)), limit) - len(vocabulary), 0)
    padding = vocabulary[-1:].expand(blocked)
    return torch.cat([vocabulary, padding]), blocked


def shortlist_beside(checkpoint: str | Path) -> Path | None:
    """The ``shortlist.safetensors`` of a checkpoint: in its folder (a checkpoint folder or
    the folder of a checkpoint file) or the two above it (the run's), else None."""
    folder = Path(checkpoint)
    folder = folder if folder.is_dir() else folder.parent
    for candidate in (folder, *folder.parents[:2]):
        if (candidate / SHORTLIST_FILE).is_file():
            return candidate / SHORTLIST_FILE
    return None


def cooccurrence(pairs: list[tuple[np.ndarray, np.ndarray]], src_vocab: int, tgt_vocab: int
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Co-occurrence counts of a corpus of (source ids, target ids) pairs, each token
    counted once per pair: (pair keys ``s * tgt_vocab + t``, their counts, c(s) (V_src,),
    c(t) (V_tgt,)), keys sorted."""
    src_count = np.zeros(src_vocab, dtype=np.int64)
    tgt_count = np.zeros(tgt_vocab, dtype=np.int64)
    keys: list[np.ndarray] = []
    counted_keys, counts = np.zeros(0, np.int64), np.zeros(0, np.int64)
    for number, (src, tgt) in enumerate(pairs, start=1):
        s, t = np.unique(src).astype(np.int64), np.unique(tgt).astype(np.int64)
        src_count[s] += 1
        tgt_count[t] += 1
        keys.append((s[:, None] * tgt_vocab + t[None, :]).ravel())
        if number % 50_000 == 0:  # merge as we go: memory bounded by the distinct pairs
            counted_keys, counts = _merge(counted_keys, counts, keys)
            keys = []
    counted_keys, counts = _merge(counted_keys, counts, keys)
    return counted_keys, counts, src_count, tgt_count


def _merge(keys: np.ndarray, counts: np.ndarray, new: list[np.ndarray]
           ) -> tuple[np.ndarray, np.ndarray]:
    if not new:
        return keys, counts
    fresh, fresh_counts = np.unique(np.concatenate(new), return_counts=True)
    both = np.concatenate([keys, fresh])
    merged, inverse = np.unique(both, return_inverse=True)
    total = np.zeros(merged.shape[0], dtype=np.int64)
    np.add.at(total, inverse, np.concatenate([counts, fresh_counts]))
    return merged, total


def build_shortlist(data_dir: str | Path, k: int = 50, frequent: int = 100,
                    split: str = "train") -> Shortlist:
    """The shortlist of a prepared split (see the module docstring)."""
    from ranmt.data.corpus import load_meta

    meta = load_meta(data_dir)
    encoded = load_split(data_dir, split)
    pairs = ((np.asarray(encoded.src[i]), np.asarray(encoded.tgt[i]))
             for i in range(len(encoded.src)))
    return shortlist_from_pairs(pairs, meta["src_vocab_size"], meta["tgt_vocab_size"], k,
                                frequent)


def shortlist_from_pairs(pairs, src_vocab: int, tgt_vocab: int, k: int = 50,
                         frequent: int = 100) -> Shortlist:
    """The shortlist of (source ids, target ids) pairs (see the module docstring)."""
    if k < 1 or frequent < 0:
        raise ValueError(f"a shortlist needs k >= 1 and frequent >= 0, not {k}, {frequent}")
    keys, counts, src_count, tgt_count = cooccurrence(pairs, src_vocab, tgt_vocab)
    sources, targets = keys // tgt_vocab, keys % tgt_vocab
    dice = 2.0 * counts / (src_count[sources] + tgt_count[targets])
    order = np.lexsort((targets, -dice, sources))  # by source, best first, then smaller id
    sources, targets = sources[order], targets[order]
    starts = np.searchsorted(sources, np.arange(src_vocab))
    rank = np.arange(sources.shape[0]) - starts[sources]
    keep = rank < k
    candidates = np.full((src_vocab, k), -1, dtype=np.int32)
    candidates[sources[keep], rank[keep]] = targets[keep]
    by_frequency = np.lexsort((np.arange(tgt_vocab), -tgt_count))
    top = by_frequency[:frequent]
    return Shortlist(candidates, top[tgt_count[top] > 0].astype(np.int32), tgt_vocab)
