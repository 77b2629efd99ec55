"""A persistent pool of host buffers (pinned where the accelerator pins) reused across offload/reload cycles.

Pinning is slow (it maps and locks pages): a steady offload/reload loop allocates no new host memory. A buffer is
handed out again only once the copy it was given back with completed (its event) and nothing still looks into it
(its storage's use count); pinned bytes are bounded by ``pinned_limit``, past which requests get pageable memory.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal, overload

import torch

from ._device_streams import host_pinning

__all__ = ["HostPool", "host_pool", "PoolStats"]

_GRANULE = 1 << 20  # sizes are rounded up to 1 MiB, so that slightly different requests reuse a buffer

# the pinned-memory limit (read once per pool, when first needed): bytes (8589934592), a number with a unit
# (8GiB, 512MiB, 1.5GB) or "unlimited"
_ENV = "OPTIMSHIFT_PINNED_LIMIT"

# cgroup v2, then v1: a container's memory limit, when it is below the machine's
_CGROUP_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")

_log = logging.getLogger("optimshift")


@dataclass(frozen=True)
class PoolStats:
    """``allocations``: buffers ever allocated; ``reuses``: requests served from the pool; ``idle``/``in_use``:
    buffers (and ``idle_bytes``/``in_use_bytes``) now. ``pinned_bytes``/``pageable_bytes``: the bytes of the
    buffers held now (idle and in use) that are pinned / pageable; ``pinned_limit``: the limit on
    ``pinned_bytes`` (None: none); ``over_limit``: pinned requests served with pageable memory because of the
    limit; ``pin_failures``: pinned requests served with pageable memory because pinning failed."""

    allocations: int
    reuses: int
    idle: int
    in_use: int
    idle_bytes: int
    in_use_bytes: int
    pinned_bytes: int = 0
    pageable_bytes: int = 0
    pinned_limit: int | None = None
    over_limit: int = 0
    pin_failures: int = 0


class _Default:
    """``HostPool``'s limit before it is known: the environment variable, else :func:`_default_limit`."""


_FROM_ENVIRONMENT = _Default()


