"""Checkpoints: one file written atomically by the main process, or, when a model in the state
was sharded by ``ap.shard``, a directory written by every rank on torch.distributed.checkpoint.

A single file holds what ``torch.save`` writes (modules and optimizers in the
state as their ``state_dict()``). A checkpoint directory holds DCP's shard files
(one per rank) and ``.metadata``, plus ``accelport.json`` (what is where) and
``plain.pt`` (the plain values, from rank 0). Both are published the same way:
written under a hidden temporary name next to ``path``, then renamed onto it, so
an interrupted save never replaces the last good checkpoint. A directory's save
or load that fails on one rank is raised on every rank at the same point
(:func:`_agree`), so no rank is left waiting in a collective.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import threading
from collections.abc import Callable, Mapping
from typing import Any

from accelport.errors import AccelportError, CheckpointError
from accelport.safe_io import fsync_dir, remove_orphans, replace_with, temp_beside
from accelport.tensors import tree_map_tensors

__all__ = ["save", "load", "save_file", "load_file", "atomic_torch_save", "agree", "PendingSave", "MANIFEST"]

#: The file that marks a directory as an accelport checkpoint and says what it holds.
MANIFEST = "accelport.json"
#: Where the plain values of a checkpoint directory live (written by rank 0).
PLAIN = "plain.pt"
FORMAT = "accelport.sharded"


# -- the two entry points ------------------------------------------------------------------


def save(backend: Any, obj: Any, path: str | os.PathLike[str], *, background: bool = False) -> PendingSave | None:
    """``ap.save``: a checkpoint directory when ``obj`` holds a sharded model, else one file.

    ``background=True`` returns a :class:`PendingSave` at once; for a directory the
    write runs on DCP's async save, otherwise (one file) it has already happened.
    """
    if not isinstance(background, bool):
        raise TypeError(f"ap.save(background=...) takes True or False, not {background!r}")
    if not isinstance(path, (str, os.PathLike)) or os.fspath(path) in ("", b""):
        raise CheckpointError(f"ap.save needs the path of the checkpoint to write, such as 'ckpt.pt' or "
                              f"'checkpoints/step100', not {path!r}")
    _finish_pending(backend)
    modules = _entries(obj, "module")
    if any(_fsdp2_sharded(m) for m in modules.values()):
        return _save_sharded(backend, obj, os.fspath(path), background=background)
    save_file(_file_state(obj), path, rank=backend.rank())
    return PendingSave(os.fspath(path)) if background else None


def load(backend: Any, path: str | os.PathLike[str], map_location: Any, *, weights_only: bool = True,
         into: Any = None) -> Any:
    """``ap.load``: a file or a checkpoint directory; ``into`` restores modules and optimizers in place.

    With ``into`` the return value is the checkpoint's other (plain) values.
    """
    if into is not None and not isinstance(into, Mapping):
        raise TypeError("ap.load(into=...) takes the dict of modules and optimizers to restore, such as "
                        f"{{'model': model, 'opt': optimizer}}, not {type(into).__name__}")
    _finish_pending(backend)
    target = _resolve(os.fspath(path))
    if os.path.isdir(target):
        manifest = _manifest(target)
        if manifest is None:
            raise CheckpointError(f"ap.load: {os.fspath(path)!r} is a directory but not an accelport checkpoint "
                                  f"(it has no {MANIFEST}); give the path ap.save wrote")
        if into is None:
            raise CheckpointError(
                f"ap.load: {os.fspath(path)!r} is a sharded checkpoint directory (written by "
                f"{manifest.get('world_size', '?')} ranks): pass what to restore in place, such as "
                f"ap.load(path, into={{{_example(manifest)}}}); the plain values come back as the result")
        return _load_sharded(backend, target, manifest, map_location, weights_only=weights_only, into=into)
    loaded = load_file(target, map_location, weights_only=weights_only)
    if into is None:
        return loaded
    return _restore_from_file(os.fspath(path), loaded, into)


class PendingSave:
    """What ``ap.save(..., background=True)`` returns: ``wait()`` until the checkpoint is in place.

    The next ``ap.save`` or ``ap.load`` waits for it first, and so does the end of
    the process (without the barrier).
    """

    def __init__(self, path: str, future: Any = None,
                 agree: Callable[[CheckpointError | None], None] | None = None) -> None:
        self.path = path
        self._future = future
        self._agree = agree  # every rank learns whether any rank's part failed
        self._published = threading.Event()
        self._error: BaseException | None = None
        self._waited = future is None
        if future is None:
            self._published.set()

    def _publish_when_done(self, publish: Callable[[], None] | None) -> None:
        def done(future: Any) -> None:
            try:
                future.result()
                if publish is not None:
                    publish()
            except BaseException as exc:  # noqa: BLE001 - handed to wait(), in the training thread
                self._error = exc
            finally:
                self._published.set()

        self._future.add_done_callback(done)

    def done(self) -> bool:
        """True once this rank's part is written (and, on rank 0, the directory renamed into place)."""
        return self._published.is_set()

    def wait(self, *, barrier: bool = True) -> None:
        """Block until the checkpoint is in place on every rank; raise what the save raised, on every rank."""
        if self._waited:
            return
        self._published.wait()
        self._waited = True
        failure = None
        if self._error is not None:
            failure = CheckpointError(f"ap.save(background=True) to {self.path!r} failed: {_describe(self._error)}")
            failure.__cause__ = self._error
        if barrier and self._agree is not None:
            self._agree(failure)  # every rank returns once rank 0 has renamed the directory, or raises
        elif failure is not None:
            raise failure

    def __repr__(self) -> str:
        return f"<PendingSave {self.path!r} {'done' if self.done() else 'writing'}>"


