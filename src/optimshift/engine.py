"""Execute a plan: copy every tensor that must move, synchronize once, then commit.

All-or-nothing: every copy is made before any state entry is replaced. An exception while copying (an OOM on
the 900th tensor) drops the copies made so far and leaves the optimizer exactly as it was. The commit only
assigns already-made objects into dicts, lists and attributes, which cannot fail.
"""

from __future__ import annotations

import contextlib
import functools
import gc
from typing import Any, Callable, Iterable, Iterator, Mapping, Optional, Sequence

import torch

from ._state import Setter, rebuild
from ._copy import Batch, copy_many
from ._dtensor import copy_dtensor, is_dtensor, local_tensor  # imports no torch.distributed machinery
from .plan import Plan, Transfer
from .pool import HostPool, host_pool

__all__ = ["execute", "execute_batch", "run", "apply_simple", "commit", "synchronize", "copy_tensor", "PendingTransfer"]


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
    if type(t) is torch.Tensor and not pin_memory and not t.requires_grad:  # the common case, kept cheap
        if non_blocking or (_cuda_available() and device.type == "cuda" and _is_pinned(t)):
            return t.to(device, non_blocking=True)
        return t.to(device)  # (keyword arguments alone double the cost of a small .to())
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
    copies, _ = execute_batch(plan, non_blocking=non_blocking, pin_memory=pin_memory)
    return copies


def execute_batch(
    plan: Plan,
    *,
    non_blocking: bool = False,
    pin_memory: bool = False,
    keep_host_views: bool = False,
    extra: Sequence[tuple[torch.Tensor, torch.device]] = (),
    pool: Optional[HostPool] = None,
) -> tuple[dict[int, torch.Tensor], Batch]:
    """:func:`execute`, grouped through :func:`optimshift.batch.copy_many`; also returns the batch (buffers it
    holds, what to release). ``extra``: more (tensor, target) pairs to copy with the plan (e.g. grads)."""
    pool = host_pool if pool is None else pool
    items: list[tuple[torch.Tensor, torch.device]] = []
    names: list[Any] = []
    seen: set[int] = set()
    for transfer in plan.transfers:
        t, target = transfer.tensor, transfer.target
        if t.device != target and id(t) not in seen:
            seen.add(id(t))
            items.append((t, target))
            names.append(transfer)
    for t, target in extra:
        if t.device != target and id(t) not in seen:
            seen.add(id(t))
            items.append((t, target))
            names.append("a param's .grad")
    optimizer_name = type(plan.optimizer).__name__

    def describe(i: int) -> str:
        what = names[i]
        return f"{optimizer_name} {what.site}" if isinstance(what, Transfer) else f"{optimizer_name} {what}"

    batch = copy_many(items, copy_one=copy_tensor, pool=pool, pin_memory=pin_memory,
                      keep_host_views=keep_host_views, non_blocking=non_blocking, describe=describe)
    to_host = any(target.type == "cpu" and t.device.type not in ("cpu", "meta") for t, target in items)
    if batch.after_sync or not non_blocking or (to_host and not keep_host_views):
        # Host memory that state will point at must be written before anyone reads it: always wait for it
        # (a non-blocking offload is the exception: it hands out a handle to wait on).
        synchronize(batch.devices)
        batch.complete(pool)
    else:
        batch.complete(pool, _current_stream_event(batch.devices))
    copies = {id(t): new for (t, _), new in zip(items, batch.copies) if new is not None}
    return copies, batch


def _current_stream_event(devices: Iterable[torch.device]) -> Optional[Any]:
    """An event after the copies queued on the current CUDA stream (staging buffers wait for it)."""
    cuda = [d for d in devices if d.type == "cuda"]
    if not cuda or not _cuda_available():
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(cuda[0]))
    return event


def commit(optimizer: Any, replace: Mapping[int, torch.Tensor]) -> None:
    """Swap the copies into ``optimizer``'s state and param groups. Prepares everything, then assigns."""
    if not replace:
        return
    assignments: list[tuple[Any, Any, Any]] = []  # (mapping, key, new value)
    setters: list[Setter] = []  # in-place updates inside nested containers
    memo: dict[int, Any] = {}
    for key, state in optimizer.state.items():
        if isinstance(state, dict):
            _prepare_mapping(state, (), replace, assignments, setters, memo)
        else:  # an optimizer-wide entry under a plain key
            new = rebuild(state, replace, setters, memo)
            if new is not state:
                assignments.append((optimizer.state, key, new))
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


