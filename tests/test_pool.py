"""The host pool's pinned-memory budget: past ``pinned_limit`` (or when pinning itself fails) a pinned request
gets pageable memory, with one WARNING, counted in ``stats()``; offload/reload round trips through such buffers
stay bitwise, blocking and non-blocking, under the simulator's deferred streams.

No pinned allocator exists on a CPU-only machine (and the simulator has none), so the pinned path is exercised
with a stand-in: ``pool._allocate`` makes plain host buffers it reports as pinned (``Tensor.is_pinned``), and the
simulated accelerator is declared one that pins (``_copy.pins_host_for``), so that copies ask for pinned buffers.
"""

from __future__ import annotations

import gc
import logging
import sys
import weakref

import pytest
import torch

import optimshift
from _matrix import Model, bitwise_equal, snapshot, tensor_ids, train
from _schedules import SCHEDULES
from optimshift import _copy, pool
from optimshift.pool import HostPool, host_pool
from optimshift.testing import deferred_streams

MiB = 1 << 20
CONFIGS = [
    pytest.param(torch.optim.Adam, {"foreach": True}, id="Adam-foreach"),
    pytest.param(torch.optim.AdamW, {"fused": True}, id="AdamW-fused"),
    pytest.param(torch.optim.SGD, {"momentum": 0.9, "foreach": False}, id="SGD-momentum"),
]
SHAPES = [(3, 2), (4,), (2, 5), (1,)]


class Pinning:
    """A stand-in pinned allocator: plain host memory, reported as pinned by ``Tensor.is_pinned``; ``fail``: the
    exception every pinned allocation (every allocation, with ``fail_pageable``) raises instead."""

    def __init__(self) -> None:
        self.pointers: set[int] = set()
        self.fail: BaseException | None = None
        self.fail_pageable = False
        self.pinned_allocations = 0

    def allocate(self, nbytes, pinned):
        if (pinned or self.fail_pageable) and self.fail is not None:
            raise self.fail
        buf = torch.empty(nbytes, dtype=torch.uint8)
        if pinned:
            self.pinned_allocations += 1
            pointer = buf.untyped_storage().data_ptr()
            self.pointers.add(pointer)
            weakref.finalize(buf, self.pointers.discard, pointer)
        return buf

    def is_pinned(self, t) -> bool:
        return t.device.type == "cpu" and t.untyped_storage().data_ptr() in self.pointers


@pytest.fixture
def pinning(monkeypatch):
    stand_in = Pinning()
    monkeypatch.setattr(pool, "_allocate", stand_in.allocate)
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self, device=None: stand_in.is_pinned(self))
    return stand_in


@pytest.fixture
def global_pool():
    """``host_pool`` as a test leaves it: its limit as it was, no idle buffer (none made by a stand-in)."""
    host_pool.release_idle()
    limit = host_pool._limit
    yield host_pool
    host_pool._limit = limit
    host_pool.release_idle()


@pytest.fixture
def sim_pins(sim, monkeypatch, pinning, global_pool):
    """The simulated accelerator as one whose copies use pinned host buffers (from the stand-in allocator)."""
    monkeypatch.setattr(_copy, "pins_host_for", lambda device: device.type == sim.type)
    return pinning


def _consistent(stats):
    assert stats.pinned_bytes + stats.pageable_bytes == stats.idle_bytes + stats.in_use_bytes, stats


def _warnings(caplog, text):
    return [r for r in caplog.records if r.name == "optimshift" and r.levelno == logging.WARNING and text in r.message]


# -- the limit -----------------------------------------------------------------------------------------------


