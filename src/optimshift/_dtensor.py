"""DTensor (FSDP2, tensor parallel) optimizer state: move the local shard, keep the mesh and placements. Imports
nothing from ``torch.distributed`` (no DTensor exists unless ``torch.distributed.tensor`` was imported)."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, TypeGuard

import torch

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor


def is_dtensor(t: Any) -> TypeGuard[DTensor]:
    """Whether ``t`` is a ``torch.distributed.tensor.DTensor``, without importing torch.distributed."""
    module = sys.modules.get("torch.distributed.tensor")
    cls = getattr(module, "DTensor", None) if module is not None else None
    return cls is not None and isinstance(t, cls)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (``t`` itself for a plain tensor)."""
    return t.to_local() if is_dtensor(t) else t


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes ``t`` occupies on this process; for a DTensor, those of the local shard (global numel would count
    every rank's memory as this rank's); 0 for a layout without a numel (sparse and other exotic ones)."""
    t = local_tensor(t)
    try:
        return t.numel() * t.element_size()
    except Exception:
        return 0


def wrap_local(like: DTensor, local: torch.Tensor) -> torch.Tensor:
    """A DTensor with ``like``'s mesh, placements, global shape and stride around ``local`` (a copy of its shard):
    DTensor's own constructor, which, unlike ``DTensor.from_local``, leaves the shard where :mod:`._copy` put it."""
    return type(like)(local, like._spec, requires_grad=False)


def row_fields(t: torch.Tensor) -> dict[str, Any]:
    """Extra :class:`optimshift.PlacementRow` fields for a DTensor (``{}`` for a plain tensor): the local
    shard's shape and the placements on the mesh, e.g. ``"Shard(dim=0) on cpu mesh (2,)"``."""
    if not is_dtensor(t):
        return {}
    mesh, placements = t.device_mesh, ", ".join(repr(p) for p in t.placements)
    where = f"{placements} on {mesh.device_type} mesh {tuple(mesh.shape)}"
    return {"local_shape": tuple(t.to_local().shape), "placements": where}
