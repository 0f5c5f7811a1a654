"""Checkpoints: one file written atomically by the main process, read back onto any backend's device."""

from __future__ import annotations

import os
import socket
import tempfile
from typing import Any

from accelport.errors import AccelportError
from accelport.tensors import tree_map_tensors

__all__ = ["save_file", "load_file", "atomic_torch_save"]


def save_file(obj: Any, path: str | os.PathLike[str], *, rank: int) -> None:
    """Write ``obj`` to ``path`` from the main process only, atomically.

    Call it from every process or from the main one only: the others return at
    once (there is no barrier, so ``if ap.is_main_process(): ap.save(...)`` cannot
    hang). Tensors are copied to the host first. The bytes go to a temporary file
    in the same directory, are flushed and fsynced, then renamed over ``path``: a
    crash or SIGKILL mid-write leaves the previous checkpoint intact.
    """
    target = os.fspath(path)
    if os.path.isdir(target):
        raise AccelportError(f"ap.save: {target!r} is a directory; give a file path such as "
                             f"{os.path.join(target, 'checkpoint.pt')!r}")
    if rank != 0:
        return
    import torch

    atomic_torch_save(torch, tree_map_tensors(obj, _host_copy), target)


def load_file(path: str | os.PathLike[str], map_location: Any, *, weights_only: bool = True) -> Any:
    """Read a checkpoint written by :func:`save_file`, its tensors moved to ``map_location``.

    Tensors are read onto the host, then moved to ``map_location`` (``ap.load``'s
    default: this process's device), so a checkpoint written on a TPU loads on a CPU and back.
    ``weights_only=True`` (torch's own default) refuses arbitrary pickled objects;
    pass False only for files you trust.
    """
    import torch

    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no checkpoint at {path!r}")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=weights_only)
    except Exception as exc:  # a text file, a truncated copy, a pickle weights_only refuses
        import pickle
        import zipfile

        # torch.save writes a zip archive; anything else is not one of ours.
        if weights_only and isinstance(exc, pickle.UnpicklingError) and zipfile.is_zipfile(path):
            raise AccelportError(f"ap.load: {path!r} holds Python objects that weights_only=True refuses "
                                 "to unpickle; pass weights_only=False only for a file you trust") from exc
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise AccelportError(f"ap.load: {path!r} is not a checkpoint torch can read "
                             f"({type(exc).__name__}: {first})") from exc
    return tree_map_tensors(obj, lambda t: t.to(map_location))


def _host_copy(t: Any) -> Any:
    """A detached host tensor holding only ``t``'s own elements.

    torch.save writes a tensor's whole storage, so a view of a large tensor is
    cloned to keep the checkpoint the size of what was asked for.
    """
    import torch

    t = t.detach().to("cpu")
    if t.layout is not torch.strided or t.is_quantized:
        return t
    if t.untyped_storage().nbytes() > t.numel() * t.element_size():
        t = t.clone()
    return t


_TMP_SUFFIX = ".accelport.tmp"
#: The part of a temp file's name taken from the target's: with the host, the pid and
#: mkstemp's random part it stays well under the 255 bytes most file systems allow.
_STEM_MAX = 120


def _stem(path: str) -> str:
    """The target's name as temp files carry it: long names are cut and told apart by a hash."""
    name = os.path.basename(path)
    if len(name.encode()) <= _STEM_MAX:
        return name
    import hashlib

    digest = hashlib.sha1(name.encode("utf-8", "surrogateescape")).hexdigest()[:12]
    return name.encode()[: _STEM_MAX - 13].decode("utf-8", "ignore") + "~" + digest


def _head(path: str) -> str:
    # Hidden, named after the target and host: an orphan left by a killed writer is
    # recognisable, and only the host that wrote it ever removes it.
    return f".{_stem(path)}.{socket.gethostname()[:40]}."


def _tmp_prefix(path: str) -> str:
    return f"{_head(path)}{os.getpid()}."


def _remove_orphans(path: str) -> None:
    """Delete temp files of ``path`` left by writers on this host that no longer run."""
    directory = os.path.dirname(path)
    head = _head(path)
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in names:
        if not (name.startswith(head) and name.endswith(_TMP_SUFFIX)):
            continue
        pid_text = name[len(head):].split(".", 1)[0]
        if not pid_text.isdigit() or int(pid_text) == os.getpid() or _alive(int(pid_text)):
            continue
        try:
            os.unlink(os.path.join(directory, name))
        except OSError:
            pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists, owned by someone else
        return True
    return True


def _file_mode(path: str) -> int:
    """The mode the checkpoint gets: the file it replaces keeps its mode; a new one follows the umask."""
    try:
        return os.stat(path).st_mode & 0o7777
    except OSError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


def _no_space(directory: str, exc: BaseException) -> AccelportError | None:
    """A clear error when ``exc`` is the disk filling up (torch says only "unexpected pos N vs M")."""
    import errno
    import shutil

    full = isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)
    try:
        free = shutil.disk_usage(directory).free
    except OSError:
        free = None
    if not full and not (isinstance(exc, RuntimeError) and free is not None and free < 64 << 20):
        return None
    left = f" ({free / (1 << 20):.0f} MB free)" if free is not None else ""
    return AccelportError(f"ap.save: the disk holding {directory!r} is full{left}; the previous checkpoint "
                          "is untouched. Free space there, or save to another directory")


def atomic_torch_save(torch: Any, obj: Any, path: str) -> None:
    """torch.save to a temp file, fsync, rename: readers never see a half-written file.

    A writer killed mid-save leaves the previous file at ``path`` untouched and a
    hidden ``.<name>.<host>.<pid>.*.accelport.tmp`` beside it; the next save on the
    same host removes such orphans (before it writes, so their space is free again).
    A symlink at ``path`` is written through: the file it points at is replaced.
    The file gets the mode of the one it replaces, or the umask's for a new one.
    """
    path = os.path.realpath(os.path.abspath(path))
    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    _remove_orphans(path)
    mode = _file_mode(path)
    fd, tmp = tempfile.mkstemp(prefix=_tmp_prefix(path), suffix=_TMP_SUFFIX, dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
            os.fchmod(f.fileno(), mode)
        os.replace(tmp, path)
    except BaseException as exc:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        full = _no_space(directory, exc) if isinstance(exc, Exception) else None
        if full is not None:
            raise full from exc
        raise
    # Make the rename itself durable.
    try:
        dfd = os.open(directory, os.O_RDONLY)
    except OSError:
        dfd = None
    if dfd is not None:
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