def test_past_the_limit_a_pinned_request_gets_pageable_memory_with_one_warning(pinning, caplog):
    p = HostPool()
    p.pinned_limit = 4 * MiB
    with caplog.at_level(logging.WARNING, logger="optimshift"):
        a, b = p.acquire(2 * MiB, pinned=True), p.acquire(2 * MiB - 5, pinned=True)
        assert pinning.is_pinned(a) and pinning.is_pinned(b)
        assert not _warnings(caplog, "limit")
        c = p.acquire(1, pinned=True)  # 4 MiB pinned already: past the limit
        d = p.acquire(3 * MiB, pinned=True)
    assert not pinning.is_pinned(c) and not pinning.is_pinned(d)
    assert c.numel() == MiB and d.numel() == 3 * MiB, "pageable buffers keep the 1 MiB granule"
    stats = p.stats()
    assert (stats.pinned_bytes, stats.pageable_bytes) == (4 * MiB, 4 * MiB)
    assert (stats.pinned_limit, stats.over_limit, stats.pin_failures) == (4 * MiB, 2, 0)
    _consistent(stats)
    [line] = _warnings(caplog, "limit")
    assert "4.0 MiB" in line.message and "OPTIMSHIFT_PINNED_LIMIT" in line.message and "over_limit" in line.message
    # the pageable buffers are reused by the next requests past the limit: no new memory in a steady loop
    p.release(c)
    allocations = p.stats().allocations
    assert p.acquire(MiB, pinned=True) is c and p.stats().allocations == allocations
    assert p.stats().over_limit == 3
    # setting the limit again re-arms the warning
    p.pinned_limit = 4 * MiB
    with caplog.at_level(logging.WARNING, logger="optimshift"):
        p.acquire(MiB, pinned=True)
    assert len(_warnings(caplog, "limit")) == 2 and p.stats().over_limit == 4


def test_idle_pinned_buffers_are_freed_to_make_room_before_pageable_memory(pinning, caplog, monkeypatch):
    emptied = []
    monkeypatch.setattr(pool, "_return_pinned_memory", lambda: emptied.append(1))
    p = HostPool()
    p.pinned_limit = 4 * MiB
    a, b = p.acquire(MiB, pinned=True), p.acquire(2 * MiB, pinned=True)

    class Event:
        synchronized = 0

        def query(self):
            return False

        def synchronize(self):
            Event.synchronized += 1

    p.release(a, Event())  # a copy in flight still reads it
    p.release(b)
    gone = [weakref.ref(a), weakref.ref(b)]
    del a, b
    with caplog.at_level(logging.WARNING, logger="optimshift"):
        c = p.acquire(4 * MiB, pinned=True)  # fits neither: both go (3 MiB held + 4 MiB > 4 MiB)
    assert pinning.is_pinned(c) and not _warnings(caplog, "limit")
    assert all(ref() is None for ref in gone), "the idle pinned buffers were freed"
    assert Event.synchronized == 1, "after the copy that read one of them"
    assert emptied == [1], "and the caching host allocator was told to give them back"
    stats = p.stats()
    assert (stats.pinned_bytes, stats.idle, stats.over_limit) == (4 * MiB, 0, 0)
    # a buffer something still looks into frees nothing: it stays, counted, and the request goes pageable
    p.release(c)
    view = c[:10]
    del c
    d = p.acquire(MiB, pinned=True)  # (a 4 MiB buffer is not in a 1 MiB request's size class)
    assert not pinning.is_pinned(d) and view.untyped_storage().data_ptr() in pinning.pointers
    assert (p.stats().pinned_bytes, p.stats().over_limit) == (4 * MiB, 1)
    _consistent(p.stats())


def test_pinned_buffers_are_powers_of_two_as_the_caching_host_allocator_pins(pinning):
    p = HostPool()
    p.pinned_limit = None
    a = p.acquire(3 * MiB, pinned=True)
    assert a.numel() == 4 * MiB and p.stats().pinned_bytes == 4 * MiB
    assert p.acquire(3 * MiB, pinned=False).numel() == 3 * MiB
    p.release(a)
    assert p.acquire(3 * MiB + 1, pinned=True) is a and p.stats().reuses == 1


def test_a_lower_limit_frees_idle_pinned_buffers_and_bad_limits_are_refused(pinning):
    p = HostPool()
    p.pinned_limit = None
    bufs = [p.acquire(2 * MiB, pinned=True) for _ in range(3)]
    for buf in bufs:
        p.release(buf)
    del bufs, buf
    p.pinned_limit = 3 * MiB
    stats = p.stats()
    assert (stats.pinned_bytes, stats.idle) == (2 * MiB, 1)
    for bad, error in [(True, TypeError), (1.5, TypeError), ("8GiB", TypeError), (-1, ValueError)]:
        with pytest.raises(error, match="host_pool.pinned_limit must be"):
            p.pinned_limit = bad
    assert p.pinned_limit == 3 * MiB
    p.pinned_limit = 0  # no pinned memory at all
    assert p.stats().pinned_bytes == 0 and not pinning.is_pinned(p.acquire(1, pinned=True))


