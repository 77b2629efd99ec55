"""The simulator's virtual memory (optimshift.testing._sim_vmm): what CUDA refuses is refused, unmapped pages go
back to the system and read as zeros once mapped again, an access to unmapped memory raises, and
simulated_memory_allocated counts mapped bytes, not the tensors over them."""

from __future__ import annotations

import pytest
import torch

from optimshift import _vmm
from optimshift.testing import simulated_memory_allocated
from optimshift.testing._sim_vmm import FaultyDriver, SimDriver

PAGE = 4096


@pytest.fixture
def drv(sim):
    d = SimDriver()
    yield d
    assert d.reserved() == 0, "a test left a reservation"


def _mapped(drv, sim, size):
    address = drv.reserve(sim, size)
    handle = drv.create(sim, size)
    drv.map(sim, address, size, handle)
    drv.set_access(sim, address, size)
    return address, handle


def _unmapped(drv, sim, address, size, handle):
    drv.unmap(sim, address, size)
    drv.release(sim, handle)
    drv.free_reserved(sim, address, size)


def test_mapped_memory_is_counted_and_its_tensors_are_not(sim, drv):
    before = simulated_memory_allocated(0)
    address, handle = _mapped(drv, sim, 4 * PAGE)
    assert simulated_memory_allocated(0) == before + 4 * PAGE
    t = drv.wrap(sim, address, 4 * PAGE, None)
    assert t.device == sim and t.data_ptr() == address
    assert simulated_memory_allocated(0) == before + 4 * PAGE
    t.fill_(7)
    assert torch.equal(t.cpu(), torch.full((4 * PAGE,), 7, dtype=torch.uint8))
    del t
    _unmapped(drv, sim, address, 4 * PAGE, handle)
    assert simulated_memory_allocated(0) == before


def test_unmapped_pages_read_as_zeros_when_mapped_again(sim, drv):
    address, handle = _mapped(drv, sim, PAGE)
    drv.wrap(sim, address, PAGE, None).fill_(255)
    drv.unmap(sim, address, PAGE)
    drv.release(sim, handle)
    handle = drv.create(sim, PAGE)
    drv.map(sim, address, PAGE, handle)
    drv.set_access(sim, address, PAGE)
    assert int(drv.read(sim, address, PAGE).sum()) == 0  # madvise(MADV_DONTNEED): the pages went back
    _unmapped(drv, sim, address, PAGE, handle)


def test_an_access_to_unmapped_memory_raises_now_and_when_queued(sim, drv):
    address, handle = _mapped(drv, sim, PAGE)
    t = drv.wrap(sim, address, PAGE, None).view(torch.float32)
    drv.unmap(sim, address, PAGE)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        t.add_(1)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        drv.wrap(sim, address, PAGE, None)
    # (queued work that reaches unmapped memory when it runs raises too: tests/test_addresses.py, the mutation of
    # the release that waits for the copies in flight)
    del t
    drv.release(sim, handle)
    drv.free_reserved(sim, address, PAGE)


def test_what_cuda_refuses_is_refused(sim, drv):
    address = drv.reserve(sim, 2 * PAGE)
    h = drv.create(sim, PAGE)
    with pytest.raises(_vmm.DriverError, match="not inside a reserved range"):
        drv.map(sim, address + 2 * PAGE, PAGE, h)
    with pytest.raises(_vmm.DriverError, match="unaligned"):
        drv.map(sim, address + 1, PAGE, h)
    with pytest.raises(_vmm.DriverError, match="is not 8192 bytes"):
        drv.map(sim, address, 2 * PAGE, h)
    drv.map(sim, address, PAGE, h)
    with pytest.raises(_vmm.DriverError, match="mapped already"):
        drv.map(sim, address + PAGE, PAGE, h)
    h2 = drv.create(sim, PAGE)
    with pytest.raises(_vmm.DriverError, match="overlaps"):
        drv.map(sim, address, PAGE, h2)
    with pytest.raises(_vmm.DriverError, match="still mapped"):
        drv.release(sim, h)
    with pytest.raises(_vmm.DriverError, match="still has mappings"):
        drv.free_reserved(sim, address, 2 * PAGE)
    with pytest.raises(_vmm.DriverError, match="no mapping of 8192 bytes"):
        drv.unmap(sim, address, 2 * PAGE)  # (whole mappings only)
    with pytest.raises(_vmm.DriverError, match="not a positive multiple"):
        drv.create(sim, 100)
    drv.unmap(sim, address, PAGE)
    drv.release(sim, h)
    drv.release(sim, h2)
    drv.free_reserved(sim, address, 2 * PAGE)


