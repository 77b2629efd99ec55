"""How the ``optimshift`` command presents itself: wrapped plain-text help, its version line, and a quiet end
when its reader goes away."""

from __future__ import annotations

import argparse
import os
import platform
import re
import sys
import textwrap
from collections.abc import Callable
from typing import Any

__all__ = ["HelpFormatter", "SubcommandParser", "version_text", "run_command", "CLOSED_PIPE"]

# The status of a command whose reader went away (``optimshift inspect ckpt.pt | head``): a tool killed by SIGPIPE
# reports 128 + 13 to the shell.
CLOSED_PIPE = 141


def run_command(call: Callable[[], int | None]) -> int:
    """Run a command's body and return its exit status; a reader that closed the pipe ends it quietly, as every
    Unix tool does (status 141, no traceback). Every entry point (``optimshift``, ``python -m optimshift.bench``)
    runs through it."""
    try:
        status = int(call() or 0)
        sys.stdout.flush()
    except BrokenPipeError:
        # NOTE: what is still buffered would fail again when Python flushes stdout at exit, so stdout is pointed
        # at /dev/null first.
        _discard_stdout()
        return CLOSED_PIPE
    return status


def _discard_stdout() -> None:
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (AttributeError, OSError, ValueError):  # not a file descriptor (a test's captured stream)
        pass


class HelpFormatter(argparse.HelpFormatter):
    """Help text as plain paragraphs wrapped to the terminal: a blank line separates paragraphs, and lines that
    start with ``- `` are list items (wrapped with a hanging indent). Every subcommand's parser uses it."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        out = []
        for paragraph in re.split(r"\n\s*\n", text.strip()):
            items = re.split(r"\n(?=\s*- )", paragraph.strip())
            for item in items:
                item = " ".join(item.split())
                hanging = indent + ("  " if item.startswith("- ") else "")
                out.append(
                    textwrap.fill(item, width, initial_indent=indent, subsequent_indent=hanging, break_on_hyphens=False)
                )
            out.append("")
        return "\n".join(out).rstrip("\n")


class SubcommandParser(argparse.ArgumentParser):
    """The subcommands' parsers: :class:`HelpFormatter` unless a subcommand asks for another."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:  # (ArgumentParser's own parameters, passed on)
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)


def version_text() -> str:
    """What ``optimshift --version`` prints: this package's version, and the torch and Python it runs on."""
    import torch

    from .._version import __version__

    return f"optimshift {__version__} (torch {torch.__version__}, Python {platform.python_version()})"
