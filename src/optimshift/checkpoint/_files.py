"""Checkpoint files: atomic saves, safe loads, and finding the optimizer state inside them (neither moves a tensor:
:func:`optimshift.load_state_dict` places the state)."""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import os
import pickle
import pickletools
import re
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import IO, Any, Union

import torch

from .._dtensor import local_tensor, tensor_bytes
from .._errors import add_note, dtype_name, with_article
from .._plan import check_optimizer, states_by_id
from .._state import MAX_DEPTH, Path, format_path, leaves, unwrap
from .._version import __version__
from . import _atomic, _records, _untrusted

PathLike = Union[str, "os.PathLike[str]"]

META_KEY = "optimshift"
"""Key that :func:`save` adds to an optimizer's state dict: ``{"format": 1, "class": qualname, "module": ...}``.
``Optimizer.load_state_dict`` ignores it, so the file still loads with plain PyTorch."""

_FORMAT = 1
_ZIP_MAGIC = b"PK\x03\x04"
_ZIP_END = b"PK\x05\x06"  # end-of-central-directory record: the last thing torch.save writes
_ZIP64_END = b"PK\x06\x06"
# torch.save's legacy (non-zip) format starts with its magic number pickled (LONG1, 10 bytes), in any protocol
_LEGACY_MAGIC_NUMBER = b"\x8a\x0a" + (0x1950A86A20F9469CFC6C).to_bytes(10, "little")
# how every torch.save file starts: a zip, or the legacy magic number pickled in protocol 2 or 3, or framed in 4 or 5
_STARTS = (
    _ZIP_MAGIC,
    *(bytes([0x80, p]) + _LEGACY_MAGIC_NUMBER for p in (2, 3)),
    *(
        bytes([0x80, p, 0x95]) + (len(_LEGACY_MAGIC_NUMBER) + 1).to_bytes(8, "little") + _LEGACY_MAGIC_NUMBER
        for p in (4, 5)
    ),
)


class CheckpointError(ValueError):
    """A file that is not a readable checkpoint: empty, truncated, corrupt, or another format."""


class UnsafeCheckpointError(CheckpointError, pickle.UnpicklingError):
    """A checkpoint whose pickle would import or call code ``weights_only=True`` does not allow (nothing was
    executed); ``globals`` lists what it names (``["os.system"]``)."""

    # (``globals`` optional: unpickling calls the class with the message alone, then restores the attribute)
    def __init__(self, message: str, globals: list[str] | None = None) -> None:
        super().__init__(message)
        self.globals = [] if globals is None else globals


# --- recognising optimizer state -------------------------------------------------------------------------


def is_optimizer_state_dict(obj: Any) -> bool:
    """Whether ``obj`` has the shape of ``Optimizer.state_dict()``: ``state`` (a dict) and ``param_groups``
    (a list of dicts, each with a ``params`` list)."""
    if not isinstance(obj, Mapping):
        return False
    state, groups = obj.get("state"), obj.get("param_groups")
    return (
        isinstance(state, Mapping)
        and isinstance(groups, (list, tuple))
        and all(isinstance(g, Mapping) and isinstance(g.get("params"), (list, tuple)) for g in groups)
    )


def stringified_ids(state_keys: Iterable[Any], ids: Iterable[Any]) -> list[str]:
    """The keys of ``state`` that are the text of a param id the groups list (``"0"``, from a JSON round trip), which
    ``Optimizer.load_state_dict`` takes for optimizer-wide entries."""
    keys = [k for k in state_keys if isinstance(k, str)]
    texts = {str(i) for i in ids if type(i) is int} if keys else set()  # the ids PyTorch writes; JSON makes "0" of 0
    return [k for k in keys if k in texts]


@dataclass(frozen=True)
class FoundOptimizer:
    """One optimizer state found in a checkpoint: ``where`` in the loaded object (``"['optimizer']"``, ``""`` for
    itself); ``kind``: ``optimshift``, ``state_dict`` (a bare one), ``lightning`` or ``nested``; ``class_name``:
    the class :func:`save` recorded (``"torch.optim.adam.Adam"``), else None."""

    where: str
    kind: str
    state_dict: Mapping[str, Any]
    class_name: str | None = None


def find_optimizer_states(obj: Any, *, max_depth: int = MAX_DEPTH) -> list[FoundOptimizer]:
    """Every optimizer state dict inside ``obj`` (a loaded checkpoint), under any key or index, in a stable order."""
    found: list[FoundOptimizer] = []
    seen: set[int] = set()  # (containers walked: one held in many places, or holding itself, once)

    def walk(value: Any, where: str, depth: int, lightning: bool) -> None:
        if id(value) in seen:
            return
        if is_optimizer_state_dict(value):
            seen.add(id(value))
            meta, cls = value.get(META_KEY), None
            if isinstance(meta, Mapping) and isinstance(meta.get("class"), str):
                module = meta.get("module")
                cls = f"{module}.{meta['class']}" if isinstance(module, str) and module else meta["class"]
            kind = (
                "optimshift" if cls is not None else "lightning" if lightning else "nested" if where else "state_dict"
            )
            found.append(FoundOptimizer(where, kind, value, cls))
            return
        if depth >= max_depth or isinstance(value, torch.Tensor):
            return  # (not marked seen: a shallower path may still walk into it)
        seen.add(id(value))
        if isinstance(value, Mapping):
            for key, child in value.items():
                if isinstance(child, (Mapping, list, tuple)):
                    walk(child, f"{where}[{key!r}]", depth + 1, lightning or (depth == 0 and key == "optimizer_states"))
        elif isinstance(value, (list, tuple)):
            for i, child in enumerate(value):
                if isinstance(child, (Mapping, list, tuple)):
                    walk(child, f"{where}[{i}]", depth + 1, lightning)

    walk(obj, "", 0, False)
    return found


