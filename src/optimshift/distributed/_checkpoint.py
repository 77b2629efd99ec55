"""Sharded model + optimizer checkpoints on ``torch.distributed.checkpoint`` (DCP), plus rank 0's note; N ranks save,
M (or one) load. Every rank checks before anything changes and the ranks exchange errors (:func:`_agree`): none
waits in a collective. A save writes ``<path>.optimshift-tmp-<id>``, which rank 0 commits (``_atomic.commit_folder``;
:func:`load` finds the ``<path>.optimshift-old`` a crash between two renames left)."""

from __future__ import annotations

import builtins
import contextlib
import io
import json
import math
import os
import shutil
import uuid
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

# NOTE: torch.distributed.checkpoint has no __all__: save, load and FileSystemReader/Writer are re-exported
# implicitly, which torch's typing does not declare (hence the attr-defined ignores on dcp.* below).
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    _get_fqns,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

from .._devices import DeviceLike, current_accelerator, resolve
from .._errors import add_note, dtype_name, with_article
from .._plan import check_optimizer, optimizer_name
from .._probe import quiet_global_step_hooks, step_needs
from .._streaming import is_streamed
from .._version import __version__
from ..api import move, wait
from ..checkpoint._atomic import commit_folder, make_folder, sweep_folders
from ..checkpoint._files import PathLike, file_path
from ..checkpoint._resume import streamed_elsewhere
from ..checkpoint._staging import pair_places

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import STORAGE_TYPES

__all__ = ["save", "load", "describe_dcp"]

_NOTE = "optimshift.json"  # rank 0's note in the checkpoint directory; DCP ignores files it did not write
_TMP = ".optimshift-tmp"
_OLD = ".optimshift-old"
_EXTRA = "optimshift_extra"
_FORMAT = 1
_SHOWN = 8  # differences listed in a mismatch error before "... and N more"
# NOTE: DCP's own error is a BaseException, not an Exception: caught with the others, or a rank that met it
# would skip _agree and leave the others waiting in a collective until the process group times out.
_FAILURES = (Exception, CheckpointException)


# --- public API -----------------------------------------------------------------------------------------


def save(
    path: PathLike, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, extra: Mapping[str, Any] | None = None
) -> None:
    """Save ``model`` and ``optimizer`` on every rank (or one process) as a DCP directory, swapped in atomically
    so a crash never leaves ``path`` half-written; values bitwise, devices not kept (:func:`load` re-derives them).

    ``extra`` (rank 0's): small data such as epoch or RNG state (tensors, numbers, strings, lists/dicts of them).
    """
    rank, world = _rank_world()
    target = None
    blob: bytes | None = None
    # phase 1: local checks only, no torch.distributed call; rank 0's token names this save's temporary directory
    with _Agreed("save", path, share=uuid.uuid4().hex) as token:
        target = _as_path(path, "save")
        _check_module(model)
        check_optimizer(optimizer)
        _check_owned(model, optimizer)
        if extra is not None:
            blob = _pack_extra(extra)
        _check_replaceable(target)
    assert target is not None
    tmp = _sibling(target, f"{_TMP}-{token.share}")  # one per save: concurrent saves to one path never share it

    # phase 2: rank 0 clears crashed saves' temporary directories and creates this save's, locked until the save
    # ends; every rank builds its state dict (a never-stepped optimizer is saved, and left, without state).
    state: dict[str, Any] = {}
    had_state = bool(optimizer.state)
    lock: int | None = None
    try:
        with _Agreed("save", path), _undone_on_failure(optimizer):
            if rank == 0:
                _clear_stale(target)
                tmp.parent.mkdir(parents=True, exist_ok=True)
                lock = make_folder(tmp)
            wait(optimizer)  # a non-blocking offload/reload still in flight: the writers read its bytes on the host
            with _initializing(optimizer):  # DCP steps a stateless optimizer once (zero lr) to create its state
                model_sd, optim_sd = get_state_dict(model, optimizer)
            if not had_state:
                optimizer.state.clear()
                optim_sd = {"state": {}, "param_groups": optim_sd["param_groups"]}
            state = {"model": model_sd, "optim": optim_sd}
            if rank == 0 and blob is not None:
                state[_EXTRA] = blob
        # phase 3: DCP writes every rank's shards; rank 0 writes the metadata once all ranks have finished
        # (DCP gathers their write results first), so when dcp.save returns on rank 0 the directory is complete.
        with _single_process_quiet(world):
            try:
                dcp.save(  # type: ignore[attr-defined]  # re-exported without being declared
                    state,
                    storage_writer=dcp.FileSystemWriter(str(tmp), **_writer_options()),  # type: ignore[attr-defined]
                    no_dist=world == 1,
                )
            except CheckpointException as e:  # (every rank gets it: DCP gathers the ranks' write results)
                raise _write_failure(e, path, rank) from e
        # phase 4: rank 0 commits; every rank learns the outcome (so none returns before the commit is done).
        note = {
            "format": _FORMAT,
            "optimshift": __version__,
            "torch": torch.__version__,
            "world_size": world,
            "model": type(model).__name__,
            "optimizer": optimizer_name(optimizer),
            "optimizer_state": had_state,
            "extra": None if extra is None else sorted(str(k) for k in extra),
        }
        _agree(_finish(tmp, target, lock, note) if rank == 0 else None, "save", path)
    except BaseException:  # (a Ctrl-C too: nothing left behind; after a commit there is nothing at tmp)
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        if lock is not None:
            os.close(lock)