def test_a_buffer_that_dies_in_use_stops_counting(pinning):
    p = HostPool()
    p.pinned_limit = None
    a, b = p.acquire(1, pinned=True), p.acquire(1, pinned=False)
    assert (p.stats().pinned_bytes, p.stats().pageable_bytes) == (MiB, MiB)
    del a, b
    gc.collect()
    assert (p.stats().pinned_bytes, p.stats().pageable_bytes, p.stats().in_use) == (0, 0, 0)


@pytest.mark.parametrize("pinned", [True, False], ids=["pinned", "pageable"])
def test_a_ctrl_c_while_waiting_for_a_buffer_s_copy_gives_it_back(pinning, pinned):
    """The buffer taken from the idle ones while its copy was waited for was neither idle nor in use: gone, its bytes
    counted as held for good (the pinned limit lowered by them), and freed under its copy in flight."""
    p = HostPool()
    p.pinned_limit = None

    class Event:
        waits = 0

        def query(self):
            return False

        def synchronize(self):
            Event.waits += 1
            if Event.waits == 1:
                raise KeyboardInterrupt

    buf = p.acquire(MiB, pinned=pinned)
    p.release(buf, Event())
    with pytest.raises(KeyboardInterrupt):
        p.acquire(MiB, pinned=pinned)
    gc.collect()
    stats = p.stats()
    assert (stats.idle, stats.in_use, stats.idle_bytes) == (1, 0, MiB)
    _consistent(stats)
    assert p.acquire(MiB, pinned=pinned) is buf and Event.waits == 2  # (its copy waited for, this time)


class _Pending:
    """A copy in flight: ``query()`` is False; ``synchronized`` counts the waits that returned."""

    def __init__(self) -> None:
        self.synchronized = 0

    def query(self):
        return False

    def synchronize(self):
        self.synchronized += 1


_LOCKED = HostPool._locked.__wrapped__.__code__


def _traced(tracer, call) -> bool:
    """Run ``call`` under ``tracer``; whether the KeyboardInterrupt the tracer raises was reached."""
    sys.settrace(tracer)
    try:
        call()
    except KeyboardInterrupt:
        return True
    finally:
        sys.settrace(None)
    return False


def _interrupted_at(line, call):
    """Run ``call`` with a KeyboardInterrupt raised at the ``line``-th line the pool runs (none past its last):
    whether it was raised. Not in a buffer's finalizer (an exception there is printed, not raised), nor in
    ``_locked`` (one before its ``yield`` is one at its caller's ``with``: a wait for the lock), nor where a trace
    function's exception skips the handlers armed and no signal lands: a ``try:`` line, ``with``'s exit."""
    import linecache

    seen = [0]

    def in_pool(frame, event, arg):
        code, outer = frame.f_code, frame
        while outer is not None and outer.f_code is not HostPool._drop.__code__:
            outer = outer.f_back
        return local if code.co_filename == pool.__file__ and code is not _LOCKED and outer is None else None

    def local(frame, event, arg):
        if event == "line" and linecache.getline(pool.__file__, frame.f_lineno).strip() != "try:":
            seen[0] += 1
            if seen[0] == line:
                raise KeyboardInterrupt
        return local

    return _traced(in_pool, call)


@pytest.mark.parametrize("pinned", [True, False], ids=["pinned", "pageable"])
@pytest.mark.parametrize("case", ["reused", "new", "evicting", "pin-failing", "all-failing"])
def test_a_ctrl_c_anywhere_in_a_request_loses_no_buffer_and_no_byte(pinning, case, pinned):
    """A KeyboardInterrupt at each line a request runs: the buffer it took from the idle ones or allocated is idle
    again or, handed to nobody, freed and counted off; the bytes held are those of the buffers idle and in use,
    and the request asked again is served. (An idle buffer taken, its copy waited for, was lost while the request
    waited for the pool's lock: its bytes counted as held for good, the pinned limit lowered by them.) A pageable
    allocation that fails raises its error, its bytes given back."""
    line = 0
    while True:
        line += 1
        p = HostPool()
        p.pinned_limit = 2 * MiB if case == "evicting" else None
        if case in ("reused", "evicting"):
            p.release(p.acquire(2 * MiB if case == "evicting" else MiB, pinned=pinned), _Pending())
        pinning.fail = RuntimeError("no memory") if case.endswith("failing") else None
        pinning.fail_pageable = case == "all-failing"
        if case == "all-failing":
            interrupted = _interrupted_at(line, lambda: pytest.raises(RuntimeError, p.acquire, MiB, pinned=pinned))
        else:
            interrupted = _interrupted_at(line, lambda: p.acquire(MiB, pinned=pinned))
        pinning.fail = None  # (its traceback holds the request's frames)
        stats = p.stats()
        _consistent(stats)
        assert stats.in_use == 0 and len(p._meta) == stats.idle, (line, stats)
        assert stats.pinned_bytes == sum(b.numel() for b, is_pinned, _ in p._idle if is_pinned), (line, stats)
        p.pinned_limit = None
        kept = p.acquire(MiB, pinned=pinned)
        _consistent(p.stats())
        assert p.stats().in_use == 1
        del kept
        if not interrupted:
            break
    assert line > 10