# NOTE: an expanded view (stride 0) has more elements than its storage holds, and copying or casting it
# materialises them all: a file of a few KB can ask for GiBs that way. Past this slack such tensors are refused.
_EXPANSION_SLACK = 1 << 20  # bytes


def overexpanded(t: torch.Tensor) -> str | None:
    """Why copying ``t`` would allocate far more than its storage holds (an expanded view), else None. Plain tensors
    only: a DTensor describes a global shape over a local storage."""
    if type(t) not in (torch.Tensor, torch.nn.Parameter) or t.is_meta or t.layout != torch.strided:
        return None
    need = t.numel() * t.element_size()
    if need <= _EXPANSION_SLACK:  # the common case, decided without touching the storage
        return None
    try:
        storage = t.untyped_storage().nbytes()
    except Exception:
        return None
    if need <= 2 * storage + _EXPANSION_SLACK:
        return None
    return (
        f"a tensor of shape {tuple(t.shape)} ({need} bytes once copied) is a view of a storage of {storage} "
        f"bytes (strides {tuple(t.stride())})"
    )


# --- saving ------------------------------------------------------------------------------------------------


def _optimizer_payload(optimizer: Any, inner: torch.optim.Optimizer) -> dict[str, Any]:
    """``optimizer.state_dict()`` (its tensors shared) plus the :data:`META_KEY` entry recording the class of
    ``inner``, the torch optimizer it is or wraps."""
    check_optimizer(inner)  # (param groups torch's state_dict() walks)
    states_by_id(inner)  # (state for a param in no group: torch's state_dict() raises a bare KeyError of an id)
    cls = type(inner)
    meta = {"format": _FORMAT, "class": cls.__qualname__, "module": cls.__module__, "optimshift": __version__}
    return {**optimizer.state_dict(), META_KEY: meta}


def _prepare(obj: Any) -> Any:
    """``obj`` with every optimizer inside its dicts, lists and tuples (subclasses too) replaced by its recorded
    state dict, containers rebuilt once each, of their class, where something changed; ValueError, before anything
    is written, for a cycle holding an optimizer or a class that cannot be rebuilt."""
    done: dict[int, Any] = {}  # id(container) -> what it becomes (itself where nothing changed)
    open_: set[int] = set()  # containers being rebuilt: met again inside themselves, a cycle
    cyclic: list[Any] = []

    def rebuilt(value: Any, depth: int) -> Any:
        inner = unwrap(value)
        if isinstance(inner, torch.optim.Optimizer) and hasattr(value, "state_dict"):
            if id(value) not in done:  # (one optimizer held in two places: one state dict, held in both)
                done[id(value)] = _optimizer_payload(value, inner)
            return done[id(value)]
        if not isinstance(value, (dict, list, tuple)) or depth >= MAX_DEPTH:
            return value
        key = id(value)
        if key in done:
            return done[key]
        if key in open_:
            cyclic.append(value)
            return value
        open_.add(key)
        try:
            out = _rebuild(
                value, [rebuilt(v, depth + 1) for v in (value.values() if isinstance(value, dict) else value)]
            )
        finally:
            open_.discard(key)
        done[key] = out
        return out

    out = rebuilt(obj, 0)
    if cyclic and any(done.get(id(c)) is not c for c in cyclic):
        raise ValueError(
            f"save: a {type(cyclic[0]).__name__} in the object holds itself, and an optimizer inside it is saved as "
            f"its state dict: a copy of it cannot hold itself. Save a structure without the cycle; nothing was "
            f"written"
        )
    return out


def _rebuild(container: Any, values: list[Any]) -> Any:
    """``container`` with ``values`` in its items' places (itself where none changed), of its own class."""
    old = list(container.values()) if isinstance(container, dict) else list(container)
    if all(a is b for a, b in zip(values, old)):
        return container
    try:
        if isinstance(container, tuple):  # (a namedtuple by its _make, any other tuple from its items)
            return container._make(values) if hasattr(container, "_make") else type(container)(values)
        made = copy.copy(container)  # (its class kept; an OrderedDict's order, a defaultdict's factory)
        if made is container:
            raise TypeError("its copy is itself")
        if isinstance(container, dict):
            made.update(zip(container, values))
        else:
            made[:] = values
        return made
    except Exception as e:  # noqa: BLE001  (a class of the user's: whatever its constructor raises)
        raise ValueError(
            f"save: an optimizer inside a {type(container).__name__} is saved as its state dict, but a "
            f"{type(container).__name__} with it in place cannot be made ({type(e).__name__}: {e}); hold the "
            f"optimizer in a dict, list or tuple. Nothing was written"
        ) from e


def save(obj: Any, path: PathLike) -> None:
    """Write ``obj`` with ``torch.save`` atomically: a crash at any moment leaves the old file or the new one.

    Optimizers in ``obj`` are saved as their ``state_dict()`` plus their class name (checked on load), tensors
    where they are; plain ``torch.load`` opens the file too. ``path``: a str or ``os.PathLike`` (renamed over)."""
    _save(obj, path)


