"""Copies on a device's copy stream, events and waits: the small interface the streamed step is written against.

# NOTE: kept apart on purpose. A device-generic stream/event interface is being written (issue 14); this module
# is the one place to swap for it. What the streamed step (:mod:`optimshift._stream`) needs from a device:

- ``copy(dst, src)``, ``copy_all(dsts, srcs)``: queue copies on the device's copy stream, after what that stream
  already holds (one flat copy per chunk and direction; ``_foreach_copy_`` where state is first laid out);
- ``after_current()``: the copy stream waits for the work queued so far on the current (compute) stream;
- ``record()``: an event after the work queued so far on the copy stream;
- ``current_waits(event)``: the current stream waits for it (on the device: the host does not wait);
- ``host_wait(event)``: the host waits for it;
- ``keep(tensor)``: device memory the copy stream reads or writes is not handed out again by the caching
  allocator before the copy stream is done with it (``record_stream``).

Two implementations: :class:`CudaCopyStream` (a ``torch.cuda.Stream`` per device, ``torch.cuda.Event``) and
:class:`SyncCopyStream` (each copy is complete when it returns and events are ``None``: the simulated
accelerator, and any backend without streams). Device-to-host copies queued here run inside
:func:`optimshift.syncs.async_copies`: on CUDA they go non-blocking into pinned memory and the host does not
wait for them, so :func:`optimshift.count_syncs` lists them as ``async_copies``, not as syncs.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional, Protocol, Sequence

import torch

from .syncs import async_copies

__all__ = ["CopyStream", "SyncCopyStream", "CudaCopyStream", "copy_stream", "use_factory"]


class CopyStream(Protocol):
    """One device's copy stream (see the module docstring)."""

    device: torch.device

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None: ...

    def copy_all(self, dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> None: ...

    def after_current(self) -> None: ...

    def record(self) -> Optional[Any]: ...

    def current_waits(self, event: Optional[Any]) -> None: ...

    def host_wait(self, event: Optional[Any]) -> None: ...

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

    def record(self) -> Optional[Any]:
        return None

    def current_waits(self, event: Optional[Any]) -> None:
        pass

    def host_wait(self, event: Optional[Any]) -> None:
        pass

    def keep(self, tensor: torch.Tensor) -> None:
        pass


class CudaCopyStream:
    """A side ``torch.cuda.Stream`` on one CUDA device. Host memory it copies to or from must be pinned (the
    streamed step's host buffers come from the pinned host pool), or the copies would not be asynchronous."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        with torch.cuda.stream(self.stream), async_copies(_to_host(dst, src)):
            dst.copy_(src, non_blocking=True)

    def copy_all(self, dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> None:
        if dsts:
            with torch.cuda.stream(self.stream), async_copies(_to_host(dsts[0], srcs[0])):
                torch._foreach_copy_(list(dsts), list(srcs), non_blocking=True)

    def after_current(self) -> None:
        self.stream.wait_stream(torch.cuda.current_stream(self.device))

    def record(self) -> Optional[Any]:
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def current_waits(self, event: Optional[Any]) -> None:
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def host_wait(self, event: Optional[Any]) -> None:
        if event is not None:
            event.synchronize()

    def keep(self, tensor: torch.Tensor) -> None:
        if tensor.device.type == "cuda":
            tensor.record_stream(self.stream)


@functools.lru_cache(maxsize=None)
def _cuda_available() -> bool:
    return torch.cuda.is_available()


def _default_factory(device: torch.device) -> CopyStream:
    if device.type == "cuda" and _cuda_available():
        return CudaCopyStream(device)
    return SyncCopyStream(device)


_factory: Callable[[torch.device], CopyStream] = _default_factory
_streams: dict[torch.device, CopyStream] = {}


def copy_stream(device: torch.device) -> CopyStream:
    """The copy stream of ``device`` (one per device for the process, made on first use)."""
    found = _streams.get(device)
    if found is None:
        found = _streams[device] = _factory(device)
    return found


def use_factory(factory: Optional[Callable[[torch.device], CopyStream]]) -> Callable[[torch.device], CopyStream]:
    """Make copy streams with ``factory`` from now on (``None``: the default); returns the previous factory.
    For tests (a stream that defers its copies checks that every wait is in place) and for swapping in another
    implementation."""
    global _factory
    previous = _factory
    _factory = _default_factory if factory is None else factory
    _streams.clear()
    return previous