def _write_failure(error: CheckpointException, path: Any, rank: int) -> BaseException:
    """What a save raises for DCP's error while writing (a BaseException naming no file: a user's ``except
    Exception`` missed a full disk); a Ctrl-C on this rank, which DCP wrapped, stays one."""
    own = _interrupt_in(error, rank)
    if own is not None:
        return own
    causes = "; ".join(f"rank {r}: {type(e).__name__}: {e}" for r, (e, _) in sorted(error.failures.items()))
    return RuntimeError(
        f"{_call('save', path)} failed while writing the checkpoint ({causes}); nothing was committed: "
        f"{os.fsdecode(path)} is as it was"
    )


def _interrupt_in(error: BaseException, rank: int) -> BaseException | None:
    """The Ctrl-C (no ``Exception``) DCP wrapped in its error on this rank, if any: raised as itself."""
    own = error.failures.get(rank) if isinstance(error, CheckpointException) else None
    return own[0] if own is not None and not isinstance(own[0], Exception) else None


def _finish(tmp: Path, target: Path, lock: int | None, note: dict[str, Any]) -> BaseException | None:
    """Rank 0: check ``tmp`` is this save's complete checkpoint, write the note, commit; the error that kept it
    from committing (``save`` then removes ``tmp``)."""
    try:
        _write_note(tmp, note)
        _check_complete(tmp, lock)
        commit_folder(tmp, target, _sibling(target, _OLD), replaceable=lambda t: _is_checkpoint(Path(t)))
    except _FAILURES as e:
        return e
    return None


def load(
    path: PathLike, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, device: DeviceLike | None = None
) -> dict[str, Any] | None:
    """Load a :func:`save` checkpoint with any number of ranks (DCP reshards), values bitwise; the optimizer state
    ends where a fresh optimizer over the params on ``device`` (default: each param's device) keeps it.

    Returns the saved ``extra`` (tensors on the host) or None. A mismatch raises on every rank before anything
    changes; an I/O error while reading may leave the model partly loaded.
    """
    target: Path | None = None
    layout: _Layout | None = None
    where: torch.device | None = None
    with _Agreed("load", path):  # phase 1: arguments and the checkpoint's metadata, local only
        _check_module(model)
        check_optimizer(optimizer)
        target = _committed(_as_path(path, "load"))
        if device is not None:
            where = resolve(device, tensors=[p for g in optimizer.param_groups for p in g["params"]])
            if is_streamed(optimizer) and where.type != "cpu":
                raise streamed_elsewhere(optimizer_name(optimizer), where)
        layout = _Layout.read(target)
        _check_owned(model, optimizer)
    assert target is not None and layout is not None

    # phase 2: compare the model and the optimizer's param groups with the checkpoint (nothing changes)
    with _Agreed("load", path):
        problems = _compare_model(get_model_state_dict(model), layout)
        # which params each group holds is compared by parameter name: only once the model's names match
        problems += _compare_groups(optimizer, layout, None if problems else model)
        if (
            layout.has_state
            and not optimizer.state
            and any(p.grad is not None for g in optimizer.param_groups for p in g["params"])
        ):
            problems.append(
                "the optimizer has no state yet but its params have gradients, so torch.distributed.checkpoint "
                "cannot initialize it; call optimizer.zero_grad(set_to_none=True) before load"
            )
        _raise_mismatch(problems, layout, model, optimizer)

    # phase 3: DCP's state dicts (its zero-lr initializing step undone if anything fails, a Ctrl-C too), compared
    # with the checkpoint's; params the checkpoint holds no state for end without state, as they were saved.
    live = optimizer.param_groups
    kept: list[dict[str, Any]] = []
    apart: list[tuple[dict[str, Any], str, int | None, torch.Tensor, Any]] = []
    state: dict[str, Any] = {}
    optim_sd: Any
    with _undone_on_failure(optimizer):
        with _Agreed("load", path):
            with _initializing(optimizer):  # DCP steps a stateless optimizer once (zero lr) to create its state
                model_sd, optim_sd = get_state_dict(model, optimizer)
            problems, stateless = _compare_state(optim_sd, layout, model)
            _raise_mismatch(problems, layout, model, optimizer)
            # Keys only the live groups have (an LR scheduler built before the load adds initial_lr): DCP would
            # look for them in the checkpoint and fail part-way; left out of the load, they keep their live values.
            kept = [{k: g[k] for k in g if k not in layout.groups.get(gi, ())} for gi, g in enumerate(live)]
            groups = [{k: v for k, v in g.items() if k not in mine} for g, mine in zip(optim_sd["param_groups"], kept)]
            for gi, group in enumerate(groups):  # (a hyperparameter saved in another kind than the live one's:
                # DCP refused it part-way; it is read into one of the saved kind, as torch's load_state_dict installs
                # the saved one)
                for key, value in group.items():
                    group[key] = _as_saved(value, layout, gi, key)
            apart = _read_apart(groups)
            stepped = {n: v for n, v in optim_sd["state"].items() if n not in stateless}
            state = {"model": model_sd, "optim": {"state": stepped, "param_groups": groups}}

        # phase 4: DCP reads into the live tensors; every check that can fail has run. An error from here on
        # (an I/O error) may leave the model and optimizer partly loaded, and says so.
        if layout.has_extra:
            state[_EXTRA] = b""  # a placeholder: DCP puts the saved object in its place
        rank, world = _rank_world()
        try:
            with _single_process_quiet(world):
                dcp.load(state, storage_reader=dcp.FileSystemReader(str(target)), no_dist=world == 1)  # type: ignore[attr-defined]
            for group, key, i, first, own in apart:  # (one value read into both: one object again, as it was)
                holder: Any = group if i is None else group[key]  # (DCP rebuilt the lists)
                at: Any = key if i is None else i
                if holder[at] is own and _same_bits(first, own):
                    holder[at] = first
            set_state_dict(
                model,
                optimizer,
                model_state_dict=state["model"],
                optim_state_dict=state["optim"],
                options=StateDictOptions(strict=False),
            )  # strict: refuses params without saved state
            if not layout.has_state:
                optimizer.state.clear()
            for group, mine in zip(optimizer.param_groups, kept):
                group.update(mine)
            _keep_group_tensors(live, optimizer.param_groups)
            if not is_streamed(optimizer):  # (a streamed optimizer's load put its state where streaming keeps it)
                move(optimizer, where)  # fresh-optimizer placement: e.g. Adam's step back on the host
            if not layout.has_extra:
                return None
            extra: dict[str, Any] = torch.load(io.BytesIO(state[_EXTRA]), map_location="cpu", weights_only=True)
            return extra
        except _FAILURES as e:  # (a Ctrl-C stays one)
            interrupt = _interrupt_in(e, rank)
            if interrupt is not None:  # (one DCP wrapped in its error while reading)
                raise interrupt from e
            raise RuntimeError(
                f"optimshift.distributed.load({os.fspath(target)}) failed after it began writing the checkpoint "
                f"into the model and optimizer, which may now be partly loaded (reload them, or load again): "
                f"{type(e).__name__}: {e}"
            ) from e