def file_path(path: Any, what: str) -> str:
    """``path`` as a str (from bytes too); TypeError naming ``what`` for anything else (a file object: a save renames
    a new file over the path, and a load maps it), and for bytes with a NUL, a file's contents (none in a path)."""
    if isinstance(path, bytes) and b"\0" in path:
        raise TypeError(
            f"{what}: path must be a file path, got {len(path)} bytes with a NUL byte in them, which no path has (a "
            f"checkpoint's contents? torch.load(io.BytesIO(data), weights_only=True) reads them)"
        )
    if not isinstance(path, (str, bytes, os.PathLike)):
        raise TypeError(
            f"{what}: path must be a file path (a str or os.PathLike), got "
            f"{'None' if path is None else with_article(type(path).__name__)}"
        )
    return os.fsdecode(path)


def _save(obj: Any, path: PathLike, progress: Callable[[int], None] | None = None, into: int | None = None) -> None:
    """:func:`save`; ``into``: an open descriptor of a temporary the caller made for ``path`` (locked, with its
    permissions: an in-place convert's), written directly and left to the caller to rename over ``path``."""
    given = file_path(path, "save")
    if not given:  # (resolved, "" is the working folder: it was refused as "<cwd> is a directory")
        raise FileNotFoundError("save: the path is empty (''); give a file path")
    if given.endswith(os.sep) or os.altsep is not None and given.endswith(os.altsep):
        # (the resolved path drops the separator: a file of that name was written where a folder was named)
        raise IsADirectoryError(f"save: {given} ends in a separator, which names a folder; give a file path")
    # Through a symlink (Lightning's save_last="link"), replace the file it points at, not the link.
    target = os.path.realpath(os.path.abspath(given))
    folder = os.path.dirname(target)
    try:
        os.stat(target)
    except (FileNotFoundError, NotADirectoryError):
        pass  # (a new file; a folder that is a file: said below)
    except PermissionError as e:  # (a folder on the way that cannot be searched)
        raise _folder_error(folder, target, e) from None
    except OSError as e:  # (symbolic links that loop: realpath leaves them)
        raise _os_error(e.errno, f"save: cannot replace {target}: {e.strerror}") from None
    if os.path.isdir(target):
        raise IsADirectoryError(f"save: {target} is a directory; give a file path")
    if (kind := _atomic.not_a_file(target)) is not None:
        raise FileExistsError(f"save: {target} is {kind}, not a file: saving would replace it; give a file path")
    if (problem := _atomic.read_only(target)) is not None:
        raise PermissionError(f"save: {problem}")
    if not os.path.isdir(folder):
        if os.path.exists(folder):
            raise NotADirectoryError(f"save: {folder} is a file, not a folder to save {os.path.basename(target)} in")
        raise FileNotFoundError(f"save: folder {folder} does not exist")
    payload = _prepare(obj)
    # A hidden, locked temporary in the same folder (same filesystem, so the rename is atomic); first remove
    # the temporaries that killed saves to this destination left behind. The temporary and its descriptor are
    # made's once they exist: both dropped below, a Ctrl-C as create_temp returns included.
    made: dict[str, int] = {}
    try:
        if into is None:
            _atomic.sweep(target)
            try:
                fd, tmp = _atomic.create_temp(target, made)
            except OSError as e:  # (named after the hidden temporary: say which folder cannot be written, and why)
                raise _folder_error(folder, target, e) from None
            _atomic.keep_mode(tmp, target)
        else:  # (a second temporary renamed over the caller's would leave it unlocked, and a crash a stray)
            fd = into
        raw = os.fdopen(fd, "wb", closefd=False)  # (the descriptor closed by its owner: made's after the rename)
        try:
            # (torch.save writes to any object with write and flush; its stubs ask for a typing.IO)
            sink: IO[bytes] = _Sink(raw, progress)  # type: ignore[assignment]
            try:
                torch.save(payload, sink)
            except RecursionError:
                raise ValueError(
                    f"save: {target}: the object is nested too deeply to pickle (more than "
                    f"{sys.getrecursionlimit()} levels); nothing was written"
                ) from None
            except OSError as e:  # (the file's own last write: a full disk's ENOSPC)
                raise _write_error(target, e) from e
            except RuntimeError as e:  # (torch's zip writer reports a failed write as an error of its own)
                if "view the same data as different types" in str(e):
                    raise ValueError(
                        f"save: {target}: {_dtype_views(payload)} view one storage in two dtypes, which torch.save "
                        f"cannot write; save a clone of one of them. Nothing was written"
                    ) from None
                cause = e.__context__
                if cause is None or "inline_container" not in str(e):
                    raise
                if not isinstance(cause, Exception):
                    raise cause from None  # (a Ctrl-C inside a write: the writer's close masked it; nothing committed)
                if not isinstance(cause, OSError) or cause.errno is None:
                    raise
                raise _write_error(target, cause) from e
            try:
                raw.flush()
                os.fsync(raw.fileno())
            except OSError as e:
                raise _write_error(target, e) from e
            if into is None:
                os.replace(tmp, target)
        except BaseException:
            with contextlib.suppress(OSError):  # (a failed write fails the close's flush again: ours says it)
                raw.close()
            raise
        raw.close()
    finally:
        _atomic.drop_temps(made)
    _atomic.fsync_dir(folder)


