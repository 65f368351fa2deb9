"""Choosing a decoding option on a held-out split: decode with each value, score, keep the best.

A length penalty (or a beam size, or an output length limit) is a choice made on valid data,
never on a test set: with beam 4 and the GNMT exponent 0.6 that papers use, a model trained
on short targets (a distilled corpus) writes ~8% shorter than its references and BLEU's
brevity penalty costs it about a point (docs/RESULTS.md, "Why the distilled students write
short"). :func:`sweep` is that choice as one call (``ranmt evaluate --sweep lenpen=...``):

* every value of a numeric search field of :class:`~ranmt.config.DecodeConfig` (``beam``,
  ``lenpen``, ``max_len_a``, ``max_len_b``), or every combination of several fields' values,
  decodes the split once, everything else as the translator's settings say;
* each decode is scored with the requested metrics plus the hypothesis/reference length
  ratio (13a words, as BLEU's brevity penalty counts them) and timed;
* the best is the one with the best selection metric (the first metric unless ``select``
  says otherwise; TER is lower-better), compared at the precision tables show it (two
  decimals): decodes that tie there go to the one listed first, so a list that starts with
  the current setting keeps it unless another value is visibly better.

The translator's own settings are left as they were.
"""

from __future__ import annotations

import itertools
import time
import typing
from collections.abc import Callable

from ranmt.config import ConfigError, DecodeConfig, decode_fields, decode_with
from ranmt.evaluate import score

LOWER_IS_BETTER = frozenset({"ter"})
"""Metrics where the smaller score is the better one."""
SELECTION_DECIMALS = 2
"""Scores are compared at this precision (what tables show); ties go to the earlier value."""


def sweepable_fields() -> tuple[str, ...]:
    """The numeric search fields of DecodeConfig, except the batch size (it does not change
    the outputs): what ``--sweep`` accepts."""
    hints = typing.get_type_hints(DecodeConfig)
    return tuple(f.name for f in decode_fields("search")
                 if hints[f.name] in (int, float) and f.name != "batch_size")


def checked_values(name: str, values: list, where: str = "--sweep") -> list:
    """``values`` of sweepable DecodeConfig field ``name`` converted to its type, each within
    its declared bounds, none twice; ConfigError naming ``where`` otherwise."""
    choices = sweepable_fields()
    if name not in choices:
        raise ConfigError(f"{where}: '{name}' cannot be swept; choose one of {list(choices)}")
    kind = typing.get_type_hints(DecodeConfig)[name]
    if not values:
        raise ConfigError(f"{where} {name}: no values")
    converted = []
    for item in values:
        text = str(item).strip()
        try:
            value = float(text) if kind is float else int(text)
        except ValueError:
            wanted = "an integer" if kind is int else "a number"
            raise ConfigError(f"{where} {name}: '{text}' is not {wanted}") from None
        converted.append(value)
    if len(set(converted)) != len(converted):
        raise ConfigError(f"{where} {name}: a value is listed twice ({values})")
    for value in converted:
        try:
            decode_with(DecodeConfig(), **{name: value})  # bounds and cross-field checks
        except ConfigError as err:
            raise ConfigError(f"{where} {name}: {err}") from None
    return converted


def parse_sweep(texts: str | list[str]) -> dict[str, list]:
    """``"lenpen=0.6,1,2"`` -> ``{"lenpen": [0.6, 1.0, 2.0]}`` (:func:`checked_values`);
    several texts (``--sweep`` repeated) sweep every combination of their values."""
    settings: dict[str, list] = {}
    for text in [texts] if isinstance(texts, str) else texts:
        name, sep, listed = text.partition("=")
        name = name.strip().replace("-", "_")
        if not sep:
            raise ConfigError(f"--sweep takes FIELD=V1,V2,... with FIELD one of "
                              f"{list(sweepable_fields())}, not '{text}'")
        if name in settings:
            raise ConfigError(f"--sweep {name} is given twice")
        settings[name] = checked_values(name, listed.split(","))
    return settings


