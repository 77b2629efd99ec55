"""``optimshift convert``: rewrite a checkpoint with every tensor on one device (and floating ones in one
dtype), atomically; a Trainer or Accelerate folder's optimizer files too."""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import json
import os
import shutil
import sys
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch

from .. import _alias
from .._devices import resolve
from .._state import tensors as all_tensors
from ..checkpoint import _files as ckpt
from ..checkpoint._atomic import (
    create_temp,
    drop_temps,
    fsync_dir,
    keep_mode,
    make_folder,
    read_only,
    sweep,
    sweep_folders,
    temp_name,
    temp_pattern,
)
from ..checkpoint._folders import TrainingFolder, training_folder
from ._common import (
    Progress,
    allow_global_arg,
    allowed,
    failure,
    first_line,
    human_bytes,
    isatty,
    warnings_only_on_success,
)

__all__ = ["register", "run_convert"]


def register(subparsers: Any) -> None:
    """Add the ``convert`` subcommand to the ``optimshift`` parser."""
    c = subparsers.add_parser(
        "convert",
        help="rewrite a checkpoint with every tensor on one device (atomically)",
        description="Loads IN without running code from it, puts every tensor on --device (and casts floating "
        "tensors to --dtype, keeping optimizer scalars such as 'step' exact), and writes OUT atomically, so that "
        "a GPU checkpoint opens on a CPU-only machine without map_location. IN may be a Hugging Face Trainer "
        "checkpoint-N folder or an Accelerate save_state folder: its optimizer files are rewritten and every "
        "other file is copied into the new folder OUT (give IN itself as OUT to rewrite them in place).",
    )
    c.add_argument("input", metavar="IN")
    c.add_argument("output", metavar="OUT")
    c.add_argument("--device", default="cpu", help="where every tensor goes (default: cpu)")
    c.add_argument("--dtype", choices=sorted(DTYPES), help="cast floating tensors to this dtype")
    c.add_argument("--json", action="store_true", help="print the result (or the error) as JSON on stdout")
    allow_global_arg(c)
    c.set_defaults(func=run_convert, into=None)


_LARGE = 64 << 20  # bytes: show a progress bar for files at least this big (on a terminal)
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}


def _protected(obj: Any) -> set[int]:
    """ids of tensors a dtype cast must not touch: optimizer scalars (``step``, ``mu_product``…) and tensors
    in param groups, whose exact values and dtypes the optimizer relies on."""
    keep: set[int] = set()
    for found in ckpt.find_optimizer_states(obj):
        for st in found.state_dict["state"].values():
            for t in all_tensors(st):
                if t.dim() == 0:
                    keep.add(id(t))
        for g in found.state_dict["param_groups"]:
            keep.update(id(t) for t in all_tensors({k: v for k, v in g.items() if k != "params"}))
    return keep


def _cast_shared(obj: Any, dtype: torch.dtype, keep: set[int], memo: dict[int, Any], counts: Counter[str]) -> None:
    """Tensors of ``obj`` that share a storage, cast as that storage into ``memo``: each a view of one cast
    storage, as saved (cast one by one, each got a storage of its own: a load allocated each, the sharing lost)."""
    tensors = all_tensors(obj)
    for group in _alias.shared(tensors):
        members = [tensors[i] for i in group]
        if members[0].dtype == dtype or any(
            id(t) in keep or not t.is_floating_point() or t.dtype != members[0].dtype for t in members
        ):
            continue  # (nothing to cast, or members cast differently: one by one, as before)
        cast = _alias.copy_storage(members, members[0].device, lambda src, _: src.to(dtype), dtype=dtype)
        memo.update(zip(map(id, members), cast))
        counts["cast"] += len(members)


_CAST_DEPTH = 64  # containers nested deeper than this are refused by --dtype (the copy is recursive)