@pytest.mark.parametrize("how", ["a request", "a lower limit", "release_idle"])
def test_a_ctrl_c_while_freeing_evicted_buffers_frees_none_under_its_copy(pinning, how):
    """Idle pinned buffers freed for room (or by ``release_idle``) are freed once their copies completed: a Ctrl-C
    in one of those waits dropped the rest without waiting. Those not freed go back to the idle ones, counted."""
    p = HostPool()
    p.pinned_limit = None
    bufs = [p.acquire(MiB, pinned=True) for _ in range(3)]

    class Event(_Pending):
        interrupted = False

        def synchronize(self):
            if not Event.interrupted:
                Event.interrupted = True
                raise KeyboardInterrupt
            super().synchronize()

    events = [Event() for _ in bufs]
    for buf, event in zip(bufs, events):
        p.release(buf, event)
    refs = [weakref.ref(buf) for buf in bufs]
    del bufs, buf
    with pytest.raises(KeyboardInterrupt):
        if how == "a request":
            p.pinned_limit = 4 * MiB
            p.acquire(4 * MiB, pinned=True)  # (3 MiB held: all three go)
        elif how == "a lower limit":
            p.pinned_limit = 0
        else:
            p.release_idle()
    assert all(ref() is not None or event.synchronized for ref, event in zip(refs, events)), "freed under its copy"
    stats = p.stats()
    _consistent(stats)
    assert stats.idle == 3 and stats.pinned_bytes == 3 * MiB
    assert p.release_idle() == 3 * MiB and all(ref() is None for ref in refs)
    assert all(event.synchronized for event in events)


def test_a_buffer_that_dies_while_the_pool_is_locked_does_not_deadlock(pinning):
    """A buffer's finalizer runs wherever the collector does: inside a section holding the pool's lock (the
    allocation of ``in_use_storages``' list, in the ``state_dict()`` post-hook of an offloaded optimizer, freeing
    another one caught in a cycle) it waited for that lock forever. The death is accounted by the lock's next
    holder. (A pool of its own: on the old code the thread below holds its lock for good.)"""
    import threading

    p = HostPool()
    p.pinned_limit = None
    held = [p.acquire(1, pinned=False)]

    def die_under_the_lock():
        with p._lock:
            held.clear()  # the buffer's last reference: its finalizer runs here, the lock held

    t = threading.Thread(target=die_under_the_lock, daemon=True)
    t.start()
    t.join(10)
    assert not t.is_alive(), "the finalizer waited for the lock its own thread holds"
    assert (p.stats().pageable_bytes, p.stats().in_use) == (0, 0)


def test_release_idle_gives_pinned_memory_back_to_the_os(pinning, monkeypatch):
    """PyTorch's caching host allocator keeps freed pinned blocks for the process: the pool empties its cache
    once it freed pinned buffers (and not for pageable ones alone)."""
    emptied = []
    monkeypatch.setattr(pool, "host_pinning", lambda: "cuda")
    monkeypatch.setattr(torch.accelerator, "empty_host_cache", lambda: emptied.append(1))
    p = HostPool()
    p.pinned_limit = None
    p.release(p.acquire(1, pinned=False))
    assert p.release_idle() == MiB and emptied == []
    p.release(p.acquire(1, pinned=True))
    assert p.release_idle() == MiB and emptied == [1]
    assert (p.stats().pinned_bytes, p.stats().pageable_bytes) == (0, 0)


# -- pinning that fails ----------------------------------------------------------------------------------------


