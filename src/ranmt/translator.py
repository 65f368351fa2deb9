"""The Python API: ``Translator.load(checkpoint).translate(["A man rides a bike."])``.

Raw text in, detokenized text out, one output per input in input order. An empty (or
whitespace-only) input gives an empty output without running the model. An input longer
than ``model.max_positions`` subwords (EOS included) is an error naming its line and
length, unless ``truncate_long`` is set, in which case it is cut with a warning.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from ranmt.checkpoint import load_checkpoint
from ranmt.config import DecodeConfig
from ranmt.data.batching import make_batches, pad_sources
from ranmt.data.vocab import Vocab
from ranmt.decode import search


class InputTooLongError(ValueError):
    pass


def pick_device(name: str = "auto") -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
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
        self.progress = False
        """Show a progress bar (sentences/s, tokens/s, ETA) on stderr while translating
        more than one batch; the CLI turns it on when stderr is a terminal."""

    @classmethod
    def load(cls, checkpoint: str | Path, device: str = "auto", quantize: str = "none",
             **decode_overrides) -> Translator:
        """Load a run directory or checkpoint; ``decode_overrides`` set decode fields.

        ``quantize="int8"``: int8 dynamic quantization of the linear layers (CPU only;
        see :mod:`ranmt.quantize`)."""
        from ranmt.quantize import quantize_model

        device_ = pick_device(device)
        if quantize != "none" and device_.type != "cpu":
            raise ValueError(f"--quantize {quantize} runs on the CPU only, not {device_}")
        model, config, _, directory = load_checkpoint(checkpoint, device_)
        model = quantize_model(model, quantize)
        for key, value in decode_overrides.items():
            if value is None:
                continue
            if not hasattr(config.decode, key):
                raise ValueError(f"unknown decoding option '{key}'")
            setattr(config.decode, key, value)
        return cls(model, config, Vocab(directory / "spm.src.model"),
                   Vocab(directory / "spm.tgt.model"), device_, directory)

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

    def translate_ids(self, ids: list[list[int]], first_line: int = 1, **decode_overrides
                      ) -> list[list[tuple[list[int], float]]]:
        """Token ids in -> per input its n-best ``(target ids, score)``, input order.

        ``decode_overrides`` (e.g. ``beam=2, nbest=2``) apply to this call only."""
        ids = self.check_lengths(ids, first_line)
        d = dataclasses.replace(self.decode_config, **decode_overrides)
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
            for batch in batches:
                rows = [nonempty[j] for j in batch]
                src = pad_sources([ids[r] for r in rows]).to(self.device)
                hyps = search(self.model, src, d.beam, d.lenpen, d.lenpen_style, d.max_len_a,
                              d.max_len_b, d.nbest)
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

    def translate(self, sentences: list[str], first_line: int = 1) -> list[str]:
        """Raw sentences in -> best detokenized translation of each, same order."""
        nbest = self.translate_nbest(sentences, first_line)
        return [hyps[0][0] for hyps in nbest]

    def translate_nbest(self, sentences: list[str], first_line: int = 1
                        ) -> list[list[tuple[str, float]]]:
        stripped = [s.strip() for s in sentences]
        ids = [self.src_vocab.encode([s])[0] if s else [] for s in stripped]
        results = self.translate_ids(ids, first_line)
        return [[(self.tgt_vocab.decode([seq])[0], score) for seq, score in hyps]
                for hyps in results]

    def translate_stream(self, lines: Iterator[str], chunk: int = 1000) -> Iterator[str]:
        """Translate an iterator of lines chunk by chunk, yielding outputs in order."""
        buffer: list[str] = []
        line_no = 1
        for line in lines:
            buffer.append(line.rstrip("\r\n"))
            if len(buffer) >= chunk:
                yield from self.translate(buffer, line_no)
                line_no += len(buffer)
                buffer = []
        if buffer:
            yield from self.translate(buffer, line_no)