def _dtype_views(payload: Any) -> str:
    """The first two tensors of ``payload`` that view one storage in different dtypes, named by their paths."""
    seen: dict[tuple[torch.device, int], tuple[Path, torch.dtype]] = {}
    for path, t in leaves(payload):
        ptr = t.untyped_storage().data_ptr()
        first = seen.setdefault((t.device, ptr), (path, t.dtype)) if ptr else (path, t.dtype)
        if first[1] != t.dtype:
            return (
                f"{format_path(first[0]) or 'the object'} ({dtype_name(first[1])}) and "
                f"{format_path(path)} ({dtype_name(t.dtype)})"
            )
    return "two of its tensors"


def _folder_error(folder: str, target: str, cause: OSError) -> OSError:
    """``folder`` cannot take the new file that would replace ``target`` (or cannot be reached), and why."""
    return _os_error(
        cause.errno,
        f"save: cannot write in folder {folder} (a new file there, to replace {target} atomically): "
        f"{cause.strerror or cause}",
    )


def _write_error(target: str, cause: OSError) -> OSError:
    """A failed write of ``target`` (a full disk's ENOSPC), said with the file's name (torch's writer names none)."""
    return _os_error(
        cause.errno, f"save: cannot write {target}: {cause.strerror or cause}; the old file, if any, is intact"
    )


def _os_error(code: int | None, message: str) -> OSError:
    """An OSError saying ``message``, of ``code``'s class where there is one (``OSError(None, message)`` reads
    "[Errno None] message")."""
    return OSError(message) if code is None else OSError(code, message)


class _Sink:
    """What torch.save writes to (its buffer writer calls write and flush, and seek under skip_data): the file ``raw``,
    the bytes written so far reported to ``progress``; once ``raw`` is closed, writes go nowhere (a zip writer a Ctrl-C
    left alive writes its end when freed, and a closed file's error there aborts the process)."""

    def __init__(self, raw: IO[bytes], progress: Callable[[int], None] | None) -> None:
        self._raw, self._progress, self.written = raw, progress, 0

    def write(self, data: Any) -> int:
        if self._raw.closed:
            return memoryview(data).nbytes
        n = self._raw.write(data)
        self.written += n
        if self._progress is not None:
            self._progress(self.written)
        return n

    def flush(self) -> None:
        if not self._raw.closed:
            self._raw.flush()

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:  # (under skip_data: a storage's unwritten bytes)
        return 0 if self._raw.closed else self._raw.seek(offset, whence)

    def fileno(self) -> int:
        return self._raw.fileno()


# --- loading -----------------------------------------------------------------------------------------------


def _sniff(path: str) -> str:
    """``"zip"`` or ``"legacy"`` (torch.save formats) or ``"pickle"``; CheckpointError for anything else."""
    if os.path.isdir(path):
        raise IsADirectoryError(
            f"{path} is a directory, not a checkpoint file (a torch.distributed.checkpoint folder? "
            f"`optimshift inspect {path}` describes one)"
        )
    if not path:
        raise FileNotFoundError("the checkpoint path is empty (''); give a file path")
    if not os.path.exists(path):
        bare = path.rstrip(os.sep + (os.altsep or ""))
        if bare != path and os.path.isfile(bare):  # ("file.pt/": the file exists, the separator names a folder)
            raise NotADirectoryError(
                f"{path} ends in a separator, which names a folder, but {bare} is a file; give its path without "
                f"the separator"
            )
        if os.path.islink(path):  # (exists() follows links)
            raise FileNotFoundError(
                f"no such checkpoint file: {path} is a symbolic link to {os.readlink(path)}, which leads to no file "
                f"(it is dangling, or the links loop)"
            )
        raise FileNotFoundError(f"no such checkpoint file: {path}")
    size = os.path.getsize(path)
    if size == 0:
        raise CheckpointError(f"{path} is empty (0 bytes): not a checkpoint; was its save interrupted?")
    with open(path, "rb") as f:
        head = f.read(64)
        if any(len(head) < len(start) and start.startswith(head) for start in _STARTS):
            raise CheckpointError(
                f"{path} is truncated ({size} bytes): the first bytes of a torch.save file, and nothing after them. "
                f"It was cut short while being written or copied; use an intact copy."
            )
        if head.startswith(_ZIP_MAGIC):
            f.seek(max(0, size - (1 << 16) - 22))
            tail = f.read()
            if _ZIP_END not in tail and _ZIP64_END not in tail:
                raise CheckpointError(
                    f"{path} is truncated ({size} bytes): a torch.save zip file whose end is missing, so it cannot be "
                    f"read. It was cut short while being written or copied; use an intact copy."
                )
            return "zip"
    if _LEGACY_MAGIC_NUMBER in head[:40]:
        return "legacy"
    if head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"):
        return "pickle"
    if len(head) >= 9 and head[8:9] == b"{" and int.from_bytes(head[:8], "little") < size:
        raise CheckpointError(
            f"{path} is a safetensors file, not a torch.save checkpoint: read it with safetensors.torch.load_file"
        )
    for magic, kind in ((b"\x89HDF", "an HDF5 file"), (b"\x93NUMPY", "a NumPy .npy file"), (b"GGUF", "a GGUF file")):
        if head.startswith(magic):
            raise CheckpointError(f"{path} is {kind}, not a torch.save checkpoint")
    raise CheckpointError(f"{path} is not a PyTorch checkpoint (it starts with {head[:16]!r})")