def test_a_failing_pin_memory_falls_back_to_pageable_memory(pinning, caplog):
    p = HostPool()
    p.pinned_limit = None
    kept = p.acquire(1, pinned=True)
    pinning.fail = torch.OutOfMemoryError("CUDA error: out of memory\nCUDA kernel errors might be reported ...")
    with caplog.at_level(logging.WARNING, logger="optimshift"):
        a = p.acquire(2 * MiB, pinned=True)
        b = p.acquire(MiB, pinned=True)
    assert not pinning.is_pinned(a) and not pinning.is_pinned(b) and a.numel() == 2 * MiB
    stats = p.stats()
    assert (stats.pin_failures, stats.over_limit) == (2, 0)
    assert (stats.pinned_bytes, stats.pageable_bytes) == (MiB, 3 * MiB), "nothing counted for the failed pins"
    [line] = _warnings(caplog, "pinning")
    assert "(OutOfMemoryError: CUDA error: out of memory);" in line.message and "pin_failures" in line.message
    # an interrupt is no allocation failure: it propagates, and nothing stays reserved
    pinning.fail = KeyboardInterrupt()
    with pytest.raises(KeyboardInterrupt):
        p.acquire(MiB, pinned=True)
    assert p.stats().pinned_bytes == MiB and p.stats().pin_failures == 2
    del kept


# -- where the limit comes from ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value, limit",
    [
        ("8GiB", 8 << 30),
        ("8g", 8 << 30),
        ("512MiB", 512 << 20),
        ("1.5GB", 1_500_000_000),
        ("2 kb", 2000),
        ("1048576", 1 << 20),
        ("0", 0),
        ("unlimited", None),
    ],
)
def test_the_limit_from_the_environment(monkeypatch, value, limit):
    monkeypatch.setenv("OPTIMSHIFT_PINNED_LIMIT", value)
    assert HostPool().pinned_limit == limit
    p = HostPool()
    p.pinned_limit = 3 * MiB  # set in code: the variable no longer counts
    assert p.pinned_limit == 3 * MiB and p.stats().pinned_limit == 3 * MiB


@pytest.mark.parametrize("value", ["lots", "8 GiBs", "-1", "1.5", "8iB"])
def test_a_bad_environment_value_is_refused_naming_the_variable(monkeypatch, pinning, value):
    monkeypatch.setenv("OPTIMSHIFT_PINNED_LIMIT", value)
    p = HostPool()
    message = rf"OPTIMSHIFT_PINNED_LIMIT='{value}' is not a size: give bytes .* or 'unlimited'"
    with pytest.raises(ValueError, match=message):
        p.acquire(1, pinned=True)
    assert p.acquire(1, pinned=False).numel() == MiB, "pageable requests never read it"
    monkeypatch.setenv("OPTIMSHIFT_PINNED_LIMIT", "1MiB")
    assert p.stats().allocations == 1 and p.pinned_limit == MiB


def test_the_default_is_half_the_host_memory_shared_by_the_local_ranks(monkeypatch):
    monkeypatch.delenv("OPTIMSHIFT_PINNED_LIMIT", raising=False)
    monkeypatch.setattr(pool, "_host_memory", lambda: 64 << 30)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert HostPool().pinned_limit == 4 << 30
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert HostPool().pinned_limit == 32 << 30
    monkeypatch.setattr(pool, "_host_memory", lambda: None)
    assert HostPool().pinned_limit is None, "unknown host memory: no limit"


def test_host_memory_is_the_machine_s_or_the_container_s_whichever_is_less(monkeypatch, tmp_path):
    import os

    machine = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    limit = tmp_path / "memory.max"
    monkeypatch.setattr(pool, "_CGROUP_LIMITS", (str(limit), str(tmp_path / "v1")))
    assert pool._host_memory() == machine, "no cgroup file"
    limit.write_text("max\n")
    assert pool._host_memory() == machine
    limit.write_text("1073741824\n")
    assert pool._host_memory() == 1 << 30
    limit.write_text(f"{machine * 4}\n")
    assert pool._host_memory() == machine


# -- offload and reload through pageable buffers: bitwise, blocking and non-blocking ---------------------------------


