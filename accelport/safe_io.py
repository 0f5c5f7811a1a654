"""Files a user names (ACCELPORT_COMPAT_MATRIX, ACCELPORT_METRICS_FILE): regular files only, never a hang.

A FIFO blocks ``open()`` until a writer (or reader) comes, ``/dev/zero`` never ends and a
directory is no file: each is refused at once with an error that says what to point the
setting at. Opening never blocks (``O_NONBLOCK``), and reads stop at a size cap.
"""

from __future__ import annotations

import os
import stat
from typing import BinaryIO

from accelport.errors import AccelportError

__all__ = ["read_regular_file", "open_append"]


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def _refuse(what: str, path: str, problem: str) -> AccelportError:
    return AccelportError(f"{what} {path!r} is {problem}: point it at a regular file")


def read_regular_file(path: str, *, what: str, limit: int) -> bytes:
    """The bytes of the regular file ``path`` (at most ``limit``); ``what`` names the setting in errors."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0))
    except OSError as exc:
        raise AccelportError(f"{what} {path!r} cannot be read ({exc.strerror or exc})") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise _refuse(what, path, _kind(mode))
        chunks, size = [], 0
        while size <= limit:
            chunk = os.read(fd, min(1 << 20, limit + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > limit:
            raise AccelportError(f"{what} {path!r} is larger than {limit // (1 << 20)} MB: "
                                 "point it at the file you meant")
        return b"".join(chunks)
    finally:
        os.close(fd)


def open_append(path: str, *, what: str) -> BinaryIO:
    """``path`` opened to append (created if missing), refused unless it is a regular file."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0),
                     0o666)
    except OSError as exc:  # a FIFO without a reader is ENXIO; a directory is EISDIR
        if os.path.exists(path) and not os.path.isfile(path):
            raise _refuse(what, path, _kind(os.stat(path).st_mode)) from None
        raise AccelportError(f"{what} {path!r} cannot be written ({exc.strerror or exc})") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise _refuse(what, path, _kind(mode))
    os.set_blocking(fd, True)
    return os.fdopen(fd, "ab")
