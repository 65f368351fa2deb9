"""Scoring the way the papers report it, on top of sacreBLEU, sacremoses and rouge-score.

* ``bleu``: detokenized, case-sensitive sacreBLEU (13a), with its signature ("SacreBLEU");
* ``tok_bleu``: BLEU on Moses-tokenized text, the way multi-bleu.perl is used in the RAN
  paper (sacremoses tokenization of hypotheses and references, then sacreBLEU with
  ``tokenize="none"``); ``compound_split`` adds the common German "##AT##-##AT##" splitting
  of hyphenated compounds;
* ``chrf``, ``ter``: sacreBLEU's chrF and TER;
* ``rouge1`` / ``rouge2`` / ``rougeL``: rouge-score F-measures x 100 (summarization);
* ``bleu_by_length``: BLEU per bin of source or reference length (paper 000 Fig. 8);
* paired bootstrap resampling of several systems against the first (sacreBLEU's own).

Metric sets per task (``TASK_METRICS``): translation, summarization (ROUGE-1/2/L) and
dialogue (BLEU-4 and ROUGE-L, paper 000 Table 4).
"""

from __future__ import annotations

import os
import re
import statistics

from sacrebleu.metrics import BLEU, CHRF, TER
from sacrebleu.significance import PairedTest

METRICS = ("bleu", "tok_bleu", "chrf", "ter", "rouge1", "rouge2", "rougeL")
TASK_METRICS = {
    "translation": ("bleu", "tok_bleu", "chrf", "ter"),
    "summarization": ("rouge1", "rouge2", "rougeL"),
    "dialogue": ("bleu", "rougeL"),
}
DEFAULT_LENGTH_EDGES = (0, 10, 20, 30, 40, 50, 60)
"""Seven bins: [0,10), [10,20), ..., [50,60), [60, inf) words (paper 000 Fig. 8)."""


class ScoreError(ValueError):
    pass


def _sacrebleu_metric(name: str, tgt_lang: str = ""):
    if name == "bleu":
        return BLEU(trg_lang=tgt_lang)
    if name == "chrf":
        return CHRF()
    if name == "ter":
        return TER()
    raise ScoreError(f"'{name}' is not a sacreBLEU metric")


BOOTSTRAP_SEED = 12345
"""sacreBLEU's default seed of the paired bootstrap (``SACREBLEU_SEED``), fixed for every
test ranmt runs: the same hypotheses give the same p-value in every table."""

_SEGMENT_STATISTICS: dict[tuple, object] = {}
"""(metric, hypotheses, references) -> sacreBLEU's segment statistics, for
:func:`paired_bootstrap`: a grid's tables test every variant's output against the same
baseline output per seed, and again against each extra baseline; TER's and chrF's segment
statistics were 85% of a committed grid's table rebuild (cProfile)."""
_STATISTICS_KEPT = 256


def _with_memoized_statistics(name: str, metric):
    """``metric`` whose segment statistics of a (hypotheses, references) pair are computed
    once per process (sacreBLEU recomputes them in every paired test). The statistics are
    a deterministic function of the pair and the metric's settings (``name``'s defaults),
    so the tables are the same; without sacreBLEU's ``_extract_corpus_statistics`` (another
    version) the metric is left as it is."""
    extract = getattr(metric, "_extract_corpus_statistics", None)
    if extract is None:
        return metric

    def memoized(hypotheses, references):
        if not references:  # the metric's own reference cache: not keyed here
            return extract(hypotheses, references)
        key = (name, tuple(hypotheses), tuple(tuple(doc) for doc in references))
        if key not in _SEGMENT_STATISTICS:
            if len(_SEGMENT_STATISTICS) >= _STATISTICS_KEPT:
                _SEGMENT_STATISTICS.clear()
            statistics = extract(hypotheses, references)
            _SEGMENT_STATISTICS[key] = (statistics, metric.num_refs)
        statistics, metric.num_refs = _SEGMENT_STATISTICS[key]  # its signature needs it
        return statistics

    metric._extract_corpus_statistics = memoized
    return metric