def _cycles(sim, cls, kwargs, *, non_blocking, offloaded=None, strict=False):
    """Train, then two offload/reload cycles with training between and after: (params, state) at the end.
    ``offloaded(opt)`` is called while the state is offloaded (and waited for); ``strict``: the schedule runs
    nothing unordered, so each non-blocking transfer must still be in flight when it returns."""
    model = Model(SHAPES).to(sim)
    opt = cls(list(model.parameters()), **kwargs)
    train(model, opt, range(2))
    objects = tensor_ids(opt)
    for cycle in range(2):
        handle = optimshift.offload(opt, non_blocking=non_blocking)
        assert not (strict and handle.done()), "the offload is in flight"
        optimshift.wait(opt)
        if offloaded is not None:
            offloaded(opt)
        handle = optimshift.reload(opt, non_blocking=non_blocking)  # the next step waits for it on the device
        assert not (strict and handle.done()), "the reload is in flight"
        train(model, opt, range(2 + 2 * cycle, 4 + 2 * cycle))
    assert tensor_ids(opt) == objects
    optimshift.wait(opt)
    return [snapshot(p.detach()) for p in model.parameters()], [snapshot(dict(st)) for st in opt.state.values()]


def _run(sim, cls, kwargs, *, non_blocking, seed=0, progress=0.0, offloaded=None):
    with deferred_streams(seed=seed, progress=progress):
        strict = non_blocking and progress == 0.0
        return _cycles(sim, cls, kwargs, non_blocking=non_blocking, offloaded=offloaded, strict=strict)


def _assert_bitwise(run, ref):
    for a, b in zip(run[0], ref[0]):
        assert bitwise_equal(a, b)
    for a, b in zip(run[1], ref[1]):
        assert bitwise_equal(a, b)


@pytest.mark.parametrize(
    "non_blocking, seed, progress",
    [pytest.param(False, 0, 0.0, id="blocking")] + [pytest.param(True, *s.values, id=s.id) for s in SCHEDULES],
)
@pytest.mark.parametrize("cls, kwargs", CONFIGS)
def test_round_trips_past_the_limit_are_bitwise(sim, sim_pins, monkeypatch, cls, kwargs, non_blocking, seed, progress):
    """A 1 MiB limit: one chunk's buffer is pinned, every other one pageable (a reload then stages it into a
    pinned buffer where there is room, a pageable one where there is not); bitwise like the unlimited pool."""
    monkeypatch.setattr(_copy, "CHUNK_BYTES", 48)  # several chunks, each in a buffer of its own
    host_pool.pinned_limit = None
    # (the pool is the process's: pageable buffers another live optimizer holds, from a test before this one in
    # the worker, are not this test's)
    gc.collect()
    base = host_pool.stats().pageable_bytes
    ref = _cycles(sim, cls, kwargs, non_blocking=False)
    assert host_pool.stats().pageable_bytes == base, "the reference ran on pinned buffers alone"
    host_pool.release_idle()
    host_pool.pinned_limit = MiB
    before = host_pool.stats()
    kinds = []

    def offloaded(opt):
        kinds.append({v.is_pinned() for st in opt.state.values() for v in st.values() if v.dim()})
        stats = host_pool.stats()
        assert stats.pinned_bytes <= MiB and stats.pageable_bytes > base
        _consistent(stats)

    run = _run(sim, cls, kwargs, non_blocking=non_blocking, seed=seed, progress=progress, offloaded=offloaded)
    _assert_bitwise(run, ref)
    assert kinds == [{True, False}] * 2, "offloaded state in pinned and in pageable buffers, both cycles"
    assert host_pool.stats().over_limit > before.over_limit


@pytest.mark.parametrize(
    "non_blocking, seed, progress",
    [pytest.param(False, 0, 0.0, id="blocking"), pytest.param(True, 0, 0.0, id="strict")]
    + [pytest.param(True, *s.values, id=s.id) for s in SCHEDULES[2:]],
)
def test_round_trips_when_pin_memory_itself_fails_are_bitwise(
    sim, global_pool, monkeypatch, caplog, non_blocking, seed, progress
):
    """The real allocator, asked for pinned memory where there is none (the simulated accelerator has no pinned
    allocator: ``pin_memory=True`` raises): every transfer still happens, through pageable buffers."""
    ref = _run(sim, torch.optim.Adam, {"foreach": True}, non_blocking=non_blocking, seed=seed, progress=progress)
    host_pool.release_idle()
    host_pool.pinned_limit = None
    monkeypatch.setattr(_copy, "pins_host_for", lambda device: device.type == sim.type)
    failures = host_pool.stats().pin_failures
    with caplog.at_level(logging.WARNING, logger="optimshift"):
        run = _run(sim, torch.optim.Adam, {"foreach": True}, non_blocking=non_blocking, seed=seed, progress=progress)
    _assert_bitwise(run, ref)
    stats = host_pool.stats()
    assert stats.pin_failures > failures and stats.pinned_bytes == 0
    assert len(_warnings(caplog, "pinning")) <= 1  # (one per pool: an earlier test may have logged it)


