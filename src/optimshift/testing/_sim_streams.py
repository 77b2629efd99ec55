"""Streams and events on the simulated accelerator: deferred execution and a race detector.

``torch.sim.Stream``, ``torch.sim.Event``, ``torch.sim.stream(s)``, ``torch.sim.current_stream()``,
``torch.sim.default_stream()``, ``torch.sim.set_stream(s)`` and ``torch.sim.synchronize()`` behave like their
``torch.cuda`` namesakes, with these semantics:

* **The default stream runs eagerly**: an op issued on it runs before the call returns, as every op of the
  simulator always did.
* **Work issued on any other stream is queued** and runs only when something orders it: an event or stream
  wait (``Event.synchronize``/``wait``, ``Stream.wait_event``/``wait_stream``/``synchronize``,
  ``torch.sim.synchronize``), a host read on that stream (``.item()``, a blocking copy to or from the host),
  or at random points drawn from a seeded generator (:func:`configure`): the device "makes progress" on its
  own, so a test run under several seeds sees several interleavings. A copy's result is poisoned (NaN, or
  all bits set) until it ran, so a host read that skips the wait sees garbage, not a lucky old value.
* **Races raise** :class:`StreamRaceError`, decided from happens-before (vector clocks, as PyTorch's
  CUDA sanitizer does), not from the order the simulator happened to run things in, so the same missing wait
  fails under every seed:

  - an op that reads or writes device memory (or host memory a copy touches) that another stream wrote or
    reads, with no event/stream wait or host synchronization between the two, raises when it is issued
    (a missing ``wait_event``, a wait on the wrong stream, a missing ``wait_stream`` before a side-stream copy);
  - device memory freed while a stream other than the one it was allocated on may still use it, and that
    stream was not declared with ``tensor.record_stream(stream)``, raises at the next call into the
    simulator (the free itself happens inside CPython's reference counting, where nothing can raise); the
    memory is poisoned, as a caching allocator reusing the block would overwrite it;
  - host memory that queued work reads (an H2D source) or writes (a D2H destination), changed by the host
    before that work ran (a buffer reused too early), raises when the work runs.

What it cannot see: host code reading host memory (plain CPU ops never reach the simulator; the poisoned
destination makes such a read wrong instead), and work on the default stream racing with the host (the
default stream is never behind the host). Host memory freed while a copy still uses it is kept alive until
the copy ran, as PyTorch's pinned host allocator does (it records an event on the block).

``torch.Stream``/``torch.Event``/``torch.accelerator.current_stream`` on ``"sim"`` still give torch's own
no-op streams (a Python backend's C++ device guard has no streams); code that should be race-tested on the
simulator uses the device module, ``torch.get_device_module(device)`` (``torch.cuda`` on CUDA, ``torch.sim``
here), as optimshift's engine does through :mod:`optimshift._device_streams`.
"""

from __future__ import annotations

import collections
import contextlib
import os
import random
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any, Optional

import torch

from optimshift.testing import simulated as _sim

__all__ = [
    "StreamRaceError",
    "SimStream",
    "SimEvent",
    "configure",
    "deferred_streams",
    "install",
    "memory_cached",
    "empty_cache",
]

_PRIVATEUSE1 = int(torch._C._autograd.DeviceType.PrivateUse1.value)  # pyright: ignore[reportAttributeAccessIssue]
_DEFAULT_ID = 0  # each device's default stream has id 0, as torch's own (no-op) stream for the backend does


class StreamRaceError(RuntimeError):
    """Two streams (or a stream and the host) touched the same memory with nothing ordering them."""


# --------------------------------------------------------------------------------------------
# State
# --------------------------------------------------------------------------------------------

StreamKey = tuple[int, int]  # (device index, stream id)
MemKey = tuple[str, int]  # ("d"|"h", data_ptr): device or host memory
_Access = tuple[MemKey, torch.Tensor, bool, int, int]  # (memory key, tensor, write, lo, hi)
# (held host memory, snapshot bytes, lo, hi, memory key, write); held and snapshot are both None or both set
_HostUse = tuple[Optional["_Held"], torch.Tensor | None, int, int, MemKey | None, bool]


class _Item:
    """One piece of queued work: a CPU closure (or only a wait), with what it must wait for first."""

    __slots__ = ("seq", "run", "waits", "what", "host")

    def __init__(
        self,
        seq: int,
        run: Callable[[], None] | None,
        waits: list[tuple[StreamKey, int]],
        what: str,
        host: list[_HostUse],
    ) -> None:
        self.seq = seq
        self.run = run
        self.waits = waits  # [(stream key, seq)]: run those streams up to there first
        self.what = what
        self.host = host  # [(_Held, snapshot bytes or None, lo, hi, memory key, write)]: host memory it touches


class _Stream:
    __slots__ = ("key", "seq", "done", "known", "queue")

    def __init__(self, key: StreamKey) -> None:
        self.key = key
        self.seq = 0  # last issued item
        self.done = 0  # last item run
        self.known: dict[StreamKey, int] = {}  # vector clock: what work issued here from now on is ordered after
        self.queue: collections.deque[_Item] = collections.deque()


class _Record:
    """An access to memory: by which stream, at which position, read or write, which bytes."""

    __slots__ = ("stream", "seq", "write", "lo", "hi", "what")

    def __init__(self, stream: StreamKey, seq: int, write: bool, lo: int, hi: int, what: str) -> None:
        self.stream, self.seq, self.write, self.lo, self.hi, self.what = stream, seq, write, lo, hi, what


