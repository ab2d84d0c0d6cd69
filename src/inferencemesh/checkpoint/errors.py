"""CheckpointError, and how names read from a checkpoint's files are shown in its messages."""

from __future__ import annotations


class CheckpointError(ValueError):
    """The checkpoint cannot be served: unsupported family, pickle-only weights, missing files."""


def shown(text: object, limit: int = 80) -> str:
    """A name from a file, quoted and cut short: a hostile header's names may be long or span lines."""
    quoted = repr(str(text))
    return quoted if len(quoted) <= limit else quoted[:limit - 4] + "...'"


def first_line(err: BaseException, limit: int = 160) -> str:
    """An exception as one short line: its type and the start of its message."""
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text[:limit]}" if text else type(err).__name__
