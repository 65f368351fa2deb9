"""Streaming ``ranmt prepare``: byte-identical to the in-memory reference, bounded memory,
existing vocabularies, several training corpora, compressed inputs and the filters."""

from __future__ import annotations

import gzip
import json
import lzma
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import reverse_task, write_parallel
from ranmt.data.corpus import PrepareError, load_split, prepare
from ranmt.data.stream import PairReservoir, iter_lines
from ranmt.data.text import read_lines
from reference_prepare import prepare as reference_prepare


def _quiet(_message):
    pass


def _corpus(root: Path, count: int = 3000) -> dict:
    """A small reverse-task corpus with empty lines, over-long pairs and CR/LF/BOM
    oddities in its training files; returns prepare's positional arguments."""
    src, tgt = reverse_task(count, 0)
    src[5], tgt[9] = "", "   "  # empty sides
    src[11] = " ".join(["7"] * 80)  # longer than max_positions
    write_parallel(root / "train", src, tgt)
    raw = (root / "train.src").read_bytes()
    (root / "train.src").write_bytes(b"\xef\xbb\xbf" + raw.replace(b"\n", b"\r\n", 40))
    for name, n, seed in (("valid", 60, 1), ("test", 50, 2)):
        write_parallel(root / name, *reverse_task(n, seed))
    return {"train": str(root / "train"), "valid": str(root / "valid"),
            "tests": {"test": str(root / "test")}}


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


@pytest.mark.parametrize("joint,workers", [(True, 1), (True, 2), (False, 2)])
def test_streaming_output_is_byte_identical_to_the_in_memory_reference(tmp_path, joint,
                                                                       workers):
    corpus = _corpus(tmp_path)
    reference_prepare("src", "tgt", corpus["train"], corpus["valid"], tmp_path / "ref",
                      corpus["tests"], vocab_size=40, joint=joint, max_positions=64,
                      log=_quiet)
    prepare("src", "tgt", corpus["train"], corpus["valid"], tmp_path / "new", corpus["tests"],
            vocab_size=40, joint=joint, max_positions=64, log=_quiet, workers=workers,
            chunk_size=700)  # several chunks, so two workers really share the work
    ours, theirs = _files(tmp_path / "new"), _files(tmp_path / "ref")
    assert list(ours) == list(theirs)
    for name in theirs:
        assert ours[name] == theirs[name], name
    meta = json.loads(ours["meta.json"])
    assert meta["dropped_empty"] == 2 and meta["splits"]["train"]["dropped_too_long"] == 1


def test_iter_lines_reads_what_read_lines_reads(tmp_path):
    path = tmp_path / "odd.txt"
    path.write_bytes(b"\xef\xbb\xbfone\r\ntwo\rthree\n\nbad \xff byte\r\r\nlast\r")
    assert list(iter_lines(path, "replace")) == read_lines(path, "replace")
    for compressed, opener in (("odd.txt.gz", gzip.open), ("odd.txt.xz", lzma.open)):
        with opener(tmp_path / compressed, "wb") as handle:
            handle.write(path.read_bytes())
        assert list(iter_lines(tmp_path / compressed, "replace")) == read_lines(path, "replace")
    with pytest.raises(ValueError, match=r"byte 23 \(line 4\)"):  # as read_lines says
        list(iter_lines(path))


def test_compressed_corpora_prepare_like_plain_ones(tmp_path):
    corpus = _corpus(tmp_path)
    packed = tmp_path / "packed"
    packed.mkdir()
    for side, opener, suffix in (("src", gzip.open, ".gz"), ("tgt", lzma.open, ".xz")):
        with opener(packed / f"train.{side}{suffix}", "wb") as handle:
            handle.write((tmp_path / f"train.{side}").read_bytes())
    args = dict(vocab_size=40, max_positions=64, log=_quiet)
    prepare("src", "tgt", corpus["train"], corpus["valid"], tmp_path / "plain", **args)
    prepare("src", "tgt", str(packed / "train"), corpus["valid"], tmp_path / "packed-out",
            **args)
    assert _files(tmp_path / "plain") == _files(tmp_path / "packed-out")


def test_existing_vocabulary_gives_the_original_ids(tmp_path):
    corpus = _corpus(tmp_path)
    first = prepare("src", "tgt", corpus["train"], corpus["valid"], tmp_path / "first",
                    corpus["tests"], vocab_size=40, max_positions=64, log=_quiet)
    again = prepare("src", "tgt", corpus["train"], corpus["valid"], tmp_path / "again",
                    corpus["tests"], max_positions=64, log=_quiet,
                    spm_models=(tmp_path / "first/spm.src.model",
                                tmp_path / "first/spm.tgt.model"))
    ours, theirs = _files(tmp_path / "again"), _files(tmp_path / "first")
    for name in theirs:
        if name != "meta.json":
            assert ours[name] == theirs[name], name
    assert again["joint_vocab"] is True and again["dropped_empty"] == first["dropped_empty"]
    assert again["splits"] == first["splits"]
    assert again["spm_models_from"][0].endswith("spm.src.model")


