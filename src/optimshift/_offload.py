"""What an offload remembers, and transfers still in flight.

:func:`optimshift.offload` records where each tensor was (by site), where each param was, the pool buffers
the host copies live in and the grads it took; :func:`optimshift.reload` reads the record back and forgets
it. A non-blocking transfer is a :class:`PendingTransfer`; the optimizer's next ``step()`` waits for it on the
device through a step pre-hook (removed by the next operation on that optimizer).

# NOTE: records live beside the optimizer (a weak-keyed table), never on it, so that offloading adds no
# attribute to a user's object and an optimizer that is garbage-collected takes its record with it.
"""

from __future__ import annotations

import contextlib
import copy
import threading
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from . import _streams
from ._state import leaves
from .plan import Ident
from .pool import host_pool

__all__ = [
    "PendingTransfer",
    "Record",
    "exclusive",
    "record_of",
    "set_record",
    "settle",
    "remember_pending",
    "forget",
    "prepare_discard",
    "pending_of",
]


class PendingTransfer:
    """A non-blocking offload or reload whose copies may still be running on a side stream.

    ``done()`` polls, ``wait()`` blocks the host until the copies are complete. A pending reload is also
    waited for automatically (on the device, without a host sync) before the optimizer's next ``step()``.
    On a device without streams (see :mod:`optimshift._streams`) transfers are synchronous and a handle is
    done from the start.
    """

    def __init__(self, event: Any | None = None, device: torch.device | None = None) -> None:
        self._event = event
        self.device = device
        self._callbacks: list[Callable[[], None]] = []

    @property
    def event(self) -> Any | None:
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

    devices: dict[Ident, torch.device] = field(default_factory=dict)
    param_devices: dict[tuple[int, int], torch.device] = field(default_factory=dict)
    buffers: list[torch.Tensor] = field(default_factory=list)
    grads: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    hooks: list[Any] = field(default_factory=list)  # handles of the hooks installed while offloaded

    def extended(self) -> Record:
        """A copy to add to (a second offload of an offloaded optimizer keeps what the first recorded)."""
        return Record(
            dict(self.devices), dict(self.param_devices), list(self.buffers), dict(self.grads), list(self.hooks)
        )

    @property
    def moved_any(self) -> bool:
        """Whether offload took anything off an accelerator (else the state sits where it belongs)."""
        return any(d.type != "cpu" for d in self.devices.values()) or bool(self.grads)


_records: weakref.WeakKeyDictionary[Any, Record] = weakref.WeakKeyDictionary()
_pending: weakref.WeakKeyDictionary[Any, PendingTransfer] = weakref.WeakKeyDictionary()
_hooks: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()  # optimizer -> its step pre-hook
_lock = threading.Lock()


_operation_locks: weakref.WeakKeyDictionary[Any, threading.RLock] = weakref.WeakKeyDictionary()
_unweakable_lock = threading.RLock()  # for optimizers that cannot be weakly referenced


@contextlib.contextmanager
def exclusive(optimizer: Any) -> Iterator[None]:
    """Run one operation on ``optimizer`` at a time, from any thread (re-entrant: reload calls move).

    # NOTE: an offload in one thread and a reload in another, interleaved, could otherwise record the host as
    # the original device or drop the record, leaving the state stranded on the host.
    """
    try:
        with _lock:
            lock = _operation_locks.get(optimizer)
            if lock is None:
                lock = _operation_locks[optimizer] = threading.RLock()
    except TypeError:
        lock = _unweakable_lock
    with lock:
        yield


def record_of(optimizer: Any) -> Record | None:
    try:
        with _lock:
            return _records.get(optimizer)
    except TypeError:  # an optimizer that cannot be weakly referenced (a wrapper) was never offloaded
        return None


def set_record(optimizer: Any, record: Record) -> None:
    """Keep ``record`` for ``optimizer`` and, the first time, install the hooks that guard offloaded state."""
    if not record.hooks:
        record.hooks.extend(_install_hooks(optimizer))
    with _lock:
        _records[optimizer] = record


def _install_hooks(optimizer: Any) -> list[Any]:
    """While offloaded: ``step()`` refuses at once (before any counter moves), and ``state_dict()`` returns
    compact copies of the host tensors instead of views into shared pool buffers."""
    handles = []
    register_pre = getattr(optimizer, "register_step_pre_hook", None)
    if register_pre is not None:
        handles.append(register_pre(_refuse_step))
    register_sd = getattr(optimizer, "register_state_dict_post_hook", None)
    if register_sd is not None:
        handles.append(register_sd(_compact_state_dict))
    return handles


def _refuse_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    record = record_of(optimizer)
    if record is not None and record.moved_any:
        raise RuntimeError(
            f"{type(optimizer).__name__}.step() while its state is offloaded to the host: call "
            f"optimshift.reload(optimizer) first (nothing was stepped)"
        )


def _compact_state_dict(optimizer: Any, state_dict: dict[str, Any]) -> dict[str, Any]:
    """A state_dict whose offloaded tensors own exactly their bytes.

    # NOTE: offloaded state is a view into a pool buffer shared with other tensors (even other optimizers');
    # torch.save writes a view's whole storage, so a checkpoint taken while offloaded would hold their bytes.
    # The live per-param dicts are shared with the returned state_dict: build new ones, never mutate them.
    """
    compact: dict[int, torch.Tensor] = {}
    record = record_of(optimizer)
    # (only views into the pool: tensors that share a storage of their own keep sharing it, see _alias)
    pooled = {buf.untyped_storage().data_ptr() for buf in record.buffers} if record is not None else set()

    def own(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.nbytes() > t.numel() * t.element_size() and storage.data_ptr() in pooled and id(t) not in compact:
            compact[id(t)] = t.clone()
        return compact.get(id(t), t)

    states = state_dict.get("state", {})
    groups = state_dict.get("param_groups", [])
    for value in list(states.values()) + [{k: v for k, v in g.items() if k != "params"} for g in groups]:
        for _, t in leaves(value):
            own(t)
    if not compact:
        return state_dict
    out = dict(state_dict)
    # (state_dict()'s groups are new dicts, but their values are the live ones: containers are copied)
    out["param_groups"] = [{k: _compacted(v, compact) if k != "params" else v for k, v in g.items()} for g in groups]
    new_states = {}
    for key, value in states.items():
        if isinstance(value, dict):
            new_states[key] = {k: _compacted(v, compact) for k, v in value.items()}
        else:
            new_states[key] = _compacted(value, compact)
    out["state"] = new_states
    return out


def _compacted(value: Any, compact: dict[int, torch.Tensor]) -> Any:
    """``value`` with the tensors in ``compact`` swapped for their compact copies; containers that hold one
    are copied (the live ones are shared with the optimizer), everything else is shared as it is."""
    if isinstance(value, torch.Tensor):
        return compact.get(id(value), value)
    found = [t for _, t in leaves(value)]
    if not any(id(t) in compact for t in found):
        return value
    return copy.deepcopy(value, {id(t): compact.get(id(t), t) for t in found})


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


def forget(optimizer: Any, pending: PendingTransfer | None = None) -> None:
    """Drop the offload record and give its host buffers back to the pool, to be reused once the copies that
    read them (``pending``) are done and nothing looks into them any more (the pool checks both)."""
    try:
        with _lock:
            record = _records.pop(optimizer, None)
    except TypeError:
        return
    if record is None:
        return
    for handle in record.hooks:
        handle.remove()
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
