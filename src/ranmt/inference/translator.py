"""The Python API: ``Translator.load(checkpoint).translate(["A man rides a bike."])``.

Raw text in, detokenized text out, one output per input in input order. An empty (or
whitespace-only) input gives an empty output without running the model. An input longer
than ``model.max_positions`` subwords (EOS included) is an error naming its line and
length, unless ``truncate_long`` is set, in which case it is cut with a warning.

Beyond beam search (see the README's "Decoding" section): ``prefixes`` force the start of
each output (``ranmt.inference.decode``); ``decode.sampling`` draws ``nbest`` samples per
input (``ranmt.inference.sampling``); :meth:`Translator.score` gives the model's
log-probabilities of given translations and :meth:`Translator.translate_detailed` word
alignments (``ranmt.inference.scoring``);
``Translator.load([a, b, ...])`` decodes with an ensemble (``ranmt.inference.ensemble``).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from ranmt.checkpoint import load_checkpoint
from ranmt.config import DecodeConfig, decode_with
from ranmt.data.batching import make_batches, pad_sources
from ranmt.data.vocab import Vocab
from ranmt.inference.continuous import ContinuousDecoder
from ranmt.inference.decode import search, search_options
from ranmt.inference.ensemble import Ensemble
from ranmt.inference.sampling import Sampler, sample
from ranmt.inference.scoring import PairScore, align, score_targets, word_alignment
from ranmt.inference.shortlist import (
    SHORTLIST_FILE,
    RestrictedOutput,
    Shortlist,
    bucketed_vocabulary,
    shortlist_beside,
)
from ranmt.runtime.memory import retain_freed_memory


class InputTooLongError(ValueError):
    pass


@dataclasses.dataclass
class Hypothesis:
    """One output of :meth:`Translator.translate_detailed`."""

    text: str
    score: float
    """Length-normalised log-probability (beam search), or the summed log-probability
    (greedy search, sampling)."""
    tokens: list[int]
    """Target subword ids (no BOS/EOS)."""
    alignment: list[tuple[int, int]] | None = None
    """(source word, target word) pairs, 0-based, when asked for."""


def device_kind(name: str) -> str:
    """``cuda`` or ``cpu``: what a ``device`` setting means (``auto``: cuda when available
    here). Unlike :func:`pick_device`, a CUDA name is no error on a machine without one:
    for reading configs recorded on other machines."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return "cuda" if name.startswith("cuda") else "cpu"


def pick_device(name: str = "auto") -> torch.device:
    if name == "auto":
        return torch.device(device_kind(name))
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError(f"device '{name}' requested but CUDA is not available")
    return torch.device(name)