def moses_tokenize(lines: list[str], lang: str = "en", compound_split: bool = False
                   ) -> list[str]:
    """Moses-tokenize (sacremoses, no escaping), optionally splitting hyphenated compounds."""
    from sacremoses import MosesTokenizer

    tokenizer = MosesTokenizer(lang=lang or "en")
    out = [tokenizer.tokenize(line, escape=False, return_str=True) for line in lines]
    if compound_split:
        out = [re.sub(r"(\S)-(\S)", r"\1 ##AT##-##AT## \2", line) for line in out]
    return out


def tokenized_bleu(hyps: list[str], refs: list[str], lang: str = "en",
                   compound_split: bool = False, extra_refs: list[list[str]] = ()
                   ) -> tuple[float, str]:
    """(BLEU on Moses-tokenized text, description) — the multi-bleu.perl style number;
    ``extra_refs``: more reference streams."""
    metric = BLEU(tokenize="none", force=True)
    score = metric.corpus_score(moses_tokenize(hyps, lang, compound_split),
                                [moses_tokenize(stream, lang, compound_split)
                                 for stream in (refs, *extra_refs)])
    signature = f"moses-tok:{lang or 'en'}|compound-split:{'yes' if compound_split else 'no'}|" \
        + str(metric.get_signature())
    return float(score.score), signature


ROUGE_REFERENCE_RULES = ("max", "mean")


def rouge(hyps: list[str], refs: list[str], kinds=("rouge1", "rouge2", "rougeL"),
          extra_refs: list[list[str]] = (), rule: str = "max") -> dict:
    """Corpus ROUGE: mean over lines of the F-measure x 100 per kind (rouge-score, with
    stemming). With ``extra_refs`` (more reference streams, e.g. DialogSum's three), a
    line's F-measure per kind is the best over its references (``rule`` max: rouge-score's
    ``score_multi``) or their mean (``rule`` mean)."""
    from rouge_score import rouge_scorer

    if rule not in ROUGE_REFERENCE_RULES:
        raise ScoreError(f"unknown multi-reference rule '{rule}' (choose from "
                         f"{', '.join(ROUGE_REFERENCE_RULES)})")
    scorer = rouge_scorer.RougeScorer(list(kinds), use_stemmer=True)
    totals = dict.fromkeys(kinds, 0.0)
    for line, hyp in enumerate(hyps):
        per_reference = [scorer.score(stream[line], hyp) for stream in (refs, *extra_refs)]
        for kind in kinds:
            values = [scores[kind].fmeasure for scores in per_reference]
            totals[kind] += max(values) if rule == "max" else sum(values) / len(values)
    return {kind: 100.0 * total / max(len(hyps), 1) for kind, total in totals.items()}


def score(hyps: list[str], refs: list[str], metrics=("bleu", "chrf", "ter"),
          tgt_lang: str = "", compound_split: bool = False, length_ratio: bool = False,
          extra_refs: list[list[str]] = (), rouge_rule: str = "max") -> dict:
    """``{"bleu": 31.2, "chrf": ..., "signature": {"bleu": "nrefs:1|..."}}``.

    ``extra_refs``: more reference streams, line by line with ``refs`` (sacreBLEU's
    multi-reference BLEU, chrF and TER; ROUGE by ``rouge_rule``, see :func:`rouge`).
    ``length_ratio``: also ``"length_ratio"``, hypothesis over reference words as BLEU's
    brevity penalty counts them (``bleu``'s tokenization; BP = exp(1 - 1/ratio) below 1)."""
    if len(hyps) != len(refs):
        raise ScoreError(f"hypothesis has {len(hyps)} lines, reference has {len(refs)}")
    for number, stream in enumerate(extra_refs, start=2):
        if len(stream) != len(refs):
            raise ScoreError(f"reference {number} has {len(stream)} lines, the first has "
                             f"{len(refs)}")
    streams = [refs, *extra_refs]
    if not refs:
        raise ScoreError("the reference is empty: nothing to score")
    unknown = [m for m in metrics if m not in METRICS]
    if unknown:
        raise ScoreError(f"unknown metric(s) {unknown}; choose from {list(METRICS)}")
    result: dict = {"signature": {}}
    rouge_kinds = [m for m in metrics if m.startswith("rouge")]
    if rouge_kinds:
        values = rouge(hyps, refs, rouge_kinds, extra_refs, rouge_rule)
        result.update({k: round(v, 4) for k, v in values.items()})
        for kind in rouge_kinds:
            result["signature"][kind] = "rouge-score|stemmer:yes|fmeasure" + (
                f"|nrefs:{len(streams)}|refs:{rouge_rule}" if extra_refs else "")
    for name in metrics:
        if name.startswith("rouge"):
            continue
        if name == "tok_bleu":
            value, signature = tokenized_bleu(hyps, refs, tgt_lang, compound_split,
                                              extra_refs)
        else:
            metric = _sacrebleu_metric(name, tgt_lang)
            corpus = metric.corpus_score(hyps, streams)
            value = float(corpus.score)
            signature = str(metric.get_signature())
            if name == "bleu" and length_ratio:
                result["length_ratio"] = round(corpus.sys_len / max(corpus.ref_len, 1), 4)
        result[name] = round(value, 4)
        result["signature"][name] = signature
    if length_ratio and "length_ratio" not in result:
        result["length_ratio"] = score(hyps, refs, ("bleu",), tgt_lang, length_ratio=True,
                                       extra_refs=extra_refs)["length_ratio"]
    return result


