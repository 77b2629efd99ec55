"""How the ``optimshift`` command presents itself: wrapped plain-text help, and its version line."""

from __future__ import annotations

import argparse
import platform
import re
import textwrap
from typing import Any

__all__ = ["HelpFormatter", "SubcommandParser", "version_text"]


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