# A global the weights-only unpickler refused, as its messages name it (builtins lose their module there); the
# second, a class met as an object's class, not by GLOBAL ("... but got <class 'numpy.dtypes.Float64DType'>").
_GLOBAL_RE = re.compile(
    r"GLOBAL (\S+) (?:was not an allowed global|whose module)|add_safe_globals`?,? but got <class '([\w.]+)'>"
)
_DOTTED = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*")

# Globals that run code or commands, reach the filesystem or the network, or call arbitrary functions: what a
# malicious pickle names. No checkpoint needs them, so no message may suggest allowing one.
_CODE_MODULES = frozenset(
    "os posix nt posixpath ntpath subprocess _posixsubprocess sys shutil socket select importlib runpy pickle _pickle "
    "pickletools marshal shelve dill cloudpickle ctypes _ctypes code codeop pty tty multiprocessing concurrent "
    "threading _thread signal webbrowser pdb bdb timeit trace profile cProfile asyncio platform tempfile io _io "
    "pathlib glob fileinput operator _operator functools types inspect gc weakref urllib http ftplib smtplib "
    "telnetlib zipimport pkgutil site sysconfig commands popen2 mmap fcntl resource".split()
)
# The builtins a data file may legitimately name (containers and numbers); every other builtin can run code.
_HARMLESS_BUILTINS = frozenset(
    "set frozenset slice complex range bytearray bytes int float str list tuple dict bool".split()
)


def _normalize_global(name: str) -> str:
    return name if "." in name else f"builtins.{name}"  # torch's message drops the "builtins." prefix


# pathlib's path classes: building one holds a path and touches no file (a config may hold one: Lightning's
# hparams); pathlib's functions and methods, named by any other global, reach the filesystem.
_PATH_CLASSES = frozenset(
    f"pathlib.{m}{c}"
    for m in ("", "_local.")
    for c in ("PurePath", "PurePosixPath", "PureWindowsPath", "Path", "PosixPath", "WindowsPath")
)


def runs_code(name: str) -> bool:
    """Whether the global ``name`` (``"os.system"``) can run code, reach files or call arbitrary functions."""
    if name in _PATH_CLASSES:
        return False
    module, _, attr = _normalize_global(name).rpartition(".")
    root = module.split(".", 1)[0]
    if root in ("builtins", "__builtin__"):
        return attr not in _HARMLESS_BUILTINS
    return root in _CODE_MODULES


def _global_exists(name: str) -> bool | None:
    """Whether ``name`` names something installed, judged without importing anything (None: cannot tell)."""
    module, _, attr = name.rpartition(".")
    root = module.split(".", 1)[0]
    try:
        if root not in sys.modules and importlib.util.find_spec(root) is None:
            return False
    except (ImportError, ValueError):
        return False
    loaded = sys.modules.get(module)
    if loaded is None:
        return None
    return hasattr(loaded, attr)


def _first_line(message: str) -> str:
    text = re.sub(r"\x1b\[[0-9;]*m", "", message).strip()
    return text.splitlines()[0].strip() if text else ""


def _weights_only_reason(e: pickle.UnpicklingError) -> str:
    """The weights-only unpickler's own message, without the advice torch.load wraps around it."""
    inner = e.__context__
    if isinstance(inner, pickle.UnpicklingError):
        return _first_line(str(inner))
    message = str(e)
    for marker in ("WeightsUnpickler error: ", "\n\n"):
        if marker in message:
            return _first_line(message.rsplit(marker, 1)[1])
    return _first_line(message)


def _unsafe(p: str, named: list[str], refused: list[_untrusted.Named]) -> UnsafeCheckpointError:
    """The error for a pickle importing globals weights-only loading refuses: ``named`` by the refusal, ``refused``
    read from the opcodes."""
    names = list(dict.fromkeys(n for n in named + [g.name for g in refused if g.name] if _DOTTED.fullmatch(n)))
    unnamed = [g for g in refused if g.name is None or not _DOTTED.fullmatch(g.name)]
    named_text = ", ".join(names)
    dangerous = [n for n in names if runs_code(n)]
    missing = [] if dangerous else [n for n in names if _global_exists(n) is False]
    scripts = [n for n in missing if n.partition(".")[0] == "__main__"]
    unreadable = sorted({g.opcode for g in refused if g.opcode != "GLOBAL"})
    if not names:
        ways = ", ".join(g.describe() for g in unnamed)
        why = (
            f"it cannot be read safely. Its pickle imports a global it does not name ({ways}): only running it would "
            f"say which, and that could run anything. Do not load it with weights_only=False; nothing was executed."
        )
    elif dangerous:
        why = (
            f"its pickle names {named_text}. {', '.join(dangerous)} can run code or commands, which no checkpoint "
            f"needs: this file is malicious or broken. Do not allow it and do not load it with weights_only=False; "
            f"nothing was executed."
        )
    elif scripts:
        one = len(scripts) == 1
        classes = ", ".join(n.rpartition(".")[2] for n in scripts)
        why = (
            f"its pickle names {named_text}. {', '.join(scripts)} {'is a class' if one else 'are classes'} of the "
            f"script that saved it (pickle calls the running script __main__), which this process does not define: "
            f"the file is not corrupt, but {'that object' if one else 'those objects'} can only be rebuilt where the "
            f"script's classes are; nothing was executed. In a script that defines {classes}: "
            f"`with torch.serialization.safe_globals([{classes}]): optimshift.load(path)`; or save plain data "
            f"(dataclasses.asdict(config)) instead. `optimshift inspect` shows the rest of the file."
        )
    elif missing:
        why = (
            f"its pickle names {named_text}, and no installed package provides {', '.join(missing)}: the file is "
            f"corrupt, or needs a package this environment lacks; nothing was executed."
        )
    elif unreadable or unnamed:
        # NOTE: allowing a global cannot help here: weights-only loading reads none of these opcodes.
        also = " and imports a global it does not name" if unnamed else ""
        why = (
            f"it cannot be read safely. Its pickle names {named_text} through {'/'.join(unreadable) or 'GLOBAL'}"
            f"{also}, opcodes weights-only loading does not read; nothing was executed. If you wrote it, save it "
            f"again with torch.save's default pickle protocol."
        )
    else:  # how to allow every one of them (allowing one only reveals the next)
        one = len(names) == 1
        what = f"{names[0]} is a class you expect (a config object)" if one else "these are classes you expect"
        flags = " ".join(f"--allow-global {n}" for n in names)
        why = (
            f"its pickle names {named_text}. Loading it would import and call that code (a checkpoint can run "
            f"anything this way), and optimshift only loads with weights_only=True; nothing was executed. If you "
            f"trust the file and {what}, allow just {'it' if one else 'them'}: "
            f"`with torch.serialization.safe_globals([{named_text}]): optimshift.load(path)` "
            f"(or `optimshift inspect/convert {flags}`). Only for a file you fully trust: "
            f"torch.load(path, weights_only=False)."
        )
    return UnsafeCheckpointError(f"refused to load {p}: {why}", names)


