"""Virtual memory management on the simulated accelerator, through optimshift's driver interface
(:class:`optimshift._vmm.Driver`), and a fake driver with fault injection at every call.

:class:`SimDriver` models CUDA's contract on host memory: a reservation is an anonymous ``mmap`` (its addresses
fixed while it lives); a physical allocation is a handle of some size; mapping one marks pages of the range usable
and counts them in :func:`optimshift.testing.simulated_memory_allocated`; unmapping returns the pages to the
operating system (``madvise(MADV_DONTNEED)``: they read as zeros afterwards, so a reload that skipped its copy
would show) and stops counting them. Tensors over a range (``wrap``) are sim tensors whose storage holds the
caller's owner object; every op that reaches unmapped memory through them raises, as CUDA's illegal-address
fault would. What CUDA refuses is refused too: a mapping outside a reservation, over another, unaligned, of a
handle of another size or one mapped already; an unmap that is not of whole mappings; releasing a mapped handle;
freeing a reservation with mappings left. ``capacity`` bounds the physical memory (an out-of-memory error past it).

:class:`FaultyDriver` wraps a driver and fails its ``fail_at``-th call (counting every call but ``unsupported``),
so that a test can run an operation once to count its calls and then fail each of them in turn.

Importing :mod:`optimshift.testing` registers :class:`SimDriver` for ``"sim"`` devices.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import mmap
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from .. import _vmm
from . import simulated as _sim

__all__ = ["SimDriver", "FaultyDriver"]

_PAGE = mmap.PAGESIZE
_MAP_FLAGS = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_NORESERVE", 0)


class _HostArray:
    """Host memory as ``__array_interface__`` (numpy wraps it without a copy, and keeps this object, and with it
    ``owner``, alive as the array's base)."""

    def __init__(self, address: int, nbytes: int, owner: object) -> None:
        self.owner = owner
        self.__array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (address, False), "version": 3}


class _Reserved:
    __slots__ = ("mm", "address", "size", "index")

    def __init__(self, mm: mmap.mmap, address: int, size: int, index: int) -> None:
        self.mm, self.address, self.size, self.index = mm, address, size, index


