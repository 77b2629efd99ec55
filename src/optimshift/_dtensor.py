"""DTensor (FSDP2, tensor parallel) optimizer state: move the local shard, keep the mesh and placements.

This module imports nothing from ``torch.distributed`` at import time: the core modules call
:func:`is_dtensor` on every tensor, and it only looks ``torch.distributed.tensor`` up in ``sys.modules``
(a DTensor cannot exist unless that module was imported), so ``import optimshift`` stays light.
"""

from __future__ import annotations

import contextlib
import sys
from typing import TYPE_CHECKING, Any, Protocol, TypeGuard

import torch

from ._device_streams import in_pinned_memory, pins_copy, pins_host_for
from ._state import like_source

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

__all__ = ["is_dtensor", "copy_dtensor", "local_tensor", "wrap_local", "row_fields", "tensor_bytes"]


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


class _Issuer(Protocol):
    """Where a copy is queued (``_copy.Side``): ``issue()`` makes its stream current, ``uses`` records tensors."""

    def issue(self) -> contextlib.AbstractContextManager[None]: ...

    def uses(self, *tensors: torch.Tensor) -> None: ...


def copy_dtensor(
    t: DTensor,
    device: torch.device,
    *,
    non_blocking: bool = False,
    pin_memory: bool = False,
    side: _Issuer | None = None,
) -> torch.Tensor:
    """A copy of DTensor ``t`` whose local shard is on ``device``: same mesh, placements, global shape and
    stride, same dtype and bitwise-equal values (the policy already decided ``device`` for this shard).

    Uses only DTensor's own dispatch (``empty_like`` and ``copy_`` are sharding-preserving local ops, no
    collectives). ``DTensor.from_local`` cannot be used here: it moves the shard back to the mesh's device
    type, which would undo every offload to the host.
    """
    src = t.detach()
    local = src.to_local()  # type: ignore[attr-defined]  # torch types detach() as returning a Tensor
    # (the same rules as every copy: _device_streams.pins_copy, in_pinned_memory; the engine synchronizes at the end)
    pin = pins_copy(local, device, pin_memory)
    from_pinned = pins_host_for(device) and in_pinned_memory(local)
    new = torch.empty_like(src, device=device, pin_memory=pin)  # preserve_format: the shard keeps its strides
    with contextlib.nullcontext() if side is None else side.issue():  # (allocated on the current stream)
        new.copy_(src, non_blocking=non_blocking or pin or from_pinned)
    if side is not None:
        side.uses(src, new)
    return like_source(t, new)


def wrap_local(like: DTensor, local: torch.Tensor) -> torch.Tensor:
    """A DTensor with ``like``'s mesh, placements, global shape and stride around ``local`` (a copy of its local
    shard, on any device): DTensor's own constructor, which, unlike ``DTensor.from_local``, leaves the shard where
    it is (the grouped copies of :mod:`optimshift._copy` made it)."""
    return type(like)(local, like._spec, requires_grad=False)


def row_fields(t: torch.Tensor) -> dict[str, Any]:
    """Extra :class:`optimshift.PlacementRow` fields for a DTensor (``{}`` for a plain tensor): the local
    shard's shape and the placements on the mesh, e.g. ``"Shard(dim=0) on cpu mesh (2,)"``."""
    if not is_dtensor(t):
        return {}
    mesh = t.device_mesh
    placements = ", ".join(repr(p) for p in t.placements)
    return {
        "local_shape": tuple(t.to_local().shape),
        "placements": f"{placements} on {mesh.device_type} mesh {tuple(mesh.shape)}",
    }