@pytest.mark.parametrize("seed, progress", [(0, 0.0), (1, 0.3)])
def test_streamed_steps_past_the_limit_are_bitwise(sim, sim_pins, monkeypatch, seed, progress):
    """Streamed state lives in pool buffers, one per chunk: past the limit in pageable ones, and each streamed
    step is still bitwise the ordinary step, under deferred copy streams."""
    from optimshift import _chunks

    monkeypatch.setattr(_chunks, "pins_host_for", lambda device: device.type == sim.type)  # (chunk buffers)
    host_pool.pinned_limit = MiB
    before = host_pool.stats()
    with deferred_streams(seed=seed, progress=progress):
        model, ref_model = Model(SHAPES).to(sim), Model(SHAPES).to(sim)
        opt, ref = (torch.optim.Adam(list(m.parameters()), foreach=True) for m in (model, ref_model))
        optimshift.stream(opt, chunk_bytes=64)  # a chunk per param or two
        train(model, opt, range(3))
        train(ref_model, ref, range(3))
        stats = host_pool.stats()
        assert stats.pinned_bytes == MiB and stats.pageable_bytes >= 2 * MiB and stats.over_limit > before.over_limit
        _consistent(stats)
        optimshift.unstream(opt)
        for a, b in zip(model.parameters(), ref_model.parameters()):
            assert bitwise_equal(a, b)
            assert bitwise_equal(dict(opt.state[a]), dict(ref.state[b]))


@pytest.mark.cuda
@pytest.mark.parametrize("non_blocking", [False, True], ids=["blocking", "non_blocking"])
@pytest.mark.parametrize("cls, kwargs", CONFIGS)
def test_on_cuda_round_trips_past_the_limit_are_bitwise(global_pool, monkeypatch, cls, kwargs, non_blocking):
    """The real pinned allocator: pinned and pageable pool buffers side by side, bitwise like the unlimited
    pool, and no more pinned than the limit."""
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(_copy, "CHUNK_BYTES", 48)
    host_pool.pinned_limit = None
    ref = _cycles(cuda, cls, kwargs, non_blocking=False)
    host_pool.release_idle()
    host_pool.pinned_limit = MiB
    kinds = []

    def offloaded(opt):
        kinds.append({v.is_pinned() for st in opt.state.values() for v in st.values() if v.dim()})
        assert host_pool.stats().pinned_bytes <= MiB

    _assert_bitwise(_cycles(cuda, cls, kwargs, non_blocking=non_blocking, offloaded=offloaded), ref)
    assert kinds == [{True, False}] * 2


def test_a_pinned_request_may_ask_for_nothing_rather_than_pageable_memory():
    """``acquire(pinned=True, pageable=False)`` past the pinned limit: None, and no pageable buffer taken (one
    the caller would give back at once, left idle in the pool)."""
    pool = HostPool()
    pool.pinned_limit = 0
    assert pool.acquire(1024, pinned=True, pageable=False) is None
    stats = pool.stats()
    assert stats.allocations == 0 and stats.pageable_bytes == 0 and stats.over_limit == 1
    buf = pool.acquire(1024, pinned=True)  # (the default: pageable memory then)
    assert buf is not None and pool.stats().pageable_bytes > 0


@pytest.mark.parametrize("call", ["release", "release_idle"])
def test_a_ctrl_c_anywhere_in_a_release_loses_no_byte(pinning, call):
    """A KeyboardInterrupt at each line of ``release`` / ``release_idle``: the bytes held stay those of the buffers idle
    and in use. (A buffer taken out of the in-use ones and not yet idle, or idle buffers taken out before their bytes
    were all counted off, left bytes counted as held for good.)"""
    line = 0
    while True:
        line += 1
        p = HostPool()
        p.pinned_limit = None
        bufs = [p.acquire(MiB, pinned=True), p.acquire(MiB, pinned=False)]
        if call == "release":
            interrupted = _interrupted_at(line, lambda: p.release(bufs[0]))
        else:
            p.release(bufs.pop())
            p.release(bufs.pop())
            interrupted = _interrupted_at(line, p.release_idle)
        del bufs
        gc.collect()
        _consistent(p.stats())
        assert p.stats().pinned_bytes + p.stats().pageable_bytes == p.stats().idle_bytes, (line, p.stats())
        if not interrupted:
            break