class HostPool:
    """Host byte buffers by size; pinned ones only where the accelerator pins host memory, at most
    ``pinned_limit`` bytes of them (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # ids of buffers that died while the lock was held (see _drop), accounted by the next holder of the lock
        self._died: list[int] = []
        self._idle: list[tuple[torch.Tensor, bool, Any | None]] = []  # (buffer, pinned, event to wait for)
        # per buffer id: (pinned, storage use count when it has no views, bytes); dropped when the buffer dies
        self._meta: dict[int, tuple[bool, int | None, int]] = {}
        # Held weakly (by id, as tensors compare elementwise): the buffers of an offloaded optimizer that is
        # garbage-collected are simply freed.
        self._in_use: dict[int, weakref.ref[torch.Tensor]] = {}
        self._allocations = 0
        self._reuses = 0
        self._held = {True: 0, False: 0}  # bytes of the buffers held (idle and in use), pinned and pageable
        self._limit: int | None | _Default = _FROM_ENVIRONMENT
        self._over_limit = 0
        self._pin_failures = 0
        self._warned_limit = False  # one WARNING per limit: re-armed when the limit is set
        self._warned_failure = False  # one WARNING per pool

    @property
    def pinned_limit(self) -> int | None:
        """The most bytes of pinned buffers the pool holds at once (idle and in use); None: no limit. Until set
        here: ``OPTIMSHIFT_PINNED_LIMIT``, else :func:`_default_limit` (read once, when first needed)."""
        limit = self._limit
        if isinstance(limit, _Default):
            raw = os.environ.get(_ENV, "").strip()
            limit = _parse_size(raw) if raw else _default_limit()  # (a bad value raises each time it is read)
            with self._locked():
                if isinstance(self._limit, _Default):
                    self._limit = limit
        return limit

    @pinned_limit.setter
    def pinned_limit(self, limit: int | None) -> None:
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int)):
            raise TypeError(f"host_pool.pinned_limit must be a number of bytes or None, not {limit!r}")
        if limit is not None and limit < 0:
            raise ValueError(f"host_pool.pinned_limit must be at least 0 bytes (None: no limit), not {limit}")
        with self._locked():
            self._limit = limit
            self._warned_limit = False
        # Idle pinned buffers above a lowered limit are freed now, not at the next request.
        evicted: list[tuple[torch.Tensor, bool, Any | None]] = []
        while limit is not None:
            with self._locked():
                evicted, pending = self._evict(self._held[True] - limit, partial=True)
            if not pending:
                break
            self._wait(pending)
        self._free(evicted)

    @overload
    def acquire(self, nbytes: int, *, pinned: bool) -> torch.Tensor: ...
    @overload
    def acquire(self, nbytes: int, *, pinned: bool, pageable: Literal[True]) -> torch.Tensor: ...
    @overload
    def acquire(self, nbytes: int, *, pinned: bool, pageable: bool) -> torch.Tensor | None: ...

    def acquire(self, nbytes: int, *, pinned: bool, pageable: bool = True) -> torch.Tensor | None:
        """A uint8 host tensor of at least ``nbytes`` (the smallest idle one that fits, else a new one).
        ``pinned``: pinned memory, unless that would take the pool past ``pinned_limit`` or pinning fails;
        then pageable memory (one WARNING, counted in :meth:`stats`), or None with ``pageable=False`` (a caller
        for whom only pinned memory helps)."""
        size = max(_GRANULE, -(-nbytes // _GRANULE) * _GRANULE)
        if pinned:
            # NOTE: PyTorch's caching host allocator rounds every pinned block up to a power of two, and pins (and
            # keeps) that much. Asking it for exactly that size costs nothing more, lets the buffer serve every
            # request of its size class, and makes the bytes the pool counts against the limit the bytes pinned.
            buf = self._acquire(1 << (size - 1).bit_length(), pinned=True)
            if buf is not None or not pageable:
                return buf
        return self._acquire(size, pinned=False)

    def _acquire(self, size: int, *, pinned: bool) -> torch.Tensor | None:
        """An idle buffer of ``size``'s class, else a new one; None for a pinned one where the limit or a failure
        to pin says pageable memory instead."""
        limit = self.pinned_limit if pinned else None
        evicted: list[tuple[torch.Tensor, bool, Any | None]] = []
        over = warn = False
        buf, reserved = None, 0
        try:
            while True:
                with self._locked():
                    found, pending = self._take_idle(size, pinned=pinned)
                    if found is None and not pending and limit is not None and self._held[True] + size > limit:
                        evicted, pending = self._evict(self._held[True] + size - limit)  # all it takes, or none
                        over = not pending and self._held[True] + size > limit
                    if found is None and not pending:
                        if over:
                            self._over_limit += 1
                            warn, self._warned_limit = not self._warned_limit, True
                            held = self._held[True]
                        else:  # reserved here, allocated outside the lock (one statement: count and ``reserved`` agree)
                            self._held[pinned], reserved = self._held[pinned] + size, size
                if not pending:
                    break
                self._wait(pending)
            self._free(evicted)
            if found is not None:
                return found
            if not over:
                try:
                    buf = _allocate(size, pinned=pinned)
                except RuntimeError as error:  # (cudaHostAlloc out of memory, no pinned allocator): pageable instead
                    with self._locked():  # (its bytes given back in one statement: a Ctrl-C in the cleanup loses none)
                        self._held[pinned], reserved = self._held[pinned] - size, 0
                        if pinned:
                            self._pin_failures += 1
                            warn, self._warned_failure = not self._warned_failure, True
                    if not pinned:
                        raise
                    if warn:
                        _log.warning(
                            "optimshift: pinning %s of host memory failed (%s: %s); copies go through pageable "
                            "host memory instead (the same bytes, slower transfers). host_pool.stats().pin_failures "
                            "counts them; a lower %s keeps the pool under what this host can pin. Logged once.",
                            _size(size),
                            type(error).__name__,
                            (str(error).splitlines() or [""])[0],
                            _ENV,
                        )
                    return None
                return self._record(buf, size, pinned=pinned)
        except BaseException:
            if reserved:
                self._unreserve(buf, size, pinned=pinned)
            raise
        if warn:
            _log.warning(
                "optimshift: the host pool's pinned-memory limit (%s; set with %s or "
                "optimshift.host_pool.pinned_limit) is reached: %s pinned, %s more asked. Copies past the "
                "limit go through pageable host memory (the same bytes, slower transfers that do not "
                "overlap); host_pool.stats().over_limit counts them. Logged once per limit.",
                _size(limit or 0),
                _ENV,
                _size(held),
                _size(size),
            )
        return None

    def _take_idle(self, size: int, *, pinned: bool) -> tuple[torch.Tensor | None, list[Any]]:
        """(Under the lock) the smallest idle buffer of ``size``'s class and kind that nothing looks into, recorded in
        use as it is taken (a Ctrl-C after it loses nothing: the buffer handed to nobody dies in use, counted off);
        none, and the event to wait for first (:meth:`_wait`), where a copy in flight still uses it."""
        fits = [  # the smallest fitting buffer, one that no copy in flight still uses first
            (_busy(event), buf.numel(), i)
            for i, (buf, is_pinned, event) in enumerate(self._idle)
            if size <= buf.numel() <= 2 * size and is_pinned == pinned and not self._viewed(buf)
        ]
        if not fits:
            return None, []
        busy, _, best = min(fits)
        if busy:
            return None, [self._idle[best][2]]
        found = self._idle[best][0]
        self._in_use[id(found)] = weakref.ref(self._idle.pop(best)[0])  # (one line: never both idle and in use)
        self._reuses += 1
        return found, []

    def _evict(
        self, need: int, *, partial: bool = False
    ) -> tuple[list[tuple[torch.Tensor, bool, Any | None]], list[Any]]:
        """(Under the lock) take idle pinned buffers out of the pool until ``need`` bytes are freed; none at all
        when that many cannot be, unless ``partial``. A buffer something looks into frees nothing, and stays.
        The caller frees them outside the lock (:meth:`_free`). Where a copy in flight still uses one of those
        chosen: none, and the events to wait for first (:meth:`_wait`)."""
        candidates = [i for i, (buf, pinned, _) in enumerate(self._idle) if pinned and not self._viewed(buf)]
        if need <= 0 or (not partial and sum(self._idle[i][0].numel() for i in candidates) < need):
            return [], []
        chosen: list[int] = []
        freed = 0
        # no copy still using it first (no host wait), then the largest
        for i in sorted(candidates, key=lambda i: (_busy(self._idle[i][2]), -self._idle[i][0].numel())):
            if freed >= need:
                break
            chosen.append(i)
            freed += self._idle[i][0].numel()
        taken = [self._idle[i] for i in chosen]
        pending = [event for _, _, event in taken if _busy(event)]
        if pending:
            return [], pending
        for i in sorted(chosen, reverse=True):
            del self._idle[i]
        self._held[True] -= freed
        return taken, []

    def _record(self, buf: torch.Tensor, size: int, *, pinned: bool) -> torch.Tensor:
        """A new buffer recorded in use: the ``size`` bytes reserved for it are its own from then on (its death
        counts them off)."""
        weakref.finalize(buf, self._drop, id(buf))  # (first: a buffer recorded is counted off when it dies)
        with self._locked():
            self._allocations += 1
            self._meta[id(buf)] = (pinned, _uses(buf), size)
            self._in_use[id(buf)] = weakref.ref(buf)
        return buf

    def _unreserve(self, buf: torch.Tensor | None, size: int, *, pinned: bool) -> None:
        """Give back the bytes reserved for a new buffer that a failure or a Ctrl-C left unrecorded (``buf``: the
        one allocated, if any)."""
        with self._locked():
            if buf is None or id(buf) not in self._in_use:
                self._held[pinned] -= size

    def _wait(self, events: list[Any]) -> None:
        """Wait for the copies still using idle buffers (outside the lock), and forget their events: a buffer
        leaves the pool only once no copy uses it, so a Ctrl-C anywhere frees none under its copy."""
        for event in {id(e): e for e in events}.values():  # (once each: a transfer gives many buffers one event)
            event.synchronize()
            with self._locked():
                self._idle = [(buf, pinned, None if e is event else e) for buf, pinned, e in self._idle]

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """The pool's lock, with the buffers that died meanwhile accounted first."""
        with self._lock:
            self._account_died()
            yield

    def _account_died(self) -> None:
        while self._died:
            key = self._died.pop()
            pinned, _, size = self._meta.pop(key, (False, None, 0))
            if self._in_use.pop(key, None) is not None:  # died in use (an offloaded optimizer collected)
                self._held[pinned] -= size

    def _drop(self, key: int) -> None:
        # NOTE: a buffer's finalizer runs wherever the collector does, also inside a section that holds the
        # lock (an allocation there); waiting for the lock would deadlock that thread. The death is recorded
        # (a list append: atomic) and accounted now if the lock is free, else by its next holder.
        self._died.append(key)
        if self._lock.acquire(blocking=False):
            try:
                self._account_died()
            finally:
                self._lock.release()

    def _viewed(self, buf: torch.Tensor) -> bool:
        """Whether a tensor other than ``buf`` itself still uses its memory."""
        uses = _uses(buf)
        base = self._meta.get(id(buf), (False, uses, 0))[1]
        return uses is not None and base is not None and uses > base

    def release(self, buf: torch.Tensor, event: Any | None = None) -> None:
        """Give ``buf`` back; with ``event``, it is reused only after that event completes."""
        with self._locked():
            if id(buf) in self._in_use:  # (one line: never in neither; a weakref is truthy)
                self._idle.append((buf, self._meta[id(buf)][0] if self._in_use.pop(id(buf)) else False, event))

    def release_idle(self) -> int:
        """Free every idle buffer (pinned memory goes back to the OS), once the copies using them completed;
        returns the bytes freed."""
        while True:
            with self._locked():
                pending = [e for _, _, e in self._idle if _busy(e)]
                if not pending:
                    held = {k: n - sum(b.numel() for b, p, _ in self._idle if p == k) for k, n in self._held.items()}
                    idle, self._idle, self._held = self._idle, [], held  # (one statement: the bytes counted off)
            if not pending:
                break
            self._wait(pending)
        freed = sum(buf.numel() for buf, _, _ in idle)
        self._free(idle)
        return freed

    def _free(self, entries: list[tuple[torch.Tensor, bool, Any | None]]) -> None:
        """Free buffers taken out of the pool, no copy using them (outside its lock: a dying buffer calls back into
        the pool); pinned memory goes back to the OS."""
        pinned = any(is_pinned for _, is_pinned, _ in entries)
        entries.clear()
        if pinned:
            _return_pinned_memory()

    def in_use_storages(self) -> set[int]:
        """The storage addresses (``untyped_storage().data_ptr()``) of the buffers handed out and not given back:
        what offloaded and streamed state are views into."""
        with self._locked():
            refs = list(self._in_use.values())
        return {b.untyped_storage().data_ptr() for b in (ref() for ref in refs) if b is not None}

    def stats(self) -> PoolStats:
        limit = self.pinned_limit
        with self._locked():
            return PoolStats(
                self._allocations,
                self._reuses,
                len(self._idle),
                len(self._in_use),
                sum(b.numel() for b, _, _ in self._idle),
                sum(b.numel() for b in (ref() for ref in self._in_use.values()) if b is not None),
                self._held[True],
                self._held[False],
                limit,
                self._over_limit,
                self._pin_failures,
            )


