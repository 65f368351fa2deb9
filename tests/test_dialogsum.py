"""``ranmt download dialogsum`` (issue 100 item 5): DialogSum's JSON lines as plain text
files, one dialogue (turns joined) and one summary a line; the test set's three references
kept apart; counts checked; nothing half-written on an error."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import pytest

from ranmt.cli import main
from ranmt.data.dialogsum import DIALOGSUM_SPLITS, download_dialogsum
from ranmt.data.download import DownloadError

SMALL = {"train": 3, "dev": 2, "test": 2}


def _release(root: Path) -> Path:
    """A miniature release: dialogsum/{train,dev,test}.jsonl.gz."""
    folder = root / "dialogsum"
    folder.mkdir(parents=True)
    for split, count in SMALL.items():
        records = []
        for i in range(count):
            record = {"fname": f"{split}_{i}",
                      "dialogue": f"#Person1#: Hello {split} {i}.\n#Person2#:  Hi   there.",
                      "topic": "greeting"}
            if split == "test":
                record.update({f"summary{r}": f"ref{r} of {i}\nsecond line" for r in (1, 2, 3)})
            else:
                record["summary"] = f"#Person1# greets #Person2# ({split} {i})."
            records.append(json.dumps(record))
        with gzip.open(folder / f"{split}.jsonl.gz", "wt", encoding="utf-8") as handle:
            handle.write("\n".join(records) + "\n")
    return root


def test_the_splits_become_one_line_a_dialogue_with_the_three_test_references(tmp_path):
    source = _release(tmp_path / "shared")
    written = download_dialogsum(tmp_path / "out", source, log=lambda *_: None,
                                 expected=SMALL)
    assert sorted(written) == ["dev.dialogue", "dev.summary", "test.dialogue", "test.summary",
                               "test.summary2", "test.summary3", "train.dialogue",
                               "train.summary"]
    out = tmp_path / "out"
    assert (out / "train.dialogue").read_text().splitlines() == [
        f"#Person1#: Hello train {i}. #Person2#: Hi there." for i in range(3)]
    assert (out / "dev.summary").read_text().splitlines()[1] == \
        "#Person1# greets #Person2# (dev 1)."
    for name, reference in (("test.summary", 1), ("test.summary2", 2), ("test.summary3", 3)):
        assert (out / name).read_text().splitlines() == [
            f"ref{reference} of {i} second line" for i in range(2)]
    assert not (out / ".download.tmp").exists()


def test_a_wrong_count_or_a_missing_file_writes_nothing(tmp_path, monkeypatch):
    source = _release(tmp_path / "shared")
    with pytest.raises(DownloadError, match="3 dialogues, expected 4"):
        download_dialogsum(tmp_path / "out", source, log=lambda *_: None,
                           expected={**SMALL, "train": 4})
    assert list((tmp_path / "out").iterdir()) == []
    monkeypatch.delenv("RANMT_DATA_DIR", raising=False)
    with pytest.raises(DownloadError, match="RANMT_DATA_DIR"):
        download_dialogsum(tmp_path / "out2", tmp_path / "nowhere", log=lambda *_: None)


def test_ranmt_download_dialogsum_reads_the_shared_copy(tmp_path):
    """The real release in $RANMT_DATA_DIR/dialogsum (12,460 / 500 / 500), through the
    command line."""
    assert os.environ.get("RANMT_DATA_DIR"), "the tests read the shared data (Makefile, CI)"
    main(["download", "dialogsum", "--out", str(tmp_path)])
    for split, count in DIALOGSUM_SPLITS.items():
        lines = (tmp_path / f"{split}.dialogue").read_text(encoding="utf-8").splitlines()
        assert len(lines) == count and all(line.startswith("#Person") for line in lines)
    references = [(tmp_path / name).read_text(encoding="utf-8").splitlines()
                  for name in ("test.summary", "test.summary2", "test.summary3")]
    assert all(len(r) == 500 for r in references)
    assert sum(a != b for a, b in zip(references[0], references[1])) > 400  # distinct refs
