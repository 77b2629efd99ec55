"""Distributed training support: DTensor (FSDP2, tensor parallel) optimizer state and sharded checkpoints.

``optimshift.move``/``offload``/``reload``/``check``/``placement``/``count_syncs`` handle DTensor state
directly (the local shard moves; mesh and placements stay). This package adds sharded checkpoints on
``torch.distributed.checkpoint``:

- :func:`save` writes a model and its optimizer as a DCP directory, committed atomically;
- :func:`load` reads one back with any number of ranks (N→M resharding, or a single process) onto any device
  type, and leaves the optimizer where a fresh one would keep its state;
- :func:`describe_dcp` lists what a DCP directory holds, without a process group.

Importing ``optimshift.distributed`` is cheap: ``torch.distributed.checkpoint`` is imported on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["save", "load", "describe_dcp"]

if TYPE_CHECKING:  # pragma: no cover
    from ._checkpoint import describe_dcp, load, save


def __getattr__(name: str) -> Any:
    # Lazy (PEP 562): `import optimshift` must stay light,
    # and torch.distributed.checkpoint takes seconds to import.
    if name in __all__:
        from . import _checkpoint

        return getattr(_checkpoint, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
