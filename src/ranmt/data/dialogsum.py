"""``ranmt download dialogsum``: DialogSum (Chen et al., Findings of ACL 2021) as plain
text files a summarization grid prepares like any corpus.

Read from a local copy (``--from DIR`` or ``$RANMT_DATA_DIR``, holding
``dialogsum/{train,dev,test}.jsonl.gz`` or those files directly): one JSON object a line
with ``dialogue`` (turns separated by newlines, speakers written ``#Person1#:``) and
``summary``; the test set has three references, ``summary1..3``. The dataset's licence
(CC BY-NC-SA 4.0) keeps it out of the repository; nothing is fetched over the network
(the public release's training file is not JSON lines). Written to OUT:

* ``{train,dev,test}.dialogue``: one dialogue a line, its turns joined by a space;
* ``{train,dev}.summary`` and ``test.summary`` (the first reference), ``test.summary2``,
  ``test.summary3`` (the other two).

Line counts are checked (12,460 / 500 / 500).
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
from pathlib import Path

from ranmt.data.download import DownloadError

DIALOGSUM_SPLITS = {"train": 12460, "dev": 500, "test": 500}
REFERENCES = 3  # on the test set
SOURCE, TARGET = "dialogue", "summary"


def _find(split: str, source: str | Path | None) -> Path:
    bases = [Path(b) for b in ([source] if source else []) + (
        [os.environ["RANMT_DATA_DIR"]] if os.environ.get("RANMT_DATA_DIR") else [])]
    for base in bases:
        for folder in (base / "dialogsum", base):
            for name in (f"{split}.jsonl.gz", f"{split}.jsonl"):
                if (folder / name).is_file():
                    return folder / name
    where = ", ".join(str(b) for b in bases) or "(none given)"
    raise DownloadError(f"no DialogSum {split}.jsonl[.gz] in {where}: point --from DIR or "
                        "RANMT_DATA_DIR at a folder holding dialogsum/*.jsonl.gz (the "
                        "public release: github.com/cylnlp/dialogsum)")


def one_line(text: str) -> str:
    """A dialogue or summary on one line: its lines (turns) joined by single spaces."""
    return " ".join(text.split())


def _columns(split: str) -> dict[str, str]:
    """File suffix -> JSON field: the dialogue, and the summary (the test set: the first
    reference as ``summary``, the others as ``summary2``, ``summary3``)."""
    if split != "test":
        return {SOURCE: SOURCE, TARGET: TARGET}
    references = {TARGET: f"{TARGET}1"}
    references.update({f"{TARGET}{i}": f"{TARGET}{i}" for i in range(2, REFERENCES + 1)})
    return {SOURCE: SOURCE, **references}


def _read(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def download_dialogsum(out: str | Path, source: str | Path | None = None, log=print,
                       expected: dict[str, int] | None = None) -> dict[str, Path]:
    """Write the DialogSum splits under ``out`` (see the module docstring); return the
    written files by name. ``expected``: line counts to check (default: the release's)."""
    expected = DIALOGSUM_SPLITS if expected is None else expected
    out = Path(out)
    staging = out / ".download.tmp"  # files move into OUT only when every one is complete
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    written: dict[str, Path] = {}
    try:
        for split, count in expected.items():
            path = _find(split, source)
            records = _read(path)
            if len(records) != count:
                raise DownloadError(f"{path}: {len(records)} dialogues, expected {count}")
            for name, key in _columns(split).items():
                missing = [r.get("fname", "?") for r in records if not r.get(key, "").strip()]
                if missing:
                    raise DownloadError(f"{path}: {len(missing)} records without '{key}' "
                                        f"(first: {missing[0]})")
                target = staging / f"{split}.{name}"
                target.write_text("".join(one_line(r[key]) + "\n" for r in records),
                                  encoding="utf-8")
                written[target.name] = target
            log(f"{split}: {len(records)} dialogues from {path}")
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    final = {name: path.replace(out / name) for name, path in written.items()}
    staging.rmdir()
    return final
