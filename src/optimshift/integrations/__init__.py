"""Optional integrations: make training frameworks place optimizer state the way a fresh optimizer would.

Each submodule is opt-in and imports its framework only when you import it; importing :mod:`optimshift` or
this package never imports Lightning, Accelerate, verl, DeepSpeed or any optimizer library.

- :mod:`optimshift.integrations.lightning`: ``patch()`` for ``Trainer`` and ``Fabric`` (strategy setup,
  checkpoint restore, teardown); ``OffloadOptimizerDuringEval`` keeps the state on the host during evaluation.
- :mod:`optimshift.integrations.accelerate`: ``patch()`` for ``Accelerator.prepare`` and ``load_state``.
- :mod:`optimshift.integrations.verl`, :mod:`optimshift.integrations.deepspeed`: importing one patches verl's
  optimizer offload/load, DeepSpeed's ZeRO-1/2 ``offload_states``/``reload_states``, onto the host pool.
- :mod:`optimshift.integrations.third_party`: ``register()`` installs the placement policies that third-party
  optimizer libraries need (``pytorch_optimizer``), and documents the classes no policy can fix.

Each is also an attribute of this package, imported on first access (``optimshift.integrations.lightning``).
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
