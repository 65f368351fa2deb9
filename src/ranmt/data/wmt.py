"""``ranmt download wmt14|wmt17``: the RAN paper's WMT corpora from the official archives.

The RAN paper (Zeng et al., 2021, §3.1) trains on WMT14 En-De (4.5M pairs) and En-Fr (36M)
with newstest2013 for validation and newstest2014 for testing, and on WMT17 En-Lv, En-Fi and
En-Tr (4.46M, 2.63M, 210K pairs; newstest2017 for testing). For a pair (either direction)
this module

1. fetches every archive the task needs into ``OUT/archives/`` — resumable (an interrupted
   download continues where it stopped, with an HTTP range request), verified by size and
   checksum, or taken from ``--from DIR`` where the archives already lie on disk;
2. streams the training corpora out of the archives, one pass per archive, into
   ``OUT/train.<corpus>.<lang>`` (plain text members, gzip files inside a tar, TMX, the
   ``|||``-separated wiki titles), checking that both sides have as many lines;
3. extracts the validation and test sets from their SGML files into
   ``OUT/<newstestYYYY>.<lang>``;

and prints the ``ranmt prepare`` command for them. Output appears whole or not at all.

Where the facts come from: the training archives' addresses, sizes and SHA-256 checksums are
those TensorFlow Datasets records for its WMT builders (``tensorflow_datasets/url_checksums/
wmt14_translate.txt``, ``wmt15_translate.txt``, ``wmt17_translate.txt``). Two WMT17 archives
that TensorFlow Datasets does not use (its En-Lv has no Europarl and no Rapid) — the WMT17
``training-parallel-ep-v8.tgz``, the only Europarl v8 release with Latvian, and the WMT17
``rapid2016.tgz``, the only Rapid release with Latvian — are checked by the MD5 that Sockeye
records (``sockeye_contrib/autopilot/tasks.py``; no size is published). The member names
follow the layouts those builders, Hugging Face ``datasets``' ``wmt_utils.py``, Sockeye's
autopilot and fairseq's WMT download script read (e.g. ``rapid2016.en-fi.fi``: the pair's
codes in alphabetical order; ``dcep.en-lv/dcep.lv``); they could not be checked against the
real archives here (no network), so a missing member is an error that lists the archive's
members. The validation and test sets (address, MD5 and member names) are read from the
registry of the installed sacreBLEU (``sacrebleu.dataset.DATASETS``), the tool the scores
come from, and their SGML is read the way sacreBLEU reads it (:func:`sgml_lines`).
"""

from __future__ import annotations

import gzip
import hashlib
import io
import re
import shlex
import shutil
import tarfile
import urllib.error
import urllib.request
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass, field
from pathlib import Path

from ranmt.data.download import DownloadError

# ------------------------------------------------------------------ the archives


@dataclass(frozen=True)
class Archive:
    """One file to fetch: its address and what it must hash to."""
    url: str
    size: int | None
    digest: str
    algorithm: str = "sha256"  # "md5" for the test sets (sacreBLEU records MD5)
    filename: str = ""  # on disk (default: the address's last part)

    @property
    def name(self) -> str:
        return self.filename or self.url.rstrip("/").split("/")[-1]


def _tfds(url: str, size: int, sha256: str) -> Archive:
    return Archive(url, size, sha256)


def _sockeye_md5(url: str, md5: str) -> Archive:
    """A WMT17 archive whose name WMT18 reused for another file: kept as ``wmt17-NAME``."""
    return Archive(url, None, md5, "md5", "wmt17-" + url.rsplit("/", 1)[-1])


