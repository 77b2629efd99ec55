"""Optional integrations: make training frameworks place optimizer state the way a fresh optimizer would
(``lightning``, ``accelerate``, ``verl``, ``deepspeed``; ``third_party``: policies for optimizer libraries).

Each submodule imports its framework only when it is imported (an attribute of this package, on first access):
importing :mod:`optimshift` or this package never imports a framework or an optimizer library. NOTE: importing
``verl`` or ``deepspeed`` (so accessing it here too) patches that framework at once; the others need ``patch()``.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from . import accelerate as accelerate
    from . import lightning as lightning
    from . import third_party as third_party

__all__: list[str] = []


def _public_modules() -> list[str]:
    return sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_"))


def __getattr__(name: str) -> Any:
    # NOTE: lazy (PEP 562), and for any public submodule present (integrations added later need no entry
    # here): importing this package must not import a framework; accessing one imports it.
    if name in _public_modules():
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_public_modules()))
