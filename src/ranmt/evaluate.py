"""Scoring with sacreBLEU: BLEU, chrF, TER with signatures, and paired bootstrap resampling.

BLEU is computed on detokenized, case-sensitive text with sacreBLEU's default ``13a``
tokenization (the "SacreBLEU" column of the papers). With several systems the first is
the baseline and the others get paired-bootstrap p-values against it (sacreBLEU's own
implementation, 1000 resamples by default).
"""

from __future__ import annotations

from sacrebleu.metrics import BLEU, CHRF, TER
from sacrebleu.significance import PairedTest

METRICS = {"bleu": BLEU, "chrf": CHRF, "ter": TER}


class ScoreError(ValueError):
    pass


def _metric(name: str, tgt_lang: str = ""):
    if name not in METRICS:
        raise ScoreError(f"unknown metric '{name}'; choose from {sorted(METRICS)}")
    if name == "bleu":
        return BLEU(trg_lang=tgt_lang)
    return METRICS[name]()


def score(hyps: list[str], refs: list[str], metrics=("bleu", "chrf", "ter"),
          tgt_lang: str = "") -> dict:
    """``{"bleu": 31.2, "chrf": ..., "ter": ..., "signature": {"bleu": "nrefs:1|..."}}``."""
    if len(hyps) != len(refs):
        raise ScoreError(f"hypothesis has {len(hyps)} lines, reference has {len(refs)}")
    result: dict = {"signature": {}}
    for name in metrics:
        metric = _metric(name, tgt_lang)
        corpus = metric.corpus_score(hyps, [refs])
        result[name] = round(float(corpus.score), 4)
        result["signature"][name] = str(metric.get_signature())
    return result


def paired_bootstrap(systems: list[tuple[str, list[str]]], refs: list[str],
                     metrics=("bleu", "chrf", "ter"), samples: int = 1000,
                     seed: int = 12345) -> dict:
    """Scores of every system and p-values of systems 2.. against system 1 (the baseline).

    Returns ``{"systems": [{"name", "bleu", "bleu_p", ...}], "signature": {...}}``.
    """
    for name, hyps in systems:
        if len(hyps) != len(refs):
            raise ScoreError(f"{name}: {len(hyps)} lines, reference has {len(refs)}")
    import os

    os.environ["SACREBLEU_SEED"] = str(seed)
    test = PairedTest(systems, {m: _metric(m) for m in metrics}, [refs], test_type="bs",
                      n_samples=samples)
    signatures, table = test()
    # sacreBLEU keys its tables by display name ("BLEU", "chrF2"), in the order given.
    columns = [key for key in table if key != "System"]
    out: dict = {"systems": [], "signature": {
        metric: str(signatures[column]) for metric, column in zip(metrics, columns)}}
    for row, (name, _) in enumerate(systems):
        entry: dict = {"name": name}
        for metric, column in zip(metrics, columns):
            result = table[column][row]
            entry[metric] = round(float(result.score), 4)
            if row > 0:
                entry[f"{metric}_p"] = result.p_value
        out["systems"].append(entry)
    return out
