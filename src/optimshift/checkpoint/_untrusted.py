"""Judging an untrusted checkpoint without running it: :func:`scan` lists every global its pickle would import, by
any opcode (``name=None`` where only running it would say); :func:`shadowed_attribute` finds objects that
``weights_only=True`` loading let the file give a method of their own (a tensor's ``__reduce_ex__``)."""

from __future__ import annotations

import _compat_pickle
import copyreg
import io
import pickletools
import struct
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO, Any

import torch


@dataclass(frozen=True)
class Named:
    """One global a pickle imports: its opcode, that opcode's byte offset, ``module.name`` (None where the opcodes do
    not say which), and ``code`` for ``EXT*``."""

    opcode: str
    pos: int
    name: str | None
    code: int | None = None

    def describe(self) -> str:
        if self.opcode.startswith("EXT"):
            return f"{self.opcode} extension code {self.code}"
        return f"{self.opcode} at byte {self.pos}"


@dataclass(frozen=True)
class Scan:
    """What :func:`scan` read: every global named, in order, and the pickle protocol of the object's pickle."""

    globals: tuple[Named, ...]
    protocol: int | None


_MARK = object()
_STRINGS = frozenset(
    op.name for op in pickletools.opcodes if op.stack_after in ([pickletools.pyunicode], [pickletools.pybytes_or_str])
)
_EXTENSIONS: dict[int, tuple[str, str]] = getattr(copyreg, "_inverted_registry", {})  # code -> (module, name)
_GETS = frozenset({"GET", "BINGET", "LONG_BINGET"})
_PUTS = frozenset({"PUT", "BINPUT", "LONG_BINPUT"})


def _compat(module: str, name: str) -> str:
    """``module.name`` as Python 3 imports it, as torch's unpickler maps it (protocol 2 says ``__builtin__``)."""
    if (module, name) in _compat_pickle.NAME_MAPPING:
        module, name = _compat_pickle.NAME_MAPPING[(module, name)]
    elif module in _compat_pickle.IMPORT_MAPPING:
        module = _compat_pickle.IMPORT_MAPPING[module]
    return f"{module}.{name}"


def _scan_one(f: IO[bytes], found: list[Named]) -> tuple[int | None, bool]:
    """Append the globals of the one pickle at ``f``'s position to ``found``; return its protocol and whether it
    parsed to its STOP. What parsed before a malformed opcode counts: an unpickler would have run it."""
    stack: list[Any] = []  # what each opcode left: a string, _MARK, or None for anything else
    memo: dict[Any, Any] = {}
    protocol = None

    def pop() -> Any:
        return stack.pop() if stack else None

    ops = pickletools.genops(f)
    while True:
        try:
            op, arg, at = next(ops)
        except StopIteration:
            return protocol, True
        except (ValueError, EOFError, OverflowError, struct.error):  # malformed from here: an unpickler stops too
            return protocol, False
        name, pos = op.name, at or 0
        if name == "PROTO" and protocol is None and isinstance(arg, int):
            protocol = arg
        if name in ("GLOBAL", "INST"):
            module, _, attr = str(arg).partition(" ")
            found.append(Named(name, pos, _compat(module, attr)))
        elif name == "STACK_GLOBAL":
            attr, module = pop(), pop()
            named = f"{module}.{attr}" if isinstance(module, str) and isinstance(attr, str) else None
            found.append(Named(name, pos, named))
            stack.append(None)
            continue
        elif name.startswith("EXT"):
            code = arg if isinstance(arg, int) else -1
            key = _EXTENSIONS.get(code)  # what copyreg.add_extension registered for the code, if anything
            found.append(Named(name, pos, f"{key[0]}.{key[1]}" if key else None, code))
        if name == "DUP":
            stack.append(stack[-1] if stack else None)
        elif name in _GETS:
            stack.append(memo.get(arg))
        elif name in _PUTS:
            memo[arg] = stack[-1] if stack else None
        elif name == "MEMOIZE":
            memo[len(memo)] = stack[-1] if stack else None
        else:
            before = op.stack_before
            if pickletools.markobject in before:
                while stack and stack[-1] is not _MARK:
                    stack.pop()
                pop()  # the mark
                for _ in range(before.index(pickletools.markobject)):
                    pop()
            else:
                for _ in before:
                    pop()
            for item in op.stack_after:
                if item is pickletools.markobject:
                    stack.append(_MARK)
                else:
                    stack.append(arg if name in _STRINGS and isinstance(arg, str) else None)


