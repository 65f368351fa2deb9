"""``ranmt translate`` beyond beam search: --score-target, --sampling, --prefix,
--alignments and ensembles (--checkpoint repeated), with the Python API behind them."""

from __future__ import annotations

import pytest

from ranmt.cli import main
from ranmt.inference.translator import Translator

LINES = ["a b c d", "e f", "g h i j k", "l"]


@pytest.fixture()
def source(tmp_path):
    path = tmp_path / "in.txt"
    path.write_text("\n".join(LINES) + "\n")
    return path


def _translate(runs, source, tmp_path, *argv, checkpoints=("transf",)):
    out = tmp_path / "out.txt"
    args = ["translate", "--input", str(source), "--output", str(out), "--device", "cpu"]
    for name in checkpoints:
        args += ["--checkpoint", str(runs[name])]
    main(args + list(argv))
    return out.read_text(encoding="utf-8").splitlines()


def test_score_target_gives_back_the_beam_scores(runs, source, tmp_path, translators):
    """Scores of the beam's own outputs: the beam's scores where the output text encodes
    back to the same subwords (text is re-segmented canonically), else the API's score."""
    translator = translators["transf"]
    tokens = [hyps[0].tokens for hyps in translator.translate_detailed(LINES)]
    beam = _translate(runs, source, tmp_path, "--beam", "3", "--nbest", "2")
    best = [text for index, (_, _, text) in enumerate(row.split("\t") for row in beam)
            if index % 2 == 0]
    scores = [float(row.split("\t")[1]) for index, row in enumerate(beam) if index % 2 == 0]
    (tmp_path / "hyp.txt").write_text("\n".join(best) + "\n")
    scored = _translate(runs, source, tmp_path, "--score-target", str(tmp_path / "hyp.txt"))
    assert len(scored) == len(LINES)
    api = translator.score(LINES, best)
    for line, expected, text, pair, output in zip(scored, scores, best, api, tokens):
        normalized, total, values = line.split("\t")
        if not text:  # an empty translation scores nan (nothing to score)
            assert normalized == "nan"
            continue
        assert float(normalized) == pytest.approx(pair.normalized, abs=1e-4)
        if translator.encode_targets([text])[0] == output:
            assert float(normalized) == pytest.approx(expected, abs=2e-4)
        assert float(total) == pytest.approx(sum(float(v) for v in values.split()), abs=1e-3)


def test_score_target_needs_one_line_per_input(runs, source, tmp_path, capsys):
    (tmp_path / "short.txt").write_text("x\n")
    with pytest.raises(SystemExit):
        _translate(runs, source, tmp_path, "--score-target", str(tmp_path / "short.txt"))
    assert "has 1 lines but the input has 4" in capsys.readouterr().err


def test_sampling_reproducible_with_a_seed(runs, source, tmp_path):
    argv = ("--sampling", "topp", "--topp", "0.95", "--temperature", "1.3", "--nbest", "3")
    first = _translate(runs, source, tmp_path, *argv, "--seed", "5")
    again = _translate(runs, source, tmp_path, *argv, "--seed", "5")
    other = _translate(runs, source, tmp_path, *argv, "--seed", "6")
    assert first == again
    assert first != other
    assert [row.split("\t")[0] for row in first] == [str(i) for i in range(4) for _ in range(3)]


def test_sampling_options_are_checked(runs, source, tmp_path, capsys):
    for argv, message in ((("--topk", "3"), "go with --sampling"),
                          (("--sampling", "topp", "--topp", "1.5"), "--topp must be <= 1, not 1.5"),
                          (("--sampling", "topk", "--temperature", "0"), "temperature")):
        with pytest.raises(SystemExit):
            _translate(runs, source, tmp_path, *argv)
        assert message in capsys.readouterr().err