class _MapLocationFailure(Exception):
    """Raised through torch.load when the caller's map_location itself fails (not the file's fault)."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


def _guarded_map_location(map_location: Any, p: str) -> Any:
    """``map_location`` for torch.load, its devices checked first (a missing one is no broken file); a callable's own
    errors passed through."""
    if callable(map_location):

        def call(storage: Any, location: str) -> Any:
            try:
                return map_location(storage, location)
            except Exception as e:
                raise _MapLocationFailure(e) from e

        return call
    targets = map_location.values() if isinstance(map_location, Mapping) else [map_location]
    for target in targets:
        if target is None:
            continue
        try:
            torch.empty(0, device=target)
            # (and a place torch.load restores storages to: "cpu:1" holds tensors, but torch.load refuses it mid-file)
            storage = torch.empty(0).untyped_storage()
            torch.serialization.default_restore_location(storage, str(target))  # type: ignore[no-untyped-call]
        except Exception as e:
            raise RuntimeError(
                f"load {p}: map_location {target!r} is not a device this machine can hold "
                f"tensors on ({_first_line(str(e))})"
            ) from None
    return map_location


_OPCODE_NAMES = {ord(op.code): op.name for op in pickletools.opcodes}


def _host_out_of_memory(p: str, e: BaseException) -> bool:
    """Whether ``e`` is the host running out of memory for a storage no larger than the file (a larger one is a
    damaged or hostile file)."""
    found = re.search(r"can't allocate memory: you tried to allocate (\d+) bytes", str(e))
    if not isinstance(e, RuntimeError) or found is None:
        return False
    try:
        return int(found.group(1)) <= os.path.getsize(p)
    except OSError:
        return False


def _load_error(p: str, kind: str, e: BaseException) -> BaseException:
    """What a failed ``torch.load`` of ``p`` raises instead: UnsafeCheckpointError for a pickle importing a global
    weights-only loading refuses (named in the refusal or read from its opcodes), else CheckpointError."""
    # NOTE: whatever broke, a pickle that imports code is reported as such, never as "corrupt": a user told
    # "corrupt" may try torch.load(weights_only=False), which would run it.
    found = _untrusted.scan(p, kind)
    refused = _untrusted.refused(found)
    reason = _weights_only_reason(e) if isinstance(e, pickle.UnpicklingError) else ""
    named = [_normalize_global(a or b) for a, b in _GLOBAL_RE.findall(reason)]
    if named or refused:
        return _unsafe(p, named, refused)
    if kind == "pickle":
        return CheckpointError(
            f"{p} is a plain pickle (written by pickle.dump), not a torch.save checkpoint; "
            f"optimshift only reads torch.save files"
        )
    if isinstance(e, pickle.UnpicklingError):
        if "must be imported to load" in reason:
            return CheckpointError(f"{p} cannot be loaded yet: {reason}; nothing was executed")
        # (a deque, a class of a module: weights-only loading rebuilds a container by appending to lists only; a
        # builtin named there, a dict, is a damaged pickle)
        appended = re.search(r"Can only (?:append to|extend) lists, but got <class '(\w+(?:\.\w+)+)'>", reason)
        if appended:
            return CheckpointError(
                f"{p} holds a {appended.group(1)} (saved in the optimizer's state), which weights-only loading cannot "
                f"rebuild: it appends only to lists. The file is sound; nothing was executed. Keep a list in "
                f"the state instead (list(d), and a deque again after the load), or, only for a file you fully "
                f"trust, torch.load(path, weights_only=False)"
            )
        operand = re.search(r"Unsupported operand (\d+)", reason)
        opcode = _OPCODE_NAMES.get(int(operand.group(1))) if operand else None
        if opcode is not None and (found.protocol or 0) >= 4:  # a valid opcode of a protocol torch cannot read
            if kind == "legacy":
                return CheckpointError(
                    f"{p} is a legacy-format torch.save file (_use_new_zipfile_serialization=False) written with "
                    f"pickle protocol {found.protocol}, whose {opcode} opcode weights-only loading cannot read; "
                    f"nothing was executed. Re-save it in torch.save's default format (or, only if you fully "
                    f"trust it, torch.load(weights_only=False))."
                )
            return CheckpointError(
                f"{p} was written with pickle protocol {found.protocol} (torch.save(..., pickle_protocol="
                f"{found.protocol})), whose {opcode} opcode weights-only loading cannot read; every global it names "
                f"is one weights-only loading allows, and nothing was executed. Re-save it with torch.save's "
                f"default protocol."
            )
        return CheckpointError(f"{p} is corrupt: its pickle cannot be read ({reason}); nothing was executed")
    if isinstance(e, RecursionError):
        return CheckpointError(f"{p} is corrupt or hostile: its objects are nested too deeply to load")
    if isinstance(e, torch.OutOfMemoryError) or _host_out_of_memory(p, e):
        # (the memory ran out for what the file holds: the file was not judged)
        add_note(e, f"optimshift: out of memory while loading {p} (the file itself may be sound)")
        return e
    if isinstance(e, MemoryError):
        return CheckpointError(
            f"{p} asks for more memory than this machine has while loading (MemoryError): "
            f"it is corrupt, or too large to load without mmap=True"
        )
    first = _first_line(str(e)) or "unexpected end of file"
    return CheckpointError(f"{p} is truncated or corrupt ({type(e).__name__}: {first})")


def load(path: PathLike, *, map_location: Any = "cpu", mmap: bool = True) -> Any:
    """``torch.load(path, weights_only=True)``, with clear errors; never runs code from the file.

    ``map_location="cpu"`` opens checkpoints saved on any device. ``mmap=True`` (zip format; ignored for legacy
    files) leaves the tensors backed by the file, which must not be rewritten in place while they are in use
    (:func:`save` renames a new file over it; ``optimshift.load_state_dict`` copies by default); every storage is
    checked against its record's size first, as ``mmap=False`` does. Raises :class:`UnsafeCheckpointError` for a
    pickle importing a global weights-only loading refuses, by any opcode (nothing imported or run),
    :class:`CheckpointError` for any other unreadable file (empty, truncated, corrupt, another format, objects
    replacing their own methods), and ``FileNotFoundError``, ``PermissionError``, ``IsADirectoryError`` or
    ``NotADirectoryError`` for a path that cannot be opened.
    """
    p = file_path(path, "load")
    kind = _sniff(p)
    use_mmap = mmap and kind == "zip"
    where = _guarded_map_location(map_location, p)
    obj = _torch_load(p, kind, where, use_mmap)
    if use_mmap:
        try:
            _records.check_records(p)
        except _records.RecordMismatch as e:
            raise CheckpointError(
                f"{p} is corrupt: {e} (a record cut short or a size changed in its pickle); nothing was loaded"
            ) from None
        except _records.Unverifiable:
            # The sizes cannot be read without torch's unpickler: load eagerly, which checks every record.
            del obj
            obj = _torch_load(p, kind, where, False)
    shadowed = _untrusted.shadowed_attribute(obj)
    if shadowed is not None:
        # NOTE: weights-only loading lets a pickle set any attribute on a tensor or an OrderedDict; one that
        # replaces a method (__reduce_ex__, items) breaks whoever calls it later with an error of theirs.
        raise CheckpointError(
            f"{p} is corrupt or hostile: its pickle {shadowed} (no checkpoint does that); nothing was executed "
            f"and nothing was returned"
        )
    return obj


def verify_checksums(path: PathLike) -> None:
    """CheckpointError for a ``torch.save`` zip file a record of which fails its CRC-32 (a flipped bit torch's reader
    takes); ``inspect`` and ``convert`` ask first (a converted file would carry the damage under valid checksums)."""
    p = file_path(path, "verify_checksums")
    if _sniff(p) != "zip":
        return
    try:
        _records.check_checksums(p)
    except _records.RecordMismatch as e:
        raise CheckpointError(f"{p} is corrupt: {e}; nothing was read from it") from None
    except _records.Unverifiable:
        pass  # (a zip the checksum pass cannot walk: torch's reader says what is wrong with it)


# torch's RuntimeErrors that say nothing is wrong with the file: saved on a device this machine lacks, and no
# map_location; a tensor subclass rebuilt as a wrapper (a DTensor) and a callable map_location
_NOT_THE_FILE = ("Attempting to deserialize object on", "Callable map_location not supported")


def _torch_load(p: str, kind: str, map_location: Any, mmap: bool) -> Any:
    try:
        # (torch's zip reader takes UTF-8 names only: one with bytes os.fsdecode kept as surrogates, a Latin-1
        # name, is read from its open file; a surrogate is what fails to encode as UTF-8)
        if any("\ud800" <= c <= "\udfff" for c in p):
            with open(p, "rb") as f:
                return torch.load(f, map_location=map_location, weights_only=True)
        return torch.load(p, map_location=map_location, mmap=mmap, weights_only=True)
    except (FileNotFoundError, PermissionError, IsADirectoryError):
        raise
    except Exception as e:
        failed = e if isinstance(e, _MapLocationFailure) else e.__context__
        if isinstance(failed, _MapLocationFailure):
            raise failed.error from None
        for error in (e, failed):  # (torch < 2.6 raised a weights-only load's RuntimeError as an UnpicklingError)
            if isinstance(error, RuntimeError) and any(m in str(error) for m in _NOT_THE_FILE):
                raise error from None  # not the file's fault (not scanned as a damaged one: load_located retries)
        raise _load_error(p, kind, e) from None


class Opaque:
    """What ``inspect`` builds in place of a class it does not import: the pickle's arguments and state, as data."""

    name = "?"  # the global it stands for: "__main__.Config"

    def __new__(cls, *args: Any, **kwargs: Any) -> Opaque:
        obj = object.__new__(cls)
        obj.__dict__["args"] = args
        return obj

    def __setstate__(self, state: Any) -> None:
        self.__dict__["state"] = state

    def __repr__(self) -> str:
        return f"<{self.name}, not rebuilt>"