class _State:
    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.local = threading.local()  # .current: {device index: stream id}
        self.streams: dict[StreamKey, _Stream] = {}
        self.objects: dict[StreamKey, SimStream] = {}
        self.next_id = 1
        self.tracking = False  # turned on by the first non-default stream: until then nothing is recorded
        self.host_known: dict[StreamKey, int] = {}  # what the host knows has completed
        self.accesses: dict[MemKey, list[_Record]] = {}  # ("d"|"h", data_ptr) -> records
        self.alloc_stream: dict[int, StreamKey] = {}  # sim storage data_ptr -> stream it was allocated on
        self.recorded: dict[int, set[StreamKey]] = {}  # sim storage data_ptr -> streams given with record_stream
        # The caching allocator's view (see memory_cached): live blocks, and freed bytes kept for each stream
        self.blocks: dict[int, tuple[StreamKey, int]] = {}  # sim storage data_ptr -> (allocating stream, bytes)
        self.cached: dict[StreamKey, int] = {}
        # storages whose death we must see (with a callback)
        self.watched: dict[MemKey, weakref.ref[torch.UntypedStorage]] = {}
        self.freed: list[MemKey] = []  # memory keys freed since the last call in (processed at a safe point)
        self.violations: list[str] = []
        self.rng = random.Random(0)
        self.progress = 0.25
        self.settled: bool | None = True  # see _settled (None: to be computed)

    @property
    def running(self) -> bool:
        """Whether this thread is inside queued work (no progress, no checks re-entered). Per thread: another
        thread's ops, meanwhile, are recorded and checked as ever (they wait for the lock)."""
        return getattr(self.local, "running", False)

    @running.setter
    def running(self, value: bool) -> None:
        self.local.running = value


_state = _State()


def configure(seed: int | None = None, progress: float | None = None) -> None:
    """Seed the random points at which queued work runs on its own, and how likely one is at each call
    into the simulator (0: queued work runs only when something orders it)."""
    with _state.lock:
        if seed is not None:
            _state.rng = random.Random(seed)
        if progress is not None:
            if not 0.0 <= progress <= 1.0:
                raise ValueError(f"progress must be within [0, 1], got {progress}")
            _state.progress = float(progress)


@contextlib.contextmanager
def deferred_streams(seed: int = 0, progress: float = 0.25) -> Iterator[None]:
    """Run the block with the simulated accelerator's streams under one seeded schedule.

    ``seed`` seeds the random points at which queued work runs on its own; ``progress`` is how likely such a
    point is at each call into the simulator (0: queued work runs only when something orders it, the
    strictest schedule). The previous settings come back afterwards. On a normal exit every sim stream is
    synchronized first, so queued work that fails its host-memory check (or a violation not yet reported)
    raises here rather than in a later test. Sets the simulator up if needed.
    """
    _sim._ensure_setup()
    with _state.lock:
        saved = (_state.rng, _state.progress)
    configure(seed, progress)
    ok = False
    try:
        yield
        ok = True
    finally:
        try:
            if ok:
                for index in range(_sim._NUM_DEVICES):
                    synchronize(index)
        finally:
            with _state.lock:
                _state.rng, _state.progress = saved


def _stream(key: StreamKey) -> _Stream:
    s = _state.streams.get(key)
    if s is None:
        s = _state.streams[key] = _Stream(key)
    return s


def _index(device: Any) -> int:
    if device is None:
        return _sim._current_index()
    if isinstance(device, int):
        return device
    if isinstance(device, torch.Stream):
        return device.device_index
    index = _sim._sim_index_of(device)
    if index is None:
        raise ValueError(f"simulated accelerator: {device} is not a {_sim.SIM_DEVICE_TYPE} device")
    return index


def _current_key(index: int) -> StreamKey:
    current = getattr(_state.local, "current", None)
    return (index, _DEFAULT_ID if current is None else current.get(index, _DEFAULT_ID))


def _set_current(key: StreamKey) -> None:
    current = getattr(_state.local, "current", None)
    if current is None:
        current = _state.local.current = {}
    current[key[0]] = key[1]


def _name(key: StreamKey) -> str:
    return f"{_sim.SIM_DEVICE_TYPE}:{key[0]} " + ("default stream" if key[1] == _DEFAULT_ID else f"stream {key[1]}")


# --------------------------------------------------------------------------------------------
# Running queued work
# --------------------------------------------------------------------------------------------


def _run_until(key: StreamKey, seq: int) -> None:
    """Run the work queued on stream ``key`` up to position ``seq`` (and what it waits for first)."""
    s = _state.streams.get(key)
    if s is None:
        return
    while s.queue and s.queue[0].seq <= seq:
        item = s.queue[0]
        for other, until in item.waits:
            _run_until(other, until)
        s.queue.popleft()
        s.done = item.seq
        if item.run is not None:
            _check_host(item, key)
            previous, _state.running = _state.running, True
            try:
                item.run()
            finally:
                _state.running = previous
    if not s.queue:
        s.done = s.seq


def _check_host(item: _Item, key: StreamKey) -> None:
    for held, snapshot, _, _, _, write in item.host:
        if held is None or snapshot is None:
            continue
        tensor = held.get()
        if not torch.equal(_bytes(tensor), snapshot):
            raise StreamRaceError(
                f"{item.what} queued on {_name(key)} {'writes' if write else 'reads'} host memory "
                f"({tensor.dtype}, {tuple(tensor.shape)}) that the host changed before the copy ran: the host must "
                "wait for the copy (an event recorded after it, Event.synchronize or query) before it reuses "
                "the buffer"
            )


def _progress() -> None:
    """At a random point, let the oldest queued item of a random busy stream run on its own (the device makes
    progress, one piece of work at a time)."""
    if _state.running or _state.progress <= 0.0 or _state.rng.random() >= _state.progress:
        return
    busy = [s for s in _state.streams.values() if s.queue]
    if not busy:
        return
    s = busy[_state.rng.randrange(len(busy))]
    _run_until(s.key, s.queue[0].seq)