def combinations(settings: dict[str, list]) -> list[dict]:
    """Every combination of the swept values, the first field varying slowest:
    ``{"beam": [4, 8], "lenpen": [0.6, 1.0]}`` -> ``[{beam 4, lenpen 0.6}, {4, 1.0}, {8,
    0.6}, {8, 1.0}]``."""
    return [dict(zip(settings, values)) for values in itertools.product(*settings.values())]


def is_better(metric: str, candidate: float, best: float) -> bool:
    """Whether ``candidate`` beats ``best`` at :data:`SELECTION_DECIMALS` (a tie does not)."""
    candidate, best = round(candidate, SELECTION_DECIMALS), round(best, SELECTION_DECIMALS)
    return candidate < best if metric in LOWER_IS_BETTER else candidate > best


def describe(values: dict) -> str:
    """``{"beam": 4, "lenpen": 0.6}`` -> ``"beam=4 lenpen=0.6"``."""
    return " ".join(f"{name}={value:g}" for name, value in values.items())


def sweep(translator, sources: list[str], references: list[str], settings: dict[str, list],
          metrics: list[str], tgt_lang: str = "", select: str | None = None,
          log: Callable[[str], None] | None = None) -> dict:
    """Decode ``sources`` with every combination of ``settings`` (DecodeConfig field ->
    values, :func:`combinations`); score each.

    Returns ``{"fields", "select", "best": {field: value}, "rows": [{"values": {field:
    value}, <metric>..., "length_ratio", "seconds"}], "signature": {metric: the scorer's
    signature}, "hypotheses": [lines per row]}``
    (rows in :func:`combinations`' order; ties at :data:`SELECTION_DECIMALS` go to the
    earlier row). ``log`` gets one line per row as it is decoded.
    """
    select = select or metrics[0]
    if select not in metrics:
        raise ConfigError(f"the selection metric {select} is not among the metrics {metrics}")
    kept = translator.decode_config
    rows, hypotheses, best, signature = [], [], None, {}
    try:
        for values in combinations(settings):
            translator.decode_config = decode_with(kept, **values)
            started = time.perf_counter()
            hyps = translator.translate(sources)
            seconds = time.perf_counter() - started
            result = score(hyps, references, metrics, tgt_lang, length_ratio=True)
            signature = result["signature"]  # the same for every row
            row = {"values": values, **{m: result[m] for m in metrics},
                   "length_ratio": result["length_ratio"], "seconds": round(seconds, 2)}
            rows.append(row)
            hypotheses.append(hyps)
            if best is None or is_better(select, row[select], best[select]):
                best = row
            if log is not None:
                log(f"{describe(values)}: " + ", ".join(f"{m} {row[m]:.2f}" for m in metrics)
                    + f", length ratio {row['length_ratio']:.3f} ({seconds:.1f} s)")
    finally:
        translator.decode_config = kept
    return {"fields": list(settings), "select": select, "best": best["values"], "rows": rows,
            "signature": signature, "hypotheses": hypotheses}


def best_index(result: dict) -> int:
    """The position of the chosen row in ``result["rows"]`` (and ``["hypotheses"]``)."""
    return next(i for i, row in enumerate(result["rows"]) if row["values"] == result["best"])


def best_hypotheses(result: dict) -> list[str]:
    """The chosen row's translations."""
    return result["hypotheses"][best_index(result)]


def sweep_table(result: dict, metrics: list[str]) -> str:
    """The sweep as aligned text: one row per combination, the chosen one marked ``*``."""
    head = [*result["fields"], *metrics, "ratio", "seconds"]
    lines = ["  ".join(f"{h:>8}" for h in head)]
    for row in result["rows"]:
        cells = [*(f"{value:>8g}" for value in row["values"].values()),
                 *(f"{row[m]:>8.2f}" for m in metrics),
                 f"{row['length_ratio']:>8.3f}", f"{row['seconds']:>8.1f}"]
        mark = " *" if row["values"] == result["best"] else ""
        lines.append("  ".join(cells) + mark)
    return "\n".join(lines)


def public_result(result: dict) -> dict:
    """The sweep without its hypotheses (for JSON output)."""
    return {key: value for key, value in result.items() if key != "hypotheses"}