ARCHIVES = {  # TensorFlow Datasets' url_checksums (see the module docstring)
    "europarl-v7": _tfds("http://www.statmt.org/wmt13/training-parallel-europarl-v7.tgz",
                         657632379,
                         "0224c7c710c8a063dfd893b0cc0830202d61f4c75c17eb8e31836103d27d96e7"),
    "commoncrawl": _tfds("http://www.statmt.org/wmt13/training-parallel-commoncrawl.tgz",
                         918311367,
                         "c7a74e2ea01ac6c920123108627e35278d4ccb5701e15428ffa34de86fa3a9e5"),
    "nc-v9": _tfds("http://www.statmt.org/wmt14/training-parallel-nc-v9.tgz", 80418416,
                   "cb8953f292298e6877ae433c98912b927cb0766b303f4540512ddd286c748485"),
    "un": _tfds("http://www.statmt.org/wmt13/training-parallel-un.tgz", 2365634246,
                "29141b5c1eba149a94f7a59d3b1a834b2e47fe0f8758d68dcd77a3d3f497ee47"),
    "giga-fren": _tfds("http://www.statmt.org/wmt10/training-giga-fren.tar", 2595102720,
                       "3ff8319f6919393520559bfbc7ad6a747ec81b3abc7be9993b338d4b017b4d9a"),
    # WMT18's Europarl v8 holds et-en and fi-en only; WMT17's holds lv-en
    "europarl-v8": _tfds(
        "http://data.statmt.org/wmt18/translation-task/training-parallel-ep-v8.tgz",
        246201434, "953eaf7f24dcfc87eff6845d13ec6ca8acbee0ccf7edf4063b8b94e943933a96"),
    "europarl-v8-wmt17": _sockeye_md5(
        "http://data.statmt.org/wmt17/translation-task/training-parallel-ep-v8.tgz",
        "07b77f254d189a5bfb7b43b7fc489716"),
    # WMT18's Rapid 2016 holds de, et and fi with English; WMT17's (another file) holds lv
    "rapid2016": _tfds("http://data.statmt.org/wmt18/translation-task/rapid2016.tgz",
                       161050516,
                       "41557dd5d8f0ed3a6d98bce3b798b1a9d3b68361eb99d902329ddbb943a6b55a"),
    "rapid2016-wmt17": _sockeye_md5(
        "http://data.statmt.org/wmt17/translation-task/rapid2016.tgz",
        "17a3a1846433ad26acb95da02f93af93"),
    "leta": _tfds("http://data.statmt.org/wmt17/translation-task/leta.v1.tgz", 2024531,
                  "af3f1a4cbeb503a231856baa9f1fb06c628d43ebb78b6f35a4f71e0a53f60e49"),
    "dcep": _tfds("http://data.statmt.org/wmt17/translation-task/dcep.lv-en.v1.tgz",
                  128549702,
                  "871df6e7c96dc878f73a3864a8a2300c1c43725b3d24a7fdb560735e584bf515"),
    "books": _tfds("http://data.statmt.org/wmt17/translation-task/books.lv-en.v1.tgz",
                   316169, "0eb70ad3e8420b131ddd29d1988d1055c72c13cef3768975a1c1a8f7662f361b"),
    "wiki-titles-v15": _tfds("http://www.statmt.org/wmt15/wiki-titles.tgz", 9487481,
                             "cd7cf81dbc99ef00b57e3106a4731b54cebcb7cff19088913cdab1c8114d3660"),
    # OPUS serves its files from its object store; the download.php address that TensorFlow
    # Datasets recorded (http://opus.nlpl.eu/download.php?f=SETIMES/v2/tmx/en-tr.tmx.gz)
    # redirected there and has been reported dead. Size and SHA-256 are TFDS's record of
    # that file; should OPUS have rebuilt it, the check fails with both digests, and a copy
    # fetched by hand is taken with --from DIR.
    "setimes2": _tfds("https://object.pouta.csc.fi/OPUS-SETIMES/v2/tmx/en-tr.tmx.gz",
                      23548787,
                      "23581212dc3267383198a92636219fceb3f23207bfc1d1e78ab60a2cb465eff8"),
}


@dataclass(frozen=True)
class Corpus:
    """A training corpus inside an archive: ``members`` maps each language to its member
    (``{a}``/``{b}`` are filled with the pair's non-English and English codes)."""
    name: str
    archive: str
    members: tuple[str, str] | str  # (member of lang a, member of lang b) or one member
    format: str = "plain"  # plain | gz (gzip member of a tar) | tmx | wiki ("a ||| b")


