"""``python -m optimshift``: the same as the ``optimshift`` command (see :mod:`optimshift.cli`)."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