def _learn(known: dict[StreamKey, int], key: StreamKey, seq: int) -> None:
    """The host now knows the work on ``key`` up to ``seq`` (and everything it had waited for) completed."""
    host = _state.host_known
    for k, v in known.items():
        if host.get(k, 0) < v:
            host[k] = v
    if host.get(key, 0) < seq:
        host[key] = seq
    _state.settled = None


def _merge(into: dict[StreamKey, int], known: dict[StreamKey, int], key: StreamKey, seq: int) -> None:
    for k, v in known.items():
        if into.get(k, 0) < v:
            into[k] = v
    if into.get(key, 0) < seq:
        into[key] = seq


def _sync_stream(key: StreamKey) -> None:
    s = _stream(key)
    _run_until(key, s.seq)
    _learn(s.known, key, s.seq)


def synchronize(device: Any = None) -> None:
    """Wait for the work queued on every stream of ``device`` (``torch.sim.synchronize``)."""
    with _state.lock:
        _enter()
        index = _index(device)
        for key in [k for k in _state.streams if k[0] == index]:
            _sync_stream(key)
        _raise_violations()


# --------------------------------------------------------------------------------------------
# Memory accesses and the race checks
# --------------------------------------------------------------------------------------------


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).clone()


def _span(t: torch.Tensor) -> tuple[int, int]:
    size = t.element_size()
    lo = int(t.storage_offset()) * size
    extent = 1 + sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride()))
    return lo, lo + extent * size


def _poison(t: torch.Tensor) -> None:
    """Fill memory whose contents are undefined (a copy not yet run, a block an allocator reused)."""
    if t.numel() == 0:
        return
    if t.is_floating_point() or t.is_complex():
        t.fill_(float("nan"))
    elif t.dtype == torch.bool:
        t.fill_(True)
    else:
        t.fill_(-1)


def _mem(t: torch.Tensor) -> MemKey | None:
    """The memory key of ``t``: ("d", ptr) for a sim tensor, ("h", ptr) for a host tensor; None if empty."""
    if t.numel() == 0:
        return None
    st = t.untyped_storage()
    if st.nbytes() == 0:
        return None
    kind = t.device.type
    if kind == _sim.SIM_DEVICE_TYPE:
        return ("d", st.data_ptr())
    if kind == "cpu":
        return ("h", st.data_ptr())
    return None


def _watch(mem: MemKey, t: torch.Tensor) -> None:
    """See ``t``'s storage die (a sim storage freed while queued work uses it; a host key to forget)."""
    if mem in _state.watched:
        return
    freed = _state.freed

    def gone(_ref: weakref.ref[torch.UntypedStorage], mem: MemKey = mem) -> None:
        freed.append(mem)

    _state.watched[mem] = weakref.ref(t.untyped_storage(), gone)


def _describe(t: torch.Tensor) -> str:
    where = "host" if t.device.type == "cpu" else str(t.device)
    return f"a {where} tensor ({str(t.dtype).replace('torch.', '')}, {tuple(t.shape)})"


def _check(key: StreamKey, reads: list[torch.Tensor], writes: list[torch.Tensor], what: str) -> list[_Access]:
    """Raise if an access of ``reads``/``writes`` from stream ``key`` races with an earlier one on another
    stream. Returns the accesses, for :func:`_record` once the op was issued."""
    s = _stream(key)
    host = _state.host_known
    known = s.known
    accesses: list[_Access] = []
    # only a non-default stream can race: none has work the host does not know complete -> nothing to check
    check = key[1] != _DEFAULT_ID or not _settled()
    for tensors, write in ((reads, False), (writes, True)):
        for t in tensors:
            mem = _mem(t)
            if mem is None:
                continue
            lo, hi = _span(t)
            accesses.append((mem, t, write, lo, hi))
            if not check:
                continue
            for r in _state.accesses.get(mem, ()):
                # NOTE: default streams of two devices are in step (both run eagerly here; on CUDA a copy between
                # devices orders their current streams), so only a non-default stream can race.
                if (
                    r.stream != key
                    and (write or r.write)
                    and r.lo < hi
                    and lo < r.hi
                    and (r.stream[1] != _DEFAULT_ID or key[1] != _DEFAULT_ID)
                    and max(known.get(r.stream, 0), host.get(r.stream, 0)) < r.seq
                ):
                    raise StreamRaceError(
                        f"{what} on {_name(key)} {'writes' if write else 'reads'} {_describe(t)} that {r.what} "
                        f"on {_name(r.stream)} {'writes' if r.write else 'reads'}, with nothing ordering the two: "
                        f"make {_name(key)} wait for an event recorded on {_name(r.stream)} after that work "
                        f"(Stream.wait_event, Event.wait, Stream.wait_stream), or synchronize the host first"
                    )
    return accesses


def _settled() -> bool:
    """Whether the host knows that all work issued on non-default streams has completed (cached until a
    non-default stream issues more, or the host learns more)."""
    if _state.settled is None:
        host = _state.host_known
        _state.settled = all(host.get(k, 0) >= s.seq for k, s in _state.streams.items() if k[1] != _DEFAULT_ID)
    return _state.settled


def _record(key: StreamKey, seq: int, accesses: list[_Access], what: str) -> None:
    """Remember accesses (checked by :func:`_check`) of the op issued at ``seq`` on stream ``key``."""
    host = _state.host_known
    side = key[1] != _DEFAULT_ID
    for mem, t, write, lo, hi in accesses:
        records = _state.accesses.get(mem)
        if records is None:
            if mem[0] == "h" and not side:
                continue  # host memory only the default stream touched: the host and it are in step
            records = _state.accesses[mem] = []
            if mem[0] == "h" or side:
                _watch(mem, t)
        elif side:
            _watch(mem, t)
        keep = []
        for r in records:
            if host.get(r.stream, 0) >= r.seq:
                continue  # the host knows it completed: everything issued from now on is after it
            if r.stream == key and r.lo >= lo and r.hi <= hi and (write or not r.write):
                continue  # superseded by this access of the same stream
            keep.append(r)
        keep.append(_Record(key, seq, write, lo, hi, what))
        records[:] = keep


