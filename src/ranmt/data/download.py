"""``ranmt download multi30k``: the official Multi30k task-1 raw files.

Files are copied from a local mirror when one is found (``--from DIR`` or
``$RANMT_DATA_DIR``, holding ``multi30k/SPLIT.LANG.gz`` or ``SPLIT.LANG.gz``), else fetched
from the dataset's official repository. Line counts are checked after writing.
"""

from __future__ import annotations

import gzip
import os
import shutil
import urllib.error
import urllib.request
from pathlib import Path

MULTI30K_URL = "https://raw.githubusercontent.com/multi30k/dataset/master/data/task1/raw/{name}"
MULTI30K_SPLITS = {"train": 29000, "val": 1014, "test_2016_flickr": 1000,
                   "test_2017_flickr": 1000}
MULTI30K_LANGS = ("en", "de", "fr", "cs")
OPTIONAL_SPLITS = {"cs": {"test_2017_flickr"}}  # task 1 has no 2017 Flickr test for Czech


class DownloadError(RuntimeError):
    pass


def _candidate_dirs(source: str | Path | None) -> list[Path]:
    dirs = []
    for base in ([source] if source else []) + (
            [os.environ["RANMT_DATA_DIR"]] if os.environ.get("RANMT_DATA_DIR") else []):
        base = Path(base)
        dirs.extend([base / "multi30k", base])
    return dirs


def _find_local(name: str, dirs: list[Path]) -> Path | None:
    for directory in dirs:
        for candidate in (directory / f"{name}.gz", directory / name):
            if candidate.is_file():
                return candidate
    return None


def _write_plain(data: bytes, gzipped: bool, target: Path) -> int:
    text = gzip.decompress(data) if gzipped else data
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_bytes(text)
    tmp.replace(target)
    return text.count(b"\n") + (0 if text.endswith(b"\n") or not text else 1)


def download_multi30k(pair: str, out: str | Path, source: str | Path | None = None,
                      log=print) -> dict[str, Path]:
    """Write ``OUT/{split}.{lang}`` for both languages of ``pair`` ("en-de"); return paths."""
    langs = pair.split("-")
    if len(langs) != 2 or any(lang not in MULTI30K_LANGS for lang in langs):
        raise DownloadError(f"pair '{pair}' not available; Multi30k task 1 has "
                            f"{', '.join(MULTI30K_LANGS)} (e.g. en-de, en-fr, en-cs)")
    out = Path(out)
    staging = out / ".download.tmp"  # files move into OUT only when every one is complete
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        written = _download_all(langs, staging, _candidate_dirs(source), log)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    final = {}
    for name, path in written.items():
        final[name] = path.replace(out / name)
    staging.rmdir()
    return final


def _download_all(langs, out: Path, dirs: list[Path], log) -> dict[str, Path]:
    written = {}
    for split, expected in MULTI30K_SPLITS.items():
        for lang in langs:
            name = f"{split}.{lang}"
            target = out / name
            local = _find_local(name, dirs)
            if local is not None:
                count = _write_plain(local.read_bytes(), local.suffix == ".gz", target)
                origin = str(local)
            else:
                url = MULTI30K_URL.format(name=name + ".gz")
                try:
                    with urllib.request.urlopen(url, timeout=60) as response:
                        data = response.read()
                except urllib.error.HTTPError as err:
                    if split in OPTIONAL_SPLITS.get(lang, set()) and err.code == 404:
                        log(f"skip {name}: not part of Multi30k task 1")
                        continue
                    raise DownloadError(f"cannot fetch {url}: HTTP {err.code}") from None
                except (urllib.error.URLError, OSError) as err:
                    where = ", ".join(str(d) for d in dirs) or "(none given)"
                    raise DownloadError(
                        f"cannot fetch {url} ({getattr(err, 'reason', err)}), and no local "
                        f"copy of {name}.gz was found in {where}; when offline, point "
                        "--from DIR or RANMT_DATA_DIR at a folder holding multi30k/*.gz"
                    ) from None
                count = _write_plain(data, True, target)
                origin = url
            if count != expected:
                target.unlink(missing_ok=True)
                raise DownloadError(f"{origin}: {count} lines, expected {expected}; "
                                    "the file is incomplete or not Multi30k task 1")
            log(f"{name}: {count} lines from {origin}")
            written[name] = target
    return written