class Translator:
    """A loaded model with its vocabularies and decoding settings."""

    def __init__(self, model, config, src_vocab: Vocab, tgt_vocab: Vocab,
                 device: torch.device, checkpoint_dir: Path | None = None):
        self.model = model
        self.config = config
        self.decode_config: DecodeConfig = config.decode
        self.src_vocab = src_vocab
        self.tgt_vocab = tgt_vocab
        self.device = device
        self.checkpoint_dir = checkpoint_dir
        self.load_options: dict | None = None
        """The arguments of :meth:`load` that give this translator again (None when it was
        built otherwise): how ``ranmt serve``'s decoding workers load their copy."""
        self._shortlist: Shortlist | None = None
        self.progress = False
        """Show a progress bar (sentences/s, tokens/s, ETA) on stderr while translating
        more than one batch; the CLI turns it on when stderr is a terminal."""

    @classmethod
    def load(cls, checkpoint: str | Path | list[str | Path], device: str = "auto",
             quantize: str = "none", precision: str = "fp32",
             **decode_overrides) -> Translator:
        """Load a run directory or checkpoint; ``decode_overrides`` set decode fields.

        Several checkpoints (a list of more than one) decode as an ensemble; they must have
        the same SentencePiece models (the decoding settings are the first one's).
        ``quantize="int8"``: int8 dynamic quantization of the linear layers (CPU only;
        see :mod:`ranmt.inference.quantize`). ``precision="bf16"``: weights and activations in bf16
        (log-probabilities and scores in fp32), on a GPU or a CPU with native bf16.

        On a CPU this tunes the process's malloc once
        (:func:`ranmt.runtime.memory.retain_freed_memory`:
        freed heap memory is kept for reuse, so decoding steps stop page-faulting their
        buffers in; the process keeps its peak memory)."""
        from ranmt.inference.quantize import quantize_model
        from ranmt.runtime.precision import avoid_cudnn_attention

        device_ = pick_device(device)
        if device_.type == "cpu":
            # Decoding allocates the (rows x vocabulary) logits and log-probabilities anew
            # every step; without this each one page-faults in (ranmt.runtime.memory).
            retain_freed_memory()
        if device_.type == "cuda":
            avoid_cudnn_attention()  # new key lengths every step: no plan per shape
        if quantize != "none" and device_.type != "cpu":
            raise ValueError(f"--quantize {quantize} runs on the CPU only, not {device_}")
        _check_precision(precision, quantize, device_)
        paths = list(checkpoint) if isinstance(checkpoint, (list, tuple)) else [checkpoint]
        if not paths:
            raise ValueError("no checkpoint given")
        loaded = [load_checkpoint(path, device_) for path in paths]
        dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        models = [quantize_model(item[0], quantize).to(dtype) for item in loaded]
        model, config, directory = models[0], loaded[0][1], loaded[0][3]
        if len(loaded) > 1:
            _check_same_vocabularies([item[3] for item in loaded])
            model = Ensemble(models)
            config = dataclasses.replace(config, model=model.config)
        config.decode = decode_with(config.decode, **decode_overrides)
        translator = cls(model, config, Vocab(directory / "spm.src.model"),
                         Vocab(directory / "spm.tgt.model"), device_, directory)
        translator.load_options = {"checkpoint": [str(path) for path in paths],
                                   "device": str(device_), "quantize": quantize,
                                   "precision": precision, **decode_overrides}
        return translator

    def check_lengths(self, ids: list[list[int]], first_line: int = 1) -> list[list[int]]:
        """The translate policy for inputs beyond ``model.max_positions``: an
        :class:`InputTooLongError` naming the line, or (``truncate_long``) a cut with a
        warning. Returns the (possibly cut) token ids."""
        limit = self.config.model.max_positions - 1  # room for EOS
        out = []
        for offset, seq in enumerate(ids):
            if len(seq) > limit:
                line = first_line + offset
                if not self.decode_config.truncate_long:
                    raise InputTooLongError(
                        f"input line {line}: {len(seq)} subwords, longer than the model's "
                        f"limit of {limit} (model.max_positions={limit + 1}); split the line "
                        "or pass --truncate-long to cut it")
                print(f"warning: input line {line}: {len(seq)} subwords truncated to {limit}",
                      file=sys.stderr)
                seq = seq[:limit]
            out.append(seq)
        return out

    def translate_ids(self, ids: list[list[int]], first_line: int = 1,
                      prefixes: list[list[int]] | None = None, **decode_overrides
                      ) -> list[list[tuple[list[int], float]]]:
        """Token ids in -> per input its n-best ``(target ids, score)``, input order (with
        ``decode.sampling``: its ``nbest`` samples in the order drawn).

        ``prefixes``: per input the target ids its outputs start with (``[]``: none).
        ``decode_overrides`` (e.g. ``beam=2, nbest=2``) apply to this call only."""
        ids = self.check_lengths(ids, first_line)
        if prefixes is not None and len(prefixes) != len(ids):
            raise ValueError(f"{len(ids)} inputs but {len(prefixes)} prefixes")
        d = search_options(self.decode_config, decode_overrides)  # checked once if unchanged
        results: list = [None] * len(ids)
        nonempty = [i for i, seq in enumerate(ids) if len(seq) > 0]
        for i, seq in enumerate(ids):
            if not seq:
                results[i] = [([], 0.0)]
        if nonempty:
            lengths = np.array([len(ids[i]) for i in nonempty])
            tokens_per_batch = d.batch_size * (int(lengths.max()) + 1)
            batches = make_batches(lengths, lengths, tokens_per_batch, d.batch_size)
            self.model.eval()
            bar = tqdm(total=len(nonempty), unit="sent", file=sys.stderr, leave=True,
                       dynamic_ncols=True, disable=not self.progress or len(batches) <= 1)
            generated = 0
            for number, batch in enumerate(batches):
                rows = [nonempty[j] for j in batch]
                src = pad_sources([ids[r] for r in rows]).to(self.device)
                prefix = None
                if prefixes is not None and any(prefixes[r] for r in rows):
                    prefix = _pad_prefixes([prefixes[r] for r in rows]).to(self.device)
                hyps = self._decode_batch(src, prefix, d, seed=d.seed + number)
                limit = self.config.model.max_positions - 1
                generated += sum(len(hyp[0][0]) + 1 for hyp in hyps)
                bar.update(len(rows))
                bar.set_postfix(tok_s=f"{generated / max(bar.format_dict['elapsed'], 1e-9):,.0f}",
                                refresh=False)
                for row, hyp in zip(rows, hyps):
                    results[row] = hyp
                    wanted = int(d.max_len_a * len(ids[row]) + d.max_len_b)
                    if wanted > limit and len(hyp[0][0]) >= limit:
                        print(f"warning: output line {first_line + row} stopped at {limit} "
                              f"subwords, the model's limit (model.max_positions="
                              f"{limit + 1})", file=sys.stderr)
            bar.close()
        return results

    def _decode_batch(self, src, prefix, d: DecodeConfig, seed: int):
        """One padded batch src (B, S) -> per sentence its hypotheses."""
        model, vocabulary = self.model, None
        if d.shortlist:  # not with cuda_graphs: decode_with refuses the pair
            shortlist = self.lexical_shortlist()
            vocabulary, blocked = shortlist.vocabulary(src, prefix), None
            if d.compile_step:  # a few vocabulary sizes, padded rows -inf: few graphs
                vocabulary, blocked = bucketed_vocabulary(vocabulary,
                                                          shortlist.target_vocab_size)
            model = RestrictedOutput(self.model, vocabulary, blocked)
            if prefix is not None:  # target ids -> indices into the batch's vocabulary
                prefix = torch.searchsorted(vocabulary, prefix)
        if d.sampling != "none":
            sampler = Sampler(d.sampling, d.topk, d.topp, d.epsilon, d.temperature)
            hyps = sample(model, src, sampler, d.nbest, seed, d.max_len_a, d.max_len_b, prefix,
                          options=d)
        else:
            hyps = search(model, src, d, prefix=prefix)
        if vocabulary is None:
            return hyps
        ids = vocabulary.tolist()
        return [[([ids[token] for token in tokens], score) for tokens, score in sentence]
                for sentence in hyps]

    def lexical_shortlist(self) -> Shortlist:
        """The checkpoint's lexical shortlist (loaded once): ``shortlist.safetensors`` in the
        checkpoint's folder or a folder above it (the run's)."""
        if self._shortlist is None:
            if self.checkpoint_dir is None:
                raise ValueError("decode.shortlist needs a translator loaded from a checkpoint")
            found = shortlist_beside(self.checkpoint_dir)
            if found is None:
                raise FileNotFoundError(
                    f"decode.shortlist: no {SHORTLIST_FILE} in {self.checkpoint_dir} or the "
                    "folders above it; build one with `ranmt shortlist`")
            self._shortlist = Shortlist.load(found)
        return self._shortlist

    def warm_up(self) -> None:
        """Decode one short input (beneath the request path): the first call's one-off
        costs (weight packing, allocator warm-up) are paid here, not by a server's first
        request."""
        search(self.model, pad_sources([[4, 5, 6]]).to(self.device), beam=2, max_len_a=0.0,
               max_len_b=3)

    def continuous_decoder(self, **decode_overrides) -> tuple[ContinuousDecoder, DecodeConfig]:
        """A step-level batching decoder (:mod:`ranmt.inference.continuous`) with this model's
        decoding settings and ``decode_overrides``, and those settings. With sampling it
        draws one sample per added line (add a line ``nbest`` times, each with the
        generator of :func:`line_generator`)."""
        d = decode_with(self.decode_config, **decode_overrides)
        shortlist = self.lexical_shortlist() if d.shortlist else None
        self.model.eval()
        if d.sampling != "none":
            sampler = Sampler(d.sampling, d.topk, d.topp, d.epsilon, d.temperature)
            return ContinuousDecoder(self.model, d, beam=1, nbest=1, pick=sampler.pick,
                                     lexical_shortlist=shortlist), d
        return ContinuousDecoder(self.model, d, lexical_shortlist=shortlist), d

    def encode_sources(self, sentences: list[str]) -> list[list[int]]:
        """Raw sentences -> source subword ids (an empty or blank line -> [])."""
        return _encode_lines(self.src_vocab, sentences)

    def encode_targets(self, sentences: list[str]) -> list[list[int]]:
        """Raw target-side text (references, prefixes) -> target subword ids."""
        return _encode_lines(self.tgt_vocab, sentences)

    def translate(self, sentences: list[str], first_line: int = 1,
                  prefixes: list[str] | None = None) -> list[str]:
        """Raw sentences in -> best detokenized translation of each, same order.
        ``prefixes``: per sentence the text its translation starts with ("" for none)."""
        nbest = self.translate_nbest(sentences, first_line, prefixes)
        return [hyps[0][0] for hyps in nbest]

    def translate_nbest(self, sentences: list[str], first_line: int = 1,
                        prefixes: list[str] | None = None) -> list[list[tuple[str, float]]]:
        """Raw sentences in -> per sentence its n-best (or samples) ``(text, score)``."""
        return [[(hyp.text, hyp.score) for hyp in hyps]
                for hyps in self.translate_detailed(sentences, first_line, prefixes)]

    def translate_detailed(self, sentences: list[str], first_line: int = 1,
                           prefixes: list[str] | None = None, alignment: bool = False,
                           alignment_layer: int | None = None) -> list[list[Hypothesis]]:
        """Raw sentences in -> per sentence its hypotheses with their subword ids and, with
        ``alignment``, word alignments (``ranmt.inference.scoring``: the cross-attention of
        ``alignment_layer``, the penultimate decoder layer by default)."""
        ids = self.encode_sources(sentences)
        prefix_ids = None if prefixes is None else self.encode_targets(prefixes)
        results = self.translate_ids(ids, first_line, prefix_ids)
        detailed = [[Hypothesis(self.tgt_vocab.decode([seq])[0], score, seq)
                     for seq, score in hyps] for hyps in results]
        if alignment:
            flat = [(row, hyp) for row, hyps in enumerate(detailed) for hyp in hyps]
            pairs = self.align_ids([ids[row] for row, _ in flat], [hyp.tokens for _, hyp in flat],
                                   alignment_layer)
            for (row, hyp), subword_pairs in zip(flat, pairs):
                hyp.alignment = word_alignment(
                    subword_pairs, self._pieces(self.src_vocab, ids[row]),
                    self._pieces(self.tgt_vocab, hyp.tokens))
        return detailed

    @staticmethod
    def _pieces(vocab: Vocab, ids: list[int]) -> list[str]:
        return [vocab.processor.id_to_piece(i) for i in ids]

    def _pairs_in_batches(self, sources: list[list[int]], targets: list[list[int]], run):
        """Apply ``run(src (B, S), targets)`` over length-sorted batches of non-empty pairs;
        results in input order (None for a pair with an empty side)."""
        if len(sources) != len(targets):
            raise ValueError(f"{len(sources)} sources but {len(targets)} targets")
        out: list = [None] * len(sources)
        usable = [i for i in range(len(sources)) if sources[i] and targets[i]]
        if not usable:
            return out
        lengths = np.array([len(sources[i]) + len(targets[i]) for i in usable])
        tokens = self.decode_config.batch_size * (int(lengths.max()) + 2)
        self.model.eval()
        for batch in make_batches(lengths, lengths, tokens, self.decode_config.batch_size):
            rows = [usable[j] for j in batch]
            src = pad_sources([sources[r] for r in rows]).to(self.device)
            for row, value in zip(rows, run(src, [targets[r] for r in rows])):
                out[row] = value
        return out

    def align_ids(self, sources: list[list[int]], targets: list[list[int]],
                  layer: int | None = None) -> list[list[tuple[int, int]]]:
        """Subword alignments (source index, target index) of id pairs
        (``ranmt.inference.scoring``)."""
        sources = self.check_lengths(sources)
        pairs = self._pairs_in_batches(sources, targets,
                                       lambda src, tgt: align(self.model, src, tgt, layer))
        return [value or [] for value in pairs]

    def score(self, sources: list[str], targets: list[str], first_line: int = 1
              ) -> list[PairScore | None]:
        """The model's log-probabilities of given translations: per pair a
        :class:`ranmt.inference.scoring.PairScore` (None where either side is empty)."""
        if len(sources) != len(targets):
            raise ValueError(f"{len(sources)} sources but {len(targets)} targets")
        return self.score_ids(self.encode_sources(sources), self.encode_targets(targets),
                              first_line)

    def score_ids(self, sources: list[list[int]], targets: list[list[int]],
                  first_line: int = 1) -> list[PairScore | None]:
        sources = self.check_lengths(sources, first_line)
        limit = self.config.model.max_positions - 1
        for offset, target in enumerate(targets):
            if len(target) > limit:
                raise InputTooLongError(f"target line {first_line + offset}: {len(target)} "
                                        f"subwords, longer than the model's limit of {limit}")
        d = self.decode_config
        return self._pairs_in_batches(
            sources, targets,
            lambda src, tgt: score_targets(self.model, src, tgt, d.lenpen, d.lenpen_style))