def test_capacity_bounds_physical_memory(sim):
    drv = SimDriver(capacity=2 * PAGE)
    a = drv.create(sim, 2 * PAGE)
    with pytest.raises(_vmm.DriverOutOfMemory):
        drv.create(sim, PAGE)
    drv.release(sim, a)
    drv.release(sim, drv.create(sim, PAGE))


def test_the_faulty_driver_fails_the_call_it_is_told(sim, drv):
    faulty = FaultyDriver(drv, fail_at=1)
    address = faulty.reserve(sim, PAGE)
    with pytest.raises(_vmm.DriverError, match="create failed: injected fault"):
        faulty.create(sim, PAGE)
    faulty.free_reserved(sim, address, PAGE)
    assert faulty.calls == ["reserve", "create", "free_reserved"] and faulty.failed == ["create"]
    oom = FaultyDriver(drv, fail_at=0, oom=True)
    with pytest.raises(_vmm.DriverOutOfMemory):
        oom.create(sim, PAGE)


def test_a_range_freed_by_a_collection_inside_the_drivers_lock_does_not_deadlock(sim, drv):
    """A collection that starts while the driver holds its lock (an allocation in ``check``, which every access to
    kept memory goes through) may finalize another optimizer's range: its unmap, release and free waited for that
    lock forever (a keep_addresses test on the simulator hung). From inside a section they are made on leaving it;
    from a thread holding the lock directly, at once."""
    import threading

    address, handle = _mapped(drv, sim, PAGE)

    def freed_under_the_lock():
        with drv._lock:
            _unmapped(drv, sim, address, PAGE, handle)

    t = threading.Thread(target=freed_under_the_lock, daemon=True)
    t.start()
    t.join(10)
    assert not t.is_alive(), "the driver waited for the lock its own thread holds"
    other, other_handle = _mapped(drv, sim, PAGE)
    with drv._held():  # (what a finalizer run inside check() does)
        _unmapped(drv, sim, other, PAGE, other_handle)
        assert drv.reserved() == 1, "deferred until the section ends"
    assert drv.reserved() == 0 and drv.mapped(0) == 0


def test_a_deferred_call_that_fails_is_logged_and_the_rest_are_made(sim, drv, caplog):
    """A deferred call that failed was raised from whichever section happened to drain the queue (another
    optimizer's access), and the calls after it stayed pending (a reservation never freed)."""
    address = drv.reserve(sim, PAGE)
    with drv._held():
        drv.unmap(sim, 12345, PAGE)  # (nothing mapped there: fails when made)
        drv.free_reserved(sim, address, PAGE)
    assert drv.reserved() == 0 and "a deferred unmap failed" in caplog.text


def test_calls_deferred_in_a_section_that_raises_are_still_made(sim, drv):
    """The deferred calls were taken by the outermost section and made after it, but not where it raised: a
    reservation freed from inside one was never freed."""
    address = drv.reserve(sim, PAGE)
    with pytest.raises(_vmm.DriverError):
        with drv._held():
            drv.free_reserved(sim, address, PAGE)
            drv.map(sim, 12345, PAGE, 999)  # (fails: no such range)
    assert drv.reserved() == 0