def _cast_tree(
    obj: Any,
    dtype: torch.dtype,
    keep: set[int],
    memo: dict[int, Any],
    counts: Counter[str],
    where: str = "",
    depth: int = 0,
) -> Any:
    if isinstance(obj, torch.Tensor):
        if id(obj) in memo:
            return memo[id(obj)]
        new = obj
        if obj.is_floating_point() and obj.dtype != dtype:
            if id(obj) in keep:
                counts["kept"] += 1
            else:
                why = ckpt.overexpanded(obj)
                if why is not None:
                    raise ValueError(
                        f"refusing to cast the tensor at {where or 'the top'}: {why}; casting it would "
                        f"allocate every element"
                    )
                new = obj.to(dtype)
                counts["cast"] += 1
        memo[id(obj)] = new
        return new
    if isinstance(obj, (dict, list)) or type(obj) is tuple:  # dict subclasses too: OrderedDict state_dicts
        if id(obj) in memo:
            return memo[id(obj)]
        if depth >= _CAST_DEPTH:
            raise ValueError(
                f"the object at {where} is nested deeper than {_CAST_DEPTH} levels; --dtype cannot rewrite it"
            )
        if isinstance(obj, dict):
            out: Any = copy.copy(obj)  # keeps the type (OrderedDict, defaultdict) and its attributes (_metadata)
            for k, v in obj.items():
                out[k] = _cast_tree(v, dtype, keep, memo, counts, f"{where}[{k!r}]", depth + 1)
        else:
            out = type(obj)(
                _cast_tree(v, dtype, keep, memo, counts, f"{where}[{i}]", depth + 1) for i, v in enumerate(obj)
            )
        memo[id(obj)] = out
        return out
    return obj


def _missing_device(device: torch.device) -> str | None:
    """What to do when ``device`` is not on this machine (``convert --device cuda`` without a GPU), else None."""
    try:
        resolve(device, what="--device")
    except (ValueError, TypeError) as e:
        if device.type == "meta":  # (no machine has data there: what to do instead is resolve's own advice)
            return f"{e}; a checkpoint written there would hold no values"
        return (
            f"{e}. Convert to the CPU here instead (--device cpu, the default): a CPU checkpoint opens on "
            f"any machine, and optimshift.load_state_dict (or torch.load's map_location) puts the state on the "
            f"accelerator when you resume there. To write a {device.type} checkpoint, run this command on a machine "
            f"that has the device."
        )
    return None


def run_convert(args: argparse.Namespace) -> int:
    src, dst, as_json = args.input, args.output, args.json

    def fail(message: str, error: BaseException | None = None) -> int:
        return failure("convert", message, as_json=as_json, error=error)

    try:
        device = torch.device(args.device)
    except Exception as e:
        return fail(f"--device {args.device!r} is not a device PyTorch knows", e)
    missing = _missing_device(device)
    if missing:
        return fail(missing, ValueError(missing))
    device = resolve(device)  # (cpu:1 is the host, as torch makes tensors there: torch.load refuses the index)
    if os.path.isdir(src):
        folder = training_folder(src)
        if folder is not None:
            return _convert_training_folder(folder, args)
        return fail(
            f"{src} is a directory but not a Hugging Face Trainer checkpoint-N folder or an Accelerate "
            f"save_state folder; convert reads torch.save files and those folders",
            IsADirectoryError(),
        )
    try:
        torch.empty(0, device=device)
    except Exception as e:
        return fail(f"cannot put {src}'s tensors on {device}: {first_line(str(e))}", e)
    try:
        ckpt.verify_checksums(src)
        with allowed(args.allow_global), warnings_only_on_success():
            obj = ckpt.load(src, map_location=device, mmap=device.type == "cpu")
    except (ckpt.CheckpointError, OSError, ValueError) as e:
        return fail(str(e), e)
    except RuntimeError as e:
        return fail(f"cannot put {src}'s tensors on {device}: {first_line(str(e))}", e)
    counts: Counter[str] = Counter()
    memo: dict[int, Any] = {}
    try:
        if args.dtype:
            keep = _protected(obj)
            _cast_shared(obj, DTYPES[args.dtype], keep, memo, counts)
            obj = _cast_tree(obj, DTYPES[args.dtype], keep, memo, counts)
    except (ValueError, RuntimeError) as e:  # RuntimeError: an OOM while casting
        return fail(f"{src}: {e}", e)
    total = ckpt.storage_bytes(all_tensors(obj))
    bar = (
        Progress(f"writing {os.path.basename(dst)}", total, sys.stderr)
        if (total >= _LARGE and isatty(sys.stderr) and not as_json)
        else None
    )
    try:
        ckpt._save(obj, dst, progress=bar, into=args.into)
    except (OSError, RuntimeError, ValueError) as e:
        if bar:
            bar.close()
        said = (e.strerror if isinstance(e, OSError) else None) or str(e)  # (without "[Errno 28] ")
        return fail(said.removeprefix("save: ") if said.startswith("save: ") else f"cannot write {dst}: {said}", e)
    if bar:
        bar.close()
    tensors = list(all_tensors(obj))
    size = os.path.getsize(dst) if args.into is None else os.fstat(args.into).st_size
    if as_json:
        print(
            json.dumps(
                {
                    "wrote": dst,
                    "tensors": len(tensors),
                    "device": str(device),
                    "bytes": size,
                    "dtype": args.dtype,
                    "cast": counts["cast"],
                    "kept": counts["kept"],
                }
            )
        )
        return 0
    summary = f"wrote {dst}: {len(tensors)} tensors on {device}, {human_bytes(size)}"
    if args.dtype:
        summary += f"; cast {counts['cast']} floating tensors to {args.dtype}"
        if counts["kept"]:
            summary += f", kept {counts['kept']} optimizer scalars (step, …) in their dtype"
    print(summary)
    return 0