def test_several_training_corpora_are_concatenated_and_counted(tmp_path):
    corpus = _corpus(tmp_path)
    src = read_lines(tmp_path / "train.src")
    tgt = read_lines(tmp_path / "train.tgt")
    write_parallel(tmp_path / "part1", src[:1000], tgt[:1000])
    write_parallel(tmp_path / "part2", src[1000:], tgt[1000:])
    whole = prepare("src", "tgt", corpus["train"], corpus["valid"], tmp_path / "whole",
                    vocab_size=40, max_positions=64, log=_quiet)
    parts = prepare("src", "tgt", [str(tmp_path / "part1"), str(tmp_path / "part2")],
                    corpus["valid"], tmp_path / "parts", vocab_size=40, max_positions=64,
                    log=_quiet, chunk_size=300)
    assert [(c["read"], c["dropped_empty"]) for c in parts["train_corpora"]] == \
        [(1000, 2), (2000, 0)]
    assert sum(c["pairs"] for c in parts["train_corpora"]) == parts["splits"]["train"]["pairs"]
    assert parts["splits"] == whole["splits"]
    for side in ("src", "tgt"):
        assert (tmp_path / f"parts/train.{side}.txt").read_bytes() == \
            (tmp_path / f"whole/train.{side}.txt").read_bytes()


def test_length_ratio_filter_drops_exactly_the_skewed_pairs(tmp_path):
    src, tgt = reverse_task(1500, 0)
    tgt[:40] = [line.split()[0] for line in tgt[:40]]  # one word against many
    write_parallel(tmp_path / "train", src, tgt)
    write_parallel(tmp_path / "valid", *reverse_task(30, 1))
    kept = prepare("src", "tgt", str(tmp_path / "train"), str(tmp_path / "valid"),
                   tmp_path / "all", vocab_size=40, log=_quiet)
    split = load_split(tmp_path / "all", "train")
    src_lengths, tgt_lengths = split.lengths()
    skewed = np.maximum(src_lengths, tgt_lengths) > 2.5 * np.maximum(
        np.minimum(src_lengths, tgt_lengths), 1)
    assert skewed.sum() >= 30
    filtered = prepare("src", "tgt", str(tmp_path / "train"), str(tmp_path / "valid"),
                       tmp_path / "filtered", log=_quiet, max_ratio=2.5,
                       spm_models=(tmp_path / "all/spm.src.model",) * 2)
    assert filtered["splits"]["train"]["dropped_ratio"] == int(skewed.sum())
    assert filtered["splits"]["train"]["pairs"] == kept["splits"]["train"]["pairs"] - skewed.sum()
    assert "dropped_ratio" not in kept["splits"]["train"]


def test_reservoir_sample_is_uniform_in_corpus_order_and_whole_when_small():
    reservoir = PairReservoir(10)
    for i in range(7):
        reservoir.add(str(i), str(-i))
    assert reservoir.sample() == ([str(i) for i in range(7)], [str(-i) for i in range(7)])
    hits = np.zeros(100)
    for seed in range(400):
        reservoir = PairReservoir(10, seed)
        for i in range(100):
            reservoir.add(str(i), "")
        sample = [int(s) for s in reservoir.sample()[0]]
        assert sample == sorted(sample) and len(sample) == 10
        hits[sample] += 1
    # Every pair is kept with probability 10/100: 40 of 400 draws; a binomial's 5 sigma.
    assert np.all(np.abs(hits - 40) < 5 * np.sqrt(400 * 0.1 * 0.9))


def test_sample_smaller_than_the_corpus_and_failures_leave_nothing(tmp_path):
    corpus = _corpus(tmp_path)
    messages = []
    meta = prepare("src", "tgt", corpus["train"], corpus["valid"], tmp_path / "out",
                   vocab_size=40, max_positions=64, log=messages.append, spm_sample=1000)
    assert any("sample of 500 of 2,998 pairs" in m for m in messages)
    assert meta["splits"]["train"]["pairs"] == 2997
    (tmp_path / "short.src").write_text("a\nb\n")
    (tmp_path / "short.tgt").write_text("a\n")
    with pytest.raises(PrepareError, match="2 lines.*1"):
        prepare("src", "tgt", [corpus["train"], str(tmp_path / "short")], corpus["valid"],
                tmp_path / "broken", vocab_size=40, log=_quiet)
    assert not (tmp_path / "broken").exists() and not (tmp_path / "broken.tmp").exists()


