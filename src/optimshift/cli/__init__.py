"""The ``optimshift`` command. Each subcommand lives in its own module and registers itself here."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from ._help import HelpFormatter, SubcommandParser, run_command, version_text

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


def main(argv: Sequence[str] | None = None) -> int:
    return run_command(lambda: _run(argv))


def _run(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)  # (its help and errors are written here: inside run_command too)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