def _as_saved(value: Any, layout: _Layout, gi: int, key: str) -> Any:
    """What DCP reads group ``gi``'s saved ``key`` into: ``value`` where it is of the saved kind, else one that is
    (a list where DCP stored one element by element, a tuple where it stored it whole)."""
    meta = layout.group_tensors.get((gi, key))
    if meta is not None:
        return _like(value, meta)
    items = layout.group_lists.get((gi, key))
    if items is None:  # (stored whole)
        return tuple(value) if _by_element(value) else value
    if isinstance(value, Mapping):
        return value
    at = value if isinstance(value, (list, tuple)) else ()
    return [_like(at[i] if i < len(at) else None, meta) for i, meta in sorted(items.items())]


def _by_element(value: Any) -> bool:
    """Whether DCP reads ``value`` element by element: a list holding a tensor, a mapping or such a list."""
    return isinstance(value, list) and any(isinstance(v, (torch.Tensor, Mapping)) or _by_element(v) for v in value)


def _like(value: Any, meta: Any) -> Any:
    """``value`` where DCP can read the saved ``meta`` into it, else a tensor of the saved shape and dtype on
    ``value``'s side."""
    if not isinstance(meta, TensorStorageMetadata) or not _compare_value("", value, meta):
        return value  # (an object: DCP puts the saved one in its place)
    side = value.device if isinstance(value, torch.Tensor) else None  # (the side it was given on)
    return torch.empty(_shape(meta.size), dtype=meta.properties.dtype, device=side)


def _keep_group_tensors(live: list[dict[str, Any]], loaded: list[dict[str, Any]]) -> None:
    """torch's ``load_state_dict`` deep-copied each tensor hyperparameter (a tensor ``lr`` a captured step reads at
    its address): the live one takes the loaded value and its place back, paired as a load's commit pairs them."""
    pairs, places = pair_places(zip(live, loaded), _fits)
    for (old, new), where in zip(pairs, places):
        with torch.no_grad():
            old.copy_(new)
        for holder, key in where:
            holder[key] = old