def _opaque_class(name: str) -> type[Opaque]:
    """A subclass of :class:`Opaque` that weights-only loading allows under the global ``name``."""
    module, _, qualname = name.rpartition(".")
    return type(qualname, (Opaque,), {"__module__": module, "__qualname__": qualname, "name": name})


def load_located(path: PathLike) -> tuple[Any, Mapping[int, str]]:
    """:func:`load` onto the host, with where each storage was saved (``{data_ptr: "cuda:0"}``, read by
    :func:`saved_location`): a load from a file places what it must by where the tensors were, not map_location."""
    locations: dict[int, str] = {}

    def keep(storage: Any, location: str) -> Any:
        with contextlib.suppress(Exception):
            locations[storage.data_ptr()] = location
        return storage

    try:
        return load(path, map_location=keep), locations
    except RuntimeError as e:
        if _NOT_THE_FILE[1] not in str(e):
            raise
    # NOTE: a tensor subclass rebuilt as a wrapper (a DTensor: FSDP2's per-rank files) takes no callable
    # map_location in torch; a dict's is asked the tags alone, without their storages
    tags = _Tags()
    return load(path, map_location=tags), tags.everywhere()


def _load_recording(path: PathLike) -> tuple[Any, Mapping[int, str], list[str]]:
    """:func:`load_located`, each global weights-only loading refuses built as an :class:`Opaque` object (unless one
    can run code), and their names."""
    stood_in: list[str] = []
    allow: Any = getattr(torch.serialization, "safe_globals", None)  # (torch >= 2.5)
    while True:
        try:
            with allow([_opaque_class(n) for n in stood_in]) if stood_in else contextlib.nullcontext():
                return (*load_located(path), stood_in)
        except UnsafeCheckpointError as e:
            more = [n for n in e.globals if n not in stood_in]
            if allow is None or not more or any(runs_code(n) for n in e.globals):
                raise
            stood_in.extend(more)  # (each retry stands in for more names, of the finitely many the file has)


