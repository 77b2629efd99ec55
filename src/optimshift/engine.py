"""Execute a plan: copy every tensor that must move, synchronize once, then commit.

All-or-nothing: every copy is made before any state entry is replaced. An exception while copying (an OOM on
the 900th tensor) drops the copies made so far and leaves the optimizer exactly as it was. The commit only
assigns already-made objects into dicts, lists and attributes, which cannot fail.
"""

from __future__ import annotations

import contextlib
import functools
import gc
from typing import Any, Iterable, Iterator, Mapping

import torch

from ._tree import Setter, rebuild
from .distributed._dtensor import copy_dtensor, is_dtensor  # imports no torch.distributed machinery
from .plan import Plan

__all__ = ["execute", "commit", "apply", "synchronize"]


@functools.lru_cache(maxsize=None)
def _cuda_available() -> bool:
    return torch.cuda.is_available()


def _can_pin(source: torch.Tensor) -> bool:
    """Pinned host memory only helps (and only exists) for copies from a CUDA-like accelerator."""
    return source.device.type == "cuda" and _cuda_available()


def _is_pinned(t: torch.Tensor) -> bool:
    """A copy from pinned host memory can be asynchronous (asking without CUDA would initialize it)."""
    return t.device.type == "cpu" and _cuda_available() and t.is_pinned()


def copy_tensor(t: torch.Tensor, device: torch.device, *, non_blocking: bool = False, pin_memory: bool = False) -> torch.Tensor:
    """A copy of ``t`` on ``device`` with the same dtype, shape, strides and values (a move is not a cast)."""
    if is_dtensor(t):  # FSDP2/TP state: the local shard moves; mesh, placements and global shape stay
        return copy_dtensor(t, device, non_blocking=non_blocking, pin_memory=pin_memory)
    pin = pin_memory and device.type == "cpu" and _can_pin(t) and t.layout == torch.strided
    if pin:
        shape_like = _dense_non_overlapping(t)
        new = torch.empty_strided(t.shape, t.stride() if shape_like else _contiguous_strides(t.shape),
                                  dtype=t.dtype, device=device, pin_memory=True)
        new.copy_(t.detach(), non_blocking=True)  # completed by the one synchronize() of execute()
    elif t.requires_grad:
        new = t.detach().to(device, copy=True, non_blocking=non_blocking or _is_pinned(t)).requires_grad_(True)
    else:
        new = t.to(device, copy=True, non_blocking=non_blocking or _is_pinned(t))
    if isinstance(t, torch.nn.Parameter) and not isinstance(new, torch.nn.Parameter):
        new = torch.nn.Parameter(new, requires_grad=t.requires_grad)
    return new


def _contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    strides, running = [], 1
    for size in reversed(shape):
        strides.append(running)
        running *= max(size, 1)
    return tuple(reversed(strides))


def _dense_non_overlapping(t: torch.Tensor) -> bool:
    if t.is_contiguous():
        return True
    # Sort dims by stride and check the strides tile the storage exactly (as empty_like's preserve_format does).
    dims = sorted((s, n) for s, n in zip(t.stride(), t.shape) if n != 1)
    expected = 1
    for stride, size in dims:
        if stride != expected:
            return False
        expected *= size
    return True


def synchronize(devices: Iterable[torch.device]) -> None:
    """Wait for the copies queued on each accelerator (one call per device, not per tensor)."""
    for device in {d for d in devices if d.type not in ("cpu", "meta")}:  # one wait per device
        try:
            module = torch.get_device_module(device.type)
        except Exception:
            module = getattr(torch, device.type, None)
        sync = getattr(module, "synchronize", None)
        available = getattr(module, "is_available", lambda: True)
        if sync is not None and available():  # not available: fake tensors that only claim the device
            try:
                sync(device)
            except TypeError:
                sync()


def execute(plan: Plan, *, non_blocking: bool = False, pin_memory: bool = False) -> dict[int, torch.Tensor]:
    """Copy every tensor of ``plan`` that is not where it belongs; return ``{id(old): new}``.

    Nothing in the optimizer changes here. With ``non_blocking=False`` the accelerators involved are
    synchronized once at the end, so every copy is complete when this returns.
    """
    copies: dict[int, torch.Tensor] = {}
    touched: set[torch.device] = set()
    for transfer in plan.transfers:
        t, target = transfer.tensor, transfer.target
        if t.device == target or id(t) in copies:
            continue
        copies[id(t)] = copy_tensor(t, target, non_blocking=non_blocking, pin_memory=pin_memory)
        touched.add(t.device)
        touched.add(target)
    if not non_blocking:
        synchronize(touched)
    return copies


def commit(optimizer: Any, replace: Mapping[int, torch.Tensor]) -> None:
    """Swap the copies into ``optimizer``'s state and param groups. Prepares everything, then assigns."""
    if not replace:
        return
    assignments: list[tuple[Any, Any, Any]] = []  # (mapping, key, new value)
    setters: list[Setter] = []  # in-place updates inside nested containers
    memo: dict[int, Any] = {}
    for state in optimizer.state.values():
        _prepare_mapping(state, (), replace, assignments, setters, memo)
    for group in optimizer.param_groups:
        _prepare_mapping(group, ("params", "param_names"), replace, assignments, setters, memo)
    for mapping, key, value in assignments:
        mapping[key] = value
    for apply_one in setters:
        apply_one()


def _prepare_mapping(mapping: Any, skip: tuple, replace: Mapping[int, torch.Tensor], assignments: list,
                     setters: list[Setter], memo: dict) -> None:
    for key, value in mapping.items():
        if isinstance(value, torch.Tensor):  # the common case, kept cheap
            new = replace.get(id(value))
            if new is not None:
                assignments.append((mapping, key, new))
        elif key not in skip:
            new = rebuild(value, replace, setters, memo)
            if new is not value:
                assignments.append((mapping, key, new))


@contextlib.contextmanager
def no_gc() -> Iterator[None]:
    """Pause the cyclic garbage collector while a plan runs: it creates many small objects next to many live
    tensors, and collections triggered by them would cost more than the copies themselves."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def apply(plan: Plan, *, non_blocking: bool = False, pin_memory: bool = False) -> int:
    """Execute and commit ``plan``; return the number of tensors moved."""
    copies = execute(plan, non_blocking=non_blocking, pin_memory=pin_memory)
    commit(plan.optimizer, copies)
    return len(copies)

