"""``python -m optimshift.bench``: the same as ``optimshift bench`` (see :mod:`optimshift.cli`)."""

from .cli._bench import main

if __name__ == "__main__":
    raise SystemExit(main())