def _encode_lines(vocab: Vocab, sentences: list[str]) -> list[list[int]]:
    """Sentences -> subword ids, blank ones -> [], the others in one SentencePiece call
    (one call per line started a thread pool each: 64 lines took 15.7 ms, 0.54 ms in one
    call; a server tokenizes every request's lines on its event loop)."""
    stripped = [s.strip() for s in sentences]
    nonempty = [s for s in stripped if s]
    encoded = iter(vocab.encode(nonempty) if nonempty else [])
    return [next(encoded) if s else [] for s in stripped]


def line_generator(seed: int, line: int, device: torch.device) -> torch.Generator:
    """The sampling generator of line ``line`` of a request with ``seed`` under step-level
    batching: its own, so that its samples depend on the seed and the line only, not on the
    requests decoded beside it."""
    mixed = (seed + (line + 1) * 0x9E3779B97F4A7C15) % (2 ** 63)
    return torch.Generator(device=device).manual_seed(mixed)


def _pad_prefixes(prefixes: list[list[int]]) -> torch.Tensor:
    """Per sentence its prefix ids -> (B, P) right-padded with PAD (0)."""
    width = max(len(p) for p in prefixes)
    out = torch.zeros(len(prefixes), width, dtype=torch.long)
    for row, ids in enumerate(prefixes):
        out[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
    return out


def _check_same_vocabularies(directories: list[Path]) -> None:
    """Ensemble members must share the SentencePiece models byte for byte."""
    for side in ("src", "tgt"):
        first = (directories[0] / f"spm.{side}.model").read_bytes()
        for directory in directories[1:]:
            if (directory / f"spm.{side}.model").read_bytes() != first:
                raise ValueError(
                    f"cannot ensemble {directories[0]} and {directory}: their "
                    f"{'source' if side == 'src' else 'target'} vocabularies (spm.{side}.model) "
                    "differ; ensemble members must be trained on the same prepared data")


def _check_precision(precision: str, quantize: str, device: torch.device) -> None:
    """Decoding precision: fp32, or bf16 on a GPU or a CPU with native bf16."""
    from ranmt.runtime.precision import cpu_bf16_support

    if precision not in ("fp32", "bf16"):
        raise ValueError(f"precision must be fp32 or bf16, not '{precision}'")
    if precision == "bf16" and quantize != "none":
        raise ValueError("bf16 and int8 quantization are alternatives: choose one")
    if precision == "bf16" and device.type == "cpu":
        native, why = cpu_bf16_support()
        if not native:
            raise ValueError(f"--precision bf16 on this CPU: {why}; decode in fp32 or int8")