def _enter() -> None:
    """What every call into the simulator does first: forget dead memory, report violations, progress."""
    if _state.freed:
        _process_frees()
    _raise_violations()
    _progress()


def _raise_violations() -> None:
    if _state.violations:
        messages, _state.violations[:] = list(_state.violations), []
        raise StreamRaceError("\n".join(messages))


def on_alloc(ptr: int, index: int, nbytes: int = 0) -> None:
    """A sim storage was allocated (``simulated._register``): remember the stream it belongs to."""
    if not _state.tracking:
        return
    with _state.lock:
        if _state.freed:
            _process_frees()
        mem = ("d", ptr)
        _state.accesses.pop(mem, None)
        _state.recorded.pop(ptr, None)
        _state.watched.pop(mem, None)
        key = _current_key(index)
        if key[1] == _DEFAULT_ID:
            _state.alloc_stream.pop(ptr, None)
        else:
            _state.alloc_stream[ptr] = key
        # As CUDA's caching allocator: an allocation is served from the blocks freed on its own stream only.
        _state.blocks[ptr] = (key, nbytes)
        cached = _state.cached.get(key, 0)
        if cached:
            _state.cached[key] = cached - min(cached, nbytes)


def on_free(ptr: int, nbytes: int = 0) -> None:
    """A sim storage's backing memory died (``simulated._unregister``; may run inside any code)."""
    if _state.tracking:
        _state.freed.append(("d", ptr))
        block = _state.blocks.pop(ptr, None)
        if block is not None:
            _state.cached[block[0]] = _state.cached.get(block[0], 0) + block[1]


def memory_cached(index: int = 0) -> dict[int, int]:
    """Bytes of freed device memory that a CUDA-like caching allocator would keep for each stream of
    ``sim:index`` (stream id -> bytes; 0 is the default stream): a block goes back to the stream that allocated
    it, and only allocations on that stream reuse it (until ``empty_cache``). Counted while streams are in use
    (after the first non-default stream was created)."""
    with _state.lock:
        return {key[1]: n for key, n in _state.cached.items() if key[0] == index and n}


def empty_cache() -> None:
    """Forget the freed blocks kept per stream (``torch.sim.empty_cache()``)."""
    with _state.lock:
        _state.cached.clear()


def _process_frees() -> None:
    # (the first n taken, then deleted: a free another thread appends meanwhile lands after them and is kept for
    # the next call; copying the list and then clearing it lost one appended between the two)
    n = len(_state.freed)
    freed = _state.freed[:n]
    del _state.freed[:n]
    host = _state.host_known
    for mem in freed:
        _state.watched.pop(mem, None)
        records = _state.accesses.pop(mem, None)
        if mem[0] != "d":
            continue
        ptr = mem[1]
        alloc = _state.alloc_stream.pop(ptr, None)
        recorded = _state.recorded.pop(ptr, set())
        if not records:
            continue
        alloc = alloc if alloc is not None else (records[0].stream[0], _DEFAULT_ID)
        alloc_known = _stream(alloc).known
        for r in records:
            if r.stream == alloc or r.stream in recorded or (r.stream[1] == _DEFAULT_ID and alloc[1] == _DEFAULT_ID):
                continue
            if max(host.get(r.stream, 0), alloc_known.get(r.stream, 0)) >= r.seq:
                continue
            _state.violations.append(
                f"device memory ({r.hi - r.lo} bytes on {_sim.SIM_DEVICE_TYPE}:{alloc[0]}) allocated on "
                f"{_name(alloc)} was freed while {r.what} on {_name(r.stream)} may still "
                f"{'write' if r.write else 'read'} it: the allocator may hand it out again at once. Call "
                f"tensor.record_stream(stream) for that stream before dropping the tensor, or wait for the work "
                f"first"
            )
            backing = _sim._lookup(ptr)
            if backing is not None:
                _poison(torch.empty(0, dtype=torch.uint8).set_(backing))
            break


# --------------------------------------------------------------------------------------------
# Issuing work: the dispatcher hook
# --------------------------------------------------------------------------------------------

_aten = torch.ops.aten
_METADATA = frozenset(
    {
        "aten::view",
        "aten::as_strided",
        "aten::_reshape_alias",
        "aten::unfold",
        "aten::view_as_real",
        "aten::view_as_complex",
        "aten::set_",
    }
)
_TENSOR_RESULTS = ("Tensor", "Tensor[]", "Tensor?", "Tensor?[]")


class _OpInfo:
    __slots__ = ("kind", "written", "names", "returns")

    def __init__(self, op: Any) -> None:
        schema = op._schema
        args = schema.arguments
        self.names = [a.name for a in args]
        self.written = [i for i, a in enumerate(args) if a.alias_info is not None and a.alias_info.is_write]
        # per return: the index of the (written) argument it is, or None for a new tensor
        returns: list[int | None] = []
        view = False
        for r in schema.returns:
            alias = r.alias_info
            if alias is None:
                returns.append(None)
                continue
            match = [i for i in self.written if args[i].alias_info.before_set == alias.before_set]
            if alias.is_write and match:
                returns.append(match[0])
            else:
                view = True
        self.returns = returns
        types = [str(r.type) for r in schema.returns]
        if schema.name in _METADATA or schema.name == "aten::resize_":
            self.kind = "metadata"
        elif schema.name == "aten::record_stream":
            self.kind = "record_stream"
        elif view and not self.written:
            self.kind = "view"
        elif view or any(t not in _TENSOR_RESULTS for t in types):
            self.kind = "host"  # a value the host reads (.item(), equal) or something too odd to defer
        else:
            self.kind = "data"


