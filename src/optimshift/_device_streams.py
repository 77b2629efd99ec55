"""Streams and events of an accelerator: one interface (:class:`Streams`) the async path and the streamed step use.

Chosen once per device type by :func:`of`, and only once a probe of every primitive worked (MPS has no
``record_stream``): a backend registered with :func:`register_backend` (a Python PrivateUse1 backend, whose C++
device guard's streams order nothing: the simulator), torch's generic API, ``torch.cuda``'s, else none (synchronous).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterable, Iterator
from typing import Any, cast

import torch

from ._devices import HOSTS, current_accelerator, device_module


class Streams:
    """One device type's streams and events. Subclasses fill in the primitives; the engine calls only these."""

    def __init__(self, device_type: str) -> None:
        self.device_type = device_type
        self._side: dict[tuple[torch.device, str], Any] = {}
        self._lock = threading.Lock()

    # -- primitives (per implementation) --------------------------------------------------------------------
    def current(self, device: torch.device) -> Any:
        """The stream work on ``device`` is queued on now (the caller's, per thread)."""
        raise NotImplementedError

    def new_stream(self, device: torch.device) -> Any:
        raise NotImplementedError

    def use(self, stream: Any) -> contextlib.AbstractContextManager[None]:
        """Make ``stream`` current on its device for the ``with`` body, then restore the previous one."""
        raise NotImplementedError

    def new_event(self, device: torch.device) -> Any:
        raise NotImplementedError

    def synchronize(self, device: torch.device) -> None:
        """Block the host until all work queued on ``device`` (every stream) has run."""
        raise NotImplementedError

    # -- ordering (the same for every implementation: the backend objects share method names) -------------
    def side(self, device: torch.device, lane: str = "engine") -> Any:
        """A side stream on ``device``, one per ``lane`` and device, kept for the process: the engine's transfers
        use ``"engine"``, the streamed step's copies ``"stream"`` (never queued behind a transfer)."""
        key = (device, lane)
        stream = self._side.get(key)
        if stream is None:
            with self._lock:
                stream = self._side.get(key)
                if stream is None:
                    stream = self._side[key] = self.new_stream(device)
        return stream

    def recorded(self, device: torch.device, stream: Any) -> Any:
        """A new event on ``device`` that completes once the work queued on ``stream`` so far has run."""
        event = self.new_event(device)
        self.record(event, stream)
        return event

    def record(self, event: Any, stream: Any) -> None:
        """``event`` completes once the work queued on ``stream`` so far has run."""
        event.record(stream)

    def wait_event(self, stream: Any, event: Any) -> None:
        """Work queued on ``stream`` from now on runs after ``event`` completed (no host sync)."""
        stream.wait_event(event)

    def wait_stream(self, stream: Any, other: Any) -> None:
        """Work queued on ``stream`` from now on runs after the work queued on ``other`` so far."""
        stream.wait_stream(other)

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        """``tensor``'s memory is in use by ``stream``: once freed, the allocator reuses it only after the work
        queued on ``stream`` at that point has run."""
        tensor.record_stream(stream)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.device_type!r})"


class _AcceleratorStreams(Streams):
    """``torch.Stream``, ``torch.Event`` and ``torch.accelerator``: any backend whose device guard has streams."""

    def current(self, device: torch.device) -> Any:
        return torch.accelerator.current_stream(device)

    def new_stream(self, device: torch.device) -> Any:
        return torch.Stream(device)

    @contextlib.contextmanager
    def use(self, stream: Any) -> Iterator[None]:
        # NOTE: set_stream also makes the stream's device current: put both back afterwards.
        index = torch.accelerator.current_device_index()
        previous = torch.accelerator.current_stream(stream.device)
        torch.accelerator.set_stream(stream)
        try:
            yield
        finally:
            torch.accelerator.set_stream(previous)
            torch.accelerator.set_device_index(index)

    def new_event(self, device: torch.device) -> Any:
        return torch.Event(device=device)

    def synchronize(self, device: torch.device) -> None:
        torch.accelerator.synchronize(device)


class _ModuleStreams(Streams):
    """A ``torch.cuda``-shaped module: ``torch.cuda`` on a torch without ``torch.accelerator``, or a backend
    registered with :func:`register_backend`."""

    def __init__(self, device_type: str, module: Any) -> None:
        super().__init__(device_type)
        self.module = module

    def current(self, device: torch.device) -> Any:
        return self.module.current_stream(device)

    def new_stream(self, device: torch.device) -> Any:
        return self.module.Stream(device)

    def use(self, stream: Any) -> contextlib.AbstractContextManager[None]:
        return cast("contextlib.AbstractContextManager[None]", self.module.stream(stream))

    def new_event(self, device: torch.device) -> Any:
        return self.module.Event()

    def synchronize(self, device: torch.device) -> None:
        self.module.synchronize(device)


# -- choosing an implementation per device type -----------------------------------------------------------

_registered: dict[str, tuple[Any, bool]] = {}  # device type -> (torch.cuda-shaped module, pins host memory)
_chosen: dict[str, Streams | None] = {}
_choose_lock = threading.Lock()