def test_prefix_starts_every_translation(runs, source, tmp_path, translators):
    translator = translators["transf"]
    prefixes = ["d c", "", "k j", "l"]
    (tmp_path / "prefix.txt").write_text("\n".join(prefixes) + "\n")
    out = _translate(runs, source, tmp_path, "--prefix", str(tmp_path / "prefix.txt"),
                     "--beam", "2")
    results = translator.translate_detailed(LINES, prefixes=prefixes)
    for line, prefix, hyps in zip(out, prefixes, results):
        wanted = translator.encode_targets([prefix])[0]
        assert hyps[0].tokens[: len(wanted)] == wanted
        assert line.startswith(prefix)


def test_alignments_are_moses_pairs_within_bounds(runs, source, tmp_path):
    out = _translate(runs, source, tmp_path, "--alignments", "--beam", "2")
    for line, src in zip(out, LINES):
        text, _, alignment = line.partition(" ||| ")
        assert _ == " ||| "
        pairs = [tuple(map(int, pair.split("-"))) for pair in alignment.split()]
        assert all(0 <= i < len(src.split()) for i, _ in pairs)
        assert all(0 <= j < len(text.split()) for _, j in pairs)
        assert {j for _, j in pairs} == set(range(len(text.split())))  # every word aligned


def test_ensemble_of_two_copies_decodes_like_one(runs, source, tmp_path):
    alone = _translate(runs, source, tmp_path, "--beam", "3")
    twice = _translate(runs, source, tmp_path, "--beam", "3", checkpoints=("transf", "transf"))
    mixed = _translate(runs, source, tmp_path, "--beam", "3", checkpoints=("transf", "ran-all"))
    assert twice == alone
    assert len(mixed) == len(LINES)


def test_ensemble_needs_the_same_vocabularies(runs, tmp_path, reverse_data):
    import shutil

    other = tmp_path / "other"
    shutil.copytree(runs["ran-all"], other)
    (other / "spm.tgt.model").write_bytes(b"not the same")
    with pytest.raises(ValueError, match="target vocabularies"):
        Translator.load([runs["transf"], other], device="cpu")


def test_decoding_defaults_are_declared_once(runs, reverse_data, tmp_path, translators,
                                             capsys):
    """The CLI's decoding options default to None (the checkpoint's DecodeConfig decides),
    the server's sampling defaults are DecodeConfig's and its beam/nbest default to the
    checkpoint's; bounds and help text are DecodeConfig's declarations in /openapi.json and
    on the command line; --nbest is checked against the checkpoint's beam, not a literal 4."""
    import argparse
    import dataclasses

    from fastapi.testclient import TestClient

    from ranmt.checkpoint import load_checkpoint, save_checkpoint
    from ranmt.cli import build_parser
    from ranmt.config import DecodeConfig, decode_field
    from ranmt.serving.app import ServeLimits, create_app

    args = build_parser().parse_args(["translate", "--checkpoint", "x"])
    options = [field.name for field in dataclasses.fields(DecodeConfig)]  # every one a flag
    assert {name: getattr(args, name) for name in options} == dict.fromkeys(options)
    defaults = dataclasses.asdict(DecodeConfig())
    with TestClient(create_app(translators, ServeLimits())) as client:
        schema = client.get("/openapi.json").json()
    request = next(schema["components"]["schemas"][name] for name in schema["components"]
                   ["schemas"] if name.startswith("TranslateRequest"))["properties"]
    for name in ("topk", "topp", "epsilon", "temperature", "seed"):
        assert request[name]["default"] == defaults[name], name
    assert request["beam"]["default"] is None and request["nbest"]["default"] is None

    # Bounds and help: the declaration's, in the schema and on the command line.
    schema_keys = {"ge": "minimum", "gt": "exclusiveMinimum", "le": "maximum",
                   "lt": "exclusiveMaximum"}
    for name in ("beam", "nbest", "topk", "topp", "epsilon", "temperature", "seed"):
        declared = decode_field(name).metadata
        constraints = request[name].get("anyOf", [request[name]])[0]  # nullable: anyOf
        assert declared["bounds"], name
        for kind, bound in declared["bounds"].items():
            assert constraints[schema_keys[kind]] == bound, (name, kind)
        assert request[name]["description"].startswith(declared["help"]), name
    translate = next(action for action in build_parser()._actions
                     if isinstance(action, argparse._SubParsersAction)).choices["translate"]
    helps = {action.dest: action.help for action in translate._actions}
    for name in options:
        assert helps[name].startswith(decode_field(name).metadata["help"]), name

    model, cfg, _, _ = load_checkpoint(runs["transf"])
    cfg.decode.beam = 2
    save_checkpoint(tmp_path / "beam2", model, cfg, {"src": reverse_data / "spm.src.model",
                                                     "tgt": reverse_data / "spm.tgt.model"})
    beam2 = {"transf": tmp_path / "beam2"}
    source = tmp_path / "in.txt"
    source.write_text("\n".join(LINES) + "\n")
    assert len(_translate(beam2, source, tmp_path, "--nbest", "2")) == 2 * len(LINES)
    with pytest.raises(SystemExit):
        _translate(beam2, source, tmp_path, "--nbest", "3")
    assert "decode.nbest must be between 1 and the beam size (decode.beam = 2)" in \
        capsys.readouterr().err