def _read_apart(groups: list[dict[str, Any]]) -> list[tuple[dict[str, Any], str, int | None, torch.Tensor, Any]]:
    """A live tensor at two places (two groups' ``lr``) would keep the last value DCP reads into it: each place after
    its first gets its own, listed as (group, key, list index or None, live, own)."""
    seen: set[int] = set()
    apart: list[tuple[dict[str, Any], str, int | None, torch.Tensor, Any]] = []
    for group in groups:
        for key, value in list(group.items()):
            listed = type(value) is list and key != "params"
            for i, t in enumerate(value) if listed else [(None, value)]:
                if not isinstance(t, torch.Tensor):
                    continue
                if id(t) not in seen:
                    seen.add(id(t))
                    continue
                if i is None:
                    group[key] = torch.empty_like(t)
                else:
                    if group[key] is value:  # (a copy of the list: the live one is left as it is)
                        group[key] = list(value)
                    group[key][i] = torch.empty_like(t)
                apart.append((group, key, i, t, group[key] if i is None else group[key][i]))
    return apart


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def _fits(old: torch.Tensor, new: torch.Tensor) -> bool:
    """Whether the live tensor ``old`` can take the loaded ``new``'s value in place."""
    return type(new) is type(old) and new.shape == old.shape and new.dtype == old.dtype


def describe_dcp(path: PathLike) -> dict[str, Any]:
    """What a DCP checkpoint directory holds (keys, global shapes, dtypes, bytes), for ``optimshift inspect``:
    read from its metadata alone, so it needs no process group and loads no tensor. JSON-serializable.

    Keys: ``path``, ``format``, ``entries`` (``key``, ``path``, ``kind`` "tensor"/"object", and for tensors
    global ``shape``, ``dtype``, ``bytes``, ``chunks``), ``sections`` (per top-level key: ``tensors``,
    ``objects``, ``bytes``), ``tensors``, ``objects``, ``tensor_bytes``, ``files``, ``disk_bytes``,
    ``incomplete`` (the files its metadata names that are missing or cut short: :func:`load` refuses it) and
    ``optimshift`` (the note :func:`save` writes, or None for a checkpoint saved otherwise).
    """
    target = _committed(_as_path(path, "describe_dcp"))
    metadata = _read_metadata(target)
    paths = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
    entries: list[dict[str, Any]] = []
    sections: dict[str, dict[str, int]] = {}
    for key in sorted(metadata.state_dict_metadata):
        meta = metadata.state_dict_metadata[key]
        steps = [s if isinstance(s, (str, int)) else str(s) for s in paths.get(key, (key,))]
        section = sections.setdefault(str(steps[0]), {"tensors": 0, "objects": 0, "bytes": 0})
        entry: dict[str, Any] = {"key": key, "path": steps}
        if isinstance(meta, TensorStorageMetadata):
            dtype = meta.properties.dtype
            nbytes = math.prod(meta.size) * dtype.itemsize
            entry.update(
                kind="tensor", shape=list(meta.size), dtype=dtype_name(dtype), bytes=nbytes, chunks=len(meta.chunks)
            )
            section["tensors"] += 1
            section["bytes"] += nbytes
        else:
            entry["kind"] = "object"
            section["objects"] += 1
        entries.append(entry)
    files = [f for f in target.iterdir() if f.is_file()]
    tensors = [e for e in entries if e["kind"] == "tensor"]
    return {
        "path": str(target),
        "format": "torch.distributed.checkpoint",
        "entries": entries,
        "sections": sections,
        "tensors": len(tensors),
        "objects": len(entries) - len(tensors),
        "tensor_bytes": sum(e["bytes"] for e in tensors),
        "files": len(files),
        "disk_bytes": sum(f.stat().st_size for f in files),
        "incomplete": _short_files(target, metadata),
        "optimshift": _read_note(target),
    }


# --- ranks ----------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _initializing(optimizer: Any) -> Iterator[None]:
    """Around DCP's ``get_state_dict``, which steps a stateless optimizer once at zero ``lr``: no user step hook
    fires, and each group's ``lr`` is its own again afterwards, also where that step raised."""
    stateless = not optimizer.state
    lrs = [(group, group["lr"]) for group in optimizer.param_groups if "lr" in group]
    # (the user's hooks only: optimshift's own, which refuse a step over offloaded or streamed state and order
    # it after a transfer in flight, stay)
    tables = [getattr(optimizer, f"_optimizer_step_{when}_hooks", None) for when in ("pre", "post")]
    own = [(table, dict(table)) for table in tables if table]
    for table, hooks in own:
        for key, hook in hooks.items():
            if not _optimshifts(hook):
                del table[key]
    try:
        with quiet_global_step_hooks():
            yield
    except Exception as error:
        if stateless:
            add_note(
                error,
                f"optimshift: {optimizer_name(optimizer)} never stepped; DCP builds its state by stepping it once "
                f"with lr 0 and no closure, which its step refused: save it after its first step",
            )
        raise
    finally:
        for table, hooks in own:  # (in their order, then any registered meanwhile)
            added = {key: hook for key, hook in table.items() if key not in hooks}
            table.clear()
            table.update(hooks)
            table.update(added)
        for group, lr in lrs:
            group["lr"] = lr


def _optimshifts(hook: Any) -> bool:
    """Whether a step hook is one optimshift put on the optimizer."""
    module = getattr(getattr(hook, "__func__", hook), "__module__", None) or ""
    return module == "optimshift" or module.startswith("optimshift.")


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


@contextlib.contextmanager
def _single_process_quiet(world: int) -> Iterator[None]:
    """Without a process group DCP warns that it assumes a single process: here that is the documented mode."""
    with warnings.catch_warnings():
        if world == 1:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


