"""`ranmt download wmt14|wmt17` on miniature archives in the official layout: the real
fetching (checksums, resume) and extraction (tar members, gzip inside tar, TMX, SGML)."""

from __future__ import annotations

import gzip
import hashlib
import io
import tarfile
import urllib.error
from pathlib import Path

import pytest
from sacrebleu.dataset import DATASETS

import ranmt.data.wmt as wmt
from ranmt.data.download import DownloadError
from ranmt.data.wmt import Archive, download_wmt


def _tgz(path: Path, members: dict[str, bytes], mode: str = "w:gz") -> Path:
    with tarfile.open(path, mode) as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def _lines(prefix: str, count: int) -> bytes:
    return "".join(f"{prefix} sentence {i} ä\n" for i in range(count)).encode()


def _sgm(lang: str, count: int) -> bytes:
    segs = "".join(f'<seg id="{i + 1}"> {lang} news {i} &amp; more </seg>\n'
                   for i in range(count))
    return (f'<srcset setid="newstest" srclang="any">\n<doc docid="d1">\n{segs}</doc>\n'
            "</srcset>\n").encode()


def _register(monkeypatch, key: str, path: Path, url: str) -> None:
    """Make ARCHIVES[key] describe the miniature archive at ``path``."""
    data = path.read_bytes()
    monkeypatch.setitem(wmt.ARCHIVES, key, Archive(url, len(data),
                                                   hashlib.sha256(data).hexdigest()))


def _register_test_set(monkeypatch, name: str, path: Path) -> None:
    monkeypatch.setattr(DATASETS[name], "md5", [hashlib.md5(path.read_bytes()).hexdigest()])


@pytest.fixture(autouse=True)
def no_network(monkeypatch):
    """No test reaches out: a download that is not served by the test itself fails."""
    def offline(url, offset=0):
        raise urllib.error.URLError("no network in tests")

    monkeypatch.setattr(wmt, "open_url", offline)


@pytest.fixture()
def wmt14_en_de(tmp_path, monkeypatch) -> Path:
    """A --from folder with miniature WMT14 En-De archives under their official names."""
    archives = tmp_path / "archives-on-disk"
    archives.mkdir()
    plan = {
        "europarl-v7": ("training-parallel-europarl-v7.tgz",
                        {"training/europarl-v7.de-en.de": _lines("ep de", 30),
                         "training/europarl-v7.de-en.en": _lines("ep en", 30),
                         "training/europarl-v7.fr-en.fr": _lines("ep fr", 5)}),
        "commoncrawl": ("training-parallel-commoncrawl.tgz",
                        {"commoncrawl.de-en.de": _lines("cc de", 20),
                         "commoncrawl.de-en.en": _lines("cc en", 20)}),
        "nc-v9": ("training-parallel-nc-v9.tgz",
                  {"training/news-commentary-v9.de-en.de": _lines("nc de", 10),
                   "training/news-commentary-v9.de-en.en": _lines("nc en", 10)}),
    }
    for key, (name, members) in plan.items():
        path = _tgz(archives / name, members)
        _register(monkeypatch, key, path, f"http://example.invalid/{name}")
    for name, members in (
            ("wmt13-test.tgz", {"test/newstest2013-src.en.sgm": _sgm("en", 7),
                                "test/newstest2013-src.de.sgm": _sgm("de", 7)}),
            ("wmt14-full-test-full.tgz",
             {"test-full/newstest2014-deen-src.en.sgm": _sgm("en", 9),
              "test-full/newstest2014-deen-ref.de.sgm": _sgm("de", 9),
              "test-full/newstest2014-deen-src.de.sgm": _sgm("de", 9),
              "test-full/newstest2014-deen-ref.en.sgm": _sgm("en", 9)})):
        path = _tgz(archives / name, members)
        _register_test_set(monkeypatch, "wmt13" if name.startswith("wmt13") else "wmt14/full",
                           path)
    return archives


def test_wmt14_en_de_from_archives_on_disk(tmp_path, wmt14_en_de):
    messages = []
    result = download_wmt("wmt14", "en-de", tmp_path / "out", wmt14_en_de, log=messages.append)
    out = tmp_path / "out"
    assert result["train"] == [str(out / f"train.{c}") for c in
                               ("europarl-v7", "commoncrawl", "news-commentary-v9")]
    assert (out / "train.europarl-v7.de").read_bytes() == _lines("ep de", 30)
    assert (out / "train.commoncrawl.en").read_bytes() == _lines("cc en", 20)
    assert (out / "newstest2013.en").read_text().splitlines()[2] == "en news 2 &amp; more"
    assert len((out / "newstest2014.de").read_text().splitlines()) == 9
    assert not (out / ".download.tmp").exists()
    assert any(m.startswith("next: ranmt prepare --src en --tgt de --train") and
               "--vocab-size 40000" in m for m in messages)
    # The other direction takes the German-original test files.
    download_wmt("wmt14", "de-en", tmp_path / "back", wmt14_en_de, log=messages.append)
    assert (tmp_path / "back/newstest2014.de").read_text() == \
        (out / "newstest2014.de").read_text()


