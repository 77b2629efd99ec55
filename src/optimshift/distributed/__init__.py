"""Sharded checkpoints on ``torch.distributed.checkpoint`` (every optimshift operation handles DTensor state itself):
:func:`save` (committed atomically), :func:`load` (any number of ranks, any device type, the state where a fresh
optimizer keeps it), :func:`describe_dcp` (no process group). DCP is imported on first use."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["save", "load", "describe_dcp"]

if TYPE_CHECKING:  # pragma: no cover
    from ._checkpoint import describe_dcp, load, save


def __getattr__(name: str) -> Any:
    # Lazy (PEP 562): torch.distributed.checkpoint takes seconds to import.
    if name in __all__:
        from . import _checkpoint

        return getattr(_checkpoint, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