def _finish_pending(backend: Any) -> None:
    shards = getattr(backend, "shard_registry", None)
    pending = getattr(shards, "pending", None)
    if shards is not None and pending is not None:
        shards.pending = None
        pending.wait()


# -- what is in the state --------------------------------------------------------------------


def _kind(value: Any) -> str:
    import sys

    torch = sys.modules.get("torch")
    if torch is None:
        return "plain"
    if isinstance(value, torch.nn.Module):
        return "module"
    if isinstance(value, torch.optim.Optimizer):
        return "optimizer"
    return "plain"


def _entries(obj: Any, kind: str) -> dict[str, Any]:
    if not isinstance(obj, Mapping):
        return {}
    return {k: v for k, v in obj.items() if _kind(v) == kind}


def _fsdp2_sharded(module: Any) -> bool:
    from accelport.sharding import _dtensor_class

    dtensor = _dtensor_class()
    return dtensor is not None and any(isinstance(p, dtensor) for p in module.parameters())


def _strip(key: str) -> str:
    # torch_xla's SPMD FSDP wraps each unit, adding "_orig_module." to the parameter names.
    return key.replace("_orig_module.", "")


def _module_state(module: Any) -> dict[str, Any]:
    state = module.state_dict()
    if not any("_orig_module." in k for k in state):
        return state
    return {_strip(k): v for k, v in state.items()}


def _file_state(obj: Any) -> Any:
    """``obj`` with its top-level modules and optimizers replaced by their state dicts."""
    if not isinstance(obj, Mapping) or all(_kind(v) == "plain" for v in obj.values()):
        return obj
    out = {}
    for k, v in obj.items():
        kind = _kind(v)
        out[k] = _module_state(v) if kind == "module" else v.state_dict() if kind == "optimizer" else v
    return out


def _pair(optimizers: Mapping[str, Any], modules: Mapping[str, Any], verb: str) -> dict[str, str]:
    """For each optimizer, the key of the module whose parameters it steps."""
    owned = {k: {id(p) for p in m.parameters()} for k, m in modules.items()}
    pairs = {}
    for key, opt in optimizers.items():
        ids = {id(p) for g in opt.param_groups for p in g["params"]}
        owner = next((k for k, params in owned.items() if ids <= params), None)
        if owner is None:
            raise CheckpointError(
                f"{verb}: optimizer {key!r} steps parameters of no single module in this dict "
                f"({', '.join(map(repr, modules)) or 'it holds none'}): a sharded optimizer state is keyed by its "
                f"model's parameter names, so put that model beside it, e.g. {{'model': model, {key!r}: ...}}")
        pairs[key] = owner
    return pairs


def _example(manifest: Mapping[str, Any]) -> str:
    names = [f"{k!r}: {k}" for k in list(manifest.get("modules", [])) + list(manifest.get("optimizers", {}))]
    return ", ".join(names) or "'model': model"