def register_backend(device_type: str, module: Any, *, pin_host: bool = False) -> None:
    """Give ``device_type`` streams through ``module`` (``Stream(device)``, ``Event()``, ``current_stream(device)``,
    ``stream(s)`` as a context manager, ``synchronize(device)``; streams with ``wait_event``/``wait_stream``, events
    with ``record(stream)``/``query()``/``synchronize()``, and ``tensor.record_stream(stream)`` working on its
    tensors). For backends whose streams torch's generic API cannot see. ``pin_host``: whether host buffers
    should be pinned for copies to and from it."""
    with _choose_lock:
        _registered[device_type] = (module, pin_host)
        _chosen.pop(device_type, None)
    host_pinning.cache_clear()


def _generic_api() -> bool:
    acc = getattr(torch, "accelerator", None)  # (hasattr(None, name): False)
    needed = "current_accelerator current_stream set_stream synchronize current_device_index set_device_index".split()
    return hasattr(torch, "Stream") and hasattr(torch, "Event") and all(hasattr(acc, name) for name in needed)


@functools.cache
def _cuda_available() -> bool:
    return torch.cuda.is_available()


def _candidate(device_type: str) -> Streams | None:
    if device_type in _registered:
        return _ModuleStreams(device_type, _registered[device_type][0])
    if device_type in HOSTS:
        return None
    if _generic_api() and current_accelerator() == device_type:
        return _AcceleratorStreams(device_type)
    if device_type == "cuda" and _cuda_available():
        return _ModuleStreams("cuda", torch.cuda)
    return None


def _probe(streams: Streams, device: torch.device) -> bool:
    """Whether every primitive the engine needs works on ``device`` (once per device type)."""
    try:
        stream = streams.new_stream(device)
        event = streams.new_event(device)
        with streams.use(stream):
            tensor = torch.empty(1, device=device)
            streams.record(event, streams.current(device))
        streams.wait_event(streams.current(device), event)
        streams.record_stream(tensor, stream)
        event.synchronize()
        return True
    except Exception:
        return False


def of(device: torch.device | None) -> Streams | None:
    """The :class:`Streams` of ``device``'s type, or None where transfers must be synchronous."""
    if device is None:
        return None
    kind = device.type
    try:
        return _chosen[kind]
    except KeyError:
        pass
    with _choose_lock:
        if kind not in _chosen:
            streams = _candidate(kind)
            _chosen[kind] = streams if streams is not None and _probe(streams, device) else None
        return _chosen[kind]


def known(device: torch.device) -> bool | None:
    """Whether ``device``'s type has streams, as far as :func:`of` has found out: None before it was asked
    (asking probes the backend, which creates a stream: something only a transfer that needs one should do)."""
    streams = _chosen.get(device.type, False)
    return None if streams is False else streams is not None


def synchronize(devices: Iterable[torch.device]) -> None:
    """Block the host until the work queued on each accelerator among ``devices`` has run, one wait per device
    (none where its torch module is not available: fake tensors that only claim the device)."""
    for device in {d for d in devices if d.type not in HOSTS}:
        streams = _chosen.get(device.type)
        if streams is not None:
            streams.synchronize(device)
            continue
        module = device_module(device.type)
        sync = getattr(module, "synchronize", None)
        available = getattr(module, "is_available", lambda: True)
        if sync is not None and available():
            try:
                sync(device)
            except TypeError:
                sync()


# -- pinned host memory -------------------------------------------------------------------------------------


@functools.cache
def host_pinning() -> str | None:
    """The device type host memory can be pinned for in this process (the accelerator's), or None. Ask this first:
    ``is_pinned()`` or ``pin_memory=True`` with no such accelerator initializes one or raises."""
    if _cuda_available():
        kind: str | None = "cuda"
    else:
        kind = current_accelerator() if _generic_api() else None
    if kind is None or (kind in _registered and not _registered[kind][1]):
        return None
    try:
        torch.empty(1, pin_memory=True)
    except Exception:
        return None
    return kind


def pins_host_for(device: torch.device) -> bool:
    """Whether host buffers for copies to and from ``device`` should be pinned (they can be, and it helps)."""
    return device.type == host_pinning()


def pins_copy(source: torch.Tensor, target: torch.device, pin_memory: bool) -> bool:
    """Whether a copy of ``source`` to ``target`` goes to pinned host memory: asked for (``pin_memory``), to the
    host, from an accelerator host memory is pinned for (only there does it exist and help), strided."""
    return pin_memory and target.type == "cpu" and pins_host_for(source.device) and source.layout == torch.strided


def in_pinned_memory(t: torch.Tensor) -> bool:
    """Whether ``t`` sits in pinned host memory, so that a copy from it may be queued."""
    return t.device.type == "cpu" and host_pinning() is not None and t.is_pinned()


def empty_cache() -> None:
    """Give the accelerator's cached, unused device memory back (no-op without one)."""
    if _cuda_available():
        torch.cuda.empty_cache()
        return
    acc = getattr(torch, "accelerator", None)
    if acc is not None and hasattr(acc, "empty_cache") and hasattr(acc, "is_available"):
        kind = current_accelerator()
        if kind is not None and kind not in _registered and acc.is_available():
            acc.empty_cache()
