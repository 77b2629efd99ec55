"""What the ``optimshift`` subcommands share: colors, byte counts, errors, the globals a file may name."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import re
import sys
import time
import warnings
from collections.abc import Iterator
from typing import IO, Any

import torch

from ..checkpoint import _files as ckpt
from ..checkpoint._inspection import jsonable

__all__ = ["use_color", "paint", "human_bytes", "failure", "allowed", "short", "indent", "allow_global_arg"]


def allow_global_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--allow-global",
        action="append",
        default=[],
        metavar="NAME",
        help="allow one class the file's pickle names (e.g. a config class), for a file you trust; repeatable",
    )


# --- output helpers ----------------------------------------------------------------------------------------


def use_color(stream: IO[str]) -> bool:
    if os.environ.get("NO_COLOR") or os.environ.get("TERM") == "dumb":
        return False
    return isatty(stream)


COLORS = {"error": "31", "warning": "33", "info": "36", "bold": "1", "dim": "2"}


def isatty(stream: IO[str]) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


def paint(text: str, style: str, color: bool) -> str:
    return f"\x1b[{COLORS[style]}m{text}\x1b[0m" if color else text


def human_bytes(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    size = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        size /= 1024
        if size < 1024 or unit == "TiB":
            return f"{size:.1f} {unit}"
    return f"{size} B"  # pragma: no cover


def failure(command: str, message: str, *, as_json: bool = False, error: BaseException | None = None) -> int:
    """Report a failure in one line (stderr), or as ``{"error": {...}}`` on stdout with ``--json``; exit 1."""
    line = re.sub(r"\s*\n\s*", " ", re.sub(r"\x1b\[[0-9;]*m", "", message)).strip()
    if as_json:
        kind = type(error).__name__ if error is not None else "UsageError"
        print(json.dumps({"error": {"command": command, "type": kind, "message": line}}))
    else:
        print(f"optimshift {command}: error: {line}", file=sys.stderr)
    return 1


def _resolve_global(name: str) -> Any:
    """The object called ``name`` (``"pkg.module.Class"``), imported, for ``torch.serialization.safe_globals``."""
    module, _, attr = name.rpartition(".")
    if not module:
        raise ValueError(f"--allow-global expects a dotted name such as 'collections.OrderedDict', got {name!r}")
    if ckpt.runs_code(name):
        raise ValueError(
            f"--allow-global {name}: refused; {name} can run code or commands, which no checkpoint "
            f"needs (a file that names it is malicious or broken)"
        )
    if module == "__main__" and not hasattr(sys.modules.get("__main__"), attr):
        raise ValueError(
            f"--allow-global {name}: {attr} is a class of the script that saved the file (pickle calls the running "
            f"script __main__), which this command cannot import: `optimshift inspect` shows the file without it "
            f"(its {attr} objects not rebuilt); to load it, call optimshift.load in a script that defines {attr}, "
            f"inside `with torch.serialization.safe_globals([{attr}])`"
        )
    parts = name.split(".")
    for cut in range(len(parts) - 1, 0, -1):  # the longest importable prefix (a nested class's), then attributes
        try:
            obj: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for part in parts[cut:]:
                obj = getattr(obj, part)
        except AttributeError:
            raise ValueError(f"--allow-global {name}: {'.'.join(parts[:cut])} has no {'.'.join(parts[cut:])}") from None
        return obj
    raise ValueError(f"--allow-global {name}: cannot import {module}")


@contextlib.contextmanager
def allowed(names: list[str]) -> Iterator[None]:
    objs = [_resolve_global(n) for n in names]
    if not objs:
        yield
        return
    with torch.serialization.safe_globals(objs):
        yield


def short(value: Any) -> str:
    v = jsonable(value)
    if isinstance(v, list):  # at most _SHOWN_DEPTH deep: jsonable summarised the rest
        return "(" + ", ".join(short(x) for x in v) + ")"
    if isinstance(v, dict) and "tensor" in v:  # (a tensor: its value, or its shape, then its dtype and device)
        return "tensor(" + ", ".join(short(x) for k, x in v.items() if k != "tensor" or "value" not in v) + ")"
    if isinstance(v, float):
        return f"{v:g}"
    return str(v)


def indent(text: str, by: str = "  ") -> str:
    return "\n".join(by + line for line in text.splitlines())


@contextlib.contextmanager
def warnings_only_on_success() -> Iterator[None]:
    """Hold back the warnings torch emits while reading a file: shown if it loads, dropped if it fails (the
    error says what matters, in one line)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        yield
    for w in caught:
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)


# --- convert -----------------------------------------------------------------------------------------------


class Progress:
    """A one-line progress bar on stderr (only created for large files on a terminal)."""

    def __init__(self, label: str, total: int, stream: IO[str]) -> None:
        self.label, self.total, self.stream = label, max(total, 1), stream
        self.shown = -1
        self.start = time.monotonic()

    def __call__(self, done: int) -> None:
        pct = min(100, int(100 * done / self.total))
        if pct == self.shown:
            return
        self.shown = pct
        bar = "#" * (pct * 30 // 100)
        self.stream.write(f"\r{self.label} [{bar:<30}] {pct:3d}%  {human_bytes(done)} / ~{human_bytes(self.total)}")
        self.stream.flush()

    def close(self) -> None:
        if self.shown >= 0:
            self.stream.write(f"  {time.monotonic() - self.start:.1f}s\n")
            self.stream.flush()


def file_bytes(path: str) -> int | None:
    return os.path.getsize(path) if os.path.isfile(path) else None


def first_line(message: str) -> str:
    lines = message.strip().splitlines()
    return lines[0] if lines else ""