def length_bins(lengths: list[int], edges=DEFAULT_LENGTH_EDGES) -> list[list[int]]:
    """Partition sentence indices by length: bin b holds edges[b] <= length < edges[b+1]
    (the last bin is open-ended). Every index lands in exactly one bin."""
    edges = list(edges)
    if edges != sorted(edges) or len(set(edges)) != len(edges):
        raise ScoreError(f"length bin edges must increase strictly: {edges}")
    bins: list[list[int]] = [[] for _ in edges]
    for index, length in enumerate(lengths):
        position = 0
        for b, edge in enumerate(edges):
            if length >= edge:
                position = b
        bins[position].append(index)
    return bins


def bleu_by_bins(hyps: list[str], refs: list[str], values: list[float], edges,
                 label) -> list[dict]:
    """BLEU of each bin of ``values`` (see :func:`length_bins`); ``label(low, high)`` names a
    bin (``high`` is None for the last, open-ended one)."""
    out = []
    for b, members in enumerate(length_bins(values, edges)):
        high = edges[b + 1] if b + 1 < len(edges) else None
        bleu = (BLEU().corpus_score([hyps[i] for i in members], [[refs[i] for i in members]])
                .score if members else None)
        out.append({"bin": label(edges[b], high), "sentences": len(members), "bleu": bleu})
    return out


def bleu_by_length(hyps: list[str], refs: list[str], sources: list[str], by: str = "source",
                   edges=DEFAULT_LENGTH_EDGES) -> list[dict]:
    """BLEU per length bin of the source or the reference (length in whitespace words)."""
    if by not in ("source", "reference"):
        raise ScoreError("by must be source or reference")
    basis = sources if by == "source" else refs
    return bleu_by_bins(hyps, refs, [len(s.split()) for s in basis], tuple(edges),
                        lambda low, high: f"{low}-{high - 1}" if high is not None else f"{low}+")


def paired_bootstrap(systems: list[tuple[str, list[str]]], refs: list[str],
                     metrics=("bleu", "chrf", "ter"), samples: int = 1000,
                     seed: int = BOOTSTRAP_SEED) -> dict:
    """Scores of every system and p-values of systems 2.. against system 1 (the baseline).

    Returns ``{"systems": [{"name", "bleu", "bleu_p", ...}], "signature": {...}}``. A system
    whose output is identical to the baseline's gets p = 1 (see below).
    """
    for name, hyps in systems:
        if len(hyps) != len(refs):
            raise ScoreError(f"{name}: {len(hyps)} lines, reference has {len(refs)}")
    metrics = [m for m in metrics if m in ("bleu", "chrf", "ter")]
    if not metrics:
        raise ScoreError("paired bootstrap supports bleu, chrf and ter")
    os.environ["SACREBLEU_SEED"] = str(seed)
    test = PairedTest(systems, {m: _with_memoized_statistics(m, _sacrebleu_metric(m))
                                for m in metrics}, [refs], test_type="bs", n_samples=samples)
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
                if list(systems[row][1]) == list(systems[0][1]):
                    # Identical outputs: every resampled difference is exactly 0 and
                    # sacreBLEU's strict count returns its floor 1/(n+1), which would read
                    # as "significant". There is no difference to test: p = 1.
                    entry[f"{metric}_p"] = 1.0
        out["systems"].append(entry)
    return out