class _Agreed:
    """A step every rank takes: its error (one of :data:`_FAILURES`) raised on every rank at its end (:func:`_agree`),
    else ``share`` is rank 0's. A class: a generator turns the StopIteration _agree may raise into a RuntimeError."""

    def __init__(self, what: str, path: Any, share: Any = None) -> None:
        self.what, self.path, self.share = what, path, share

    def __enter__(self) -> _Agreed:
        return self

    def __exit__(self, kind: Any, error: BaseException | None, tb: Any) -> None:
        if error is None or isinstance(error, _FAILURES):  # (a Ctrl-C goes on as itself)
            self.share = _agree(error, self.what, self.path, self.share)


def _agree(error: BaseException | None, what: str, path: Any, share: Any = None) -> Any:
    """Raise on every rank if any failed, with each failing rank's message (none must wait in DCP's collectives for
    one that raised); else rank 0's ``share`` (small, picklable)."""
    world = _rank_world()[1]
    if world == 1:
        if isinstance(error, CheckpointException):  # (not an Exception: a user's `except Exception` missed it)
            raise RuntimeError(f"{_call(what, path)}: {error}") from error
        if error is not None:
            raise error
        return share
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, (None if error is None else (type(error).__name__, str(error)), share))
    failed = [(r, e) for r, (e, _) in enumerate(gathered) if e is not None]
    if not failed:
        return gathered[0][1]
    messages: dict[str, list[int]] = {}
    for r, (_, message) in failed:
        messages.setdefault(message, []).append(r)
    if len(messages) == 1:
        ((message, ranks),) = messages.items()
        text = f"{message} (on rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} of {world})"
    else:
        text = "; ".join(f"rank {', '.join(map(str, rs))}: {m}" for m, rs in messages.items())
    kind = getattr(builtins, failed[0][1][0], None)
    if not (isinstance(kind, type) and issubclass(kind, Exception)):
        kind = RuntimeError
    if error is None:
        text = f"{_call(what, path)} failed on another rank: {text}"
    raise kind(text) from error


# --- checks ---------------------------------------------------------------------------------------------


def _call(what: str, path: Any) -> str:
    shown = os.fsdecode(path) if isinstance(path, (str, bytes, os.PathLike)) else repr(path)
    return f"optimshift.distributed.{what}({shown})"


def _as_path(path: Any, what: str) -> Path:
    """``path`` (a str, bytes or os.PathLike, as checkpoint files take) as a Path; TypeError naming ``what``."""
    return Path(file_path(path, f"optimshift.distributed.{what}"))


def _clear_stale(target: Path) -> None:
    """Remove crashed saves' temporary directories: the name older versions used, and ours no process locks."""
    shutil.rmtree(_sibling(target, _TMP), ignore_errors=True)
    prefix = target.name + _TMP + "-"
    sweep_folders(target.parent, lambda name: name.startswith(prefix))


def _sibling(target: Path, suffix: str) -> Path:
    if target.name in ("", ".", ".."):  # "." has no name of its own to add a suffix to: name the folder
        target = Path(os.path.abspath(target))
    return target.with_name(target.name + suffix)


def _check_module(model: Any) -> None:
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")


def _check_owned(model: torch.nn.Module, optimizer: Any) -> None:
    owned = {id(p) for p in model.parameters()}
    for gi, group in enumerate(optimizer.param_groups):
        for pi, p in enumerate(group["params"]):
            if id(p) not in owned:
                shape = tuple(p.shape) if isinstance(p, torch.Tensor) else None
                raise ValueError(
                    f"{optimizer_name(optimizer)}: group {gi}, param {pi} (shape {shape}) is not a parameter of "
                    f"the {type(model).__name__} given; a checkpoint names optimizer state by the model's "
                    f"parameter names, so the optimizer must be built over model.parameters()"
                )


def _is_checkpoint(directory: Path) -> bool:
    return directory.is_dir() and (directory / ".metadata").is_file()


def is_dcp_folder(path: PathLike) -> bool:
    """Whether ``path`` is a torch.distributed.checkpoint folder (what :func:`describe_dcp` reads)."""
    return _is_checkpoint(_as_path(path, "is_dcp_folder"))


def _check_replaceable(target: Path) -> None:
    if target.is_symlink():
        raise ValueError(
            f"{target} is a symlink; save replaces checkpoint directories atomically and will not "
            f"replace a link: give the path it points to"
        )
    here, inside = os.path.realpath(target), False  # (getcwd names the folder without the links it was reached by)
    with contextlib.suppress(OSError):  # (a current folder deleted meanwhile is none that target holds)
        inside = os.path.commonpath([here, os.getcwd()]) == here
    if target.name in ("", "..") or inside:
        raise ValueError(
            f"{target} is the current folder or holds it (or ends in '..'): save replaces a checkpoint folder by "
            f"a rename, which cannot replace '.', and would leave this process in a deleted folder; give the "
            f"folder's path from outside it"
        )
    if os.path.ismount(target):
        raise ValueError(
            f"{target} is a mount point: save replaces a checkpoint folder by a rename, which cannot replace a "
            f"mounted volume; save into a folder inside it"
        )
    empty = target.is_dir() and not any(target.iterdir())
    if target.exists() and not _is_checkpoint(target) and not empty:
        kind = "directory" if target.is_dir() else "file"
        raise FileExistsError(
            f"{target} exists and is a {kind} that is not a torch.distributed.checkpoint "
            f"checkpoint (no .metadata); refusing to replace it"
        )


