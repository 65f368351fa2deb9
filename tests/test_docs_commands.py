"""The ``ranmt`` commands the README and docs/ show in their shell blocks are ones ranmt
accepts: each parses with the CLI's own parser, and a ``ranmt train`` command's config file
and ``key=value`` overrides load, an ``experiment`` command's grid loads with the variants,
seeds and datasets it picks. A flag, config key or grid entry renamed without its docs
fails here. Synopses (``[--flag VALUE]``, ``a|b``, ``...``) are not literal commands and are
left out."""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import runpy
import shlex
from pathlib import Path

import pytest

from ranmt.cli import build_parser
from ranmt.config import load_config
from ranmt.experiment.loading import load_experiment

ROOT = Path(__file__).resolve().parents[1]
SHELL_BLOCK = re.compile(r"```(?:bash|sh|shell|console)?\n(.*?)```", re.S)
COMMAND = re.compile(r"(?:^|\s)(?:\.venv/bin/)?ranmt ([a-z][a-z-]*(?: .*)?)$")
SYNOPSIS = re.compile(r"\[|\.\.\.|\w\|\w|\(|[A-Z]{3,} ?$")
SHELL_END = re.compile(r"\s(?:\||&&|;|>|<|2>)")
SCRIPT = re.compile(r"(?:^|\s)python ((?:benchmarks|scripts)/\w+\.py)(.*)$")


def documented_commands(text: str, pattern: re.Pattern = COMMAND) -> list[str]:
    """The argument strings (after ``ranmt``; with :data:`SCRIPT`, the script's path and
    its arguments) of the literal commands in ``text``'s shell blocks: continuation lines
    joined, comments, pipes and redirections cut off."""
    commands = []
    for block in SHELL_BLOCK.findall(text):
        for line in re.sub(r"\\\n\s*", " ", block).splitlines():
            line = line.split(" # ")[0].strip()
            found = pattern.search(line)
            if line.startswith("#") or not found:
                continue
            command = SHELL_END.split(" ".join(found.groups()))[0].strip()
            if not SYNOPSIS.search(command):
                commands.append(command)
    return commands


def _docs() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


@contextlib.contextmanager
def _parser_errors(what: str):
    """An argparse exit inside the block as an AssertionError naming ``what`` and the
    parser's last line of error."""
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors):
            yield
    except SystemExit:
        message = (errors.getvalue().strip().splitlines() or ["(no message)"])[-1]
        raise AssertionError(f"{what}: {message}") from None


def test_the_extraction_finds_commands_and_skips_synopses():
    text = ("```bash\nranmt train --data d --out r \\\n    model.preset=tiny  # a comment\n"
            "zcat x.gz | .venv/bin/ranmt translate --checkpoint r > out.txt\n"
            "ranmt average --checkpoint RUN --last K --out DIR\n"
            "ranmt export --checkpoint RUN --format hf-marian|ctranslate2 --out DIR\n"
            "# ranmt info --checkpoint r\n```\nranmt score --ref r\n")
    assert [shlex.split(command) for command in documented_commands(text)] == [
        ["train", "--data", "d", "--out", "r", "model.preset=tiny"],
        ["translate", "--checkpoint", "r"]]


def _check_grid_selection(args) -> None:
    """The grid file loads and the variants, seeds and datasets a command picks are in it."""
    grid = load_experiment(ROOT / args.config)
    for picked, present in ((args.variants, [v.name for v in grid.variants]),
                            (args.seeds, grid.seeds),
                            (args.datasets, [d.name for d in grid.datasets])):
        missing = set(picked or ()) - set(present)
        assert not missing, f"{sorted(missing)} not in {args.config} ({present})"


@pytest.mark.parametrize("doc", _docs(), ids=lambda path: path.name)
def test_documented_commands_parse_and_their_overrides_load(doc):
    commands = documented_commands(doc.read_text(encoding="utf-8"))
    for command in commands:
        what = f"{doc.name}: `ranmt {command}`"
        with _parser_errors(what):
            args = build_parser().parse_args(shlex.split(command))
        try:
            if args.command == "train":
                config = ROOT / args.config if args.config else None
                load_config(config if config and config.is_file() else None, args.overrides)
            elif args.command == "experiment":
                _check_grid_selection(args)
        except Exception as err:
            raise AssertionError(f"{what}: {err}") from None


def test_the_docs_show_commands_of_every_kind():
    commands = [command for doc in _docs()
                for command in documented_commands(doc.read_text(encoding="utf-8"))]
    assert len(commands) >= 25
    assert {"train", "translate", "prepare", "experiment"} <= {c.split()[0] for c in commands}


class _StopAfterParsingError(Exception):
    """Raised by the patched ``parse_args`` once a script's arguments parsed."""


def test_documented_benchmark_and_script_commands_parse(monkeypatch):
    """``python benchmarks/X.py ...`` / ``scripts/X.py`` in the docs' shell blocks: each
    script runs as ``__main__`` until its parser has parsed the documented arguments (a
    patched ``parse_args`` stops it there: nothing is benchmarked)."""
    parse_args = argparse.ArgumentParser.parse_args

    def parse_then_stop(parser, args=None, namespace=None):
        raise _StopAfterParsingError(parse_args(parser, args, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    checked = 0
    for doc in _docs():
        for command in documented_commands(doc.read_text(encoding="utf-8"), SCRIPT):
            script, *argv = shlex.split(command)
            monkeypatch.setattr("sys.argv", [script, *argv])
            with pytest.raises(_StopAfterParsingError), \
                    _parser_errors(f"{doc.name}: `python {command}`"):
                runpy.run_path(str(ROOT / script), run_name="__main__")
            checked += 1
    assert checked >= 5
