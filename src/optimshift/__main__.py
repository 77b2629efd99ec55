"""``python -m optimshift``: the same as the ``optimshift`` command (see :mod:`optimshift.cli`)."""

import os
import sys


def _as_the_command() -> None:
    """Resolve modules as the ``optimshift`` command does: ``python -m`` puts the current folder first on
    ``sys.path`` (the command does not), where a checkpoint's globals (``--allow-global``) would be imported
    from; ``-P``/``PYTHONSAFEPATH`` already leave it out."""
    if getattr(sys.flags, "safe_path", False) or not sys.path:
        return
    if sys.path[0] in ("", os.curdir) or os.path.abspath(sys.path[0]) == os.getcwd():
        del sys.path[0]


if __name__ == "__main__":
    _as_the_command()
    from .cli import main

    sys.exit(main())