def _committed(target: Path) -> Path:
    """``target``, or the previous checkpoint a crash between the two renames of a non-atomic commit left."""
    if _is_checkpoint(target):
        return target
    if target.exists():
        raise ValueError(f"{target} is not a torch.distributed.checkpoint checkpoint (no .metadata file)")
    if _is_checkpoint(old := _sibling(target, _OLD)):
        return old
    raise FileNotFoundError(f"no checkpoint at {target}")


def _read_metadata(target: Path) -> Metadata:
    try:
        return dcp.FileSystemReader(str(target)).read_metadata()  # type: ignore[attr-defined]
    except _FAILURES as e:
        raise ValueError(f"{target}: cannot read the checkpoint's metadata: {e}") from e


def _shape(value: Any) -> tuple[int, ...]:
    return tuple(int(n) for n in value)


_NESTED = object()  # _Layout's marker for an entry DCP flattened further (a dict from get_extra_state, a nested list)


@dataclass
class _Layout:
    """A checkpoint's entries, from its DCP metadata."""

    path: Path
    model: dict[str, Any] = field(default_factory=dict)
    state: dict[str, dict[str, list[tuple[tuple[Any, ...], STORAGE_TYPES]]]] = field(default_factory=dict)
    groups: dict[int, set[str]] = field(default_factory=dict)
    params_keys: dict[int, str] = field(default_factory=dict)  # group index -> DCP key of its "params" list
    group_tensors: dict[tuple[int, str], TensorStorageMetadata] = field(default_factory=dict)  # a tensor lr's
    # (group index, key) -> each element's metadata by index: a list DCP stored element by element (tensor betas)
    group_lists: dict[tuple[int, str], dict[int, Any]] = field(default_factory=dict)
    has_extra: bool = False
    note: dict[str, Any] | None = None

    @property
    def has_state(self) -> bool:
        return bool(self.state)

    @classmethod
    def read(cls, target: Path) -> _Layout:
        metadata = _read_metadata(target)
        paths = metadata.planner_data
        if not isinstance(paths, dict):
            raise ValueError(
                f"{target}: this DCP checkpoint was saved without flattening; optimshift.distributed "
                f"loads checkpoints written by optimshift.distributed.save"
            )
        layout = cls(target, note=_read_note(target))
        for key, meta in metadata.state_dict_metadata.items():
            steps = tuple(paths.get(key, (key,)))
            if steps[:1] == ("model",) and len(steps) == 2:
                layout.model[str(steps[1])] = meta
            elif steps[:1] == ("model",) and len(steps) > 2:
                layout.model[str(steps[1])] = _NESTED  # a container (get_extra_state), flattened by DCP
            elif steps[:2] == ("optim", "state") and len(steps) >= 4:
                layout.state.setdefault(str(steps[2]), {}).setdefault(str(steps[3]), []).append((steps[4:], meta))
            elif steps[:2] == ("optim", "param_groups") and len(steps) >= 4:
                at = (int(steps[2]), str(steps[3]))
                layout.groups.setdefault(at[0], set()).add(at[1])
                if len(steps) == 4 and steps[3] == "params":
                    layout.params_keys[at[0]] = key
                elif len(steps) == 4 and isinstance(meta, TensorStorageMetadata):
                    layout.group_tensors[at] = meta
                elif len(steps) >= 5 and isinstance(steps[4], int):  # (an element of a list: _NESTED, deeper)
                    layout.group_lists.setdefault(at, {})[steps[4]] = meta if len(steps) == 5 else _NESTED
            elif steps == (_EXTRA,):
                layout.has_extra = True
        if not layout.model and not layout.groups:
            raise ValueError(
                f"{target} is a DCP checkpoint but not one written by optimshift.distributed.save "
                f"(no 'model' and 'optim' entries)"
            )
        short = _short_files(target, metadata)
        if short:  # (found before anything is read: a load from it would stop part-way, the model half written)
            raise ValueError(
                f"{target} is incomplete: it lacks {_listed(short)}, or holds fewer bytes there than its metadata "
                f"names (a copy cut short?); nothing was loaded"
            )
        return layout

    def group_params(self) -> dict[int, list[str]]:
        """The parameter names each saved param group holds (read by this process alone: no collective)."""
        wanted: dict[str, Any] = {key: None for key in self.params_keys.values()}
        if wanted:
            with _single_process_quiet(1):
                dcp.load(wanted, storage_reader=dcp.FileSystemReader(str(self.path)), no_dist=True)  # type: ignore[attr-defined]
        out = {}
        for gi, key in self.params_keys.items():
            names = wanted[key]
            if not isinstance(names, (list, tuple)):
                raise ValueError(
                    f"{self.path}: optim.param_groups.{gi}.params is {with_article(type(names).__name__)}, "
                    f"not a list of parameter names"
                )
            out[gi] = [str(n) for n in names]
        return out


