"""A persistent pool of host buffers (pinned where the accelerator can pin) reused across offload/reload cycles.

Allocating pinned memory is slow (it maps and locks pages) and DeepSpeed's ZeRO-1/2 offload pays it on every
offload. optimshift keeps the buffers: offloaded state lives in pool buffers until it is reloaded, then the
buffers go back to the pool for the next cycle, so a steady offload/reload loop allocates no new host memory.
``optimshift.host_pool.release_idle()`` frees what is idle; ``stats()`` counts allocations and reuses.

A buffer whose contents a copy still in flight reads or writes is held with that copy's event (the device's
own event object, see :mod:`optimshift._streams`) and is reused only once the event has completed: ``acquire``
prefers idle buffers whose event is already complete, and otherwise waits for the event before handing it out.
A buffer that something still looks into (a ``state_dict()`` taken while
the state was offloaded, a kept reference to an offloaded tensor) is never handed out again: its storage's
use count says so, and the pool allocates a new buffer instead of overwriting what someone still holds.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["HostPool", "host_pool", "PoolStats"]

_GRANULE = 1 << 20  # sizes are rounded up to 1 MiB, so that slightly different requests reuse a buffer


@dataclass(frozen=True)
class PoolStats:
    """``allocations``: buffers ever allocated; ``reuses``: requests served from the pool; ``idle``/``in_use``:
    buffers (and ``idle_bytes``/``in_use_bytes``) now."""

    allocations: int
    reuses: int
    idle: int
    in_use: int
    idle_bytes: int
    in_use_bytes: int


class HostPool:
    """Host byte buffers by size; pinned ones only where the accelerator pins host memory (see the module
    docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: list[tuple[torch.Tensor, bool, Any | None]] = []  # (buffer, pinned, event to wait for)
        # per buffer id: (pinned, storage use count when it has no views); dropped when the buffer dies
        self._meta: dict[int, tuple[bool, int | None]] = {}
        # Held weakly (by id, as tensors compare elementwise): the buffers of an offloaded optimizer that is
        # garbage-collected are simply freed.
        self._in_use: dict[int, weakref.ref[torch.Tensor]] = {}
        self._allocations = 0
        self._reuses = 0

    def acquire(self, nbytes: int, *, pinned: bool) -> torch.Tensor:
        """A uint8 host tensor of at least ``nbytes`` (the smallest idle one that fits, else a new one)."""
        nbytes = max(_GRANULE, -(-nbytes // _GRANULE) * _GRANULE)
        buf: torch.Tensor | None  # each idle candidate, then the buffer handed out (None: none fits)
        with self._lock:
            best = None
            best_key: tuple[bool, int] = (True, 0)
            for i, (buf, is_pinned, pending) in enumerate(self._idle):
                if nbytes <= buf.numel() <= 2 * nbytes and is_pinned == pinned and not self._viewed(buf):
                    # the smallest fitting buffer, one that no copy in flight still uses first
                    key = (pending is not None and not pending.query(), buf.numel())
                    if best is None or key < best_key:
                        best, best_key = i, key
            found: torch.Tensor | None = None
            event: Any | None = None
            if best is not None:
                found, _, event = self._idle.pop(best)
                self._reuses += 1
        buf = found
        if buf is None:
            buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
            with self._lock:
                self._allocations += 1
                self._meta[id(buf)] = (pinned, _uses(buf))
            weakref.finalize(buf, self._drop, id(buf))
        elif event is not None:
            event.synchronize()  # a copy still reading this buffer must finish before it is overwritten
        with self._lock:
            self._in_use[id(buf)] = weakref.ref(buf)
        return buf

    def _drop(self, key: int) -> None:
        with self._lock:
            self._meta.pop(key, None)
            self._in_use.pop(key, None)

    def _viewed(self, buf: torch.Tensor) -> bool:
        """Whether a tensor other than ``buf`` itself still uses its memory."""
        uses = _uses(buf)
        base = self._meta.get(id(buf), (False, uses))[1]
        return uses is not None and base is not None and uses > base

    def release(self, buf: torch.Tensor, event: Any | None = None) -> None:
        """Give ``buf`` back; with ``event``, it is reused only after that event completes."""
        with self._lock:
            if self._in_use.pop(id(buf), None) is not None:
                self._idle.append((buf, self._meta[id(buf)][0], event))

    def release_idle(self) -> int:
        """Free every idle buffer (pinned memory goes back to the OS); returns the bytes freed."""
        with self._lock:
            idle, self._idle = self._idle, []
        for _, _, event in idle:
            if event is not None:
                event.synchronize()
        return sum(buf.numel() for buf, _, _ in idle)

    def stats(self) -> PoolStats:
        with self._lock:
            return PoolStats(
                self._allocations,
                self._reuses,
                len(self._idle),
                len(self._in_use),
                sum(b.numel() for b, _, _ in self._idle),
                sum(b.numel() for b in (ref() for ref in self._in_use.values()) if b is not None),
            )


def _uses(buf: torch.Tensor) -> int | None:
    """How many tensors share ``buf``'s storage (None where this torch cannot tell)."""
    counter = getattr(torch._C, "_storage_Use_Count", None)
    if counter is None:
        return None
    return int(counter(buf.untyped_storage()._cdata))


host_pool = HostPool()