def _pickles(path: str, kind: str) -> Iterator[IO[bytes]]:
    """The file whose position starts the pickles an unpickler would run: a zip's data.pkl, or the file itself."""
    if kind == "zip":
        try:
            with zipfile.ZipFile(path) as zf:
                names = zf.namelist()
                # torch's reader: every record sits under the first record's top folder (the archive name).
                pkl = f"{names[0].split('/', 1)[0]}/data.pkl" if names else ""
                data = zf.read(pkl) if pkl in names else b""
        except Exception:  # not a readable zip: nothing for an unpickler to run either
            return
        yield io.BytesIO(data)
    else:
        with open(path, "rb") as f:
            yield f


def scan(path: str, kind: str) -> Scan:
    """Every global the pickles of ``path`` (sniffed as ``zip``, ``legacy`` or ``pickle``) import, read from their
    opcodes without running anything."""
    found: list[Named] = []
    protocols: list[int | None] = []
    for f in _pickles(path, kind):
        # NOTE: a legacy file is five pickles (magic number, protocol, system info, the object, its storage
        # keys), then raw storage bytes; a plain pickle or data.pkl is one. Read pickles until one stops parsing.
        for _ in range(5 if kind != "zip" else 1):
            protocol, complete = _scan_one(f, found)
            protocols.append(protocol)
            if not complete:
                break
    return Scan(tuple(found), next((p for p in protocols if p is not None), None))


def refused(found: Scan) -> list[Named]:
    """The globals of ``found`` that weights-only loading does not allow (as of now: ``safe_globals``
    included), and every one the opcodes do not name."""
    from torch import _weights_only_unpickler as wou

    try:
        # (_get_user_allowed_globals is unannotated in torch)
        allowed = set(wou._get_allowed_globals()) | set(wou._get_user_allowed_globals())  # type: ignore[no-untyped-call]
    except (AttributeError, TypeError):  # a torch without these private helpers: nothing counts as allowed
        allowed = set()
    blocked = set(getattr(wou, "_blocklisted_modules", ()))
    return [g for g in found.globals if g.name is None or g.name.rpartition(".")[0] in blocked or g.name not in allowed]


# --- what loading built --------------------------------------------------------------------------------------

_ATOMS = (str, bytes, bytearray, int, float, complex, bool, type(None), torch.dtype, torch.device, torch.Size)


def _replaces(cls: type, key: str) -> bool:
    """Whether an instance attribute ``key`` replaces what ``cls`` defines as behaviour: a method, a property or
    another descriptor, or a class (a plain value default that instances override is fine)."""
    attr = next((klass.__dict__[key] for klass in cls.__mro__ if key in klass.__dict__), _MARK)
    return attr is not _MARK and (callable(attr) or hasattr(type(attr), "__get__"))


def _key_text(key: Any) -> str:
    return repr(key) if isinstance(key, (str, int, float, bool, type(None))) else f"<{type(key).__name__}>"


def shadowed_attribute(obj: Any) -> str | None:
    """Where ``obj`` (a loaded checkpoint) holds an object whose own attribute replaces behaviour its class defines,
    in words, else None; nothing is called on the objects (containers read through the base types' methods)."""
    seen: set[int] = set()
    todo: list[tuple[Any, str]] = [(obj, "")]
    while todo:
        value, where = todo.pop()
        if isinstance(value, _ATOMS) or id(value) in seen:
            continue
        seen.add(id(value))
        try:
            attrs = object.__getattribute__(value, "__dict__")
        except AttributeError:
            attrs = None
        if isinstance(attrs, dict):
            for key in dict.keys(attrs):
                if isinstance(key, str) and _replaces(type(value), key):
                    what = type(value).__name__
                    return f"sets {key!r} on the {what} at {where or 'the top'}, in place of its class's own"
            todo.extend((v, f"{where}.{k}") for k, v in dict.items(attrs))
        if isinstance(value, dict):
            for k, v in dict.items(value):
                todo.append((v, f"{where}[{_key_text(k)}]"))
                todo.append((k, f"{where} (a key)"))
        elif isinstance(value, (list, tuple)):
            items = list.__iter__(value) if isinstance(value, list) else tuple.__iter__(value)
            todo.extend((v, f"{where}[{i}]") for i, v in enumerate(items))
        elif isinstance(value, (set, frozenset)):
            items = set.__iter__(value) if isinstance(value, set) else frozenset.__iter__(value)
            todo.extend((v, f"{where} (an element)") for v in items)
        elif isinstance(value, torch.Tensor):
            grad = value._grad  # no warning for a non-leaf, unlike .grad
            if grad is not None:
                todo.append((grad, f"{where}.grad"))
    return None
