"""Data: Multi30k download, SentencePiece vocabularies, prepared corpora, token batching."""