def _convert_training_folder(folder: TrainingFolder, args: argparse.Namespace) -> int:
    """``convert`` of a Trainer or Accelerate folder: its optimizer files are rewritten, the rest copied as is.

    Every optimizer file is converted into a hidden folder beside the target first. OUT the folder itself: only
    once every file converted does each replace its original (each atomically), so a failure to convert one leaves
    all as they were (a rename that fails says which files it replaced already). Otherwise OUT must not exist (or
    be an empty folder): the copy is completed in the hidden folder and renamed into place at the end, so OUT never
    holds half a checkpoint (a framework would resume from a folder that lacks its optimizer file without a word).
    """

    as_json = args.json

    def convert(src: str, dst: str, into: int | None = None) -> int:
        return run_convert(
            argparse.Namespace(
                input=src,
                output=dst,
                device=args.device,
                dtype=args.dtype,
                allow_global=args.allow_global,
                json=as_json,
                into=into,
            )
        )

    if not folder.optimizer_files:
        return failure(
            "convert",
            f"{folder.path} is a {folder.label} without an optimizer file: nothing to convert",
            as_json=as_json,
        )
    dst = args.output
    if os.path.exists(dst) and os.path.samefile(dst, folder.path):
        return _convert_in_place(folder, dst, convert, as_json)
    if os.path.exists(dst) and not (os.path.isdir(dst) and not os.listdir(dst)):
        return failure(
            "convert",
            f"{dst} exists: give a new folder, or {folder.path} itself to rewrite its optimizer files in place",
            as_json=as_json,
        )
    target = os.path.abspath(dst)
    parent = os.path.dirname(target)
    pattern = temp_pattern(target)
    tmp = temp_name(target)
    lock = None
    try:
        sweep_folders(parent, lambda name: pattern.fullmatch(name) is not None)  # what crashed converts left
        lock = make_folder(tmp)  # (locked while this convert writes: a concurrent one's sweep leaves it alone)
        written = io.StringIO()
        for name in folder.optimizer_files:
            with contextlib.redirect_stdout(written):
                failed = convert(os.path.join(folder.path, name), os.path.join(tmp, name))
            if failed:
                sys.stdout.write(written.getvalue().splitlines(keepends=True)[-1] if as_json else "")  # (its error)
                return 1
        for name, role in folder.files.items():
            if role == "optimizer":
                continue
            source = os.path.join(folder.path, name)
            if os.path.isdir(source):
                shutil.copytree(source, os.path.join(tmp, name), symlinks=True)
            else:
                shutil.copy2(source, os.path.join(tmp, name), follow_symlinks=False)
        os.replace(tmp, target)  # an empty OUT folder is replaced too (POSIX)
        fsync_dir(parent)
    except OSError as e:
        return failure("convert", f"cannot write {dst}: {e}", as_json=as_json, error=e)
    finally:
        if lock is not None:
            os.close(lock)
        if os.path.exists(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    copied = len(folder.files) - len(folder.optimizer_files)
    _report(written, {os.path.join(tmp, n): os.path.join(dst, n) for n in folder.optimizer_files}, dst, copied, as_json)
    if not as_json:
        print(f"copied {copied} other entr{'y' if copied == 1 else 'ies'} of {folder.path} unchanged into {dst}")
    return 0


def _convert_in_place(folder: TrainingFolder, dst: str, convert: Callable[..., int], as_json: bool) -> int:
    """Each optimizer file of ``folder`` converted into a hidden temporary beside the file it replaces (through a
    link, the file it points at: the same folder, so the same filesystem), with its permissions and locked from the
    start, and only once every one converted, each renamed over its original (a failure to convert one leaves all
    as they were; a rename that fails, rare, names those replaced already). A read-only file, or one in a folder
    that cannot be written, is refused before anything is converted."""
    # (each real file once: two names linked to one file are one file to convert)
    at = {os.path.realpath(os.path.join(folder.path, name)): name for name in reversed(folder.optimizer_files)}
    reals, names = list(reversed(at)), list(reversed(at.values()))
    # (each temporary and its descriptor, which keeps another process's sweep off it until it is renamed or removed)
    temps: dict[str, int] = {}
    written = io.StringIO()
    try:
        for real, name in zip(reals, names):
            path = os.path.join(folder.path, name)
            try:
                os.stat(real)
            except OSError as e:
                return failure("convert", f"cannot read {path}: {e}", as_json=as_json, error=e)
            if (problem := read_only(real)) is not None:
                return failure("convert", problem, as_json=as_json, error=PermissionError(problem))
            sweep(real)  # (what crashed saves and converts of it left)
            try:
                _, tmp = create_temp(real, temps)
            except OSError as e:  # (named after the hidden temporary: say which file and folder, and why)
                problem = (
                    f"cannot write in folder {os.path.dirname(real)} (a new file there, to replace {path}): "
                    f"{e.strerror or e}"
                )
                return failure("convert", problem, as_json=as_json, error=e)
            keep_mode(tmp, real)  # (before a byte is written: a private file's state stays private)
        for name, fd in zip(names, temps.values()):  # (written through the locked descriptor; messages name the file)
            with contextlib.redirect_stdout(written):
                failed = convert(os.path.join(folder.path, name), os.path.normpath(os.path.join(dst, name)), fd)
            if failed:
                sys.stdout.write(written.getvalue().splitlines(keepends=True)[-1] if as_json else "")  # (its error)
                return 1
        for real, tmp in zip(reals, temps):  # (every file converted: each takes its original's mode as it is now,
            keep_mode(tmp, real)  # as save's rename keeps it, before any replaces its original)
        replaced: list[str] = []
        for real, name, tmp in zip(reals, names, temps):
            try:
                os.replace(tmp, real)
            except OSError as e:  # (the rest stay as they were; those before it are the converted files now)
                done = f"{', '.join(replaced)} replaced already, " if replaced else ""
                problem = f"cannot replace {os.path.join(folder.path, name)}: {e.strerror}; {done}the rest as they were"
                return failure("convert", problem, as_json=as_json, error=e)
            replaced.append(os.path.join(folder.path, name))
        for parent in dict.fromkeys(os.path.dirname(real) for real in reals):
            fsync_dir(parent)
    except OSError as e:
        return failure("convert", f"cannot write {dst}: {e}", as_json=as_json, error=e)
    finally:
        drop_temps(temps)
    _report(written, {}, dst, 0, as_json)
    return 0


def _report(written: io.StringIO, shown: dict[str, str], dst: str, copied: int, as_json: bool) -> None:
    """Each file's summary (written to a temporary: ``shown`` maps it to where the file is now), as text or, with
    ``--json``, one object with what was copied beside them."""
    if as_json:
        files = [json.loads(line) for line in written.getvalue().splitlines()]
        for entry in files:
            entry["wrote"] = shown.get(entry["wrote"], entry["wrote"])
        print(json.dumps({"wrote": dst, "files": files, "copied": copied}))
        return
    text = written.getvalue()
    for tmp, path in shown.items():
        text = text.replace(tmp, os.path.normpath(path))
    sys.stdout.write(text)