@dataclass(frozen=True)
class Task:
    train: list[Corpus]
    valid: tuple[str, str]  # (name, sacreBLEU test set)
    test: tuple[str, str]
    sizes: dict = field(default_factory=dict)


def _europarl(version: str, archive: str = "") -> Corpus:
    return Corpus(f"europarl-{version}", archive or f"europarl-{version}",
                  (f"training/europarl-{version}.{{x}}-en.{{x}}",
                   f"training/europarl-{version}.{{x}}-en.en"))


TASKS = {  # keyed by (year, the non-English language); the pair may go either way
    ("wmt14", "de"): Task(
        [_europarl("v7"),
         Corpus("commoncrawl", "commoncrawl", ("commoncrawl.de-en.de", "commoncrawl.de-en.en")),
         Corpus("news-commentary-v9", "nc-v9", ("training/news-commentary-v9.de-en.de",
                                                "training/news-commentary-v9.de-en.en"))],
        ("newstest2013", "wmt13"), ("newstest2014", "wmt14/full")),
    ("wmt14", "fr"): Task(
        [_europarl("v7"),
         Corpus("commoncrawl", "commoncrawl", ("commoncrawl.fr-en.fr", "commoncrawl.fr-en.en")),
         Corpus("un", "un", ("un/undoc.2000.fr-en.fr", "un/undoc.2000.fr-en.en")),
         Corpus("news-commentary-v9", "nc-v9", ("training/news-commentary-v9.fr-en.fr",
                                                "training/news-commentary-v9.fr-en.en")),
         Corpus("giga-fren", "giga-fren", ("giga-fren.release2.fixed.fr.gz",
                                           "giga-fren.release2.fixed.en.gz"), "gz")],
        ("newstest2013", "wmt13"), ("newstest2014", "wmt14/full")),
    ("wmt17", "lv"): Task(
        [_europarl("v8", "europarl-v8-wmt17"),
         Corpus("rapid2016", "rapid2016-wmt17", ("rapid2016.en-lv.lv", "rapid2016.en-lv.en")),
         Corpus("leta", "leta", ("LETA-lv-en/leta.lv", "LETA-lv-en/leta.en")),
         Corpus("dcep", "dcep", ("dcep.en-lv/dcep.lv", "dcep.en-lv/dcep.en")),
         Corpus("books", "books", ("farewell/farewell.lv", "farewell/farewell.en"))],
        ("newsdev2017", "wmt17/dev"), ("newstest2017", "wmt17")),
    ("wmt17", "fi"): Task(
        [_europarl("v8"),
         Corpus("wiki-titles", "wiki-titles-v15", "wiki/fi-en/titles.fi-en", "wiki"),
         Corpus("rapid2016", "rapid2016", ("rapid2016.en-fi.fi", "rapid2016.en-fi.en"))],
        ("newstest2016", "wmt16"), ("newstest2017", "wmt17")),
    ("wmt17", "tr"): Task(
        [Corpus("setimes2", "setimes2", "en-tr.tmx", "tmx")],
        ("newstest2016", "wmt16"), ("newstest2017", "wmt17")),
}


def available() -> dict[str, list[str]]:
    """Years and pairs ``download_wmt`` knows: {"wmt14": ["en-de", "en-fr"], ...}."""
    pairs: dict[str, list[str]] = {}
    for year, lang in TASKS:
        pairs.setdefault(year, []).append(f"en-{lang}")
    return pairs


def find_task(year: str, pair: str) -> tuple[Task, str]:
    """The task of ``pair`` (either direction) and its non-English language."""
    langs = pair.split("-")
    if len(langs) != 2 or "en" not in langs or langs[0] == langs[1]:
        raise DownloadError(f"{year}: pair '{pair}' must be English and one other language "
                            f"({_listing()})")
    other = langs[1] if langs[0] == "en" else langs[0]
    if (year, other) not in TASKS:
        raise DownloadError(f"{year} {pair} is not available ({_listing()})")
    return TASKS[(year, other)], other


