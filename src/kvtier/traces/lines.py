"""Trace files read line by line, each line bounded: ``trace_lines``.

A trace file is plain, or gzip-compressed: known by its first two bytes
(``1f 8b``), not by its name, and decompressed as it is read (never whole).
A file compressed some other way (zstd, bzip2, xz: their magic bytes) is
refused by name; one that cannot be opened (missing, a directory, no
permission) is refused naming ``--trace`` and the path.

Every line is read with a bounded ``readline``, so no line is ever held
whole: a line whose bytes (the line break not counted) pass
``max_line_bytes`` comes back as a bad line after its first
``max_line_bytes + 1`` bytes were read and the rest discarded in small
pieces. A line that is not UTF-8 comes back as a bad line too. What a bad
line means is the caller's: an error naming the file and the line, or, with
``--skip-bad-lines``, left out and counted.

``DEFAULT_MAX_LINE_BYTES`` is 1 MiB. A Mooncake line is four small fields
and one id per 512 tokens of its prompt: even with ids of 20 digits (64-bit)
1 MiB holds some 47,000 ids, a 24M-token prompt, twice the longest context
window of any model today (10M tokens); the released traces' lines are a few
KiB. A kvtier trace line holds its prompt's token ids (about 7 bytes a
token), so 1 MiB is a prompt of some 150,000 tokens; ``--max-line-size``
raises the limit for longer ones.
"""

from __future__ import annotations

import gzip
import io
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

DEFAULT_MAX_LINE_BYTES = 1 << 20
MAX_LINE_FLAG = "--max-line-size"
GZIP_MAGIC = b"\x1f\x8b"
# Compressed formats refused by name: (magic bytes, name, how to decompress).
REFUSED_MAGIC = (
    (b"\x28\xb5\x2f\xfd", "zstd", "zstd -d"),
    (b"BZh", "bzip2", "bunzip2 -k"),
    (b"\xfd7zXZ\x00", "xz", "unxz -k"),
)
_DISCARD_BYTES = 1 << 16  # the rest of an over-long line is read in pieces this big
_READ_ERRORS = (OSError, EOFError, zlib.error)  # a damaged gzip stream: BadGzipFile, EOFError


@dataclass(frozen=True, slots=True)
class TraceLine:
    """One line of a trace file: its text (line break included), or why it
    could not be read (``error``; ``text`` is then empty)."""

    number: int  # 1-based
    text: str = ""
    error: str | None = None

    @property
    def blank(self) -> bool:
        return self.error is None and not self.text.strip()


def trace_lines(path: Path, max_line_bytes: int = DEFAULT_MAX_LINE_BYTES) -> Iterator[TraceLine]:
    """The lines of ``path`` in order, each read with at most
    ``max_line_bytes + 1`` bytes in memory (see the module docstring).

    ValueError naming ``--trace`` and ``path`` when the file cannot be opened,
    is compressed other than with gzip, or fails part way (a read error, a
    damaged gzip stream); a bad line is a ``TraceLine`` with an ``error``."""
    with open_trace(path) as stream:
        number = 0
        while True:
            number += 1
            try:
                data = stream.readline(max_line_bytes + 1)
                too_long = len(data) > max_line_bytes and not data.endswith(b"\n")
                if too_long:
                    _discard_line(stream)
            except _READ_ERRORS as exc:
                raise ValueError(f"--trace {path}:{number}: cannot read it ({exc})") from None
            if not data:
                return
            if too_long:
                yield TraceLine(number, error=_too_long(max_line_bytes))
                continue
            yield _decoded(number, data)


@contextmanager
def open_trace(path: Path) -> Iterator[io.BufferedIOBase]:
    """``path`` as a stream of bytes, gzip decompressed as it is read;
    ValueError naming ``--trace`` and ``path`` when it cannot be read."""
    try:
        raw = path.open("rb")
    except OSError as exc:
        raise ValueError(f"--trace {path}: cannot open it ({exc.strerror or exc})") from None
    with raw:
        try:
            head = raw.peek(8)[:8]
        except OSError as exc:
            raise ValueError(f"--trace {path}: cannot read it ({exc.strerror or exc})") from None
        for magic, name, command in REFUSED_MAGIC:
            if head.startswith(magic):
                raise ValueError(
                    f"--trace {path}: compressed with {name}, which kvtier does not read; "
                    f"decompress it first ({command} {path}), or compress it with gzip"
                )
        if head.startswith(GZIP_MAGIC):
            with gzip.GzipFile(fileobj=raw, mode="rb") as unzipped:
                yield unzipped
        else:
            yield raw


def _discard_line(stream: io.BufferedIOBase) -> None:
    """Read past the rest of the current line, a piece at a time."""
    while True:
        piece = stream.readline(_DISCARD_BYTES)
        if not piece or piece.endswith(b"\n"):
            return


def _too_long(max_line_bytes: int) -> str:
    return (
        f"longer than {max_line_bytes} bytes, the most {MAX_LINE_FLAG} allows "
        f"(raise it, e.g. {MAX_LINE_FLAG} {max(2 * max_line_bytes, 4 << 20) >> 20}MiB)"
    )


def _decoded(number: int, data: bytes) -> TraceLine:
    try:
        return TraceLine(number, data.decode("utf-8"))
    except UnicodeDecodeError as exc:
        where = f"byte 0x{data[exc.start]:02x} at offset {exc.start} of the line"
        return TraceLine(number, error=f"not UTF-8 text ({where})")


__all__ = [
    "DEFAULT_MAX_LINE_BYTES",
    "MAX_LINE_FLAG",
    "TraceLine",
    "open_trace",
    "trace_lines",
]