class SimDriver:
    """The simulated accelerator's virtual memory (see the module docstring)."""

    def __init__(self, capacity: int | None = None) -> None:
        self.capacity = capacity  # physical bytes per device (None: unbounded)
        self._lock = threading.RLock()
        self._inside = threading.local()  # .depth: how many sections this thread is in
        self._deferred: list[tuple[Any, tuple[Any, ...]]] = []  # calls made from inside a section (see _held)
        self._ranges: dict[int, _Reserved] = {}  # address -> reservation
        self._handles: dict[int, tuple[int, int]] = {}  # handle -> (device index, size)
        self._mappings: dict[int, tuple[int, int, bool]] = {}  # address -> (size, handle, accessible)
        self._next = 1
        self.created = [0, 0]  # physical bytes held per device

    @contextlib.contextmanager
    def _held(self) -> Iterator[None]:
        """The driver's lock. NOTE: a collection inside a section (an allocation there) may run a finalizer that
        unmaps and releases a range (``_addresses``'s, of an optimizer freed in a cycle): that call is deferred
        until this thread leaves its outermost section, never made against the structures being read. Deferred
        calls run as a finalizer's would: one that fails is logged, the rest go on."""
        batch: list[tuple[Any, tuple[Any, ...]]] = []
        try:
            with self._lock:
                self._inside.depth = getattr(self._inside, "depth", 0) + 1
                try:
                    yield
                finally:
                    self._inside.depth -= 1
                    if not self._inside.depth:
                        batch, self._deferred = self._deferred, []
        finally:
            self._run(batch)

    @staticmethod
    def _run(batch: list[tuple[Any, tuple[Any, ...]]]) -> None:
        for fn, args in batch:  # (outside the lock: each takes it again)
            try:
                fn(*args)
            except Exception:
                logging.getLogger("optimshift").exception("simulated VMM driver: a deferred %s failed", fn.__name__)

    def _deferring(self, fn: Any, *args: Any) -> bool:
        """Whether ``fn(*args)`` was called from inside a section, and so deferred (see :meth:`_held`)."""
        if getattr(self._inside, "depth", 0):
            self._deferred.append((fn, args))
            return True
        return False

    @staticmethod
    def _index(device: torch.device) -> int:
        if device.type != _sim.SIM_DEVICE_TYPE:
            raise _vmm.DriverError("sim", 1, f"{device} is not a simulated device")
        return 0 if device.index is None else device.index

    def unsupported(self, device: torch.device) -> str | None:
        return None if device.type == _sim.SIM_DEVICE_TYPE else f"{device} is not a simulated device"

    def granularity(self, device: torch.device) -> int:
        self._index(device)
        return _PAGE

    def reserve(self, device: torch.device, size: int) -> int:
        index = self._index(device)
        if size <= 0 or size % _PAGE:
            raise _vmm.DriverError("reserve", 1, f"size {size} is not a positive multiple of {_PAGE}")
        mm = mmap.mmap(-1, size, flags=_MAP_FLAGS, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        view = ctypes.c_char.from_buffer(mm)
        address = ctypes.addressof(view)
        del view  # (an export would keep the mmap from closing)
        with self._held():
            self._ranges[address] = _Reserved(mm, address, size, index)
        return address

    def _reserved(self, address: int, size: int) -> _Reserved:
        for r in self._ranges.values():
            if r.address <= address and address + size <= r.address + r.size:
                return r
        raise _vmm.DriverError("map", 1, f"[{address:#x}, +{size}) is not inside a reserved range")

    def free_reserved(self, device: torch.device, address: int, size: int) -> None:
        self._index(device)
        if self._deferring(self.free_reserved, device, address, size):
            return
        with self._held():
            r = self._ranges.get(address)
            if r is None or r.size != size:
                raise _vmm.DriverError("free_reserved", 1, f"no reservation of {size} bytes at {address:#x}")
            if any(address <= a < address + size for a in self._mappings):
                raise _vmm.DriverError("free_reserved", 1, "the range still has mappings")
            del self._ranges[address]
        r.mm.close()

    def create(self, device: torch.device, size: int) -> int:
        index = self._index(device)
        if size <= 0 or size % _PAGE:
            raise _vmm.DriverError("create", 1, f"size {size} is not a positive multiple of {_PAGE}")
        with self._held():
            if self.capacity is not None and self.created[index] + size > self.capacity:
                raise _vmm.DriverOutOfMemory("create", 2, "out of memory")
            handle = self._next
            self._next += 1
            self._handles[handle] = (index, size)
            self.created[index] += size
        return handle

    def map(self, device: torch.device, address: int, size: int, handle: int) -> None:
        index = self._index(device)
        with self._held():
            r = self._reserved(address, size)
            if r.index != index or (address - r.address) % _PAGE:
                raise _vmm.DriverError("map", 1, "a mapping on another device's range, or unaligned")
            if self._handles.get(handle) != (index, size):
                raise _vmm.DriverError("map", 1, f"handle {handle} is not {size} bytes on sim:{index}")
            if any(h == handle for _, h, _ in self._mappings.values()):
                raise _vmm.DriverError("map", 1, f"handle {handle} is mapped already")
            for a, (n, _, _) in self._mappings.items():
                if a < address + size and address < a + n:
                    raise _vmm.DriverError("map", 1, "the mapping overlaps another")
            self._mappings[address] = (size, handle, False)
        _sim._count_mapped(index, size)

    def set_access(self, device: torch.device, address: int, size: int) -> None:
        self._index(device)
        with self._held():
            found = self._mappings.get(address)
            if found is None or found[0] != size:
                raise _vmm.DriverError("set_access", 1, f"no mapping of {size} bytes at {address:#x}")
            self._mappings[address] = (size, found[1], True)

    def unmap(self, device: torch.device, address: int, size: int) -> None:
        index = self._index(device)
        if self._deferring(self.unmap, device, address, size):
            return
        with self._held():
            found = self._mappings.get(address)
            if found is None or found[0] != size:
                raise _vmm.DriverError("unmap", 1, f"no mapping of {size} bytes at {address:#x}")
            r = self._reserved(address, size)
            del self._mappings[address]
        r.mm.madvise(mmap.MADV_DONTNEED, address - r.address, size)  # the pages go back to the system
        _sim._count_mapped(index, -size)

    def release(self, device: torch.device, handle: int) -> None:
        self._index(device)
        if self._deferring(self.release, device, handle):
            return
        with self._held():
            found = self._handles.get(handle)
            if found is None:
                raise _vmm.DriverError("release", 1, f"no handle {handle}")
            if any(h == handle for _, h, _ in self._mappings.values()):
                raise _vmm.DriverError("release", 1, f"handle {handle} is still mapped")
            del self._handles[handle]
            self.created[found[0]] -= found[1]

    def check(self, address: int, nbytes: int) -> None:
        """Raise unless all of ``[address, address + nbytes)`` is mapped and accessible: every access to a range
        goes through here (an op's input or output), as the device's page tables would check it."""
        end, at = address + nbytes, address
        with self._held():
            spans = sorted((a, a + n, ok) for a, (n, _, ok) in self._mappings.items() if a < end and address < a + n)
        for lo, hi, ok in spans:
            if lo > at or not ok:
                break
            at = hi
            if at >= end:
                return
        raise RuntimeError(
            f"simulated accelerator: an illegal memory access was encountered: [{address:#x}, +{nbytes}) is not "
            f"mapped (reading or writing memory of a reserved range that was unmapped, as CUDA would fault)"
        )

    def wrap(self, device: torch.device, address: int, nbytes: int, owner: object) -> torch.Tensor:
        index = self._index(device)
        self.check(address, nbytes)
        cpu = torch.from_numpy(np.asarray(_HostArray(address, nbytes, owner)))
        return _sim._wrap_mapped(cpu, index, lambda: self.check(address, nbytes))

    def read(self, device: torch.device, address: int, nbytes: int) -> torch.Tensor:
        """A host copy of ``nbytes`` at ``address``, read as a kernel of a captured graph would (the address
        recorded, no tensor held): raises where the memory is not mapped."""
        return self.wrap(device, address, nbytes, None).cpu()

    def mapped(self, index: int = 0) -> int:
        """Bytes mapped on ``sim:index`` now."""
        with self._held():
            ranges = [r for r in self._ranges.values() if r.index == index]
            return sum(
                n for a, (n, _, _) in self._mappings.items() if any(r.address <= a < r.address + r.size for r in ranges)
            )

    def reserved(self) -> int:
        """Reservations alive now (all devices)."""
        with self._held():
            return len(self._ranges)


class FaultyDriver:
    """``inner`` with its ``fail_at``-th call (0-based; every call but ``unsupported``) failing: a DriverError, or
    :class:`optimshift._vmm.DriverOutOfMemory` when ``oom`` and the call is a ``create``. ``calls`` lists every
    call made, by name."""

    _CALLS = ("granularity", "reserve", "free_reserved", "create", "map", "set_access", "unmap", "release", "wrap")

    def __init__(self, inner: Any, fail_at: int | None = None, *, oom: bool = False, times: int = 1) -> None:
        self.inner = inner
        self.fail_at = fail_at
        self.oom = oom
        self.times = times  # how many calls fail in a row, from fail_at on
        self.calls: list[str] = []
        self.failed: list[str] = []

    def unsupported(self, device: torch.device) -> str | None:
        result: str | None = self.inner.unsupported(device)
        return result

    def __getattr__(self, name: str) -> Any:
        if name not in self._CALLS:
            return getattr(self.inner, name)
        fn = getattr(self.inner, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            n = len(self.calls)
            self.calls.append(name)
            if self.fail_at is not None and self.fail_at <= n < self.fail_at + self.times:
                self.failed.append(name)
                if self.oom and name == "create":
                    raise _vmm.DriverOutOfMemory(name, 2, "injected out of memory")
                raise _vmm.DriverError(name, 999, "injected fault")
            return fn(*args, **kwargs)

        return call


_vmm.register_driver(_sim.SIM_DEVICE_TYPE, SimDriver)