def _listing() -> str:
    return "; ".join(f"{year}: {', '.join(pairs)} (either direction)"
                     for year, pairs in available().items())


# ------------------------------------------------------------------ fetching


def _digest(path: Path, algorithm: str) -> str:
    hasher = hashlib.new(algorithm)
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            hasher.update(block)
    return hasher.hexdigest()


def _verify(path: Path, archive: Archive) -> str | None:
    """None when ``path`` is ``archive`` (size and checksum), else what differs."""
    size = path.stat().st_size
    if archive.size is not None and size != archive.size:
        return f"{size} bytes, expected {archive.size}"
    digest = _digest(path, archive.algorithm)
    if digest != archive.digest:
        return f"{archive.algorithm} {digest}, expected {archive.digest}"
    return None


def open_url(url: str, offset: int = 0):
    """A response for ``url`` from byte ``offset`` on (a range request when > 0)."""
    request = urllib.request.Request(url, headers={"Range": f"bytes={offset}-"} if offset
                                     else {})
    return urllib.request.urlopen(request, timeout=60)


def fetch(archive: Archive, archives_dir: Path, sources: list[Path], log=print) -> Path:
    """The verified archive: found in ``sources`` or ``archives_dir``, else downloaded into
    ``archives_dir`` (resuming a ``NAME.part`` left by an interrupted download)."""
    for folder in [*sources, archives_dir]:
        candidate = Path(folder) / archive.name
        if candidate.is_file():
            problem = _verify(candidate, archive)
            if problem is None:
                log(f"{archive.name}: found in {folder} (checksum verified)")
                return candidate
            raise DownloadError(f"{candidate}: not the expected archive ({problem}); delete "
                                "or replace it")
    archives_dir.mkdir(parents=True, exist_ok=True)
    part = archives_dir / (archive.name + ".part")
    offset = part.stat().st_size if part.is_file() else 0
    log(f"{archive.name}: downloading {archive.url}"
        + (f" (resuming at byte {offset:,})" if offset else ""))
    try:
        with open_url(archive.url, offset) as response:
            if offset and getattr(response, "status", 206) != 206:
                offset = 0  # the server ignored the range: start again
            with open(part, "ab" if offset else "wb") as handle:
                shutil.copyfileobj(response, handle, 1 << 20)
    except (urllib.error.URLError, OSError) as err:
        where = ", ".join(str(s) for s in sources) or "(no --from given)"
        raise DownloadError(f"cannot fetch {archive.url} ({getattr(err, 'reason', err)}); "
                            f"rerun to resume, or, offline, put {archive.name} into a folder "
                            f"given with --from (looked in {where})") from None
    problem = _verify(part, archive)
    if problem is not None:
        part.unlink()
        raise DownloadError(f"{archive.url}: downloaded file is not the expected archive "
                            f"({problem}); it was deleted, rerun to download it again")
    target = archives_dir / archive.name
    part.replace(target)
    return target


# ------------------------------------------------------------------ extraction


def _write_members(archive_path: Path, wanted: dict[str, list[Path]], fmt: dict[str, str]
                   ) -> None:
    """Stream the members ``wanted`` (member name -> output files) out of a tar archive in
    one pass; ``fmt[member]`` says how to turn it into lines."""
    missing = set(wanted)
    with tarfile.open(archive_path, "r:*") as tar:
        for member in tar:
            if member.name not in missing or not member.isfile():
                continue
            missing.discard(member.name)
            _convert(tar.extractfile(member), fmt[member.name], wanted[member.name])
        if missing:
            names = [m.name for m in tar.getmembers() if m.isfile()]
            raise DownloadError(f"{archive_path.name}: no member {sorted(missing)}; its "
                                f"files are {names[:40]}")