def apply_simple(moves: Sequence[tuple[dict, Any, torch.Tensor, torch.device]], *,
                 pool: Optional[HostPool] = None) -> int:
    """Copy and commit the moves of :func:`optimshift.plan.simple_moves`: every copy first (grouped as
    :func:`execute_batch` does, one synchronize), then plain assignments. Returns the number moved."""
    pool = host_pool if pool is None else pool
    items = [(tensor, target) for _, _, tensor, target in moves]
    batch = copy_many(items, copy_one=copy_tensor, pool=pool,
                      describe=lambda i: f"state[{moves[i][1]!r}] of a param")
    synchronize(batch.devices)
    batch.complete(pool)
    for (state, key, _, _), new in zip(moves, batch.copies):
        state[key] = new
    return len(moves)


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



class PendingTransfer:
    """A non-blocking offload or reload whose copies may still be running on a side stream.

    ``done()`` polls, ``wait()`` blocks the host until the copies are complete. A pending reload is also
    waited for automatically (on the device, without a host sync) before the optimizer's next ``step()``.
    Off CUDA, transfers are synchronous and a handle is done from the start.
    """

    def __init__(self, event: Optional[Any] = None, device: Optional[torch.device] = None) -> None:
        self._event = event
        self.device = device
        self._callbacks: list[Callable[[], None]] = []

    @property
    def event(self) -> Optional[Any]:
        """The CUDA event that completes with the copies (None once done, or off CUDA)."""
        return self._event

    def add_done_callback(self, fn: Callable[[], None]) -> None:
        if self._event is None:
            fn()
        else:
            self._callbacks.append(fn)

    def _finish(self) -> None:
        self._event = None
        callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            fn()

    def done(self) -> bool:
        if self._event is not None and self._event.query():
            self._finish()
        return self._event is None

    def wait(self) -> None:
        if self._event is not None:
            self._event.synchronize()
            self._finish()

    def wait_on_current_stream(self) -> None:
        """Make the current stream wait for the copies (no host sync): what the step pre-hook does. Without a
        CUDA device to wait on, the host waits."""
        if self._event is None:
            return
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.current_stream(self.device).wait_event(self._event)
        else:
            self.wait()

    def __repr__(self) -> str:
        return f"PendingTransfer(device={self.device}, done={self.done()})"


_side_streams: dict[torch.device, Any] = {}


def _single_cuda_device(plan: Plan, extra: Sequence[tuple[torch.Tensor, torch.device]]) -> Optional[torch.device]:
    if not _cuda_available():
        return None
    devices = {d for tr in plan.transfers for d in (tr.tensor.device, tr.target) if d.type == "cuda"}
    devices.update(d for t, target in extra for d in (t.device, target) if d.type == "cuda")
    return devices.pop() if len(devices) == 1 else None


def run(
    plan: Plan,
    *,
    non_blocking: bool = False,
    pin_memory: bool = False,
    keep_host_views: bool = False,
    extra: Sequence[tuple[torch.Tensor, torch.device]] = (),
    pool: Optional[HostPool] = None,
) -> tuple[dict[int, torch.Tensor], Batch, PendingTransfer]:
    """Execute ``plan`` (and ``extra``) grouped; with ``non_blocking`` on one CUDA device, on a side stream.

    Returns the copies, the batch (host buffers it holds) and a handle. Buffers that in-flight copies read are
    released to the pool with the handle's event; device memory that they read is protected with
    ``record_stream`` so the caching allocator never reuses it early.
    """
    pool = host_pool if pool is None else pool
    device = _single_cuda_device(plan, extra) if non_blocking else None
    if device is None:
        copies, batch = execute_batch(plan, pin_memory=pin_memory, keep_host_views=keep_host_views, extra=extra,
                                      pool=pool)
        return copies, batch, PendingTransfer()
    main = torch.cuda.current_stream(device)
    side = _side_streams.get(device)
    if side is None:
        side = _side_streams[device] = torch.cuda.Stream(device)
    side.wait_stream(main)  # the copies read what the main stream last wrote (e.g. the last step)
    with torch.cuda.stream(side):
        copies, batch = execute_batch(plan, non_blocking=True, pin_memory=pin_memory,
                                      keep_host_views=keep_host_views, extra=extra, pool=pool)
        event = torch.cuda.Event()
        event.record(side)
    sources = [tr.tensor for tr in plan.transfers if id(tr.tensor) in copies] + [t for t, _ in extra]
    for t in sources:
        if t.device.type == "cuda":
            local_tensor(t).record_stream(side)  # freed by the commit, but the side stream still reads it
    for new in copies.values():
        if new.device.type == "cuda":
            local_tensor(new).record_stream(main)  # allocated on the side stream, used by the main one
    batch.complete(pool, event)
    return copies, batch, PendingTransfer(event, device)
