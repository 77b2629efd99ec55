"""The driver interface for keeping device addresses (:class:`Driver`), one per device type (:func:`driver_for`):
CUDA's ``cuMem*`` through ``ctypes`` on ``libcuda.so.1``; the simulator registers its own, tests a fake."""

from __future__ import annotations

import contextlib
import ctypes
import threading
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch

__all__ = [
    "Driver",
    "DriverError",
    "DriverOutOfMemory",
    "driver_for",
    "register_driver",
    "use_driver",
    "unsupported",
    "CudaDriver",
]


class DriverError(RuntimeError):
    """A driver call failed: ``call`` is its name, ``code`` the driver's error code."""

    def __init__(self, call: str, code: int, message: str) -> None:
        super().__init__(f"{call} failed: {message} (error {code})")
        self.call = call
        self.code = code


class DriverOutOfMemory(DriverError):
    """The device has no physical memory left for a mapping (``CUDA_ERROR_OUT_OF_MEMORY``)."""


class Driver(Protocol):
    """What keeping addresses asks of a device's driver (each call may raise :class:`DriverError`)."""

    def unsupported(self, device: torch.device) -> str | None:
        """Why ``device`` cannot keep addresses, or None where it can."""

    def granularity(self, device: torch.device) -> int:
        """The size every reservation, physical allocation and mapping is a multiple of."""

    def reserve(self, device: torch.device, size: int) -> int:
        """A reserved virtual range of ``size`` bytes (nothing mapped): its address."""

    def free_reserved(self, device: torch.device, address: int, size: int) -> None:
        """Give a reserved range back (everything in it unmapped first)."""

    def create(self, device: torch.device, size: int) -> int:
        """``size`` bytes of physical memory on ``device``: a handle (:class:`DriverOutOfMemory` when none)."""

    def map(self, device: torch.device, address: int, size: int, handle: int) -> None:
        """Map the physical memory ``handle`` at ``address`` (inside a reserved range)."""

    def set_access(self, device: torch.device, address: int, size: int) -> None:
        """Let ``device`` read and write a new mapping (every mapping needs it)."""

    def unmap(self, device: torch.device, address: int, size: int) -> None:
        """Unmap the mapping at ``address`` (the range stays reserved)."""

    def release(self, device: torch.device, handle: int) -> None:
        """Free the physical memory ``handle`` (unmapped first)."""

    def wrap(self, device: torch.device, address: int, nbytes: int, owner: object) -> torch.Tensor:
        """A flat uint8 tensor on ``device`` over ``nbytes`` of mapped memory at ``address``, whose storage keeps
        ``owner`` alive for as long as the storage lives (what tells a range that memory is still in use)."""


_drivers: dict[str, Callable[[], Driver | None]] = {}
_made: dict[str, Driver | None] = {}
_overrides: dict[str, Driver] = {}
_lock = threading.Lock()


def register_driver(device_type: str, factory: Callable[[], Driver | None]) -> None:
    """Make ``factory()`` (called once, when first needed) the driver of ``device_type`` (None: none there)."""
    with _lock:
        _drivers[device_type] = factory
        _made.pop(device_type, None)


def driver_for(device: torch.device) -> Driver | None:
    """The driver of ``device``'s type, or None where no driver is known for it."""
    kind = device.type
    override = _overrides.get(kind)
    if override is not None:
        return override
    with _lock:
        if kind not in _made:
            factory = _drivers.get(kind)
            _made[kind] = None if factory is None else factory()
        return _made[kind]


def unsupported(device: torch.device) -> str | None:
    """Why ``device`` cannot keep addresses (no driver, or the driver says why), or None where it can."""
    driver = driver_for(device)
    if driver is None:
        return f"no virtual memory driver is known for {device.type} devices"
    return driver.unsupported(device)


@contextlib.contextmanager
def use_driver(device_type: str, driver: Driver) -> Iterator[Driver]:
    """Use ``driver`` for ``device_type`` inside the block (tests: a fake driver with fault injection)."""
    previous = _overrides.get(device_type)
    _overrides[device_type] = driver
    try:
        yield driver
    finally:
        if previous is None:
            _overrides.pop(device_type, None)
        else:
            _overrides[device_type] = previous


# --- CUDA: the driver API through ctypes ---------------------------------------------------------------------