def _convert(stream, fmt: str, outputs: list[Path]) -> None:
    """Write the lines of one member: plain or gzip text to ``outputs[0]``; a two-sided
    format (tmx, wiki) to ``outputs[0]`` (language a) and ``outputs[1]`` (English)."""
    if fmt == "gz":
        stream = gzip.GzipFile(fileobj=stream)
    if fmt in ("plain", "gz"):
        with open(outputs[0], "wb") as out:
            shutil.copyfileobj(stream, out, 1 << 20)
        return
    with open(outputs[0], "w", encoding="utf-8") as first, \
            open(outputs[1], "w", encoding="utf-8") as english:
        for foreign, en in (_tmx_pairs(stream, outputs) if fmt == "tmx"
                            else _wiki_pairs(stream)):
            first.write(foreign.replace("\n", " ") + "\n")
            english.write(en.replace("\n", " ") + "\n")


def _wiki_pairs(stream):
    """(foreign, English) of the wiki titles' ``foreign ||| English`` lines: split on
    ``|||`` and stripped, as the other readers do; a line without exactly one ``|||`` is
    left out (both sides, so the two stay aligned)."""
    for raw in io.TextIOWrapper(stream, encoding="utf-8", errors="replace", newline="\n"):
        parts = raw.split("|||")
        if len(parts) == 2:
            yield parts[0].strip(), parts[1].strip()


def _tmx_pairs(stream, outputs):
    """(foreign, English) of a TMX file's translation units, parsed incrementally."""
    foreign = outputs[0].suffix.lstrip(".")
    lang_key = "{http://www.w3.org/XML/1998/namespace}lang"
    for _, unit in ElementTree.iterparse(stream, events=("end",)):
        if unit.tag != "tu":
            continue
        segments = {}
        for variant in unit.iter("tuv"):
            lang = (variant.get(lang_key) or variant.get("lang") or "").lower()[:2]
            seg = variant.find("seg")
            segments[lang] = "".join(seg.itertext()).strip() if seg is not None else ""
        if foreign in segments and "en" in segments:
            yield segments[foreign], segments["en"]
        unit.clear()


_SEG = re.compile(r"<seg.*?>(.*)</seg>.*?")
_SPACES = re.compile(r"\s+")


def sgml_lines(data: bytes) -> list[str]:
    """The segments of a WMT SGML file, one per line, as sacreBLEU reads them (its
    ``FakeSGMLDataset``): lines split at ``\n`` only (not at U+2028, U+0085 or a lone
    ``\r``, where ``str.splitlines`` would split), a line that starts with ``<seg `` stands
    for its segment, whose whitespace is stripped and whose runs of whitespace collapse to
    one space."""
    return [_SPACES.sub(" ", _SEG.sub(r"\1", line).strip())
            for line in data.decode("utf-8").split("\n") if line.startswith("<seg ")]


def _line_count(path: Path) -> int:
    count, last = 0, b"\n"
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            count += block.count(b"\n")
            last = block[-1:]
    return count + (last != b"\n")


# ------------------------------------------------------------------ the test sets


def test_set(name: str, pair: str) -> tuple[Archive, str, str]:
    """(archive, source member, reference member) of a sacreBLEU test set for ``pair``."""
    from sacrebleu.dataset import DATASETS

    if name not in DATASETS:
        raise DownloadError(f"the installed sacreBLEU does not know the test set {name}")
    dataset = DATASETS[name]
    if pair not in dataset.langpairs:
        raise DownloadError(f"sacreBLEU's {name} has no {pair}")
    members = dataset.langpairs[pair]
    # test.tgz of several years share a name: prefix the set's ("wmt13-test.tgz").
    filename = f"{name.replace('/', '-')}-{dataset.data[0].rstrip('/').split('/')[-1]}"
    return (Archive(dataset.data[0], None, dataset.md5[0], "md5", filename), members[0],
            members[1])


# ------------------------------------------------------------------ the whole download