def test_checksum_mismatch_is_a_clear_error_and_leaves_nothing(tmp_path, wmt14_en_de,
                                                               monkeypatch):
    archive = wmt.ARCHIVES["nc-v9"]
    monkeypatch.setitem(wmt.ARCHIVES, "nc-v9", Archive(archive.url, archive.size, "0" * 64))
    with pytest.raises(DownloadError, match="not the expected archive.*sha256"):
        download_wmt("wmt14", "en-de", tmp_path / "out", wmt14_en_de, log=lambda _m: None)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == []


def test_interrupted_download_resumes_where_it_stopped(tmp_path, wmt14_en_de, monkeypatch):
    name = "training-parallel-commoncrawl.tgz"
    data = (wmt14_en_de / name).read_bytes()
    (wmt14_en_de / name).unlink()  # this one is not on disk: it must be downloaded
    archives = tmp_path / "out" / "archives"
    archives.mkdir(parents=True)
    (archives / (name + ".part")).write_bytes(data[: len(data) // 2])  # a cut download
    requested = []

    def serve(url, offset=0):
        requested.append((url, offset))
        return io.BytesIO(data[offset:])

    monkeypatch.setattr(wmt, "open_url", serve)
    download_wmt("wmt14", "en-de", tmp_path / "out", wmt14_en_de, log=lambda _m: None)
    assert requested == [(f"http://example.invalid/{name}", len(data) // 2)]
    assert (archives / name).read_bytes() == data and not (archives / (name + ".part")).exists()


def test_offline_without_the_archive_is_a_clear_error(tmp_path, wmt14_en_de, monkeypatch):
    (wmt14_en_de / "training-parallel-nc-v9.tgz").unlink()
    with pytest.raises(DownloadError, match="training-parallel-nc-v9.tgz into a folder given "
                                            "with --from"):
        download_wmt("wmt14", "en-de", tmp_path / "out", wmt14_en_de, log=lambda _m: None)


def test_gzip_inside_tar_tmx_and_wiki_titles_formats(tmp_path, monkeypatch):
    giga = _tgz(tmp_path / "giga.tar", {
        "giga-fren.release2.fixed.fr.gz": gzip.compress(_lines("giga fr", 12)),
        "giga-fren.release2.fixed.en.gz": gzip.compress(_lines("giga en", 12))}, "w")
    corpus = wmt.Corpus("giga-fren", "giga", ("giga-fren.release2.fixed.{x}.gz",
                                              "giga-fren.release2.fixed.en.gz"), "gz")
    _register(monkeypatch, "giga", giga, "http://example.invalid/giga.tar")
    tmx = (b'<?xml version="1.0" encoding="utf-8"?>\n<tmx version="1.4"><body>'
           + b"".join(f'<tu><tuv xml:lang="en"><seg>hello {i}</seg></tuv>'
                      f'<tuv xml:lang="tr"><seg>merhaba {i}</seg></tuv></tu>'.encode()
                      for i in range(6)) + b"</body></tmx>\n")
    (tmp_path / "en-tr.tmx.gz").write_bytes(gzip.compress(tmx))
    _register(monkeypatch, "setimes2", tmp_path / "en-tr.tmx.gz",
              "http://example.invalid/download.php?f=SETIMES/v2/tmx/en-tr.tmx.gz")
    wiki = _tgz(tmp_path / "wiki-titles.tgz", {
        "wiki/fi-en/titles.fi-en": b"Helsinki ||| Helsinki\nkissa ||| cat\nbroken line\n"})
    _register(monkeypatch, "wiki-titles-v15", wiki, "http://example.invalid/wiki-titles.tgz")
    staging = tmp_path / "staging"
    staging.mkdir()
    task = wmt.Task([corpus], ("x", "x"), ("y", "y"))
    wmt._extract_training(task, "fr", tmp_path, [tmp_path], staging, lambda _m: None)
    assert (staging / "train.giga-fren.fr").read_bytes() == _lines("giga fr", 12)
    wmt._extract_training(wmt.TASKS[("wmt17", "tr")], "tr", tmp_path, [tmp_path], staging,
                          lambda _m: None)
    assert (staging / "train.setimes2.tr").read_text().splitlines()[5] == "merhaba 5"
    assert (staging / "train.setimes2.en").read_text().splitlines()[0] == "hello 0"
    wiki_task = wmt.Task([wmt.TASKS[("wmt17", "fi")].train[1]], ("x", "x"), ("y", "y"))
    wmt._extract_training(wiki_task, "fi", tmp_path, [tmp_path], staging, lambda _m: None)
    assert (staging / "train.wiki-titles.en").read_text() == "Helsinki\ncat\n"


def test_unknown_pairs_and_missing_members_are_clear_errors(tmp_path, wmt14_en_de,
                                                            monkeypatch):
    with pytest.raises(DownloadError, match="wmt14 en-ru is not available"):
        download_wmt("wmt14", "en-ru", tmp_path / "x")
    with pytest.raises(DownloadError, match="English and one other"):
        download_wmt("wmt17", "de-fr", tmp_path / "x")
    path = _tgz(wmt14_en_de / "training-parallel-nc-v9.tgz", {"README": b"moved\n"})
    _register(monkeypatch, "nc-v9", path,
              "http://example.invalid/training-parallel-nc-v9.tgz")
    with pytest.raises(DownloadError, match=r"no member .*news-commentary-v9.*README"):
        download_wmt("wmt14", "en-de", tmp_path / "out", wmt14_en_de, log=lambda _m: None)
