"""Download (from a local mirror) and prepare: counts, filtering, refusal of bad inputs."""

from __future__ import annotations

import gzip
import json

import numpy as np
import pytest

from conftest import write_parallel
from ranmt.data.corpus import PrepareError, load_split, prepare
from ranmt.data.download import DownloadError, download_multi30k
from ranmt.data.text import TextError, read_lines


def _fake_mirror(root, counts=None, langs=("en", "de")):
    counts = counts or {"train": 29000, "val": 1014, "test_2016_flickr": 1000,
                        "test_2017_flickr": 1000}
    (root / "multi30k").mkdir(parents=True)
    for split, count in counts.items():
        for lang in langs:
            data = "".join(f"{lang} line {i}\n" for i in range(count)).encode()
            (root / "multi30k" / f"{split}.{lang}.gz").write_bytes(gzip.compress(data))


def test_download_copies_from_local_mirror_and_checks_counts(tmp_path, monkeypatch):
    _fake_mirror(tmp_path / "mirror")
    monkeypatch.delenv("RANMT_DATA_DIR", raising=False)
    written = download_multi30k("en-de", tmp_path / "out", tmp_path / "mirror",
                                log=lambda _m: None)
    assert len(written) == 8
    assert len(read_lines(tmp_path / "out" / "train.de")) == 29000
    assert read_lines(tmp_path / "out" / "val.en")[3] == "en line 3"


def test_download_rejects_wrong_line_count(tmp_path, monkeypatch):
    _fake_mirror(tmp_path / "mirror", {"train": 100, "val": 1014, "test_2016_flickr": 1000,
                                       "test_2017_flickr": 1000})
    monkeypatch.delenv("RANMT_DATA_DIR", raising=False)
    with pytest.raises(DownloadError, match="expected 29000"):
        download_multi30k("en-de", tmp_path / "out", tmp_path / "mirror", log=lambda _m: None)


def test_download_offline_without_copy_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.delenv("RANMT_DATA_DIR", raising=False)
    import urllib.request

    def offline(*_args, **_kwargs):
        raise OSError("network unreachable")

    monkeypatch.setattr(urllib.request, "urlopen", offline)
    with pytest.raises(DownloadError, match="no local copy"):
        download_multi30k("en-de", tmp_path / "out", tmp_path / "empty", log=lambda _m: None)
    with pytest.raises(DownloadError, match="not available"):
        download_multi30k("en-xx", tmp_path / "out", log=lambda _m: None)


def test_download_real_multi30k_copy(multi30k_dir, tmp_path):
    written = download_multi30k("en-de", tmp_path, multi30k_dir.parent, log=lambda _m: None)
    assert len(read_lines(written["test_2016_flickr.de"])) == 1000
    assert len(read_lines(written["train.en"])) == 29000


def _corpus(tmp_path, train_src, train_tgt):
    write_parallel(tmp_path / "train", train_src, train_tgt)
    write_parallel(tmp_path / "valid", ["a b c", "d e"], ["c b a", "e d"])


def test_prepare_filters_and_reports(tmp_path):
    long = " ".join(["x"] * 30)
    src = ["a b c", "", "d e f g", long, "b a"] * 20
    tgt = ["c b a", "z", "g f e d", "x", "a b"] * 20
    _corpus(tmp_path, src, tgt)
    messages = []
    meta = prepare("src", "tgt", str(tmp_path / "train"), str(tmp_path / "valid"),
                   tmp_path / "data", vocab_size=30, max_positions=20, log=messages.append)
    assert meta["dropped_empty"] == 20
    assert meta["splits"]["train"]["dropped_too_long"] == 20
    assert meta["splits"]["train"]["pairs"] == 60
    assert any("longer than 19" in m for m in messages)
    split = load_split(tmp_path / "data", "train")
    assert len(split) == 60 and max(len(s) for s in split.src) <= 19
    with pytest.raises(FileNotFoundError, match="split 'tset' not found in .*; splits there: "
                                                "train, valid$"):
        load_split(tmp_path / "data", "tset")
    with pytest.raises(FileNotFoundError, match="data folder .*dtaa does not exist"):
        load_split(tmp_path / "dtaa", "train")
    stored = json.loads((tmp_path / "data" / "meta.json").read_text())
    expected_gamma = stored["splits"]["train"]["src_mean_len"] / stored["splits"]["train"][
        "tgt_mean_len"]
    assert stored["gamma"] == pytest.approx(expected_gamma)
    assert (tmp_path / "data" / "spm.src.model").read_bytes() == (
        tmp_path / "data" / "spm.tgt.model").read_bytes()  # joint by default


def test_prepare_separate_vocabularies(tmp_path):
    _corpus(tmp_path, ["a b c d"] * 50, ["w x y z"] * 50)
    meta = prepare("src", "tgt", str(tmp_path / "train"), str(tmp_path / "valid"),
                   tmp_path / "data", vocab_size=20, joint=False, log=lambda _m: None)
    assert not meta["joint_vocab"]
    assert (tmp_path / "data" / "spm.src.model").read_bytes() != (
        tmp_path / "data" / "spm.tgt.model").read_bytes()


def test_prepare_refuses_different_line_counts(tmp_path):
    _corpus(tmp_path, ["a", "b", "c"], ["a", "b"])
    with pytest.raises(PrepareError, match=r"train.src has 3 lines.*train.tgt has 2"):
        prepare("src", "tgt", str(tmp_path / "train"), str(tmp_path / "valid"),
                tmp_path / "data", log=lambda _m: None)
    assert not (tmp_path / "data").exists()


def test_read_lines_handles_bom_crlf_and_bad_utf8(tmp_path):
    path = tmp_path / "x.txt"
    path.write_bytes("\ufeffeins\r\nzwei\r\n\r\n".encode())
    assert read_lines(path) == ["eins", "zwei", ""]
    path.write_bytes(b"ok\nbad \xff byte\n")
    with pytest.raises(TextError, match="byte 7 .line 2"):
        read_lines(path)
    assert read_lines(path, errors="replace")[1] == "bad \ufffd byte"


def test_training_skips_pairs_longer_than_the_model_positions_without_copying(reverse_data,
                                                                               tmp_path,
                                                                               capsys):
    """Data prepared with a larger --max-positions than the model's: the trainer views the
    pairs that fit (SubsetSequences over the memory-mapped split) and never batches others."""
    from ranmt.config import load_config
    from ranmt.data.corpus import SubsetSequences
    from ranmt.training.train import TrainingRun

    split = load_split(reverse_data, "train")
    src_lengths, tgt_lengths = split.lengths()
    cfg = load_config(None, {"model.preset": "tiny", "model.max_positions": "6",
                             "train.max_steps": "2", "train.progress": "false",
                             "train.tensorboard": "false", "train.validate_bleu": "false",
                             "data.max_tokens": "300"})
    run = TrainingRun(cfg, reverse_data, tmp_path / "run")
    keep = (src_lengths < 6) & (tgt_lengths < 6)
    assert 0 < keep.sum() < len(keep)
    assert isinstance(run.train_split.src, SubsetSequences)
    assert len(run.train_split) == keep.sum()
    assert np.array_equal(run.train_split.lengths()[0], src_lengths[keep])
    kept = np.flatnonzero(keep)
    assert np.array_equal(run.train_split.tgt[3], split.tgt[kept[3]])
    assert f"{int((~keep).sum())} training pair(s) longer than" in capsys.readouterr().err
    summary = run.run()
    assert summary["steps"] == 2 and summary["seconds_to_first_step"] > 0
