"""The command line: subcommand spellings, translate line accounting, clear errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import tiny_config
from ranmt.checkpoint import save_checkpoint
from ranmt.cli import build_parser, main
from ranmt.model import build_model


@pytest.fixture(scope="module")
def untrained_run(reverse_data, tmp_path_factory):
    """An untrained tiny checkpoint over the synthetic vocabulary (fast; outputs are junk)."""
    from ranmt.data.corpus import load_meta

    meta = load_meta(reverse_data)
    cfg = tiny_config(**{"model.src_vocab_size": meta["src_vocab_size"],
                         "model.tgt_vocab_size": meta["tgt_vocab_size"]})
    run = tmp_path_factory.mktemp("run")
    save_checkpoint(run / "best", build_model(cfg.model), cfg,
                    {"src": reverse_data / "spm.src.model", "tgt": reverse_data / "spm.tgt.model"})
    return run


def test_contract_subcommands_exist():
    parser = build_parser()
    for argv in (["download", "multi30k", "--pair", "en-de", "--out", "d"],
                 ["prepare", "--src", "en", "--tgt", "de", "--train", "t", "--valid", "v",
                  "--test", "x=y", "--vocab-size", "10", "--joint", "--max-positions", "9",
                  "--out", "o"],
                 ["train", "--data", "d", "--out", "r", "--config", "c.yaml", "a.b=1"],
                 ["translate", "--checkpoint", "r", "--input", "i", "--output", "o", "--beam",
                  "2", "--lenpen", "1", "--batch-size", "3"],
                 ["score", "--ref", "r", "--hyp", "a", "--hyp", "b", "--metrics", "bleu",
                  "chrf", "ter", "--json"],
                 ["evaluate", "--checkpoint", "r", "--data", "d", "--split", "test", "--json"],
                 ["info", "--checkpoint", "r", "--json"]):
        assert parser.parse_args(argv).command == argv[0]


def test_experiment_names_that_start_with_a_dash_take_the_equals_form_and_repeat():
    """Ablation variants are named -Pos-E etc.: ``--baseline=-Pos-E`` (argparse reads a bare
    ``-Pos-E`` as an option), and the option repeats, adding names."""
    args = build_parser().parse_args(
        ["experiment", "g.yaml", "--variants=-Pos-E", "--variants", "TransF", "RAN-ALL",
         "--baseline=-Pos-E", "--baseline=-Pos-D", "--baseline", "RAN-ALL"])
    assert args.variants == ["-Pos-E", "TransF", "RAN-ALL"]
    assert args.baseline == ["-Pos-E", "-Pos-D", "RAN-ALL"]
    assert build_parser().parse_args(["experiment", "g.yaml"]).baseline == []


def test_translate_one_line_out_per_line_in(untrained_run, tmp_path):
    lines = ["a b c", "", "   ", "d e f g h", "p"] * 3
    (tmp_path / "in.txt").write_text("\n".join(lines) + "\n")
    main(["translate", "--checkpoint", str(untrained_run), "--input", str(tmp_path / "in.txt"),
          "--output", str(tmp_path / "out.txt"), "--beam", "2", "--batch-size", "4",
          "--device", "cpu"])
    out = (tmp_path / "out.txt").read_text().split("\n")[:-1]
    assert len(out) == len(lines)
    assert all(out[i] == "" for i, line in enumerate(lines) if not line.strip())


def test_translate_long_line_is_an_error_naming_the_line(untrained_run, tmp_path, capsys):
    (tmp_path / "in.txt").write_text("a b\n" + " ".join(["a"] * 100) + "\n")
    with pytest.raises(SystemExit) as err:
        main(["translate", "--checkpoint", str(untrained_run), "--input",
              str(tmp_path / "in.txt"), "--device", "cpu"])
    assert err.value.code == 2
    assert "input line 2" in capsys.readouterr().err
    main(["translate", "--checkpoint", str(untrained_run), "--input", str(tmp_path / "in.txt"),
          "--device", "cpu", "--truncate-long", "--output", str(tmp_path / "out.txt")])
    assert len((tmp_path / "out.txt").read_text().splitlines()) == 2


@pytest.mark.parametrize("argv,message", [
    (["--beam", "0"], "--beam must be >= 1"),
    (["--batch-size", "-1"], "--batch-size must be >= 1"),
    (["--max-len-b", "-3"], "--max-len-b must be >= 0, not -3"),
])
def test_impossible_decoding_options(untrained_run, argv, message, capsys):
    with pytest.raises(SystemExit):
        main(["translate", "--checkpoint", str(untrained_run), "--device", "cpu", *argv])
    assert message in capsys.readouterr().err


def test_score_json_and_bootstrap(tmp_path, capsys):
    refs = [f"the cat number {i} sat on the mat" for i in range(30)]
    worse = [f"a cat {i} sat on mat" for i in range(30)]
    (tmp_path / "ref").write_text("\n".join(refs) + "\n")
    (tmp_path / "good").write_text("\n".join(refs) + "\n")
    (tmp_path / "bad").write_text("\n".join(worse) + "\n")
    main(["score", "--ref", str(tmp_path / "ref"), "--hyp", str(tmp_path / "good"), "--json"])
    single = json.loads(capsys.readouterr().out)
    assert single["bleu"] == pytest.approx(100.0) and single["ter"] == 0.0
    assert "tok:13a" in single["signature"]["bleu"]
    main(["score", "--ref", str(tmp_path / "ref"), "--hyp", str(tmp_path / "bad"), "--hyp",
          str(tmp_path / "good"), "--metrics", "bleu", "--json"])
    paired = json.loads(capsys.readouterr().out)
    assert paired["systems"][1]["bleu"] > paired["systems"][0]["bleu"]
    assert paired["systems"][1]["bleu_p"] < 0.01


def test_info_counts_parameters(untrained_run, capsys):
    main(["info", "--checkpoint", str(untrained_run), "--json"])
    result = json.loads(capsys.readouterr().out)
    counts = result["parameters"]
    assert result["total"] == counts["total"] == sum(v for k, v in counts.items()
                                                     if k != "total")
    assert counts["encoder.self_attention"] == 2 * 4 * (64 * 64 + 64)  # 2 layers, W_q/k/v/o


def test_unknown_config_key_via_cli(capsys):
    with pytest.raises(SystemExit) as err:
        main(["info", "model.dropot=0.1"])
    assert err.value.code == 2
    assert "did you mean model.dropout" in capsys.readouterr().err


def test_python_dash_m_entry_point():
    result = subprocess.run([sys.executable, "-m", "ranmt", "--version"], capture_output=True,
                            text=True, check=True)
    assert result.stdout.startswith("ranmt ")


@pytest.mark.parametrize("arch", ["transf", "ran-e", "ran-d", "ran-all", "syn-r", "hc-sa",
                                  "hc-all", "sh-x", "aan-d", "ssru-d"])
def test_save_load_translate_is_identical(arch, reverse_data, tmp_path):
    """The checkpoint alone rebuilds the model: same translations before and after loading."""
    import torch

    from ranmt.data.corpus import load_meta
    from ranmt.data.vocab import Vocab
    from ranmt.inference.translator import Translator

    meta = load_meta(reverse_data)
    cfg = tiny_config(**{"model.arch": arch, "model.src_vocab_size": meta["src_vocab_size"],
                         "model.tgt_vocab_size": meta["tgt_vocab_size"]})
    torch.manual_seed(3)
    model = build_model(cfg.model).eval()
    vocab = {"src": reverse_data / "spm.src.model", "tgt": reverse_data / "spm.tgt.model"}
    save_checkpoint(tmp_path / "ckpt", model, cfg, vocab)
    sentences = ["a b c d", "p o n", "e f g h i j k"]
    direct = Translator(model, cfg, Vocab(vocab["src"]), Vocab(vocab["tgt"]),
                        torch.device("cpu")).translate(sentences)
    loaded = Translator.load(tmp_path / "ckpt", device="cpu").translate(sentences)
    assert direct == loaded


def test_translate_nbest_output(untrained_run, tmp_path):
    (tmp_path / "in.txt").write_text("a b c\nd e\n")
    main(["translate", "--checkpoint", str(untrained_run), "--input", str(tmp_path / "in.txt"),
          "--output", str(tmp_path / "out.txt"), "--beam", "3", "--nbest", "2",
          "--device", "cpu"])
    rows = [line.split("\t") for line in (tmp_path / "out.txt").read_text().splitlines()]
    assert [row[0] for row in rows] == ["0", "0", "1", "1"]
    for first, second in ((rows[0], rows[1]), (rows[2], rows[3])):
        assert float(first[1]) >= float(second[1])  # best first


def test_translate_progress_bar_on_a_terminal_only(untrained_run, tmp_path, capsys, monkeypatch):
    """More than one batch: a bar with sentences/s and tokens/s on stderr when stderr is a
    terminal, nothing with --quiet or when stderr is a file or pipe; stdout holds only the
    translations either way."""
    lines = [" ".join("abcdefg"[: 1 + i % 7]) for i in range(40)]
    (tmp_path / "in.txt").write_text("\n".join(lines) + "\n")
    argv = ["translate", "--checkpoint", str(untrained_run), "--input", str(tmp_path / "in.txt"),
            "--batch-size", "8", "--beam", "2", "--device", "cpu"]
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    main(argv)
    out, err = capsys.readouterr()
    assert len(out.splitlines()) == 40
    assert "40/40" in err and "sent/s" in err and "tok_s=" in err
    main(argv + ["--quiet"])
    out_quiet, err_quiet = capsys.readouterr()
    assert out_quiet == out and "sent/s" not in err_quiet
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False, raising=False)
    main(argv)
    assert "sent/s" not in capsys.readouterr().err


def test_prepare_progress_bar_on_a_terminal_only(tmp_path, capsys, monkeypatch):
    from conftest import reverse_task, write_parallel

    for name, count, seed in (("train", 300, 0), ("valid", 20, 1)):
        write_parallel(tmp_path / name, *reverse_task(count, seed))
    argv = ["prepare", "--src", "src", "--tgt", "tgt", "--train", str(tmp_path / "train"),
            "--valid", str(tmp_path / "valid"), "--vocab-size", "30"]
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    main(argv + ["--out", str(tmp_path / "a")])
    err = capsys.readouterr().err
    assert "reading" in err and "encoding train" in err and "300/300" in err
    main(argv + ["--out", str(tmp_path / "b"), "--quiet"])
    assert "encoding" not in capsys.readouterr().err
