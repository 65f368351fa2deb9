"""``ranmt distill``: a teacher's translations of a prepared split as a student's corpus —
resumable after a kill without losing or repeating a line, filtered with counts, and
encoded by ``ranmt prepare`` with the teacher's SentencePiece models."""

from __future__ import annotations

import json
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from conftest import reverse_task, write_parallel
from ranmt.cli import main
from ranmt.data.corpus import load_meta, raw_text
from ranmt.inference.distill import DistillFilter, distill, repeated_ngram
from ranmt.inference.translator import Translator


def _repeated(text: str, times: int) -> bool:
    return repeated_ngram(text.split(" "), times)


def test_repeated_ngrams_are_counted_in_a_row():
    assert _repeated("a a a a", 4)
    assert not _repeated("a a a b a", 4)
    assert _repeated("x a b a b a b y", 3)  # the bigram "a b" three times
    assert not _repeated("a b c a b c", 3)
    assert _repeated("p q r s p q r s p q r s", 3)  # a 4-gram


def test_the_filter_names_its_reason():
    keep = DistillFilter(max_ratio=2.0, max_repeats=3)
    assert keep.reason("one two three", "") == "empty"
    assert keep.reason("one two", "a b c d e") == "ratio"
    assert keep.reason("one two three four five", "a") == "ratio"
    assert keep.reason("one two three four", "la la la x") == "repetition"
    assert keep.reason("one two three", "eins zwei drei") is None
    off = DistillFilter(max_ratio=0, max_repeats=0, drop_empty=False)
    assert off.reason("one", "") is None and off.reason("a", "b b b b b b b") is None


def test_distilled_corpus_is_the_teachers_translations_and_prepares(reverse_run, reverse_data,
                                                                    tmp_path):
    teacher = Translator.load(reverse_run, device="cpu", beam=2)
    out = tmp_path / "distilled 'out'"  # the report's command quotes its paths
    report = distill(teacher, reverse_data, out, split="test", chunk_lines=64)
    sources = raw_text(reverse_data, "test", "src")
    assert report["lines"] == len(sources) == 200
    kept = (out / "test.src").read_text().splitlines()
    targets = (out / "test.tgt").read_text().splitlines()
    assert len(kept) == len(targets) == report["kept"] == 200 - sum(report["dropped"].values())
    translations = dict(zip(sources, teacher.translate(sources)))
    assert all(translations[source] == target for source, target in zip(kept, targets))
    assert (out / "valid.tgt").read_text().splitlines() == raw_text(reverse_data, "valid", "tgt")
    # the report's command encodes the corpus with the teacher's vocabularies
    main(shlex.split(report["prepare_command"])[1:] + ["--quiet"])
    prepared = load_meta(out / "prepared")
    assert prepared["src_vocab_size"] == load_meta(reverse_data)["src_vocab_size"]
    assert (out / "prepared" / "spm.src.model").read_bytes() == \
        (reverse_data / "spm.src.model").read_bytes()
    # resuming with another teacher setting refuses instead of mixing outputs
    with pytest.raises(ValueError, match="other settings"):
        distill(Translator.load(reverse_run, device="cpu", beam=3), reverse_data, out,
                split="test", chunk_lines=64)


def _distill_command(run: Path, data: Path, out: Path) -> list[str]:
    return [sys.executable, "-m", "ranmt", "distill", "--checkpoint", str(run), "--data",
            str(data), "--split", "valid", "--out", str(out), "--chunk-lines", "16",
            "--device", "cpu", "--beam", "2"]


