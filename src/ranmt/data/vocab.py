"""SentencePiece vocabularies with fixed special ids (pad 0, unk 1, bos 2, eos 3)."""

from __future__ import annotations

import io
from collections.abc import Iterable
from pathlib import Path

import sentencepiece as spm

PAD, UNK, BOS, EOS = 0, 1, 2, 3


class VocabError(ValueError):
    """A vocabulary that cannot be built from the given text and options."""


def train_sentencepiece(lines: Iterable[str], model_path: str | Path, vocab_size: int,
                        model_type: str = "bpe", seed_sentences: int = 2_000_000) -> None:
    """Train a SentencePiece model on ``lines`` and write it to ``model_path``.

    ``hard_vocab_limit`` is off, so a corpus too small for ``vocab_size`` yields a smaller
    vocabulary instead of an error.
    """
    sentences = [line for line in lines if line.strip()]
    characters = {char for line in sentences for char in line if not char.isspace()}
    _train(characters, model_path, vocab_size, model_type, seed_sentences,
           sentence_iterator=iter(sentences))


def train_sentencepiece_file(path: str | Path, characters: set[str], model_path: str | Path,
                             vocab_size: int, model_type: str = "bpe",
                             seed_sentences: int = 2_000_000) -> None:
    """:func:`train_sentencepiece` on the lines of a UTF-8 file (one non-empty sentence a
    line), streamed to SentencePiece one at a time, so that no Python copy of the text is
    held while it trains (the model is the same as from a list of the lines: SentencePiece
    records a file given as ``input`` in the model, an iterator not);
    ``characters``: the file's distinct characters."""
    with open(path, encoding="utf-8", newline="\n") as handle:
        _train(characters, model_path, vocab_size, model_type, seed_sentences,
               sentence_iterator=(line[:-1] for line in handle))


def _train(characters: set[str], model_path: str | Path, vocab_size: int, model_type: str,
           seed_sentences: int, **text) -> None:
    """The SentencePiece training both entry points share; ``text``: its input argument."""
    if model_type not in ("bpe", "unigram", "char", "word"):
        raise ValueError(f"unknown SentencePiece model type '{model_type}'")
    # Every character is kept (character_coverage=1.0), so each needs a piece of its own.
    characters = {char for char in characters if not char.isspace()} | {"\u2581"}
    if vocab_size < len(characters) + 4:
        raise VocabError(f"vocabulary size {vocab_size} is too small: the training text has "
                         f"{len(characters)} distinct characters (plus 4 special pieces); "
                         f"use --vocab-size {len(characters) + 4} or more")
    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            **text,
            model_writer=model,
            vocab_size=vocab_size,
            model_type=model_type,
            character_coverage=1.0,
            pad_id=PAD, unk_id=UNK, bos_id=BOS, eos_id=EOS,
            hard_vocab_limit=False,
            input_sentence_size=seed_sentences,
            shuffle_input_sentence=True,
            minloglevel=2,
        )
    except RuntimeError as err:  # e.g. text that is empty once normalised (control chars)
        raise VocabError(f"SentencePiece cannot train a vocabulary on this text ({err}); check "
                         "that the training files hold real text") from None
    Path(model_path).write_bytes(model.getvalue())


class Vocab:
    """A loaded SentencePiece model: text <-> ids (no BOS/EOS added)."""

    def __init__(self, model_path: str | Path):
        model_path = Path(model_path)
        if not model_path.is_file():
            raise FileNotFoundError(f"SentencePiece model {model_path} does not exist")
        self.path = model_path
        self.processor = spm.SentencePieceProcessor(model_file=str(model_path))
        if self.processor.pad_id() != PAD or self.processor.eos_id() != EOS:
            raise ValueError(f"{model_path}: special ids differ from ranmt's (pad 0, eos 3)")

    def __len__(self) -> int:
        return self.processor.get_piece_size()

    def encode(self, texts: list[str]) -> list[list[int]]:
        return self.processor.encode(texts, out_type=int)

    def decode(self, ids: list[list[int]]) -> list[str]:
        return [self.processor.decode(seq) for seq in ids]

    def pieces(self, text: str) -> list[str]:
        return self.processor.encode(text, out_type=str)