def download_wmt(year: str, pair: str, out: str | Path, source: str | Path | None = None,
                 log=print) -> dict:
    """Fetch and extract the ``year`` task of ``pair`` (e.g. "wmt14", "en-de") into
    ``out``; return {"train": [prefixes], "valid": prefix, "tests": {name: prefix}}."""
    task, other = find_task(year, pair)
    src, tgt = pair.split("-")
    out = Path(out)
    sources = [Path(source)] if source else []
    archives_dir = out / "archives"
    staging = out / ".download.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        _extract_training(task, other, archives_dir, sources, staging, log)
        for name, dataset in (task.valid, task.test):
            _extract_test_set(name, dataset, (src, tgt), archives_dir, sources, staging, log)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    for file in sorted(staging.iterdir()):
        file.replace(out / file.name)
    staging.rmdir()
    result = {"train": [str(out / f"train.{c.name}") for c in task.train],
              "valid": str(out / task.valid[0]),
              "tests": {task.test[0]: str(out / task.test[0])}}
    log(_prepare_hint(year, pair, result))
    return result


def _extract_test_set(name: str, dataset: str, langs: tuple[str, str], archives_dir: Path,
                      sources: list[Path], staging: Path, log) -> None:
    """``staging/NAME.{src,tgt}`` from sacreBLEU's test set ``dataset`` (its SGML files)."""
    archive, src_member, ref_member = test_set(dataset, "-".join(langs))
    path = fetch(archive, archives_dir, sources, log)
    with tarfile.open(path, "r:*") as tar:
        for lang, member in zip(langs, (src_member, ref_member)):
            try:
                data = tar.extractfile(member).read()
            except KeyError:
                raise DownloadError(f"{path.name}: no member {member}") from None
            lines = (sgml_lines(data) if member.endswith(".sgm")
                     else data.decode("utf-8").splitlines())
            (staging / f"{name}.{lang}").write_text("".join(line + "\n" for line in lines),
                                                    encoding="utf-8")
    log(f"{name}: {len(lines):,} pairs")


def _extract_training(task: Task, other: str, archives_dir: Path, sources: list[Path],
                      staging: Path, log) -> None:
    """Fetch the training archives and stream their corpora into ``staging``."""
    by_archive: dict[str, list[Corpus]] = {}
    for corpus in task.train:
        by_archive.setdefault(corpus.archive, []).append(corpus)
    for archive_name, corpora in by_archive.items():
        archive = ARCHIVES[archive_name]
        path = fetch(archive, archives_dir, sources, log)
        wanted: dict[str, list[Path]] = {}
        formats: dict[str, str] = {}
        for corpus in corpora:
            outputs = [staging / f"train.{corpus.name}.{lang}" for lang in (other, "en")]
            if isinstance(corpus.members, str):  # one member holds both sides
                wanted[corpus.members] = outputs
                formats[corpus.members] = corpus.format
            else:
                for member, output in zip(corpus.members, outputs):
                    member = member.format(x=other)
                    wanted[member] = [output]
                    formats[member] = corpus.format
        if archive.name.endswith(".tmx.gz"):  # a bare gzip file, not a tar
            member = next(iter(wanted))
            with gzip.open(path, "rb") as stream:
                _convert(stream, formats[member], wanted[member])
        else:
            _write_members(path, wanted, formats)
        for corpus in corpora:
            counts = [_line_count(staging / f"train.{corpus.name}.{lang}")
                      for lang in (other, "en")]
            if counts[0] != counts[1]:
                raise DownloadError(f"{corpus.name}: {counts[0]} {other} lines but "
                                    f"{counts[1]} English lines")
            log(f"train.{corpus.name}: {counts[0]:,} pairs")


def _prepare_hint(year: str, pair: str, result: dict) -> str:
    """The ``ranmt prepare`` call for what was downloaded, quoted for a shell."""
    src, tgt = pair.split("-")
    vocab = 40000 if year == "wmt14" else 32000  # the RAN paper's joint vocabularies
    name, prefix = next(iter(result["tests"].items()))
    words = ["ranmt", "prepare", "--src", src, "--tgt", tgt, "--train", *result["train"],
             "--valid", result["valid"], "--test", f"{name}={prefix}",
             "--vocab-size", str(vocab), "--joint", "--out", f"data/{year}-{pair}"]
    return "next: " + shlex.join(words)