def _first_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    return lines[-1] if lines else type(exc).__name__


def _rank_errors(exc: BaseException) -> list[tuple[int, BaseException]]:
    """The error of each failed rank inside DCP's ``CheckpointException`` (rank order), else none."""
    failures = getattr(exc, "failures", None)
    if not isinstance(failures, Mapping):
        return []
    found = []
    for rank in sorted(failures):
        inner = failures[rank][0] if isinstance(failures[rank], tuple) else failures[rank]
        if isinstance(inner, BaseException):
            found.append((rank, inner))
    return found


def _describe(exc: BaseException) -> str:
    """``Type: message`` of ``exc``, or of the first failed rank's error inside DCP's CheckpointException."""
    for rank, inner in _rank_errors(exc):
        return f"on rank {rank}, {type(inner).__name__}: {_first_line(inner)}"
    return f"{type(exc).__name__}: {_first_line(exc)}"


# -- every rank stops together -----------------------------------------------------------------

#: How much of a failing rank's message reaches the others.
_MESSAGE_BYTES = 4096


def _agree(rank: int, world: int, failure: CheckpointError | None, reduce: Callable[[Any], Any],
           device: Any) -> None:
    """Every rank learns whether any rank failed; then all raise the first failing rank's error.

    One collective of a flag per rank when all went well, a second carrying the
    message when not: a failure on one rank never leaves the others waiting in the
    next collective, and a script that catches the error stays in step with its peers.
    """
    if world == 1:
        if failure is not None:
            raise failure
        return
    import torch

    flags = torch.zeros(world, dtype=torch.int32, device=device)
    if failure is not None:
        flags[rank] = 1
    reduce(flags)
    failed = [r for r, flag in enumerate(flags.tolist()) if flag]
    if not failed:
        return
    source = failed[0]
    text = torch.zeros(_MESSAGE_BYTES, dtype=torch.uint8, device=device)
    if rank == source:
        data = str(failure).encode()[:_MESSAGE_BYTES]
        text[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    reduce(text)  # the others hold zeros: the sum is the source's bytes
    if rank == source and failure is not None:
        raise failure
    message = bytes(text.cpu().tolist()).rstrip(b"\0").decode("utf-8", "ignore")
    raise CheckpointError(f"{message} (the error of rank {source}, raised on every rank)")


def agree(backend: Any, failure: CheckpointError | None) -> None:
    """Every rank of ``backend`` learns whether any rank failed; then all raise the first failing rank's error.

    Call it on every rank at the same point (a no-op alone when ``failure`` is None).
    """
    _backend_agree(backend)(failure)


def _backend_agree(backend: Any) -> Callable[[CheckpointError | None], None]:
    """:func:`_agree` over the backend's own process group."""
    from accelport.tensors import collective_device

    return lambda failure: _agree(backend.rank(), backend.world_size(), failure, backend.all_reduce,
                                  collective_device(backend))


def _numpy_problem(verb: str, rank: int) -> CheckpointError | None:
    """Why this rank cannot take part in a checkpoint of several ranks for want of numpy, or None.

    torch.distributed.checkpoint sends its plans between ranks as pickled objects,
    which torch reads back through numpy (``Tensor.numpy()``); torch's CPU wheels do
    not install numpy, and without it rank 0 dies in DCP while its peers see the
    connection close. The same call is tried here, before the first collective.
    """
    import torch

    try:
        torch.zeros(1, dtype=torch.uint8).numpy()
    except Exception as exc:  # noqa: BLE001 - torch says "Numpy is not available" (RuntimeError)
        return CheckpointError(
            f"{verb}: a sharded checkpoint on several ranks needs numpy, and rank {rank} cannot use it "
            f"({type(exc).__name__}: {_first_line(exc)}): torch.distributed.checkpoint passes its plans "
            "between ranks as pickled objects, which torch reads through numpy, and torch's CPU wheels do "
            "not install it. Run `pip install numpy` in the environment of every rank")
    return None


def _start_error(exc: Exception, path: str) -> CheckpointError:
    """What rank 0 says when it cannot begin a checkpoint directory at ``path``."""
    if isinstance(exc, CheckpointError):
        return exc
    if isinstance(exc, OSError):
        where = f" ({exc.filename!r})" if exc.filename else ""
        error = CheckpointError(f"ap.save: cannot write the checkpoint at {path!r}: "
                                f"{exc.strerror or _first_line(exc)}{where}; give a path in a directory "
                                "this process can create and write (every part of it a directory)")
    else:
        error = CheckpointError(f"ap.save: rank 0 could not start the checkpoint at {path!r} "
                                f"({type(exc).__name__}: {_first_line(exc)})")
    error.__cause__ = exc
    return error


# -- checkpoint directories (torch.distributed.checkpoint) -------------------------------------


def _tmp_dir(target: str) -> str:
    return os.path.join(os.path.dirname(target), f".{os.path.basename(target)}.accelport-tmp")


def _old(target: str) -> str:
    return os.path.join(os.path.dirname(target), f".{os.path.basename(target)}.accelport-old")


def _resolve(target: str) -> str:
    """``target``, or the previous checkpoint if a save stopped between its two renames."""
    old = _old(os.path.abspath(target))
    if not os.path.lexists(target) and os.path.lexists(old):
        return old
    return target


def _manifest(directory: str) -> dict[str, Any] | None:
    try:
        with open(os.path.join(directory, MANIFEST)) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("format") == FORMAT else None


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        os.unlink(path)


def _publish(tmp: str, target: str) -> None:
    """Rename the finished ``tmp`` onto ``target``; the previous checkpoint goes only after."""
    old = _old(target)
    if os.path.lexists(target):
        _remove(old)
        os.rename(target, old)
    os.rename(tmp, target)
    fsync_dir(os.path.dirname(target))
    _remove(old)


def _prepare_target(target: str, verb: str) -> None:
    """Rank 0, before a save: refuse a foreign directory, recover a half-published save, clear leftovers."""
    here = os.path.realpath(os.getcwd())
    if os.path.isdir(target) and os.path.commonpath([here, os.path.realpath(target)]) == os.path.realpath(target):
        raise CheckpointError(f"{verb}: {target!r} is the directory this process runs in (or holds it); saving "
                              "would replace it. Give a new path such as "
                              f"{os.path.join(target, 'checkpoint')!r}")
    if os.path.isdir(target) and _manifest(target) is None and os.listdir(target):
        raise CheckpointError(f"{verb}: {target!r} is a directory that is not an accelport checkpoint; saving "
                              "would replace it. Give a new path such as "
                              f"{os.path.join(target, 'checkpoint')!r}")
    if not os.path.lexists(target) and os.path.lexists(_old(target)):
        os.rename(_old(target), target)  # a save that stopped between its renames: keep the previous one
    _make_parents(target)
    _remove(_tmp_dir(target))


def _save_sharded(backend: Any, obj: Mapping[str, Any], path: str, *, background: bool) -> PendingSave | None:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    target = os.path.abspath(path)
    modules, optimizers = _entries(obj, "module"), _entries(obj, "optimizer")
    plain = {k: v for k, v in obj.items() if _kind(v) == "plain"}
    pairs = _pair(optimizers, modules, "ap.save")
    rank, world = backend.rank(), backend.world_size()
    tmp = _tmp_dir(target)
    agree = _backend_agree(backend)
    failure = _numpy_problem("ap.save", rank) if world > 1 else None
    if rank == 0 and failure is None:
        try:
            _prepare_target(target, "ap.save")
            os.makedirs(tmp)
            manifest = {"format": FORMAT, "version": 1, "world_size": world, "torch": torch.__version__,
                        "modules": sorted(modules), "optimizers": pairs, "plain": sorted(plain)}
            buffer = io.BytesIO()
            torch.save(tree_map_tensors(plain, _host_copy), buffer)
            for name, data in ((PLAIN, buffer.getvalue()), (MANIFEST, json.dumps(manifest, indent=1).encode())):
                with open(os.path.join(tmp, name), "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
        except Exception as exc:  # noqa: BLE001 - whatever stops rank 0 must reach the others, not strand them
            failure = _start_error(exc, path)
    # Every rank learns whether every rank could start, so none is left waiting in a collective.
    agree(failure)
    state: dict[str, Any] = {k: get_model_state_dict(m) for k, m in modules.items()}
    for key, opt in optimizers.items():
        state[key] = get_optimizer_state_dict(modules[pairs[key]], opt)
    if background:
        import torch.distributed as dist

        from accelport.sharding import registry

        shards = registry(backend)
        if shards.checkpoint_group is None:
            # Its own group: the save's collectives run in a thread while training uses the default one.
            shards.checkpoint_group = dist.new_group(backend="gloo")
        group = shards.checkpoint_group
        response = dcp.async_save(state, checkpoint_id=tmp, process_group=group)
        future = getattr(response, "upload_completion", response)
        pending = PendingSave(path, future, agree=lambda failure: _agree(
            rank, world, failure, lambda t: dist.all_reduce(t, group=group), "cpu"))
        pending._publish_when_done((lambda: _publish(tmp, target)) if rank == 0 else None)
        shards.pending = pending
        _wait_at_exit(pending)
        return pending
    try:
        dcp.save(state, checkpoint_id=tmp)
    except (Exception, CheckpointException) as exc:  # CheckpointException is a BaseException
        # DCP raises on every rank when one failed: all stop here together.
        raise CheckpointError(f"ap.save: writing the checkpoint at {path!r} failed ({_describe(exc)}); the "
                              "previous checkpoint there is untouched") from exc
    # dcp.save returns on every rank only after rank 0 wrote .metadata: every shard is in place.
    failure = None
    if rank == 0:
        try:
            _publish(tmp, target)
        except Exception as exc:  # noqa: BLE001 - reaches every rank, as at the start
            failure = CheckpointError(f"ap.save: the checkpoint written to {tmp!r} could not be renamed onto "
                                      f"{path!r} ({_describe(exc)})")
            failure.__cause__ = exc
    agree(failure)
    return None


_AT_EXIT: list[PendingSave] = []


def _wait_at_exit(pending: PendingSave) -> None:
    if not _AT_EXIT:
        import atexit

        atexit.register(_drain)
    _AT_EXIT[:] = [p for p in _AT_EXIT if not p.done()] + [pending]


def _drain() -> None:
    # At exit no barrier: a peer that already failed would never reach it.
    for pending in _AT_EXIT:
        try:
            pending.wait(barrier=False)
        except Exception:  # noqa: BLE001 - the interpreter is going away; the error was the save's own
            pass


class _Mismatch(ValueError):
    """Raised in DCP's planning step when the checkpoint and the objects given differ (picklable: it
    travels to rank 0 with DCP's other failures)."""


def _exact_planner() -> Any:
    """DCP's default load planner, also refusing saved values that the objects given lack.

    DCP reads only what the objects ask for: a checkpoint of a 3-block model loads
    into a 2-block one without a word. Here every saved value under a top-level
    entry being restored must have a place, and the missing values and other shapes
    DCP refuses are all named, not just the first.
    """
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    class ExactLoadPlanner(DefaultLoadPlanner):
        def create_local_plan(self) -> Any:
            saved = self.metadata.state_dict_metadata if self.metadata is not None else {}
            try:
                plan = super().create_local_plan()
            except (RuntimeError, ValueError) as exc:  # DCP's "Missing key", "Size mismatch"
                raise _Mismatch(self._differences(saved) or _first_line(exc)) from exc
            if self._extra(saved):
                raise _Mismatch(self._differences(saved))
            return plan

        def _extra(self, saved: Mapping[str, Any]) -> list[str]:
            entries = set(self.original_state_dict)
            paths = getattr(self.metadata, "planner_data", None) or {}

            def entry(key: str) -> Any:
                path = paths.get(key)
                return path[0] if path else key.split(".", 1)[0]

            return sorted(k for k in saved if k not in self.state_dict and entry(k) in entries)

        def _differences(self, saved: Mapping[str, Any]) -> str:
            extra = self._extra(saved)
            missing = sorted(k for k in self.state_dict if k not in saved)
            shapes = sorted((k, tuple(saved[k].size), tuple(v.size())) for k, v in self.state_dict.items()
                            if k in saved and isinstance(saved[k], TensorStorageMetadata)
                            and callable(getattr(v, "size", None)) and tuple(saved[k].size) != tuple(v.size()))
            parts = []
            if extra:
                parts.append(f"{len(extra)} saved value(s) that the objects given have no place for, such as "
                             f"{extra[0]!r}")
            if missing:
                parts.append(f"{len(missing)} value(s) of the objects given that it lacks, such as {missing[0]!r}")
            if shapes:
                key, was, now = shapes[0]
                parts.append(f"{len(shapes)} value(s) of another shape, such as {key!r}: saved {was}, here {now}")
            return "; ".join(parts)

    return ExactLoadPlanner()


def _load_sharded(backend: Any, target: str, manifest: Mapping[str, Any], map_location: Any, *,
                  weights_only: bool, into: Mapping[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    modules, optimizers = _entries(into, "module"), _entries(into, "optimizer")
    missing = [k for k in modules if k not in manifest.get("modules", [])] + \
        [k for k in optimizers if k not in manifest.get("optimizers", {})]
    if missing:
        raise CheckpointError(
            f"ap.load: {target!r} has no module or optimizer {', '.join(map(repr, missing))}; it holds modules "
            f"{manifest.get('modules')}, optimizers {list(manifest.get('optimizers', {}))} and values "
            f"{manifest.get('plain')}")
    pairs = _pair(optimizers, modules, "ap.load")
    alone = not (dist.is_available() and dist.is_initialized())  # a checkpoint of N ranks read by one process
    # Everything that can fail on one rank alone comes before DCP's collectives, and the
    # plain values before anything is restored in place: a failure leaves the objects as they were.
    failure = None if alone else _numpy_problem("ap.load", backend.rank())
    plain: Any = None
    if failure is None:
        try:
            _check_files(target)
            plain = _load_plain(target, weights_only)
        except CheckpointError as exc:
            failure = exc
    if alone:
        if failure is not None:
            raise failure
    else:
        _backend_agree(backend)(failure)
    state: dict[str, Any] = {k: get_model_state_dict(m) for k, m in modules.items()}
    for key, opt in optimizers.items():
        state[key] = get_optimizer_state_dict(modules[pairs[key]], opt)
    try:
        dcp.load(state, checkpoint_id=target, no_dist=alone, planner=_exact_planner())
    except (Exception, CheckpointException) as exc:  # CheckpointException is a BaseException
        # DCP gathers every rank's failure and raises on all of them: every rank says the same.
        mismatch = _mismatch_in(exc)
        if mismatch is not None:
            raise CheckpointError(f"ap.load: {target!r} does not fit the objects given in into= ({mismatch}): "
                                  "build them as they were when saved (the same classes and sizes)") from exc
        raise CheckpointError(f"ap.load: {target!r} is damaged or incomplete: its files do not hold what its "
                              f".metadata lists ({_describe(exc)}). Restore the directory from a copy, or "
                              "load an earlier checkpoint") from exc
    for key, module in modules.items():
        set_model_state_dict(module, state[key])
    for key, opt in optimizers.items():
        set_optimizer_state_dict(modules[pairs[key]], opt, state[key])
    return tree_map_tensors(plain, lambda t: t.to(map_location))


def _mismatch_in(exc: BaseException) -> str | None:
    """The text of a :class:`_Mismatch` raised on any rank inside ``exc``, or None."""
    if isinstance(exc, _Mismatch):
        return str(exc)
    return next((str(inner) for _, inner in _rank_errors(exc) if isinstance(inner, _Mismatch)), None)


def _check_files(target: str) -> None:
    """Refuse a checkpoint directory whose shard files are missing or shorter than its ``.metadata`` says.

    DCP's metadata records where each saved value lies (file, offset, length), and
    no checksum: a file cut short is found here, even in parts this load would not
    read, but a changed byte inside a value is not (see docs/distributed.md).
    """
    from torch.distributed.checkpoint import FileSystemReader

    try:
        metadata = FileSystemReader(target).read_metadata()
    except Exception as exc:  # noqa: BLE001 - missing, cut short, not a pickle
        raise CheckpointError(f"ap.load: {target!r} is damaged or incomplete: its .metadata cannot be read "
                              f"({type(exc).__name__}: {_first_line(exc)}). Restore the directory from a copy, or "
                              "load an earlier checkpoint") from exc
    needed: dict[str, int] = {}
    for info in (getattr(metadata, "storage_data", None) or {}).values():
        name, end = getattr(info, "relative_path", None), getattr(info, "offset", 0) + getattr(info, "length", 0)
        if isinstance(name, str):
            needed[name] = max(needed.get(name, 0), end)
    for name, end in sorted(needed.items()):
        try:
            size = os.path.getsize(os.path.join(target, name))
        except OSError:
            size = None
        if size is None or size < end:
            held = "is missing" if size is None else f"holds {size} bytes"
            raise CheckpointError(f"ap.load: {target!r} is damaged or incomplete: {name} {held}, but its .metadata "
                                  f"places data up to byte {end}. Restore the directory from a copy, or load an "
                                  "earlier checkpoint")


def _load_plain(target: str, weights_only: bool) -> Any:
    """The plain values of a checkpoint directory (``plain.pt``, which every save writes)."""
    path = os.path.join(target, PLAIN)
    if not os.path.isfile(path):
        raise CheckpointError(f"ap.load: {target!r} is incomplete: it has no {PLAIN} (the plain values, which "
                              "rank 0 writes with every save). Restore the directory from a copy, or load an "
                              "earlier checkpoint")
    try:
        return load_file(path, "cpu", weights_only=weights_only)
    except AccelportError as exc:
        raise CheckpointError(f"ap.load: {target!r}: {str(exc).removeprefix('ap.load: ')}") from exc


def _restore_from_file(path: str, loaded: Any, into: Mapping[str, Any]) -> dict[str, Any]:
    """``into``'s modules and optimizers from a single-file checkpoint; the rest is returned."""
    if not isinstance(loaded, Mapping):
        raise CheckpointError(f"ap.load: {path!r} holds a {type(loaded).__name__}, not a dict of named "
                              "entries; load it without into= ")
    modules, optimizers = _entries(into, "module"), _entries(into, "optimizer")
    missing = [k for k in list(modules) + list(optimizers) if k not in loaded]
    if missing:
        raise CheckpointError(f"ap.load: {path!r} has no entry {', '.join(map(repr, missing))}; "
                              f"it holds {', '.join(map(repr, loaded))}")
    sharded = {k for k, m in modules.items() if _fsdp2_sharded(m)}
    pairs = _pair({k: o for k, o in optimizers.items()}, modules, "ap.load") if sharded else {}
    for key, module in modules.items():
        differences = _key_differences(module, loaded[key])
        if differences:
            raise CheckpointError(f"ap.load: {path!r} does not fit the objects given in into= ({key!r}: "
                                  f"{differences}): build the model as it was when saved (the same classes and sizes)")
    try:
        for key, module in modules.items():
            _load_module(module, loaded[key], sharded=key in sharded)
        for key, opt in optimizers.items():
            if pairs.get(key) in sharded:
                _load_sharded_optimizer(modules[pairs[key]], opt, loaded[key])
            else:
                opt.load_state_dict(loaded[key])
    except (RuntimeError, ValueError, KeyError) as exc:
        raise CheckpointError(f"ap.load: {path!r} does not fit the objects given in into= "
                              f"({type(exc).__name__}: {_first_line(exc)})") from exc
    return {k: v for k, v in loaded.items() if k not in modules and k not in optimizers}


def _key_differences(module: Any, state: Any) -> str:
    """The keys a module lacks and those its state dict has that ``state`` lacks, as one clause ("" if none)."""
    if not isinstance(state, Mapping):
        return f"the saved entry is a {type(state).__name__}, not a state dict"
    expected = {_strip(k) for k in module.state_dict()}
    saved = {_strip(str(k)) for k in state}
    missing, unexpected = sorted(expected - saved), sorted(saved - expected)

    def some(keys: list[str]) -> str:
        shown = ", ".join(map(repr, keys[:5]))
        return shown + (f" and {len(keys) - 5} more" if len(keys) > 5 else "")

    parts = []
    if missing:
        parts.append(f"{len(missing)} missing key(s): {some(missing)}")
    if unexpected:
        parts.append(f"{len(unexpected)} unexpected key(s): {some(unexpected)}")
    return "; ".join(parts)


def _load_module(module: Any, state: Mapping[str, Any], *, sharded: bool) -> None:
    if sharded:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        # Every rank holds the whole file; each keeps its own shard of every tensor.
        set_model_state_dict(module, dict(state), options=StateDictOptions(full_state_dict=True))
        return
    names = {_strip(k): k for k in module.state_dict()}
    if any(k != v for k, v in names.items()):
        state = {names.get(k, k): v for k, v in state.items()}
    module.load_state_dict(state)


def _load_sharded_optimizer(model: Any, opt: Any, native: Mapping[str, Any]) -> None:
    """A ``torch.optim`` state dict (parameters by position) into the optimizer of a sharded model."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    params = [p for g in opt.param_groups for p in g["params"]]
    fqn = {id(p): name for name, p in model.named_parameters()}
    name = [fqn[id(p)] for p in params]
    converted: dict[str, Any] = {
        "state": {name[int(i)]: dict(s) for i, s in native["state"].items()},
        "param_groups": [{**g, "params": [name[int(i)] for i in g["params"]]} for g in native["param_groups"]],
    }
    set_optimizer_state_dict(model, opt, converted, options=StateDictOptions(full_state_dict=True))


# -- single files --------------------------------------------------------------------------------


def save_file(obj: Any, path: str | os.PathLike[str], *, rank: int) -> None:
    """Write ``obj`` to ``path`` from the main process only, atomically.

    Call it from every process or from the main one only: the others return at
    once (there is no barrier, so ``if ap.is_main_process(): ap.save(...)`` cannot
    hang). Tensors are copied to the host first. The bytes go to a temporary file
    in the same directory, are flushed and fsynced, then renamed over ``path``: a
    crash or SIGKILL mid-write leaves the previous checkpoint intact. A checkpoint
    directory at ``path`` (written sharded) is replaced the same way.
    """
    target = os.fspath(path)
    replaces_directory = os.path.isdir(target) and _manifest(target) is not None
    if os.path.isdir(target) and not replaces_directory:
        raise AccelportError(f"ap.save: {target!r} is a directory; give a file path such as "
                             f"{os.path.join(target, 'checkpoint.pt')!r}")
    if rank != 0:
        return
    import torch

    host = tree_map_tensors(obj, _host_copy)
    if replaces_directory:
        target = os.path.abspath(target)
        old = _old(target)
        _remove(old)
        os.rename(target, old)  # until the file is in place, ap.load reads the previous checkpoint here
        atomic_torch_save(torch, host, target)
        _remove(old)
        return
    atomic_torch_save(torch, host, target)


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


def _make_parents(path: str) -> None:
    """Create the missing directories above ``path``, or say which part of it is in the way."""
    directory = os.path.dirname(path)
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as exc:
        blocker = directory
        while blocker and not os.path.lexists(blocker):
            blocker = os.path.dirname(blocker)
        if os.path.islink(blocker) and not os.path.exists(blocker):
            why = f"{blocker!r} is a symlink to {os.readlink(blocker)!r}, which does not exist"
        elif os.path.lexists(blocker) and not os.path.isdir(blocker):
            why = f"{blocker!r} is a file, not a directory"
        else:
            why = f"{exc.strerror or _first_line(exc)} ({exc.filename or directory!r})"
        raise CheckpointError(f"ap.save: cannot create the directory of {path!r}: {why}; give a path whose "
                              "every part is a directory this process can write") from exc


def atomic_torch_save(torch: Any, obj: Any, path: str) -> None:
    """torch.save beside ``path``, then renamed over it (:mod:`accelport.safe_io`): readers never see a
    half-written file.

    A writer killed mid-save leaves the previous file at ``path`` untouched and a
    hidden ``.<name>.<host>.<pid>.*.tmp`` beside it; the next save on the same host
    removes such orphans (before it writes, so their space is free again). A symlink
    at ``path`` is written through: the file it points at is replaced. The file gets
    the mode of the one it replaces, or the umask's for a new one.
    """
    given = os.path.abspath(path)
    _make_parents(given)
    path = os.path.realpath(given)
    directory = os.path.dirname(path)
    if not os.path.isdir(directory):
        # Only the path as written gets its missing directories, never a place a symlink points at.
        raise CheckpointError(f"ap.save: {given!r} is a symlink to {path!r}, whose directory {directory!r} does "
                              "not exist; create that directory, or remove the link to save at its place")
    remove_orphans(path)
    tmp = temp_beside(path)
    try:
        with os.fdopen(os.open(tmp, os.O_WRONLY | getattr(os, "O_NOFOLLOW", 0)), "wb") as f:
            torch.save(obj, f)
        replace_with(tmp, path)
    except BaseException as exc:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        full = _no_space(directory, exc) if isinstance(exc, Exception) else None
        if full is not None:
            raise full from exc
        raise
