"""``ranmt experiment GRID --status``: where every cell of a grid stands, read from disk
only — cell.json, the cell's lock, its run folder's train.log and step checkpoints — so it
is safe to run beside the workers training the grid (nothing is loaded or trained):

* ``done``: its steps, best validation and test scores (SacreBLEU per test set);
* ``training``: a live process on this host holds its lock (or one on another host);
* ``stopped``: trained part-way (a signal, a time limit, a crash), resumed by the next run;
* ``not started``.

For a cell under way: its last logged step and throughput, its best validation so far and
how many validations have not beaten it, against the early-stopping patience.
"""

from __future__ import annotations

import re
import socket

from ranmt.checkpoint import step_checkpoints
from ranmt.config import ConfigError
from ranmt.experiment.loading import load_placed
from ranmt.experiment.locks import pid_alive
from ranmt.experiment.spec import Cell
from ranmt.experiment.table_parts import best_valid_score

_STEP = re.compile(r"^step (\d+) .*?\| ([\d,.]+) tgt tok/s", re.MULTILINE)
_VALIDATE = re.compile(r"^validate step (\d+):.*\| best (-?[\d.]+) at step (\d+)$",
                       re.MULTILINE)


def lock_holder(cell: Cell) -> str | None:
    """"host pid" of the process holding the cell's lock: a live one on this host, or any
    on another host (which cannot be checked from here); None when unlocked or stale."""
    try:
        host, pid = cell.lock.read_text(encoding="utf-8").split()
    except (OSError, ValueError):
        return None
    if host == socket.gethostname() and not pid_alive(int(pid)):
        return None
    return f"{host} {pid}"


def _patience(cell: Cell) -> int | None:
    try:
        return cell.config().train.patience or None
    except (ConfigError, OSError):
        return None


def _progress(cell: Cell) -> dict:
    """A cell under way: its last logged step and target tokens/s, its newest step
    checkpoint, the best validation so far (step, metric) and the validations since."""
    log_file = cell.run_dir / "train.log"
    text = log_file.read_text(encoding="utf-8", errors="replace") if log_file.is_file() else ""
    steps = _STEP.findall(text)
    validations = {int(step): (float(best), int(best_step))
                   for step, best, best_step in _VALIDATE.findall(text)}
    checkpoints = step_checkpoints(cell.run_dir)
    progress: dict = {
        "step": int(steps[-1][0]) if steps else None,
        "tokens_per_s": float(steps[-1][1].replace(",", "")) if steps else None,
        "checkpoint_step": int(checkpoints[-1].name[len("step_"):]) if checkpoints else None,
        "patience": _patience(cell)}
    if validations:
        best, best_step = validations[max(validations)]
        progress.update(best_valid=best, best_step=best_step,
                        validations_since_best=sum(step > best_step for step in validations))
    return progress


def cell_status(cell: Cell) -> dict:
    """One cell's state and numbers (see the module's docstring)."""
    entry: dict = {"cell": cell.label, "dataset": cell.dataset.name,
                   "variant": cell.variant.name, "seed": cell.seed}
    if cell.finished:
        result = cell.result()
        train = result.get("train", {})
        entry.update(state="done", step=train.get("steps"), best_step=train.get("best_step"),
                     best_valid=best_valid_score(train),
                     tests={test: scores.get("bleu")
                            for test, scores in result.get("tests", {}).items()})
        return entry
    holder = lock_holder(cell)
    progress = _progress(cell)
    started = progress["step"] is not None or progress["checkpoint_step"] is not None
    entry.update(progress, state="training" if holder else
                 "stopped" if started else "not started", holder=holder)
    return entry


def _row(entry: dict, width: int) -> str:
    """One line of the status table (``width``: of the cell column)."""
    def number(value, digits=0):
        return "-" if value is None else f"{value:,.{digits}f}"

    best = ("-" if entry.get("best_valid") is None else
            f"{entry['best_valid']:.2f} @ {number(entry.get('best_step'))}")
    if entry["state"] == "done":
        detail = "SacreBLEU " + " / ".join(f"{score:.2f}" for score in entry["tests"].values()
                                      if score is not None)
    elif entry.get("best_valid") is None:
        detail = ""
    else:
        patience = entry.get("patience")
        detail = (f"{entry['validations_since_best']}"
                  + (f"/{patience}" if patience else "") + " validations without gain")
    if entry["state"] == "training":
        detail += f"; {number(entry.get('tokens_per_s'))} tgt tok/s ({entry['holder']})"
    elif entry["state"] == "stopped":
        detail += f"; resumes from step {number(entry.get('checkpoint_step'))}"
    return (f"{entry['cell']:<{width}} {entry['state']:<11} {number(entry.get('step')):>8} "
            f"{best:>16}  {detail.strip('; ')}")


def grid_status(path, out=None, work=None, log=print) -> list[dict]:
    """Print the state of every cell of the grid ``path`` (its ``out`` / ``work`` placed as
    ``ranmt experiment`` places them) and return the entries, in grid order."""
    experiment = load_placed(path, out, work)
    entries = [cell_status(cell) for cell in experiment.cells()]
    counts = {state: sum(e["state"] == state for e in entries)
              for state in ("done", "training", "stopped", "not started")}
    log(f"grid {experiment.name} ({experiment.out}): {len(entries)} cells: "
        + ", ".join(f"{count} {state}" for state, count in counts.items()))
    width = max(len(entry["cell"]) for entry in entries)
    log(f"{'cell':<{width}} {'state':<11} {'step':>8} {'best valid @':>16}  detail")
    for entry in entries:
        log(_row(entry, width))
    return entries