def test_a_decoding_option_declared_once_reaches_the_cli_the_api_and_the_server(
        runs, translators, monkeypatch):
    """A field added to DecodeConfig with decode_option (here by the test) is, with no other
    code: a flag of `ranmt translate` and `ranmt evaluate` with its help, a keyword of the
    Python API checked against its bounds, and a field of POST /translate in /openapi.json
    with its default, bounds and help, whose value reaches the translator's decoding."""
    import argparse
    import dataclasses

    from fastapi.testclient import TestClient

    import ranmt.inference.translator as translator_module
    from ranmt import config
    from ranmt.cli import build_parser
    from ranmt.config import ConfigError
    from ranmt.serving.app import ServeLimits, create_app

    help_text = "a bonus per covered source word (declared by the test)"
    added = dataclasses.make_dataclass("DecodeConfig", [(
        "coverage_bonus", float, config.decode_option(0.0, help_text, ge=0, served=True))],
        bases=(config.DecodeConfig,))
    monkeypatch.setattr(config, "DecodeConfig", added)

    commands = next(action for action in build_parser()._actions
                    if isinstance(action, argparse._SubParsersAction)).choices
    for command in ("translate", "evaluate"):
        helps = {action.dest: action.help for action in commands[command]._actions}
        assert helps["coverage_bonus"].startswith(help_text), command
    args = build_parser().parse_args(["translate", "--checkpoint", "x",
                                      "--coverage-bonus", "0.5"])
    assert args.coverage_bonus == 0.5

    translator = Translator.load(runs["transf"], device="cpu", coverage_bonus=0.25)
    assert translator.decode_config.coverage_bonus == 0.25
    with pytest.raises(ConfigError, match="decode.coverage_bonus must be >= 0, not -1"):
        Translator.load(runs["transf"], device="cpu", coverage_bonus=-1.0)

    # What the translator's step-level decoder is given (a worker thread: in this process,
    # where the test declared the field; a worker process would not know it).
    seen = []
    real_decoder = translator_module.ContinuousDecoder
    monkeypatch.setattr(translator_module, "ContinuousDecoder",
                        lambda model, options, **k: seen.append(options)
                        or real_decoder(model, options, **k))
    limits = ServeLimits(workers="thread", batch_window_ms=1)
    with TestClient(create_app(translators, limits)) as client:
        schema = client.get("/openapi.json").json()
        answer = client.post("/translate", json={"text": ["a b c"], "coverage_bonus": 0.5})
        refused = client.post("/translate", json={"text": ["a b c"], "coverage_bonus": -1.0})
    request = next(schema["components"]["schemas"][name] for name in schema["components"]
                   ["schemas"] if name.startswith("TranslateRequest"))["properties"]
    field = request["coverage_bonus"]
    assert field["default"] == 0.0 and field["minimum"] == 0
    assert field["description"].startswith(help_text)
    assert answer.status_code == 200, answer.text
    assert seen and seen[0].coverage_bonus == 0.5
    assert refused.status_code == 400 and "coverage_bonus" in refused.json()["error"]