_CUDA_SUCCESS = 0
_CUDA_ERROR_OUT_OF_MEMORY = 2
_VMM_SUPPORTED = 102  # CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED
_MEM_ALLOCATION_TYPE_PINNED = 1
_MEM_LOCATION_TYPE_DEVICE = 1
_MEM_ACCESS_FLAGS_PROT_READWRITE = 3
_MEM_ALLOC_GRANULARITY_MINIMUM = 0


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [
        ("compressionType", ctypes.c_ubyte),
        ("gpuDirectRDMACapable", ctypes.c_ubyte),
        ("usage", ctypes.c_ushort),
        ("reserved", ctypes.c_ubyte * 4),
    ]


class _AllocationProp(ctypes.Structure):  # CUmemAllocationProp: 32 bytes
    _fields_ = [
        ("type", ctypes.c_int),
        ("requestedHandleTypes", ctypes.c_int),
        ("location", _Location),
        ("win32HandleMetaData", ctypes.c_void_p),
        ("allocFlags", _AllocFlags),
    ]


class _AccessDesc(ctypes.Structure):  # CUmemAccessDesc: 12 bytes
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


class _CudaArray:
    """Mapped device memory as ``__cuda_array_interface__``; the tensor's storage holds it, and so ``owner``."""

    def __init__(self, address: int, nbytes: int, owner: object) -> None:
        self.owner = owner
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (address, False),
            "version": 3,
            "strides": None,
            "stream": None,
        }