def _param_names(model: torch.nn.Module) -> dict[int, str]:
    """id(param) -> the name torch.distributed.checkpoint gives it in optimizer state dicts."""
    out = {}
    for name, param in model.named_parameters():
        fqns = _get_fqns(model, name)
        out[id(param)] = next(iter(fqns)) if len(fqns) == 1 else name
    return out


def _shown(items: list[str], sep: str) -> str:
    """The first :data:`_SHOWN` of ``items`` joined by ``sep``, then how many more."""
    return sep.join(items[:_SHOWN] + ([f"... and {len(items) - _SHOWN} more"] if len(items) > _SHOWN else []))


def _listed(names: list[str]) -> str:
    return "[" + _shown([repr(n) for n in names], ", ") + "]"


@contextlib.contextmanager
def _undone_on_failure(optimizer: Any) -> Iterator[None]:
    """Undo DCP's initializing step if the block raises (a Ctrl-C too): its state, and the zero grads it gave."""
    had_state = bool(optimizer.state)
    no_grad = [p for g in optimizer.param_groups for p in g["params"] if p.grad is None]
    try:
        yield
    except BaseException:
        if not had_state:
            optimizer.state.clear()
        for p in no_grad:
            p.grad = None
        raise


def _compare_model(model_sd: Mapping[str, Any], layout: _Layout) -> list[str]:
    problems = [
        f"model.{name}: in the checkpoint, not in the model" for name in sorted(set(layout.model) - set(model_sd))
    ]
    for name, value in model_sd.items():
        meta = layout.model.get(name)
        if meta is None:
            problems.append(f"model.{name}: in the model, not in the checkpoint")
        elif meta is _NESTED:
            continue  # a nested container: DCP loads it entry by entry; there is no whole tensor to compare
        else:
            problems.extend(_compare_value(f"model.{name}", value, meta))
    return problems


def _compare_value(label: str, value: Any, meta: Any) -> list[str]:
    if not isinstance(value, torch.Tensor):
        if isinstance(meta, TensorStorageMetadata):
            return [f"{label}: the checkpoint holds a tensor, this side {with_article(type(value).__name__)}"]
        return []
    if not isinstance(meta, TensorStorageMetadata):
        return [f"{label}: the checkpoint holds a non-tensor object, this side a tensor"]
    problems = []
    if _shape(value.shape) != _shape(meta.size):  # a DTensor's .shape is its global shape
        problems.append(f"{label}: shape {_shape(meta.size)} in the checkpoint, {_shape(value.shape)} here")
    if value.dtype != meta.properties.dtype:
        problems.append(
            f"{label}: dtype {dtype_name(meta.properties.dtype)} in the checkpoint, "
            f"{dtype_name(value.dtype)} here (load never casts)"
        )
    return problems


def _compare_groups(optimizer: Any, layout: _Layout, model: torch.nn.Module | None) -> list[str]:
    """Group count, each group's params (by name, given ``model``: else DCP loads hyperparameters onto other
    params), and hyperparameters a step needs that the checkpoint lacks; keys only it has are left behind."""
    live = optimizer.param_groups
    if len(live) != len(layout.groups):
        return [f"param groups: {len(layout.groups)} in the checkpoint, {len(live)} in the optimizer"]
    defaults = set(getattr(optimizer, "defaults", None) or ())
    problems = []
    if model is not None:
        names = _param_names(model)
        saved_params = layout.group_params()
        for gi, group in enumerate(live):
            mine = [names.get(id(p), f"<unnamed param {pi}>") for pi, p in enumerate(group["params"])]
            theirs = saved_params.get(gi)
            if theirs is None:
                problems.append(f"param group {gi}: the checkpoint does not list its params")
                continue
            mine_set, theirs_set = set(mine), set(theirs)
            only_saved = [n for n in theirs if n not in mine_set]
            only_live = [n for n in mine if n not in theirs_set]
            parts = [f"{_listed(only_saved)} are in this group only in the checkpoint"] if only_saved else []
            parts += [f"{_listed(only_live)} are in this group only in the optimizer"] if only_live else []
            if parts:
                problems.append(
                    f"param group {gi} holds other params in the checkpoint than in the optimizer "
                    f"({len(theirs)} there, {len(mine)} here): {'; '.join(parts)} (build the optimizer's param groups "
                    f"as when it was saved)"
                )
    for gi, group in enumerate(live):
        saved = layout.groups.get(gi, set())
        # (a key the step does not read, or that __setstate__ fills, as a newer torch's flag an older one did not
        # save: keeps its live value, as torch's load_state_dict fills it)
        absent = (defaults or set(group)) - saved - {"params"}
        missing = sorted(k for k in absent if step_needs(type(optimizer), group, k))
        if missing:
            others = sorted(saved - set(group))
            problems.append(
                f"param group {gi}: the checkpoint lacks {missing}, which {optimizer_name(optimizer)} "
                f"uses"
                + (f", and has {others}, which it does not" if others else "")
                + " (saved from another optimizer class?)"
            )
    return problems


