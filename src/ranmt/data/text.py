"""Reading user text files: UTF-8 (BOM dropped), any line ending, one entry per line."""

from __future__ import annotations

import gzip
from pathlib import Path


class TextError(ValueError):
    """A text file that cannot be read as asked."""


def read_lines(path: str | Path, errors: str = "strict") -> list[str]:
    """Lines of a UTF-8 text file (``.gz`` read transparently), without line endings.

    A UTF-8 BOM is dropped, ``\\r\\n`` and ``\\r`` endings are accepted. Invalid UTF-8 is an
    error naming the file and byte offset unless ``errors="replace"``.
    """
    path = Path(path)
    if not path.is_file():
        raise TextError(f"{path}: file does not exist")
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as handle:
        data = handle.read()
    return decode_lines(data, str(path), errors)


def decode_lines(data: bytes, name: str, errors: str = "strict") -> list[str]:
    """Split UTF-8 bytes into lines (BOM dropped, any line ending); ``name`` for errors."""
    if errors not in ("strict", "replace"):
        raise ValueError(f"errors must be strict or replace, not '{errors}'")
    try:
        text = data.decode("utf-8", errors=errors)
    except UnicodeDecodeError as err:
        line = data[: err.start].count(b"\n") + 1
        raise TextError(f"{name}: invalid UTF-8 at byte {err.start} (line {line}); "
                        "fix the file or pass --errors replace") from None
    if text.startswith("\ufeff"):
        text = text[1:]
    lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return lines


def write_lines(path: str | Path, lines: list[str]) -> None:
    """Write lines atomically (temporary file, then rename)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8", newline="\n") as handle:
        for line in lines:
            handle.write(line + "\n")
    tmp.replace(path)
