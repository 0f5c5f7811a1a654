"""Files a user names (ACCELPORT_COMPAT_MATRIX, ACCELPORT_METRICS_FILE, an output path): regular files only,
never a hang, never half written.

A FIFO blocks ``open()`` until a writer (or reader) comes, ``/dev/zero`` never ends and a
directory is no file: each is refused at once with an error that says what to point the
setting at. Opening never blocks (``O_NONBLOCK``), and reads stop at a size cap.

An output is written beside its target and renamed over it once complete
(:func:`write_atomic`; :func:`temp_beside` and :func:`replace_with` for one written
over a while): a full disk or a kill leaves the earlier file as it was, never a
truncated one; the temporary file a killed writer leaves is named after its target,
host and process, so :func:`remove_orphans` can remove it later. A file accelport makes up
the name of (a repro) is written only where nothing is yet (:func:`write_new`): never over a
user's file, never through a symlink planted at its name. :func:`same_file`
says whether two paths are one file, through symlinks and hard links, so an output
is never written over an input.
"""

from __future__ import annotations

import errno
import hashlib
import os
import socket
import stat
from typing import BinaryIO

from accelport.errors import AccelportError

__all__ = ["read_regular_file", "open_append", "same_file", "output_target", "temp_beside", "replace_with",
           "remove_orphans", "write_atomic", "write_new", "fsync_dir"]


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
            try:  # a read can fail after the open did (/proc/self/mem: an I/O error)
                chunk = os.read(fd, min(1 << 20, limit + 1 - size))
            except OSError as exc:
                raise AccelportError(f"{what} {path!r} cannot be read ({exc.strerror or exc})") from None
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


