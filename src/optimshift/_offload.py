"""What an offload remembers, and transfers still in flight.

:func:`optimshift.offload` records where each tensor was (by site), where each param was, the pool buffers
the host copies live in and the grads it took; :func:`optimshift.reload` reads the record back and forgets
it. A non-blocking transfer is a :class:`PendingTransfer`; the optimizer's next ``step()`` waits for it on the
device through a step pre-hook (removed by the next operation on that optimizer).

# NOTE: records live beside the optimizer (a weak-keyed table), never on it, so that offloading adds no
# attribute to a user's object and an optimizer that is garbage-collected takes its record with it.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from . import _streams
from .pool import host_pool

__all__ = ["PendingTransfer", "Record", "record_of", "settle", "remember_pending", "forget",
           "prepare_discard", "pending_of"]


class PendingTransfer:
    """A non-blocking offload or reload whose copies may still be running on a side stream.

    ``done()`` polls, ``wait()`` blocks the host until the copies are complete. A pending reload is also
    waited for automatically (on the device, without a host sync) before the optimizer's next ``step()``.
    On a device without streams (see :mod:`optimshift._streams`) transfers are synchronous and a handle is
    done from the start.
    """

    def __init__(self, event: Optional[Any] = None, device: Optional[torch.device] = None) -> None:
        self._event = event
        self.device = device
        self._callbacks: list[Callable[[], None]] = []

    @property
    def event(self) -> Optional[Any]:
        """The device's event that completes with the copies (a ``torch.Event``, or the backend's own event
        type); None once done, or where the transfer was synchronous."""
        return self._event

    def add_done_callback(self, fn: Callable[[], None]) -> None:
        if self._event is None:
            fn()
        else:
            self._callbacks.append(fn)

    def _finish(self) -> None:
        self._event = None
        callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            fn()

    def done(self) -> bool:
        if self._event is not None and self._event.query():
            self._finish()
        return self._event is None

    def wait(self) -> None:
        if self._event is not None:
            self._event.synchronize()
            self._finish()

    def wait_on_current_stream(self) -> None:
        """Make the device's current stream wait for the copies (no host sync): what the step pre-hook does.
        Without a device stream to wait on, the host waits."""
        if self.done():
            return  # complete already: the host knows, so everything issued from now on comes after it
        streams = _streams.of(self.device)
        if streams is not None:
            assert self.device is not None
            streams.wait_event(streams.current(self.device), self._event)
        else:
            self.wait()

    def __repr__(self) -> str:
        return f"PendingTransfer(device={self.device}, done={self.done()})"


@dataclass
class Record:
    """Where each tensor was (by site ident), where each param was (by group and index), the pool buffers
    the host copies live in, and the grads offload took (``{(group, index): (param, host grad)}``)."""

    devices: dict[tuple, torch.device] = field(default_factory=dict)
    param_devices: dict[tuple, torch.device] = field(default_factory=dict)
    buffers: list[torch.Tensor] = field(default_factory=list)
    grads: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def extended(self) -> "Record":
        """A copy to add to (a second offload of an offloaded optimizer keeps what the first recorded)."""
        return Record(dict(self.devices), dict(self.param_devices), list(self.buffers), dict(self.grads))


_records: "weakref.WeakKeyDictionary[Any, Record]" = weakref.WeakKeyDictionary()
_pending: "weakref.WeakKeyDictionary[Any, PendingTransfer]" = weakref.WeakKeyDictionary()
_hooks: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()  # optimizer -> its step pre-hook
_lock = threading.Lock()


def record_of(optimizer: Any) -> Optional[Record]:
    try:
        with _lock:
            return _records.get(optimizer)
    except TypeError:  # an optimizer that cannot be weakly referenced (a wrapper) was never offloaded
        return None


def set_record(optimizer: Any, record: Record) -> None:
    with _lock:
        _records[optimizer] = record


def settle(optimizer: Any) -> None:
    """Finish a non-blocking transfer still running for this optimizer before touching its state again."""
    try:
        with _lock:
            pending = _pending.pop(optimizer, None)
            handle = _hooks.pop(optimizer, None)
    except TypeError:
        return
    if handle is not None:
        handle.remove()
    if pending is not None:
        pending.wait()


def pending_of(optimizer: Any) -> PendingTransfer:
    try:
        with _lock:
            return _pending.get(optimizer) or PendingTransfer()
    except TypeError:
        return PendingTransfer()


def remember_pending(optimizer: Any, pending: PendingTransfer) -> None:
    """Keep a transfer still in flight, and make the optimizer's next step wait for it (on the device).

    # NOTE: one step pre-hook per optimizer, which waits for whatever is pending when ``step()`` runs. It
    # cannot remove itself: torch iterates its hook dict while calling the hooks, and deleting from it there
    # raises as soon as another hook follows. Once it has waited it does nothing until the next optimshift
    # operation on this optimizer removes it (``settle``).
    """
    if pending.done():
        return
    register = getattr(optimizer, "register_step_pre_hook", None)
    try:
        with _lock:
            _pending[optimizer] = pending
            hooked = optimizer in _hooks
    except TypeError:  # an optimizer that cannot be weakly referenced: nothing can remember it, wait now
        pending.wait()
        return
    if hooked:
        return
    if register is None:
        settle(optimizer)
        return
    handle = register(_wait_before_step)
    with _lock:
        _hooks[optimizer] = handle


def _wait_before_step(optimizer: Any, *_: Any) -> None:
    with _lock:
        pending = _pending.get(optimizer)
    if pending is not None:
        pending.wait_on_current_stream()


def forget(optimizer: Any, pending: Optional[PendingTransfer] = None) -> None:
    """Drop the offload record and give its host buffers back to the pool, to be reused once the copies that
    read them (``pending``) are done and nothing looks into them any more (the pool checks both)."""
    try:
        with _lock:
            record = _records.pop(optimizer, None)
    except TypeError:
        return
    if record is None:
        return
    event = pending.event if pending is not None else None
    for buf in record.buffers:
        host_pool.release(buf, event)


def prepare_discard(optimizer: Any) -> Callable[[], None]:
    """For a load that replaces the optimizer's state: finish any transfer in flight and copy offloaded grads
    back to their params' devices now (this may raise; nothing has changed then); the returned function, called
    once the new state is installed, hands the grads back and forgets the old record and its buffers."""
    settle(optimizer)
    record = record_of(optimizer)
    if record is None:
        return lambda: None
    back = [(p, host_grad.to(p.device)) for p, host_grad in record.grads.values() if p.grad is None]

    def finish() -> None:
        for p, grad in back:
            p.grad = grad
        forget(optimizer)

    return finish