def _peak_rss_mb(tmp_path: Path, name: str, count: int) -> float:
    """Peak RSS (MB) of a `ranmt prepare` process tree: the process (VmHWM: ru_maxrss would
    carry the forking pytest process's) plus twice its largest worker."""
    src, tgt = reverse_task(count, 3)
    write_parallel(tmp_path / name, src, tgt)
    script = (
        "import re, resource\n"
        "from pathlib import Path\n"
        "from ranmt.data.corpus import prepare\n"
        f"prepare('src', 'tgt', {str(tmp_path / name)!r}, {str(tmp_path / 'valid')!r},\n"
        f"        {str(tmp_path / (name + '-out'))!r}, vocab_size=40, log=lambda m: None,\n"
        "        workers=2, chunk_size=2000, spm_sample=4000)\n"
        "status = Path('/proc/self/status').read_text()\n"
        "print(re.search(r'VmHWM:\\s+(\\d+)', status).group(1),\n"
        "      resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            check=True)
    parent, worker = (int(v) / 1024 for v in result.stdout.split())
    return parent + 2 * worker


@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="needs Linux /proc")
def test_peak_memory_of_prepare_does_not_grow_with_the_corpus(tmp_path):
    """15x the pairs (the in-memory path held every line and id list: ~100 MB more here)
    adds next to nothing to the peak RSS of the process tree."""
    write_parallel(tmp_path / "valid", *reverse_task(50, 1))
    small = _peak_rss_mb(tmp_path, "small", 10_000)
    large = _peak_rss_mb(tmp_path, "large", 150_000)
    assert large < small + 15, (small, large)


def test_cli_takes_several_corpora_an_existing_model_and_the_filters(tmp_path):
    from ranmt.cli import main

    corpus = _corpus(tmp_path)
    src, tgt = read_lines(tmp_path / "train.src"), read_lines(tmp_path / "train.tgt")
    write_parallel(tmp_path / "a", src[:1500], tgt[:1500])
    write_parallel(tmp_path / "b", src[1500:], tgt[1500:])
    common = ["prepare", "--src", "src", "--tgt", "tgt", "--valid", corpus["valid"],
              "--max-positions", "64", "--quiet"]
    main([*common, "--train", corpus["train"], "--vocab-size", "40", "--out",
          str(tmp_path / "first")])
    main([*common, "--train", str(tmp_path / "a"), "--train", str(tmp_path / "b"),
          "--spm-model", str(tmp_path / "first/spm.src.model"), "--workers", "2",
          "--max-ratio", "9", "--out", str(tmp_path / "second")])
    meta = json.loads((tmp_path / "second/meta.json").read_text())
    assert [c["read"] for c in meta["train_corpora"]] == [1500, 1500]
    assert meta["splits"]["train"]["dropped_ratio"] == 0
    assert (tmp_path / "second/train.src.tokens.npy").read_bytes() == \
        (tmp_path / "first/train.src.tokens.npy").read_bytes()
    with pytest.raises(SystemExit):
        main([*common, "--train", corpus["train"], "--spm-src", "x", "--out",
              str(tmp_path / "third")])


def test_add_tests_encodes_new_test_sets_as_prepare_would_and_leaves_the_rest(tmp_path,
                                                                              capsys):
    """``ranmt prepare --add-tests``: a test set added to a prepared directory has the
    files it would have had if prepared with the rest (byte for byte), meta.json lists it,
    every other file stays; a name already there, a clash with train/valid, options that
    belong to a full prepare, or a full prepare without its corpora are errors."""
    from ranmt.cli import main

    corpus = _corpus(tmp_path)
    write_parallel(tmp_path / "later", *reverse_task(40, 5))
    whole = prepare("src", "tgt", corpus["train"], corpus["valid"], tmp_path / "whole",
                    {**corpus["tests"], "later": str(tmp_path / "later")}, vocab_size=40,
                    max_positions=64, log=_quiet)
    prepare("src", "tgt", corpus["train"], corpus["valid"], tmp_path / "first",
            corpus["tests"], vocab_size=40, max_positions=64, log=_quiet)
    before = _files(tmp_path / "first")
    main(["prepare", "--add-tests", "--test", f"later={tmp_path / 'later'}", "--out",
          str(tmp_path / "first")])
    after, reference = _files(tmp_path / "first"), _files(tmp_path / "whole")
    assert sorted(set(after) - set(before)) == sorted(
        name for name in reference if name.startswith("later."))
    for name in after:
        if name != "meta.json":
            assert after[name] == reference[name], name
    assert json.loads(after["meta.json"])["splits"] == whole["splits"]
    for argv, message in (
            (["--test", f"later={tmp_path / 'later'}"], "already has a split 'later'"),
            (["--test", f"valid={tmp_path / 'later'}"], "clashes with train/valid"),
            (["--test", f"x={tmp_path / 'later'}", "--src", "src"], "drop --src"),
            ([], "give one")):
        with pytest.raises(SystemExit):
            main(["prepare", "--add-tests", *argv, "--out", str(tmp_path / "first")])
        assert message in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["prepare", "--src", "src", "--tgt", "tgt", "--out", str(tmp_path / "x")])
    assert "required: --train, --valid" in capsys.readouterr().err
