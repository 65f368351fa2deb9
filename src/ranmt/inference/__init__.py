"""Inference: the ``Translator``, the searches (``decode``: fast, sync-free and reference beam
search, greedy), sampling, scoring, ensembles, step-level batching (``continuous``), int8
copies (``quantize``) and export to CTranslate2 / Hugging Face.

Nothing is imported here, so that importing one module does not import the others."""