def _compare_state(optim_sd: Mapping[str, Any], layout: _Layout, model: torch.nn.Module) -> tuple[list[str], set[str]]:
    """Problems, and the params with live state the checkpoint has none for (never stepped: they end without)."""
    live: Mapping[str, Mapping[str, Any]] = optim_sd.get("state", {})
    if not layout.has_state:
        return [], set(live)  # saved before the first step: nothing to compare, the optimizer ends without state
    problems = []
    named = set(_param_names(model).values())
    for name in sorted(set(layout.state) - set(live)):
        if name in named:
            problems.append(
                f"optim.state.{name}: the checkpoint has state for it, the optimizer none (it has "
                f"state for other params, so it is not initialized for the load; load into an "
                f"optimizer without state, e.g. a fresh one)"
            )
        else:
            problems.append(f"optim.state.{name}: in the checkpoint, the optimizer holds no such param")
    stateless = set(live) - set(layout.state)
    for name, entries in live.items():
        saved = layout.state.get(name)
        if saved is None:
            continue
        if set(entries) != set(saved):
            problems.append(
                f"optim.state.{name}: keys {sorted(saved)} in the checkpoint, {sorted(entries)} in the optimizer"
            )
            continue
        for key, value in entries.items():
            found = saved[key]
            if len(found) == 1 and found[0][0] == ():  # a tensor or object stored whole under this key
                problems.extend(_compare_value(f"optim.state.{name}.{key}", value, found[0][1]))
    return problems, stateless


def _raise_mismatch(problems: list[str], layout: _Layout, model: Any, optimizer: Any) -> None:
    if not problems:
        return
    saved = f" (saved from a {layout.note.get('model')} with {layout.note.get('optimizer')})" if layout.note else ""
    raise ValueError(
        f"checkpoint {layout.path}{saved} does not match this {type(model).__name__} with "
        f"{optimizer_name(optimizer)}:\n  " + _shown(problems, "\n  ")
    )


# --- extra ----------------------------------------------------------------------------------------------


def _pack_extra(extra: Any) -> bytes:
    if not isinstance(extra, Mapping):
        raise TypeError(f"extra must be a mapping (e.g. a dict), got {type(extra).__name__}")
    buffer = io.BytesIO()
    try:
        torch.save(dict(extra), buffer)
        torch.load(io.BytesIO(buffer.getvalue()), map_location="cpu", weights_only=True)
    except Exception as e:
        raise TypeError(
            f"extra must hold only tensors, numbers, strings, None, and lists/tuples/dicts of them "
            f"(it is read back with torch.load(weights_only=True)): {e}"
        ) from e
    return buffer.getvalue()


# --- files ----------------------------------------------------------------------------------------------


def _writer_options() -> dict[str, Any]:
    # DCP's overlapping device-to-host loader needs the backend module's current_stream(): a PrivateUse1 backend
    # without one (the simulated accelerator) gets the serial loader.
    module = getattr(torch, current_accelerator() or "", None)
    return {"per_thread_copy_ahead": 0} if module is not None and not hasattr(module, "current_stream") else {}


def _write_note(directory: Path, note: dict[str, Any]) -> None:
    with open(directory / _NOTE, "w", encoding="utf-8") as f:
        json.dump(note, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())


def _read_note(directory: Path) -> dict[str, Any] | None:
    try:
        with open(directory / _NOTE, encoding="utf-8") as f:
            note = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        return {"unreadable": str(e)}
    return note if isinstance(note, dict) else {"unreadable": f"not a JSON object: {note!r}"}


def _check_complete(tmp: Path, lock: int | None) -> None:
    """``tmp`` is still this save's directory (``lock`` is open on it), with its metadata and every file it names."""
    try:
        same = lock is None or os.path.samestat(os.fstat(lock), os.stat(tmp))
    except OSError:
        same = False
    incomplete = "not committing an incomplete checkpoint"
    if not same:
        why = "was removed or replaced by something else during the save; not committing"
    elif not _is_checkpoint(tmp):
        why = f"holds no .metadata after the write; {incomplete}"
    elif short := _short_files(tmp, dcp.FileSystemReader(str(tmp)).read_metadata()):  # type: ignore[attr-defined]
        why = f"lacks {_listed(short)} (or holds fewer bytes than its metadata names); {incomplete}"
    else:
        return
    raise RuntimeError(f"{tmp}, this save's temporary directory, {why}")


def _short_files(directory: Path, metadata: Metadata) -> list[str]:
    """The files ``metadata`` names that ``directory`` lacks, or that hold fewer bytes than it reads from them."""
    ends: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        name = getattr(info, "relative_path", None)
        if isinstance(name, str):
            end = int(getattr(info, "offset", 0) or 0) + int(getattr(info, "length", 0) or 0)
            ends[name] = max(ends.get(name, 0), end)
    short = []
    for name, end in sorted(ends.items()):
        try:
            size = (directory / name).stat().st_size if (directory / name).is_file() else -1
        except OSError:
            size = -1
        if size < end:
            short.append(name)
    return short