def test_distill_killed_mid_run_resumes_without_losing_or_repeating_lines(
        reverse_run, reverse_data, tmp_path):
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    subprocess.run(_distill_command(reverse_run, reverse_data, whole), check=True,
                   capture_output=True, timeout=300)
    proc = subprocess.Popen(_distill_command(reverse_run, reverse_data, killed),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while not (killed / "parts" / "00002.tgt").exists():
        assert time.time() < deadline and proc.poll() is None
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (killed / "valid.tgt").exists()  # stopped before the end
    resumed = subprocess.run(_distill_command(reverse_run, reverse_data, killed), check=True,
                             capture_output=True, text=True, timeout=300)
    assert "resuming: " in resumed.stderr
    for name in ("valid.src", "valid.tgt"):
        assert (killed / name).read_bytes() == (whole / name).read_bytes()
    report = json.loads((killed / "distill.json").read_text())
    assert report["lines"] == 200 and report["this_run"]["chunks"] < 13


def distilled_grid(tmp_path, student_arch: str = "transf",
                   teacher_overrides: dict | None = None) -> Path:
    """The tiny reverse-task grid with a distilled dataset: a Teacher cell (TransF) on
    ``reverse`` and a Student cell on the Teacher's translations (``reverse-distilled``)."""
    from test_experiment import _grid

    path = _grid(tmp_path)
    config = yaml.safe_load(path.read_text())
    config["baseline"] = "Student"
    config["datasets"].append({
        "name": "reverse-distilled", "src": "src", "tgt": "tgt",
        "distill": {"teacher": {"dataset": "reverse", "variant": "Teacher", "seed": 1},
                    "decode": {"beam": 1}, "chunk_lines": 1000}})
    config["variants"] = [
        {"name": "Teacher", "datasets": ["reverse"],
         "overrides": {"model.arch": "transf", **(teacher_overrides or {})}},
        {"name": "Student", "datasets": ["reverse-distilled"],
         "overrides": {"model.arch": student_arch}}]
    path.write_text(yaml.safe_dump(config))
    return path


def test_a_grid_trains_its_teacher_distills_and_trains_students_on_the_result(tmp_path):
    """teacher -> distilled data -> students in one `ranmt experiment`: the distilled
    dataset is the teacher cell's translations, encoded with the teacher's vocabularies;
    a variant runs only on the datasets it lists."""
    path = distilled_grid(tmp_path, student_arch="ssru-d")
    main(["experiment", str(path), "--dry-run"])
    main(["experiment", str(path)])
    exp = tmp_path / "exp"
    cells = sorted(p.relative_to(exp / "runs").parent.parent.as_posix()
                   for p in (exp / "runs").glob("*/*/seed1/cell.json"))
    assert cells == ["reverse-distilled/Student", "reverse/Teacher"]
    distilled = exp / "data" / "reverse-distilled"
    teacher_data = exp / "data" / "reverse"
    assert (distilled / "spm.src.model").read_bytes() == \
        (teacher_data / "spm.src.model").read_bytes()
    teacher = Translator.load(exp / "runs/reverse/Teacher/seed1/run", device="cpu", beam=1)
    report = json.loads((exp / "data" / "reverse-distilled.distill" / "distill.json").read_text())
    sources = raw_text(distilled, "train", "src")
    assert report["lines"] == 3000 and len(sources) == report["kept"] > 100  # a weak teacher
    translations = teacher.translate(sources)  # batched otherwise: equal but for float ties
    same = sum(a == b for a, b in zip(raw_text(distilled, "train", "tgt"), translations))
    assert same >= 0.99 * len(sources)
    assert raw_text(distilled, "test", "tgt") == raw_text(teacher_data, "test", "tgt")
    # the students are scored on the teacher dataset's test sets (it lists none of its own)
    student = json.loads((exp / "runs/reverse-distilled/Student/seed1/cell.json").read_text())
    assert list(student["tests"]) == ["test"] and student["tests"]["test"]["bleu"] >= 0
    assert len(raw_text(distilled, "test", "src")) == 40 == len(
        (exp / "runs/reverse-distilled/Student/seed1/test.hyp").read_text().splitlines())
    config = yaml.safe_load(path.read_text())
    assert config["datasets"][0]["name"] == "reverse"
    assert "reverse-distilled" in (exp / "results.md").read_text()
    _rebuilt_from_kept_translations(path, exp, distilled)
    # a test set added to the teacher's dataset later reaches the distilled one (copied:
    # the same sources, references and SentencePiece models) and both datasets' cells
    src2, tgt2 = reverse_task(20, 9)
    write_parallel(tmp_path / "test2", src2, tgt2)
    config["datasets"][0]["tests"]["test2"] = str(tmp_path / "test2")
    path.write_text(yaml.safe_dump(config))
    main(["experiment", str(path)])
    for side in ("src", "tgt"):
        assert (distilled / f"test2.{side}.tokens.npy").read_bytes() == \
            (teacher_data / f"test2.{side}.tokens.npy").read_bytes()
    assert raw_text(distilled, "test2", "tgt") == tgt2
    for cell in ("reverse/Teacher", "reverse-distilled/Student"):
        scored = json.loads((exp / "runs" / cell / "seed1/cell.json").read_text())["tests"]
        assert sorted(scored) == ["test", "test2"]


def _rebuilt_from_kept_translations(path: Path, exp: Path, distilled: Path) -> None:
    """The grid keeps the teacher's translations beside the cells (OUT/distilled/NAME, for
    git): a checkout without the teacher's run folder (a new machine) rebuilds the same
    distilled dataset from them; with neither, the error says what to do."""
    from ranmt.config import ConfigError
    from ranmt.experiment.loading import load_placed
    from ranmt.experiment.preparation import prepare_once

    kept = exp / "distilled" / "reverse-distilled"
    assert sorted(p.name for p in kept.iterdir()) == ["settings.json", "translations.gz"]
    encoded = {p.name: p.read_bytes() for p in distilled.iterdir() if p.suffix == ".npy"}
    assert "train.tgt.tokens.npy" in encoded
    teacher_run = exp / "runs/reverse/Teacher/seed1/run"
    teacher_run.rename(exp / "teacher_run_aside")
    for folder in (distilled, exp / "data" / "reverse-distilled.distill"):
        shutil.rmtree(folder)
    experiment = load_placed(path)
    dataset = next(d for d in experiment.datasets if d.name == "reverse-distilled")
    messages: list[str] = []
    prepare_once(dataset, exp, messages.append, experiment)
    assert any("translations kept in" in message for message in messages)
    assert {p.name: p.read_bytes() for p in distilled.iterdir() if p.suffix == ".npy"} == encoded
    shutil.rmtree(distilled)
    settings = (kept / "settings.json").read_text()
    (kept / "settings.json").write_text(settings.replace('"beam": 1', '"beam": 5'))
    with pytest.raises(ConfigError, match="decoded with other settings"):
        prepare_once(dataset, exp, messages.append, experiment)
    (kept / "settings.json").write_text(settings)
    shutil.move(kept, exp / "kept_aside")
    with pytest.raises(ConfigError, match="run folder .* is not here"):
        prepare_once(dataset, exp, messages.append, experiment)
    (exp / "teacher_run_aside").rename(teacher_run)
    shutil.move(exp / "kept_aside", kept)
    prepare_once(dataset, exp, messages.append, experiment)