class CudaDriver:
    """CUDA's virtual memory management through ``ctypes`` on ``libcuda.so.1``."""

    def __init__(self, lib: Any) -> None:
        self._lib = lib
        self._contexts: dict[int, ctypes.c_void_p] = {}
        self._granularity: dict[int, int] = {}
        self._support: dict[int, str | None] = {}
        u64, vp, i = ctypes.c_uint64, ctypes.c_void_p, ctypes.c_int
        signatures: dict[str, list[Any]] = {
            "cuInit": [ctypes.c_uint],
            "cuDeviceGet": [ctypes.POINTER(i), i],
            "cuDeviceGetAttribute": [ctypes.POINTER(i), i, i],
            "cuCtxGetCurrent": [ctypes.POINTER(vp)],
            "cuCtxSetCurrent": [vp],
            "cuDevicePrimaryCtxRetain": [ctypes.POINTER(vp), i],
            "cuMemGetAllocationGranularity": [ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(_AllocationProp), i],
            "cuMemAddressReserve": [ctypes.POINTER(u64), ctypes.c_size_t, ctypes.c_size_t, u64, u64],
            "cuMemAddressFree": [u64, ctypes.c_size_t],
            "cuMemCreate": [ctypes.POINTER(u64), ctypes.c_size_t, ctypes.POINTER(_AllocationProp), u64],
            "cuMemMap": [u64, ctypes.c_size_t, ctypes.c_size_t, u64, u64],
            "cuMemSetAccess": [u64, ctypes.c_size_t, ctypes.POINTER(_AccessDesc), ctypes.c_size_t],
            "cuMemUnmap": [u64, ctypes.c_size_t],
            "cuMemRelease": [u64],
            "cuGetErrorString": [i, ctypes.POINTER(ctypes.c_char_p)],
        }
        for name, argtypes in signatures.items():
            fn = getattr(lib, name)
            fn.argtypes = argtypes
            fn.restype = ctypes.c_int

    @classmethod
    def load(cls) -> CudaDriver | None:
        """The driver of this machine's ``libcuda.so.1``, or None where there is none (no NVIDIA driver)."""
        try:
            return cls(ctypes.CDLL("libcuda.so.1"))
        except (OSError, AttributeError):
            return None

    def _cu(self, call: str, *args: Any, on: torch.device | None = None) -> None:
        """Call the driver function ``call`` (``on``: with that device's context made current first); a
        :class:`DriverError` naming it where it fails."""
        if on is not None:
            self._current(on)
        code = getattr(self._lib, call)(*args)
        if code == _CUDA_SUCCESS:
            return
        text = ctypes.c_char_p()
        self._lib.cuGetErrorString(code, ctypes.byref(text))
        message = text.value.decode(errors="replace") if text.value else "unknown error"
        raise (DriverOutOfMemory if code == _CUDA_ERROR_OUT_OF_MEMORY else DriverError)(call, code, message)

    def _current(self, device: torch.device) -> int:
        """Make the device's primary context (torch's) current on this thread, as every call needs (this thread may
        have none: vLLM's allocator met that mismatch); the device's ordinal."""
        index = torch.cuda.current_device() if device.index is None else device.index
        ctx = self._contexts.get(index)
        if ctx is None:
            self._cu("cuInit", 0)
            dev = ctypes.c_int()
            self._cu("cuDeviceGet", ctypes.byref(dev), index)
            ctx = ctypes.c_void_p()
            self._cu("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), dev)
            self._contexts[index] = ctx
        now = ctypes.c_void_p()
        self._cu("cuCtxGetCurrent", ctypes.byref(now))
        if now.value != ctx.value:
            self._cu("cuCtxSetCurrent", ctx)
        return index

    def _prop(self, index: int) -> _AllocationProp:
        return _AllocationProp(_MEM_ALLOCATION_TYPE_PINNED, 0, _Location(_MEM_LOCATION_TYPE_DEVICE, index))

    def unsupported(self, device: torch.device) -> str | None:
        if device.type != "cuda":
            return f"{device} is not a CUDA device"
        if not torch.cuda.is_available():
            return "CUDA is not available"
        index = torch.cuda.current_device() if device.index is None else device.index
        if index not in self._support:
            try:
                self._current(device)
                value = ctypes.c_int()
                dev = ctypes.c_int()
                self._cu("cuDeviceGet", ctypes.byref(dev), index)
                self._cu("cuDeviceGetAttribute", ctypes.byref(value), _VMM_SUPPORTED, dev)
                why = None if value.value else f"{device} does not support virtual memory management"
            except DriverError as e:
                why = f"the CUDA driver could not be asked about {device}: {e}"
            self._support[index] = why
        return self._support[index]

    def granularity(self, device: torch.device) -> int:
        index = self._current(device)
        if index not in self._granularity:
            size = ctypes.c_size_t()
            prop = self._prop(index)
            self._cu(
                "cuMemGetAllocationGranularity", ctypes.byref(size), ctypes.byref(prop), _MEM_ALLOC_GRANULARITY_MINIMUM
            )
            self._granularity[index] = int(size.value)
        return self._granularity[index]

    def reserve(self, device: torch.device, size: int) -> int:
        ptr = ctypes.c_uint64()
        self._cu("cuMemAddressReserve", ctypes.byref(ptr), size, 0, 0, 0, on=device)
        return int(ptr.value)

    def free_reserved(self, device: torch.device, address: int, size: int) -> None:
        self._cu("cuMemAddressFree", address, size, on=device)

    def create(self, device: torch.device, size: int) -> int:
        prop = self._prop(self._current(device))
        handle = ctypes.c_uint64()
        self._cu("cuMemCreate", ctypes.byref(handle), size, ctypes.byref(prop), 0)
        return int(handle.value)

    def map(self, device: torch.device, address: int, size: int, handle: int) -> None:
        self._cu("cuMemMap", address, size, 0, handle, 0, on=device)

    def set_access(self, device: torch.device, address: int, size: int) -> None:
        index = self._current(device)
        desc = _AccessDesc(_Location(_MEM_LOCATION_TYPE_DEVICE, index), _MEM_ACCESS_FLAGS_PROT_READWRITE)
        self._cu("cuMemSetAccess", address, size, ctypes.byref(desc), 1)

    def unmap(self, device: torch.device, address: int, size: int) -> None:
        self._cu("cuMemUnmap", address, size, on=device)

    def release(self, device: torch.device, handle: int) -> None:
        self._cu("cuMemRelease", handle, on=device)

    def wrap(self, device: torch.device, address: int, nbytes: int, owner: object) -> torch.Tensor:
        self._current(device)
        t = torch.as_tensor(_CudaArray(address, nbytes, owner), device=device)
        if t.data_ptr() != address or t.device != device:  # pragma: no cover - a torch change
            raise RuntimeError(f"__cuda_array_interface__ gave a tensor at {t.data_ptr():#x} on {t.device}")
        return t


register_driver("cuda", CudaDriver.load)
