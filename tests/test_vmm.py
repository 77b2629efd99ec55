"""The driver interface (optimshift._vmm): the CUDA driver through ctypes, checked here against a recording fake
of libcuda.so.1 (the real one runs in benchmarks/gpu_check.sh and tests/test_addresses_cuda.py), and the
registry of drivers by device type."""

from __future__ import annotations

import ctypes

import pytest
import torch

from optimshift import _vmm


def test_the_structures_have_cudas_sizes():
    # CUDA 13's headers: CUmemAllocationProp is 32 bytes, CUmemAccessDesc 12 (see REFERENCE.md)
    assert ctypes.sizeof(_vmm._AllocationProp) == 32
    assert ctypes.sizeof(_vmm._AccessDesc) == 12
    assert _vmm._AllocationProp.allocFlags.offset == 24


class _FakeLib:
    """libcuda.so.1's functions used, recording each call; ``fail``: {name: error code} returned instead."""

    def __init__(self, fail=None, current=0):
        self.calls = []
        self.fail = dict(fail or {})
        self.current = current  # the context current on this thread (0: none)
        self.next = 0x7000

        def fn(name, body=None):
            def call(*args):
                self.calls.append(name)
                if name in self.fail:
                    return self.fail[name]
                if body is not None:
                    body(*args)
                return 0

            call.__name__ = name
            return call

        def out(value):
            return lambda ref, *rest: setattr(ref._obj, "value", value)

        self.cuInit = fn("cuInit")
        self.cuDeviceGet = fn("cuDeviceGet", lambda ref, i: setattr(ref._obj, "value", i))
        self.cuDeviceGetAttribute = fn("cuDeviceGetAttribute", out(1))
        self.cuCtxGetCurrent = fn("cuCtxGetCurrent", lambda ref: setattr(ref._obj, "value", self.current or None))
        self.cuCtxSetCurrent = fn("cuCtxSetCurrent", lambda ctx: setattr(self, "current", ctx.value))
        self.cuDevicePrimaryCtxRetain = fn("cuDevicePrimaryCtxRetain", out(0xC0))
        self.cuMemGetAllocationGranularity = fn("cuMemGetAllocationGranularity", out(2 << 20))
        self.cuMemAddressReserve = fn("cuMemAddressReserve", out(0x10000000))
        self.cuMemAddressFree = fn("cuMemAddressFree")
        self.cuMemCreate = fn("cuMemCreate", out(0x42))
        self.cuMemMap = fn("cuMemMap")
        self.cuMemSetAccess = fn("cuMemSetAccess", self._access)
        self.cuMemUnmap = fn("cuMemUnmap")
        self.cuMemRelease = fn("cuMemRelease")
        self.cuGetErrorString = fn("cuGetErrorString", lambda code, ref: setattr(ref._obj, "value", b"fake error"))
        self.access = None

    def _access(self, ptr, size, desc, count):
        d = desc._obj
        self.access = (d.location.type, d.location.id, d.flags, count)


def test_each_call_makes_the_primary_context_current_first():
    lib = _FakeLib()
    driver = _vmm.CudaDriver(lib)
    device = torch.device("cuda", 1)
    assert driver.granularity(device) == 2 << 20
    assert lib.calls[:5] == ["cuInit", "cuDeviceGet", "cuDevicePrimaryCtxRetain", "cuCtxGetCurrent", "cuCtxSetCurrent"]
    assert lib.current == 0xC0
    lib.calls.clear()
    address = driver.reserve(device, 4 << 20)
    handle = driver.create(device, 2 << 20)
    driver.map(device, address, 2 << 20, handle)
    driver.set_access(device, address, 2 << 20)
    driver.unmap(device, address, 2 << 20)
    driver.release(device, handle)
    driver.free_reserved(device, address, 4 << 20)
    assert (address, handle) == (0x10000000, 0x42)
    # the context is current already: one check before each call, nothing set again
    calls = [c for c in lib.calls if c != "cuCtxGetCurrent"]
    assert calls == [
        "cuMemAddressReserve",
        "cuMemCreate",
        "cuMemMap",
        "cuMemSetAccess",
        "cuMemUnmap",
        "cuMemRelease",
        "cuMemAddressFree",
    ]
    assert lib.calls.count("cuCtxGetCurrent") == 7
    assert lib.access == (1, 1, 3, 1)  # the device's location, read-write, one descriptor
    lib.current = 0x99  # another context became current (another library): set back before the next call
    driver.create(device, 2 << 20)
    assert lib.calls[-3:] == ["cuCtxGetCurrent", "cuCtxSetCurrent", "cuMemCreate"] and lib.current == 0xC0


def test_errors_name_the_call_and_out_of_memory_is_its_own():
    driver = _vmm.CudaDriver(_FakeLib(fail={"cuMemCreate": 2, "cuMemMap": 1}))
    device = torch.device("cuda", 0)
    with pytest.raises(_vmm.DriverOutOfMemory, match=r"cuMemCreate failed: fake error \(error 2\)"):
        driver.create(device, 2 << 20)
    with pytest.raises(_vmm.DriverError, match=r"cuMemMap failed: fake error \(error 1\)") as e:
        driver.map(device, 0x1000, 2 << 20, 1)
    assert not isinstance(e.value, _vmm.DriverOutOfMemory) and e.value.call == "cuMemMap"


def test_support_is_the_device_attribute(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert _vmm.CudaDriver(_FakeLib()).unsupported(torch.device("cuda", 0)) is None
    lib = _FakeLib()
    lib.cuDeviceGetAttribute = lambda ref, attr, dev: (setattr(ref._obj, "value", 0), 0)[1]
    assert "does not support virtual memory management" in _vmm.CudaDriver(lib).unsupported(torch.device("cuda", 0))
    broken = _vmm.CudaDriver(_FakeLib(fail={"cuInit": 100}))
    assert "could not be asked" in broken.unsupported(torch.device("cuda", 0))
    assert "not a CUDA device" in broken.unsupported(torch.device("cpu"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present")
def test_without_a_gpu_cuda_cannot_keep_addresses():
    why = _vmm.unsupported(torch.device("cuda", 0))
    assert why is not None and ("no virtual memory driver" in why or "CUDA is not available" in why)
    assert "no virtual memory driver is known for meta devices" == _vmm.unsupported(torch.device("meta"))


def test_use_driver_overrides_and_restores(sim):
    real = _vmm.driver_for(sim)
    other = object()
    with _vmm.use_driver(sim.type, other):  # type: ignore[arg-type]
        assert _vmm.driver_for(sim) is other
    assert _vmm.driver_for(sim) is real