def same_file(a: str, b: str) -> bool:
    """Whether ``a`` and ``b`` are one file: the same inode (so also through a symlink or a hard link),
    or, where either does not exist yet, the same path once symlinks are resolved."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.realpath(a) == os.path.realpath(b)


def output_target(path: str, *, what: str) -> str:
    """The file to write for ``path`` (a symlink's target: the link stays); refused unless it is a regular
    file or does not exist yet. Renaming over a FIFO or a device would replace it, opening one would hang."""
    real = os.path.realpath(path)
    try:
        mode = os.stat(real).st_mode
    except FileNotFoundError:
        return real
    except OSError as exc:
        raise AccelportError(f"{what} {path!r} cannot be written ({exc.strerror or exc})") from None
    if not stat.S_ISREG(mode):
        raise _refuse(what, path, _kind(mode))
    return real


def _host_part() -> str:
    """``.HOST.``: what a temporary file's name holds after its stem, before the writer's pid."""
    return f".{socket.gethostname()[:40]}."


def _temp_head(path: str) -> str:
    """Where the names of ``path``'s temporary files from this host start: ``DIR/.NAME.HOST.``"""
    directory, name = os.path.split(path)
    raw = name.encode("utf-8", "surrogateescape")
    # With the host, the pid and the random part the name stays well under the 255 bytes file systems allow.
    stem = name if len(raw) <= 100 else hashlib.sha1(raw).hexdigest()[:16]
    return os.path.join(directory, f".{stem}{_host_part()}")


def temp_beside(path: str) -> str:
    """A new, empty, hidden file in ``path``'s directory (so the rename onto ``path`` is one step), named
    ``.NAME.HOST.PID.RANDOM.tmp``; its mode follows the umask, as ``open(path, "w")`` would give. OSError
    if it cannot."""
    head = f"{_temp_head(path)}{os.getpid()}."
    for _ in range(100):
        tmp = f"{head}{os.urandom(4).hex()}.tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o666)
        except FileExistsError:
            continue
        os.close(fd)
        return tmp
    raise FileExistsError(errno.EEXIST, "no free temporary name", f"{head}*.tmp")


def remove_orphans(path: str) -> None:
    """Remove the temporary files of ``path`` (:func:`temp_beside`'s) whose writer on this host no longer
    runs: a killed writer's leftovers, which would otherwise fill the disk save after save. Those of
    another host (on a shared file system) are left to it, and so is anything that cannot be removed."""
    head = _temp_head(path)
    directory, start = os.path.split(head)
    try:
        names = os.listdir(directory or ".")
    except OSError:
        return
    for name in names:
        if not (name.startswith(start) and name.endswith(".tmp")):
            continue
        pid = name[len(start):].split(".", 1)[0]
        if not pid.isdigit() or int(pid) == os.getpid() or _running(int(pid)):
            continue
        try:
            os.unlink(os.path.join(directory, name))
        except OSError:
            pass


def remove_own_temps(directory: str) -> list[str]:
    """Remove the temporary files (:func:`temp_beside`'s) this process has open under ``directory``, at any
    depth: a write cut short by the process's own exit (a deadline), which no later save would remove while
    this pid is alive. Returns the paths removed."""
    mine = f"{_host_part()}{os.getpid()}."  # (as temp_beside names them)
    removed = []
    for root, _dirs, names in os.walk(directory):
        for name in names:
            if name.startswith(".") and name.endswith(".tmp") and mine in name:
                try:
                    os.unlink(os.path.join(root, name))
                    removed.append(os.path.join(root, name))
                except OSError:
                    pass
    return removed


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # it runs, as another user
        return True
    return True


def replace_with(tmp: str, path: str) -> None:
    """Put the finished file ``tmp`` in ``path``'s place in one rename, its data on disk first; ``path``
    keeps the mode it had. OSError if it cannot (``tmp`` is then left for the caller to remove)."""
    try:
        os.chmod(tmp, stat.S_IMODE(os.stat(path).st_mode))
    except FileNotFoundError:
        pass
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    try:  # the rename itself, durable
        fsync_dir(os.path.dirname(path) or ".")
    except OSError:
        pass


def fsync_dir(directory: str) -> None:
    """Make the entries of ``directory`` (a rename into it) durable; nothing where it cannot be opened."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: str, data: bytes, *, what: str) -> str:
    """Write ``data`` to ``path`` all at once (see :func:`output_target`); return the file written.

    Uses no ``open()`` a running script may have replaced. On failure the file that was at
    ``path`` is unchanged and nothing is left beside it; the error says why, in ``what``'s name.
    """
    target = output_target(path, what=what)
    tmp = None
    try:
        tmp = temp_beside(target)
        fd = os.open(tmp, os.O_WRONLY)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)
        replace_with(tmp, target)
    except OSError as exc:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass
        full = exc.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC))
        why = "the disk is full; the file that was there is unchanged" if full else (exc.strerror or str(exc))
        raise AccelportError(f"{what} {path!r} cannot be written ({why})") from None
    return target


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def write_new(path: str, data: bytes, *, what: str) -> bool:
    """Write ``data`` to ``path`` as a new file, whole; False (nothing written) where anything is at ``path``
    already: a file, a directory, a symlink (also a dangling one), which is never followed or replaced.

    The data goes to a temporary file beside it (:func:`temp_beside`), which is then hard-linked to
    ``path``: the link fails where the name is taken, so no check-then-write race lets another file
    in between, and no reader sees the file half written. Where the file system has no hard links,
    ``path`` is created exclusively (``O_EXCL``, ``O_NOFOLLOW``) and written in place. AccelportError,
    in ``what``'s name, where it cannot be written; nothing is then left behind.
    """
    tmp = None
    created = False
    try:
        tmp = temp_beside(path)
        fd = os.open(tmp, os.O_WRONLY | getattr(os, "O_NOFOLLOW", 0))
        try:
            _write_all(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(tmp, path)  # (a name that is taken, a symlink too, fails: EEXIST)
        except FileExistsError:
            return False
        except OSError:  # no hard links here (EPERM, ENOTSUP ...): created exclusively instead
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o666)
            except FileExistsError:
                return False
            created = True
            try:
                _write_all(fd, data)
                os.fsync(fd)
            finally:
                os.close(fd)
        created = True
        fsync_dir(os.path.dirname(path) or ".")
        return True
    except OSError as exc:
        if created:
            try:
                os.unlink(path)
            except OSError:
                pass
        full = exc.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC))
        raise AccelportError(f"{what} {path!r} cannot be written "
                             f"({'the disk is full' if full else exc.strerror or exc})") from None
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass
