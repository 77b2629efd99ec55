"""Copies on a device's copy stream, events and waits: the small interface the streamed step is written against.

# NOTE: kept apart on purpose: what the streamed step (:mod:`optimshift._stream`) needs from a device, in its
# own words, implemented over :mod:`optimshift._streams` (issue 14's device-generic streams and events):

- ``copy(dst, src)``, ``copy_all(dsts, srcs)``: queue copies on the device's copy stream, after what that stream
  already holds (one flat copy per chunk and direction; ``_foreach_copy_`` where state is first laid out);
- ``after_current()``: the copy stream waits for the work queued so far on the current (compute) stream;
- ``record()``: an event after the work queued so far on the copy stream;
- ``current_waits(event)``: the current stream waits for it (on the device: the host does not wait);
- ``host_wait(event)``: the host waits for it;
- ``keep(tensor)``: device memory the copy stream reads or writes is not handed out again by the caching
  allocator before the copy stream is done with it (``record_stream``).

Two implementations: :class:`StreamsCopyStream` (a stream of its own per device from :mod:`optimshift._streams`:
CUDA, the simulated accelerator's deferred and race-checked streams, any registered backend) and
:class:`SyncCopyStream` (each copy is complete when it returns and events are ``None``: devices without streams).
Device-to-host copies queued here run inside
:func:`optimshift.syncs.async_copies`: on CUDA they go non-blocking into pinned memory and the host does not
wait for them, so :func:`optimshift.count_syncs` lists them as ``async_copies``, not as syncs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from . import _streams
from .syncs import async_copies

__all__ = ["CopyStream", "SyncCopyStream", "StreamsCopyStream", "copy_stream", "use_factory", "pinned_for"]


class CopyStream(Protocol):
    """One device's copy stream (see the module docstring)."""

    device: torch.device

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None: ...

    def copy_all(self, dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> None: ...

    def after_current(self) -> None: ...

    def record(self) -> Any | None: ...

    def current_waits(self, event: Any | None) -> None: ...

    def host_wait(self, event: Any | None) -> None: ...

    def keep(self, tensor: torch.Tensor) -> None: ...


def _to_host(dst: torch.Tensor, src: torch.Tensor) -> bool:
    return dst.device.type == "cpu" and src.device.type != "cpu"


class SyncCopyStream:
    """Every copy is complete when it returns; nothing to wait for."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        with async_copies(_to_host(dst, src)):
            dst.copy_(src)

    def copy_all(self, dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> None:
        if dsts:
            with async_copies(_to_host(dsts[0], srcs[0])):
                torch._foreach_copy_(list(dsts), list(srcs))

    def after_current(self) -> None:
        pass

    def record(self) -> Any | None:
        return None

    def current_waits(self, event: Any | None) -> None:
        pass

    def host_wait(self, event: Any | None) -> None:
        pass

    def keep(self, tensor: torch.Tensor) -> None:
        pass


class StreamsCopyStream:
    """A side stream through :mod:`optimshift._streams` (the device-generic interface of issue 14): on CUDA
    ``torch.Stream``/``torch.Event`` (or ``torch.cuda``'s on an older torch), on the simulated accelerator its
    deferred, race-checked streams, and whatever backend is registered there. Host memory it copies to or from
    must be pinned where the device pins (:func:`optimshift._streams.pins_host_for`), or the copies would not be
    asynchronous: the streamed step's host buffers come from the host pool, pinned for such devices."""

    def __init__(self, device: torch.device, streams: Any) -> None:
        self.device = device
        self.streams = streams
        self.stream = streams.new_stream(device)  # its own: never queued behind the engine's side-stream copies

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        with self.streams.use(self.stream), async_copies(_to_host(dst, src)):
            dst.copy_(src, non_blocking=True)

    def copy_all(self, dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> None:
        if dsts:
            with self.streams.use(self.stream), async_copies(_to_host(dsts[0], srcs[0])):
                torch._foreach_copy_(list(dsts), list(srcs), non_blocking=True)

    def after_current(self) -> None:
        self.streams.wait_stream(self.stream, self.streams.current(self.device))

    def record(self) -> Any | None:
        event = self.streams.new_event(self.device)
        self.streams.record(event, self.stream)
        return event

    def current_waits(self, event: Any | None) -> None:
        if event is not None:
            self.streams.wait_event(self.streams.current(self.device), event)

    def host_wait(self, event: Any | None) -> None:
        if event is not None:
            event.synchronize()

    def keep(self, tensor: torch.Tensor) -> None:
        if tensor.device.type == self.device.type:
            self.streams.record_stream(tensor, self.stream)


def _default_factory(device: torch.device) -> CopyStream:
    streams = _streams.of(device)
    return SyncCopyStream(device) if streams is None else StreamsCopyStream(device, streams)


_factory: Callable[[torch.device], CopyStream] = _default_factory
_by_device: dict[torch.device, CopyStream] = {}


def pinned_for(device: torch.device) -> bool:
    """Whether host buffers that copies to and from ``device`` use should be pinned."""
    return _streams.pins_host_for(device)


def copy_stream(device: torch.device) -> CopyStream:
    """The copy stream of ``device`` (one per device for the process, made on first use)."""
    found = _by_device.get(device)
    if found is None:
        found = _by_device[device] = _factory(device)
    return found


def use_factory(factory: Callable[[torch.device], CopyStream] | None) -> Callable[[torch.device], CopyStream]:
    """Make copy streams with ``factory`` from now on (``None``: the default); returns the previous factory.
    For tests (a stream that defers its copies checks that every wait is in place) and for swapping in another
    implementation."""
    global _factory
    previous = _factory
    _factory = _default_factory if factory is None else factory
    _by_device.clear()
    return previous