def _allocate(nbytes: int, pinned: bool) -> torch.Tensor:
    """A new uint8 host buffer (a test stands in for the pinned allocator here)."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)


def _return_pinned_memory() -> None:
    """Give the freed pinned blocks that PyTorch's caching host allocator keeps back to the OS.

    # NOTE: the caching host allocator keeps every freed pinned block for the process (not for the pool), so
    # without this a limit would bound what the pool holds but not what the process pins: a block freed to
    # make room, of another size class, would stay pinned next to the new one. (It frees every unused cached
    # block, others' too: they are pinned again when next asked for.)
    """
    if host_pinning() is None:  # no pinned allocator (a stand-in for one in tests): nothing is cached
        return
    accelerator = getattr(torch, "accelerator", None)
    empty = getattr(accelerator, "empty_host_cache", None) or getattr(torch._C, "_host_emptyCache", None)
    if empty is not None:
        empty()


def _default_limit() -> int | None:
    """The pinned-memory limit when none is set: half the host's memory (the machine's or the container's,
    whichever is less) divided by the node's ranks (``LOCAL_WORLD_SIZE``, set by torchrun); None where the
    host's memory cannot be read.

    # NOTE: pinned pages are locked: the OS can neither swap nor reclaim them, and each rank of a node pins its
    # own. Half leaves the other half for what every rank also needs on the host (the process, pageable
    # copies, dataloader workers, the page cache a checkpoint is written through); past the limit copies still
    # work, through pageable memory.
    """
    total = _host_memory()
    if total is None:
        return None
    try:
        ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        ranks = 1
    return total // 2 // ranks


def _host_memory() -> int | None:
    """Bytes of physical memory, or of the container's memory limit when that is lower."""
    try:
        total: int | None = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, OSError, ValueError):  # (no sysconf: Windows)
        total = None
    for path in _CGROUP_LIMITS:
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit():
            total = int(text) if total is None else min(total, int(text))
        break
    return total if total else None