def _interrupted_at_opcode(n, call):
    """Run ``call`` with a KeyboardInterrupt raised at the ``n``-th bytecode the pool runs (outside ``_locked`` and a
    buffer's finalizer, as :func:`_interrupted_at`): whether it was raised. Finer than a signal can land (after
    every C call, at every function's start and backward jump): every state between two bytecodes is one."""
    seen = [0]

    def in_pool(frame, event, arg):
        code, outer = frame.f_code, frame
        while outer is not None and outer.f_code is not HostPool._drop.__code__:
            outer = outer.f_back
        if code.co_filename != pool.__file__ or code is _LOCKED or outer is not None:
            return None
        frame.f_trace_opcodes = True
        return local

    def local(frame, event, arg):
        if event == "opcode":
            seen[0] += 1
            if seen[0] == n:
                raise KeyboardInterrupt
        return local

    return _traced(in_pool, call)


@pytest.mark.parametrize(
    "how, pinned",
    [(how, True) for how in ("reused", "evicting", "a lower limit", "release_idle")]
    + [(how, False) for how in ("reused", "release_idle")],  # (pageable buffers are never evicted)
)
def test_a_ctrl_c_at_any_bytecode_frees_no_buffer_under_its_copy(pinning, how, pinned):
    """A KeyboardInterrupt at each bytecode of a request that reuses an idle buffer or frees idle ones for room, of a
    lower limit and of ``release_idle``: a buffer given back with a copy in flight is never freed before that copy
    was waited for. (A request that took an idle buffer out and was stopped before its wait, or idle buffers taken
    out for freeing and dropped before theirs, freed host memory a copy in flight still read or wrote.)"""
    n = 0
    while True:
        n += 1
        p = HostPool()
        p.pinned_limit = None
        events = [_Pending(), _Pending()]
        bufs = [p.acquire(2 * MiB if how == "evicting" else MiB, pinned=pinned) for _ in events]
        refs = [weakref.ref(buf) for buf in bufs]
        for buf, event in zip(bufs, events):
            p.release(buf, event)
        del bufs, buf
        if how == "reused":
            interrupted = _interrupted_at_opcode(n, lambda: p.acquire(MiB, pinned=pinned))
        elif how == "evicting":
            p.pinned_limit = 5 * MiB
            interrupted = _interrupted_at_opcode(n, lambda: p.acquire(4 * MiB, pinned=True))  # (4 held: both go)
        elif how == "a lower limit":
            interrupted = _interrupted_at_opcode(n, lambda: setattr(p, "pinned_limit", 0))
        else:
            interrupted = _interrupted_at_opcode(n, p.release_idle)
        freed = [ref() is None for ref in refs]
        assert all(not dead or event.synchronized for dead, event in zip(freed, events)), (n, "freed under its copy")
        if not interrupted:
            break
    assert n > 20


@pytest.mark.parametrize("how", ["a request", "a lower limit", "release_idle"])
def test_idle_buffers_given_back_with_one_event_are_freed_after_one_wait_for_it(pinning, how):
    """Idle buffers given back with one transfer's event (an offload record's, a batch's staging) are freed, for room
    or by ``release_idle``, after one wait for it: each buffer waited for that event again, then forgot it over the
    whole idle list under the pool's lock (a lock and a pass over the idle buffers per buffer: quadratic)."""
    p = HostPool()
    p.pinned_limit = None
    bufs = [p.acquire(MiB, pinned=True) for _ in range(50)]
    event = _Pending()
    for buf in bufs:
        p.release(buf, event)
    del bufs, buf
    if how == "a request":
        p.pinned_limit = 64 * MiB
        p.acquire(64 * MiB, pinned=True)  # (all fifty go for room)
    elif how == "a lower limit":
        p.pinned_limit = 0
    else:
        p.release_idle()
    assert p.stats().idle == 0 and event.synchronized == 1
