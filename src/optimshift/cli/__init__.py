"""The ``optimshift`` command. Each subcommand lives in its own module and registers itself here."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

from ._help import HelpFormatter, SubcommandParser, version_text

# subcommand name -> module defining ``register(subparsers)`` (which sets ``func`` on its parser).
_COMMANDS = {
    "demo": "optimshift.cli._demo",
    "inspect": "optimshift.cli._inspect",
    "convert": "optimshift.cli._convert",
    "bench": "optimshift.cli._bench",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="optimshift",
        description="The missing optimizer.to(device): move, offload, reload, check and restore PyTorch "
        "optimizer state across devices, where a fresh optimizer would keep it.",
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--version", action="version", version=version_text())
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=SubcommandParser)
    registered = set()
    for module_name in dict.fromkeys(_COMMANDS.values()):
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            if e.name == module_name:
                continue  # a subcommand this build does not ship
            raise
        module.register(sub)
        registered.add(module_name)
    return parser


# The status of a command whose reader went away (``optimshift inspect ckpt.pt | head``): a tool killed by SIGPIPE
# reports 128 + 13 to the shell.
_CLOSED_PIPE = 141


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        status = int(args.func(args) or 0)
        sys.stdout.flush()
    except BrokenPipeError:
        # NOTE: the reader closed the pipe: end quietly, as every Unix tool does. What is still buffered would
        # fail again when Python flushes stdout at exit, so stdout is pointed at /dev/null first.
        _discard_stdout()
        return _CLOSED_PIPE
    return status


def _discard_stdout() -> None:
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (AttributeError, OSError, ValueError):  # not a file descriptor (a test's captured stream)
        pass


if __name__ == "__main__":
    sys.exit(main())