_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*(?:([kmgt])(i?)(b?)|(b?))", re.IGNORECASE)


def _parse_size(text: str) -> int | None:
    """Bytes from ``8589934592``, ``8GiB``/``8G`` (powers of 1024), ``8GB`` (powers of 1000) or ``unlimited``
    (None); a ValueError naming the variable otherwise."""
    value = text.strip()
    if value.lower() in ("unlimited", "none"):
        return None
    match = _SIZE.fullmatch(value)
    if match is None or (match[2] is None and "." in match[1]):
        raise ValueError(
            f"{_ENV}={text!r} is not a size: give bytes (8589934592), a number with a unit (8GiB, 512MiB, "
            f"1.5GB) or 'unlimited'"
        )
    number, unit, binary, decimal = match[1], match[2], match[3], match[4]
    if unit is None:
        return int(number)
    power = "kmgt".index(unit.lower()) + 1
    scale = 1000**power if decimal and not binary else 1024**power  # (a bare 8G: powers of 1024)
    return int(float(number) * scale) if "." in number else int(number) * scale


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} bytes"


def _busy(event: Any | None) -> bool:
    """Whether a copy that an idle buffer was given back with is still in flight."""
    return event is not None and not event.query()


def _uses(buf: torch.Tensor) -> int | None:
    """How many tensors share ``buf``'s storage (None where this torch cannot tell)."""
    counter = getattr(torch._C, "_storage_Use_Count", None)
    if counter is None:
        return None
    return int(counter(buf.untyped_storage()._cdata))


host_pool = HostPool()