# ------------------------------------------------------------------------------ significance
#
# One rule for every table ranmt writes, at one level unless asked (``--alpha``):
#
# * one run against another (``ranmt score`` with several --hyp): † when sacreBLEU's paired
#   bootstrap gives p < alpha (:func:`single_run_mark`);
# * several seeds against several seeds (the grids' tables, :func:`compare_over_seeds`):
#   † when every seed's paired bootstrap gives p < alpha and all seeds differ in the same
#   direction, ‡ when Welch's t-test over the seed scores gives p < alpha.

DEFAULT_ALPHA = 0.05
"""The significance level of every mark unless asked otherwise."""


def single_run_mark(p_value: float | None, alpha: float = DEFAULT_ALPHA) -> str:
    """† for one system against the baseline when the paired bootstrap's p < ``alpha``."""
    return "†" if p_value is not None and p_value < alpha else ""


def welch_p_value(first: list[float], second: list[float]) -> float | None:
    """Two-sided p of Welch's t-test between two sets of seed scores (None if undefined)."""
    if len(first) < 2 or len(second) < 2:
        return None
    if statistics.stdev(first) == 0 and statistics.stdev(second) == 0:
        return 1.0 if statistics.mean(first) == statistics.mean(second) else 0.0
    from scipy.stats import ttest_ind

    return float(ttest_ind(first, second, equal_var=False).pvalue)


def compare_over_seeds(baseline: dict[int, float], variant: dict[int, float],
                       bootstrap_p: dict[int, float], alpha: float,
                       seed_spread: bool = True) -> dict:
    """The significance rule of the results tables, for one metric of one variant.

    ``baseline`` / ``variant``: seed -> score; ``bootstrap_p``: seed -> p-value of the paired
    bootstrap between the variant's and the baseline's outputs of that seed.

    * ``dagger`` (†): every seed the two share is significant (p < alpha) **and** every
      per-seed difference has the same sign: the gain (or loss) holds in every run.
    * ``double_dagger`` (‡): Welch's two-sided t-test over the seed scores (at least two
      seeds on each side) gives p < alpha: the difference of the seed means is larger than
      the spread between seeds. ``seed_spread=False`` when the baseline is one run
      repeated for every seed (its spread is unknown): no Welch's test, no ‡.
    """
    shared = sorted(set(baseline) & set(variant) & set(bootstrap_p))
    deltas = [variant[s] - baseline[s] for s in shared]
    signs = {(d > 0) - (d < 0) for d in deltas}
    dagger = bool(shared) and all(bootstrap_p[s] < alpha for s in shared) \
        and len(signs) == 1 and 0 not in signs
    welch = welch_p_value(list(variant.values()), list(baseline.values())) \
        if seed_spread else None
    return {"delta": statistics.mean(variant.values()) - statistics.mean(baseline.values()),
            "seeds": shared, "per_seed_delta": deltas,
            "per_seed_p": [bootstrap_p[s] for s in shared], "welch_p": welch,
            "dagger": dagger, "double_dagger": welch is not None and welch < alpha}


def significance_marks(comparison: dict) -> str:
    return ("†" if comparison["dagger"] else "") + ("‡" if comparison["double_dagger"] else "")


def marks_suffix(comparison: dict | None) -> str:
    """The seed rule's marks as a table cell appends them: " †", " †‡" or "" (also where
    there was no comparison)."""
    marks = significance_marks(comparison) if comparison else ""
    return f" {marks}" if marks else ""
