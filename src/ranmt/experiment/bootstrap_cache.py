"""The paired-bootstrap p-values a grid's tables computed, kept on disk between writes.

The tables (:mod:`.tables`) test every variant against the baseline seed by seed, every
``also_decode`` setting against the grid's decode, every comparison row against its
counterpart: the students grid's 17 cells (234 pairs) took 299 s of sacreBLEU resampling per
write, and ``ranmt experiment`` rewrites the tables after every cell; through this cache a
write of the same cells takes 8.5 s (docs/EXPERIMENTS.md). A p-value is a deterministic
function of the pair alone — sacreBLEU reseeds its generator (``SACREBLEU_SEED``) for every
system of a test, so a system's p is the same in a test of two systems as in a test of
ten — so it is kept, keyed by what it depends on: the metric (and sacreBLEU's version), the
number of resamples, the seed, and digests of the baseline's hypotheses, the system's
hypotheses and the references. A rewrite after one new cell then resamples only that
cell's pairs; a changed hypothesis file changes its key and is tested again.

The file (``bootstrap_cache.json``) lives in the grid's work folder when it has one, else
in its output folder (:func:`cache_path`); deleting it only costs the next write its time.
Each write keeps the entries that write used, so the file does not grow with stale pairs.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from contextlib import contextmanager
from pathlib import Path

import sacrebleu

from ranmt.experiment.spec import Experiment, grid_work_dir

CACHE_NAME = "bootstrap_cache.json"
CACHE_FORMAT = 1
"""Bumped whenever ranmt changes how it scores (a metric's settings): older files are
dropped, not trusted."""

PROGRESS_EVERY_S = 30.0
"""A write that resamples for longer says how far it got this often (a cold write of a big
grid takes minutes)."""

_active: BootstrapCache | None = None


def cache_path(experiment: Experiment) -> Path:
    """``WORK/<out's folder name>/bootstrap_cache.json`` beside the run folders when the grid
    has a work folder, else ``OUT/bootstrap_cache.json``."""
    if experiment.work is not None:
        return grid_work_dir(experiment.work, experiment.out) / CACHE_NAME
    return experiment.out / CACHE_NAME


def _digest(lines: list[str]) -> str:
    """A digest of a list of lines (its length included, so ["a\\nb"] != ["a", "b"])."""
    hasher = hashlib.sha256(f"{len(lines)}\n".encode())
    for line in lines:
        hasher.update(line.encode("utf-8"))
        hasher.update(b"\0")
    return hasher.hexdigest()


class BootstrapCache:
    """p-values by pair key, loaded from ``path`` (when there) and saved back by
    :meth:`save`; ``path`` None keeps them in memory only."""

    def __init__(self, path: Path | None, log=print):
        self.path, self.log = path, log
        self.entries: dict[str, float] = {}
        self.used: set[str] = set()
        self.computed = self.reused = 0  # systems resampled / answered from the file
        self.started = self.reported = time.monotonic()
        if path is not None and path.is_file():
            try:
                stored = json.loads(path.read_text(encoding="utf-8"))
                if stored.get("format") == CACHE_FORMAT:
                    self.entries = {str(key): float(p) for key, p in
                                    stored["p_values"].items()}
            except (ValueError, KeyError, TypeError, AttributeError) as error:
                log(f"{path}: not a bootstrap cache ({error}); computing every p-value anew")

    @staticmethod
    def key(metric: str, samples: int, seed: int, baseline: str, system: str,
            references: str) -> str:
        """The key of one metric's p of ``system`` against ``baseline`` (digests)."""
        what = f"{metric}|sacrebleu {sacrebleu.__version__}|{samples}|{seed}|" \
               f"{baseline}|{system}|{references}"
        return hashlib.sha256(what.encode()).hexdigest()

    def p_values(self, systems: list[tuple[str, list[str]]], refs: list[str],
                 metrics: list[str], samples: int, seed: int, compute
                 ) -> list[dict[str, float]]:
        """metric -> p of each of ``systems[1:]`` against ``systems[0]``: kept ones from the
        cache, the others from one ``compute(baseline + missing systems, refs, metrics,
        samples)`` (``paired_bootstrap``'s arguments and result)."""
        baseline, references = _digest(systems[0][1]), _digest(refs)
        keys = [{metric: self.key(metric, samples, seed, baseline, _digest(hyps), references)
                 for metric in metrics} for _, hyps in systems[1:]]
        missing = [index for index, by_metric in enumerate(keys)
                   if any(key not in self.entries for key in by_metric.values())]
        if missing:
            result = compute([systems[0]] + [systems[index + 1] for index in missing], refs,
                             metrics, samples)
            for row, index in enumerate(missing, start=1):
                for metric, key in keys[index].items():
                    self.entries[key] = float(result["systems"][row][f"{metric}_p"])
            self.computed += len(missing)
            self._report_progress()
        self.reused += len(keys) - len(missing)
        for by_metric in keys:
            self.used.update(by_metric.values())
        return [{metric: self.entries[key] for metric, key in by_metric.items()}
                for by_metric in keys]

    def _report_progress(self) -> None:
        now = time.monotonic()
        if now - self.reported >= PROGRESS_EVERY_S:
            self.log(f"paired bootstraps: {self.computed} resampled, {self.reused} kept so far "
                     f"({now - self.started:.0f} s)")
            self.reported = now

    def save(self) -> None:
        """Write the entries used since loading (atomically: a concurrent reader sees the
        old file or the new one)."""
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept = {key: self.entries[key] for key in sorted(self.used)}
        partial = self.path.with_name(f".{self.path.name}.{os.getpid()}")
        partial.write_text(json.dumps({"format": CACHE_FORMAT, "p_values": kept}),
                           encoding="utf-8")
        partial.replace(self.path)


@contextmanager
def cached_bootstraps(path: Path | None, log=print):
    """While active, the tables' paired bootstraps go through a :class:`BootstrapCache`
    at ``path`` (:func:`active`), saved when the block ends without an error."""
    global _active
    previous, _active = _active, BootstrapCache(path, log)
    try:
        yield _active
        _active.save()
    finally:
        _active = previous


def active() -> BootstrapCache | None:
    """The cache of the enclosing :func:`cached_bootstraps`, or None."""
    return _active