_infos: dict[Any, _OpInfo] = {}


def _info(op: Any) -> _OpInfo:
    info = _infos.get(op)
    if info is None:
        info = _infos[op] = _OpInfo(op)
    return info


def _tensors(x: Any) -> Iterator[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from _tensors(y)


def _op_index(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    for t in _tensors(list(args) + list(kwargs.values())):
        if t.device.type == _sim.SIM_DEVICE_TYPE:
            return t.device.index
    index = _sim._sim_index_of(kwargs.get("device"))
    return _sim._current_index() if index is None else index


def _caller() -> str:
    """Where user code (not torch, not this simulator) issued the work: for error messages."""
    frame: FrameType | None = sys._getframe(2)
    here = os.path.dirname(os.path.abspath(__file__))
    torch_dir = os.path.dirname(os.path.abspath(torch.__file__))
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if not path.startswith(here) and not path.startswith(torch_dir):
            return f"{os.path.basename(path)}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back
    return "?"


def dispatch(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any], eager: Callable[..., Any]) -> Any:
    """Every sim op once streams are in use: record and check its accesses; run it now (default stream)
    or queue it (any other stream). ``eager(op, *args, **kwargs)`` is the simulator's own kernel."""
    if _state.running:
        return eager(op, *args, **kwargs)
    with _state.lock:
        _enter()
        info = _info(op)
        if info.kind == "metadata" and op._schema.name != "aten::resize_":
            return eager(op, *args, **kwargs)
        if info.kind == "record_stream":
            _record_stream(args[0], args[1])
            return None
        index = _op_index(args, kwargs)
        key = _current_key(index)
        if info.kind == "view":
            return eager(op, *args, **kwargs)
        name = op._schema.name
        if (
            name == "aten::_copy_from"
            or name == "aten::_to_copy"
            or (name == "aten::_copy_from_and_resize" and args[0].shape == args[1].shape)
        ):
            return _copy(op, name, args, kwargs, key, eager)
        reads, writes = _reads_writes(info, args, kwargs)
        if key[1] == _DEFAULT_ID or info.kind in ("host", "metadata"):
            return _now(op, args, kwargs, key, eager, reads, writes, host_read=info.kind == "host")
        deferred = _defer(op, info, args, kwargs, key, reads, writes)
        if deferred is not _CANNOT:
            return deferred
        return _now(op, args, kwargs, key, eager, reads, writes, host_read=False)


def _arg(info: _OpInfo, args: tuple[Any, ...], kwargs: dict[str, Any], i: int) -> Any:
    return args[i] if i < len(args) else kwargs.get(info.names[i])


def _reads_writes(
    info: _OpInfo, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The tensors ``op`` reads and writes (a 0-dim host tensor is a scalar read on the host at launch)."""
    reads: list[torch.Tensor] = []
    writes: list[torch.Tensor] = []
    written = info.written
    written_names = {info.names[i] for i in written}
    for i, a in enumerate(args):
        (writes if i in written else reads).extend(_tensors(a))
    for k, v in kwargs.items():
        (writes if k in written_names else reads).extend(_tensors(v))
    reads = [t for t in reads if t.device.type != "cpu" or t.dim() > 0]
    return reads, writes


def _issue(key: StreamKey) -> int:
    s = _stream(key)
    s.seq += 1
    if key[1] == _DEFAULT_ID:
        s.done = s.seq
    else:
        _state.settled = False
    return s.seq


def _now(
    op: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    key: StreamKey,
    eager: Callable[..., Any],
    reads: list[torch.Tensor],
    writes: list[torch.Tensor],
    *,
    host_read: bool,
) -> Any:
    """Run ``op`` now: on the default stream, or on another one once its queue ran (a host read waits)."""
    if key[1] != _DEFAULT_ID:
        _run_until(key, _stream(key).seq)
    what = op._schema.name
    if key[1] != _DEFAULT_ID:
        what = f"{what} ({_caller()})"
    accesses = _check(key, reads, writes, what)
    out = eager(op, *args, **kwargs)
    seq = _issue(key)
    if not host_read:
        made = [t for t in _tensors(out) if all(t is not w for w in writes)]
        if made:
            accesses += _check(key, [], made, what)
    _record(key, seq, accesses, what)
    s = _stream(key)
    s.done = s.seq
    if host_read:
        _learn(s.known, key, seq)
    return out


_CANNOT = object()


def _meta(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return torch.empty_strided(x.size(), x.stride(), dtype=x.dtype, device="meta")
    if isinstance(x, (list, tuple)):
        return type(x)(_meta(y) for y in x)
    if isinstance(x, torch.device) and x.type == _sim.SIM_DEVICE_TYPE:
        return torch.device("meta")
    return x


class _Held:
    """Host memory that queued work uses, held by its storage rather than by a tensor.

    # NOTE: a tensor would count as one more view of the memory (optimshift's pool checks exactly that
    # before it reuses a buffer); the storage object adds no use, and keeps the memory alive after the
    # caller dropped it, as PyTorch's pinned host allocator does for a block a copy still uses.
    """

    __slots__ = ("storage", "offset", "size", "stride", "dtype")

    def __init__(self, t: torch.Tensor) -> None:
        self.storage = t.untyped_storage()
        self.offset, self.size, self.stride, self.dtype = t.storage_offset(), t.size(), t.stride(), t.dtype

    def get(self) -> torch.Tensor:
        return torch.empty(0, dtype=self.dtype).set_(self.storage, self.offset, self.size, self.stride)


def _launch_value(x: Any, scalars: bool = True) -> Any:
    """What queued work keeps of an argument: device memory (a backing) as is, a host scalar of a kernel
    (``scalars``) by value, other host memory by its storage."""
    if isinstance(x, torch.Tensor):
        if x.device.type != "cpu" or _is_backing(x):
            return x
        return x.clone() if scalars and x.dim() == 0 else _Held(x)
    if isinstance(x, (list, tuple)):
        return type(x)(_launch_value(y, scalars) for y in x)
    return x


def _resolve(x: Any) -> Any:
    if isinstance(x, _Held):
        return x.get()
    if isinstance(x, (list, tuple)):
        return type(x)(_resolve(y) for y in x)
    return x


def _is_backing(t: torch.Tensor) -> bool:
    st = t.untyped_storage()
    return st.nbytes() > 0 and _sim._lookup(st.data_ptr()) is not None


def _host_item(t: torch.Tensor, write: bool) -> _HostUse:
    """(tensor, snapshot, lo, hi, key) for host memory queued work touches; the snapshot only where no other
    queued work touches it first (then the bytes at run time must be the ones seen now)."""
    mem = _mem(t)
    lo, hi = _span(t)
    for s in _state.streams.values():
        for item in s.queue:
            for _, _, olo, ohi, okey, _ in item.host:
                if okey == mem and olo < hi and lo < ohi:
                    return (None, None, lo, hi, mem, write)
    if write:
        _poison(t)
    return (_Held(t), _bytes(t), lo, hi, mem, write)


def _enqueue(
    key: StreamKey,
    run: Callable[[], None],
    what: str,
    reads: list[torch.Tensor],
    writes: list[torch.Tensor],
    host: list[_HostUse],
) -> int:
    accesses = _check(key, reads, writes, what)
    seq = _issue(key)
    _record(key, seq, accesses, what)
    guards = [g for g in map(_sim._guard_of, reads + writes) if g is not None]
    if guards:  # memory of a reserved range: it must still be mapped when the queued work runs
        unguarded = run

        def run() -> None:
            for guard in guards:
                guard()
            unguarded()

    _stream(key).queue.append(_Item(seq, run, [], what, host))
    return seq


def _defer(
    op: Any,
    info: _OpInfo,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    key: StreamKey,
    reads: list[torch.Tensor],
    writes: list[torch.Tensor],
) -> Any:
    """Queue a data op issued on a non-default stream: its new outputs are allocated now (shapes from its
    meta kernel) and filled when it runs; in-place and out= results are the caller's tensors."""
    _sim._check_devices(op, args, kwargs)
    try:
        meta_args = [_meta(a) for a in args]
        meta_kwargs = {k: _meta(v) for k, v in kwargs.items()}
        meta_out = op(*meta_args, **meta_kwargs)
    except Exception:
        return _CANNOT  # no meta kernel, or a shape that depends on values: run it now
    for i in info.written:
        meta_value = meta_args[i] if i < len(meta_args) else meta_kwargs.get(info.names[i])
        for m, t in zip(_tensors(meta_value), _tensors(_arg(info, args, kwargs, i))):
            if m.shape != t.shape:
                return _CANNOT  # an out= the kernel resizes: run it now
    index = key[0]
    if not info.returns:
        outs_meta: tuple[Any, ...] = ()
    else:
        outs_meta = meta_out if isinstance(meta_out, tuple) else (meta_out,)
    if len(outs_meta) != len(info.returns):
        return _CANNOT
    results: list[Any] = []
    fills: list[tuple[int, int | None, torch.Tensor]] = []  # (return position, list index, cpu buffer)
    made: list[torch.Tensor] = []
    roots: dict[int, torch.Tensor] = {}
    for pos, (m, alias) in enumerate(zip(outs_meta, info.returns)):
        if alias is not None:
            results.append(_arg(info, args, kwargs, alias))
            continue
        group = m if isinstance(m, (list, tuple)) else [m]
        new = []
        for j, one in enumerate(group):
            if not isinstance(one, torch.Tensor):
                return _CANNOT
            cpu = torch.empty_strided(one.size(), one.stride(), dtype=one.dtype)
            _poison(cpu)
            fills.append((pos, j if isinstance(m, (list, tuple)) else None, cpu))
            sim_t = _sim._wrap_fresh(cpu, index, roots)
            new.append(sim_t)
            made.append(sim_t)
        results.append(type(m)(new) if isinstance(m, (list, tuple)) else new[0])
    unwrapped = _sim._Unwrapped()
    cpu_args = _sim._unwrap(args, unwrapped)
    cpu_kwargs = {k: _sim._unwrap(v, unwrapped) for k, v in kwargs.items()}
    if "device" in cpu_kwargs and _sim._sim_index_of(cpu_kwargs["device"]) is not None:
        cpu_kwargs["device"] = torch.device("cpu")
    del unwrapped
    # NOTE: a 0-dim host tensor is a scalar the kernel reads when it is launched (CUDA passes its value):
    # keep the value of now, not of when the queued work runs.
    cpu_args = [_launch_value(a) for a in cpu_args]
    cpu_kwargs = {k: _launch_value(v) for k, v in cpu_kwargs.items()}

    def run() -> None:
        out = op(*_resolve(cpu_args), **{k: _resolve(v) for k, v in cpu_kwargs.items()})
        outs = out if isinstance(out, tuple) else (out,)
        for pos, j, cpu in fills:
            value = outs[pos] if j is None else outs[pos][j]
            cpu.copy_(value)

    host = [_host_item(t, False) for t in reads if t.device.type == "cpu" and t.dim() > 0]
    host += [_host_item(t, True) for t in writes if t.device.type == "cpu" and t.dim() > 0]
    _enqueue(key, run, f"{op._schema.name} ({_caller()})", reads, writes + made, host)
    if not results:
        return None
    return tuple(results) if len(results) > 1 or isinstance(meta_out, tuple) else results[0]


def _copy(
    op: Any, name: str, args: tuple[Any, ...], kwargs: dict[str, Any], key: StreamKey, eager: Callable[..., Any]
) -> Any:
    """``_copy_from(src, dst, non_blocking)`` and ``_to_copy(src, ..., device, non_blocking)``: the copies."""
    src = args[0]
    if name == "aten::_to_copy":
        non_blocking = bool(kwargs.get("non_blocking", False))
        device = kwargs.get("device")
        target_index = src.device.index if device is None and _sim._is_sim(src) else _sim._sim_index_of(device)
        to_host = target_index is None
        involves_host = to_host or src.device.type == "cpu"
        if (
            key[1] == _DEFAULT_ID
            or kwargs.get("layout") not in (None, torch.strided)
            or (to_host and device is not None and torch.device(device).type != "cpu")
        ):
            return _now(op, args, kwargs, key, eager, [src], [], host_read=involves_host and not non_blocking)
        src_cpu = _sim._backing(src) if _sim._is_sim(src) else src
        cpu = torch.empty_like(
            src_cpu,
            dtype=kwargs.get("dtype") or src.dtype,
            memory_format=kwargs.get("memory_format") or torch.preserve_format,
        )
        _poison(cpu)
        result = cpu if target_index is None else _sim._wrap_fresh(cpu, target_index, {})
        held_src, held_out = _launch_value(src_cpu, False), _launch_value(cpu, False)

        def run() -> None:
            _resolve(held_out).copy_(_resolve(held_src))

        host = [_host_item(src, False)] if src.device.type == "cpu" and src.numel() else []
        if to_host and result.numel():
            host.append((_Held(result), _bytes(result), *_span(result), _mem(result), True))
        seq = _enqueue(key, run, f"{name} ({_caller()})", [src], [result], host)
        if involves_host and not non_blocking:  # a blocking copy: the host waits for it
            _run_until(key, seq)
            _learn(_stream(key).known, key, seq)
        return result
    dst = args[1]
    non_blocking = bool(args[2]) if len(args) > 2 else bool(kwargs.get("non_blocking", False))
    involves_host = src.device.type == "cpu" or dst.device.type == "cpu"
    if key[1] == _DEFAULT_ID:
        return _now(op, args, kwargs, key, eager, [src], [dst], host_read=involves_host and not non_blocking)
    src_cpu = _launch_value(_sim._backing(src) if _sim._is_sim(src) else src, False)
    dst_cpu = _launch_value(_sim._backing(dst) if _sim._is_sim(dst) else dst, False)
    host = [_host_item(src, False)] if src.device.type == "cpu" and src.numel() else []
    if dst.device.type == "cpu" and dst.numel():
        host.append(_host_item(dst, True))

    def run_copy() -> None:
        _resolve(dst_cpu).copy_(_resolve(src_cpu))

    seq = _enqueue(key, run_copy, f"{name} ({_caller()})", [src], [dst], host)
    if involves_host and not non_blocking:
        _run_until(key, seq)
        _learn(_stream(key).known, key, seq)
    return dst


def _record_stream(t: torch.Tensor, stream: Any) -> None:
    if stream.device_type != _PRIVATEUSE1:  # (CUDA's record_stream takes only a CUDA stream)
        raise RuntimeError(
            f"simulated accelerator: record_stream needs a {_sim.SIM_DEVICE_TYPE} stream, got one of {stream.device}"
        )
    mem = _mem(t)
    if mem is None or mem[0] != "d" or not _state.tracking:  # (no stream but the default ones: nothing to keep)
        return
    _state.recorded.setdefault(mem[1], set()).add((stream.device_index, stream.stream_id))


# --------------------------------------------------------------------------------------------
# The public objects: torch.sim.Stream, torch.sim.Event and friends
# --------------------------------------------------------------------------------------------


class SimStream(torch.Stream):
    """A stream of the simulated accelerator (``torch.sim.Stream``; mirrors ``torch.cuda.Stream``).

    Work issued while it is current (``with torch.sim.stream(s):``) is queued and runs when something orders
    it (see :mod:`optimshift.testing._sim_streams`). ``tensor.record_stream(s)`` works with it.
    """

    _entered: list[tuple[StreamKey, int]]  # (previous stream, previous device) per `with`, set by __enter__

    def __new__(cls, device: Any = None, priority: int = 0) -> SimStream:
        index = _index(device)
        with _state.lock:
            sid = _state.next_id
            _state.next_id += 1
            _state.tracking = True
            self = super().__new__(cls, stream_id=sid, device_index=index, device_type=_PRIVATEUSE1)
            _stream((index, sid))
            _state.objects[(index, sid)] = self
        return self

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    @classmethod
    def _of(cls, key: StreamKey) -> SimStream:
        obj = _state.objects.get(key)
        if obj is None:
            obj = _state.objects[key] = torch.Stream.__new__(
                cls, stream_id=key[1], device_index=key[0], device_type=_PRIVATEUSE1
            )
        return obj

    @property
    def _key(self) -> StreamKey:
        return (self.device_index, self.stream_id)

    def wait_event(self, event: torch.Event) -> None:
        """Work issued on this stream from now on runs after ``event`` completed."""
        with _state.lock:
            _enter()
            if not isinstance(event, SimEvent):
                raise TypeError(
                    f"simulated accelerator: wait_event needs a torch.sim.Event, got {type(event).__name__}"
                )
            if event._at is None:
                return  # an event never recorded: nothing to wait for (as on CUDA)
            other, seq = event._at
            me = _stream(self._key)
            _merge(me.known, event._known, other, seq)
            if self.stream_id == _DEFAULT_ID:
                _run_until(other, seq)  # the default stream runs eagerly: what it waits for runs now
            elif other != self._key:
                me.seq += 1
                _state.settled = False
                me.queue.append(_Item(me.seq, None, [(other, seq)], "a wait", []))

    def wait_stream(self, stream: torch.Stream) -> None:  # pyright: ignore[reportIncompatibleMethodOverride]  # (torch.Stream types it loosely)
        """Work issued on this stream from now on runs after the work issued on ``stream`` so far."""
        self.wait_event(stream.record_event())

    def record_event(self, event: torch.Event | None = None) -> torch.Event:
        event = SimEvent() if event is None else event
        event.record(self)
        return event

    def query(self) -> bool:
        with _state.lock:
            _enter()
            s = _stream(self._key)
            if s.done >= s.seq:
                _learn(s.known, self._key, s.seq)
                return True
            return False

    def synchronize(self) -> None:
        with _state.lock:
            _enter()
            _sync_stream(self._key)

    def __enter__(self) -> SimStream:
        stack = self.__dict__.setdefault("_entered", [])
        stack.append((_current_key(self.device_index), _sim._current_index()))
        _sim._backend_module.set_device(self.device_index)
        _set_current(self._key)
        return self

    def __exit__(self, *exc: object) -> None:
        previous, device = self._entered.pop()
        _set_current(previous)
        _sim._backend_module.set_device(device)

    def __repr__(self) -> str:
        return f"torch.sim.Stream(device=sim:{self.device_index}, stream_id={self.stream_id})"


class SimEvent(torch.Event):
    """An event of the simulated accelerator (``torch.sim.Event``; mirrors ``torch.cuda.Event``)."""

    _at: tuple[StreamKey, int] | None  # (stream, position) it was last recorded at
    _known: dict[StreamKey, int]  # that stream's vector clock then
    _timing: bool  # created with enable_timing=True
    _time: float  # host time of the last record(), for elapsed_time

    def __new__(cls, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> SimEvent:
        self = super().__new__(cls, device=torch.device(_sim.SIM_DEVICE_TYPE, _sim._current_index()))
        self._at = None
        self._known = {}
        self._timing = enable_timing
        self._time = 0.0
        return self

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, stream: Any | None = None) -> None:
        """Complete once the work issued on ``stream`` (default: the current one) so far has run."""
        with _state.lock:
            _enter()
            key = _current_key(_sim._current_index()) if stream is None else (stream.device_index, stream.stream_id)
            s = _stream(key)
            self._at = (key, s.seq)
            self._known = dict(s.known)
            self._time = time.perf_counter()

    def wait(self, stream: Any | None = None) -> None:
        stream = current_stream() if stream is None else stream
        assert stream is not None
        SimStream._of((stream.device_index, stream.stream_id)).wait_event(self)

    def query(self) -> bool:
        with _state.lock:
            _enter()
            if self._at is None:
                return True
            key, seq = self._at
            if _stream(key).done >= seq:
                _learn(self._known, key, seq)
                return True
            return False

    def synchronize(self) -> None:
        with _state.lock:
            _enter()
            if self._at is None:
                return
            key, seq = self._at
            _run_until(key, seq)
            _learn(self._known, key, seq)
            _raise_violations()

    def elapsed_time(self, end_event: Any) -> float:  # pyright: ignore[reportIncompatibleMethodOverride]
        """Milliseconds of host time between the two ``record()`` calls, with CUDA's checks: both created with
        ``enable_timing=True``, both recorded, and both complete (else CUDA's "device not ready")."""
        if not (self._timing and getattr(end_event, "_timing", False)):
            raise RuntimeError("Both events must be created with argument 'enable_timing=True'.")
        if self._at is None or end_event._at is None:
            raise RuntimeError("Both events must be recorded before calculating elapsed time.")
        if not (self.query() and end_event.query()):
            raise RuntimeError(
                "simulated accelerator: device not ready: an event's work has not completed; synchronize "
                "(Event.synchronize, torch.sim.synchronize) before elapsed_time, as CUDA requires"
            )
        return float(end_event._time - self._time) * 1000.0

    def __repr__(self) -> str:
        state = "not recorded" if self._at is None else f"on {_name(self._at[0])} at {self._at[1]}"
        return f"torch.sim.Event({state})"


def current_stream(device: Any = None) -> SimStream:
    return SimStream._of(_current_key(_index(device)))


def default_stream(device: Any = None) -> SimStream:
    return SimStream._of((_index(device), _DEFAULT_ID))


def set_stream(stream: SimStream) -> None:
    _set_current((stream.device_index, stream.stream_id))


@contextlib.contextmanager
def stream(stream: SimStream | None) -> Iterator[None]:
    """``with torch.sim.stream(s):`` issues work on ``s`` (``None``: no change), as ``torch.cuda.stream``."""
    if stream is None:
        yield
        return
    with SimStream._of((stream.device_index, stream.stream_id)):
        yield


def install(module: Any) -> Any:
    """Put the stream API on ``torch.sim`` and give optimshift's engine the simulator's streams; returns the
    hooks the simulator calls (this module)."""
    module.Stream = SimStream
    module.Event = SimEvent
    module.current_stream = current_stream
    module.default_stream = default_stream
    module.set_stream = set_stream
    module.stream = stream
    module.StreamRaceError = StreamRaceError
    module.empty_cache = empty_cache
    from optimshift import _device_streams

    _device_streams.register_backend(_sim.SIM_DEVICE_TYPE, module, pin_host=False)
    return sys.modules[__name__]


_sim.attach_streams(install)  # the simulator calls install() when it is set up (see simulated.attach_streams)