class _Tags(dict[Any, str]):
    """A dict ``map_location`` that maps every tag to the host and keeps the tags (torch asks it no storage): with one
    tag each storage was saved there, with several on "one of" them (:meth:`everywhere`)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[str] = set()

    def get(self, key: Any, default: Any = None) -> str:
        self.seen.add(str(key))
        return "cpu"

    def everywhere(self) -> Mapping[int, str]:
        return _Everywhere(next(iter(self.seen)) if len(self.seen) == 1 else "one of " + ", ".join(sorted(self.seen)))


class _Everywhere(dict[int, str]):
    """A table of where each storage was saved that says one place for every storage."""

    def __init__(self, tag: str) -> None:
        super().__init__()
        self.tag = tag

    def get(self, key: Any, default: Any = None) -> str:
        return self.tag


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """The bytes of the storages ``tensors`` are on, each once (a tensor without one: its own bytes)."""
    seen: set[int] = set()
    total = 0
    for t in tensors:
        try:
            s = t.untyped_storage()
            key = s.data_ptr()
            if key in seen and key != 0:
                continue
            seen.add(key)
            total += s.nbytes()
        except Exception:
            total += tensor_bytes(t)
    return total


def saved_location(t: torch.Tensor, locations: Mapping[int, str]) -> str:
    """Where ``t`` was saved (its storage's location tag), given :func:`_load_recording`'s table."""
    try:
        ptr = local_tensor(t).untyped_storage().data_ptr()  # (a DTensor's: its local shard's)
    except Exception:
        return str(t.device)
    return locations.get(ptr, str(t.device))


_TAG = re.compile(r"([A-Za-z_]\w*)(?::(\d+))?")


def tag_device(tag: str, unknown: dict[torch.device, str] | None = None) -> torch.device | None:
    """The device a storage's location tag names, for torch's placement rules (None for a malformed tag). NOTE: a
    type torch cannot parse is another process's PrivateUse1 backend (``npu``, ``sim``); the rules tell only the host
    from accelerators, so this process's PrivateUse1 device stands in (``unknown``: its tag, for messages)."""
    with contextlib.suppress(Exception):
        return torch.device(tag)
    match = _TAG.fullmatch(tag)
    if match is None:
        return None
    try:
        stand_in = torch.device(torch._C._get_privateuse1_backend_name(), int(match.group(2) or 0))
    except Exception:
        return None
    if unknown is not None:
        unknown.setdefault(stand_in, tag)
    return stand_in
