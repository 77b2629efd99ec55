"""What an offload remembers (:class:`Record`), and transfers still in flight (:class:`PendingTransfer`), which
whatever reads the state waits for first: the optimizer's own methods through hooks and fronts, every optimshift
operation through :func:`end_pending` or ``pending_of(optimizer).order_before_use()``. Kept in the optimizer's
:class:`optimshift._session.Session`."""

from __future__ import annotations

import contextlib
import copy
import inspect
import threading
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from . import _device_streams, _engine, _session
from ._adopt import kept
from ._alias import storage_key, storage_of
from ._devices import HOST, HOSTS
from ._dtensor import local_tensor
from ._plan import Ident, Plan, Transfer, optimizer_name
from ._state import GROUP_SKIP, group_tensors, label_in, leaves, param_positions
from .pool import host_pool


class PendingTransfer:
    """A non-blocking offload or reload whose copies may still be running on a side stream (on a device without
    streams: done from the start). ``done()`` polls, ``wait()`` blocks the host until they are complete; the
    optimizer's ``step()``, ``state_dict()``, ``load_state_dict()`` and optimshift's operations wait by themselves,
    but code reading ``optimizer.state`` directly must ``wait()`` first (until then it holds undefined bytes).
    """

    def __init__(self, event: Any | None = None, device: torch.device | None = None, *, to_host: bool = False) -> None:
        self._event = event
        self.device = device
        self.to_host = to_host  # its copies write host memory (an offload): host readers must wait on the host
        self._callbacks: list[Callable[[], None]] = []
        self._lock = threading.Lock()  # (a handle waited for from several threads: its callbacks run once)

    @property
    def event(self) -> Any | None:
        """The device's event that completes with the copies (a ``torch.Event``, or the backend's own event
        type); None once done, or where the transfer was synchronous."""
        return self._event

    def add_done_callback(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` once the copies are complete (now if they are): when the host learns it, by ``done()``,
        ``wait()`` or the next operation on the optimizer (:meth:`retire`)."""
        with self._lock:
            if self._event is not None:
                self._callbacks.append(fn)
                return
        fn()

    def _finish(self) -> None:
        """Mark the copies complete and run every callback, then raise the first error one raised (a Ctrl-C first)."""
        with self._lock:
            self._event = None
            callbacks, self._callbacks = self._callbacks, []
        errors = []
        for fn in callbacks:
            try:
                fn()
            except BaseException as error:  # (the others still run: each frees what it was given)
                errors.append(error)
        try:
            if errors:  # (a Ctrl-C first: raised as another's error, an ``except Exception`` would swallow it)
                raise next((e for e in errors if not isinstance(e, Exception)), errors[0])
        finally:
            errors.clear()  # (the list, a local of this frame in the error's traceback, would hold it: a cycle)

    def done(self) -> bool:
        event = self._event  # (read once: another thread's wait() may finish it meanwhile)
        if event is not None and event.query():
            self._finish()
        return self._event is None

    def wait(self) -> None:
        """Block the host until the copies are complete."""
        event = self._event
        if event is not None:
            event.synchronize()
            self._finish()

    def order_before_use(self, *, host: bool = False) -> None:
        """Order what touches the transferred tensors next after the copies: the host waits for copies writing
        host memory, or when ``host`` (it reads them itself); otherwise the device's current stream waits, no host
        sync (the engine's side stream waits for the current one before its copies: the next transfer is ordered)."""
        event = self._event  # (read once: another thread's wait() may finish it meanwhile)
        if event is None or self.done():
            return  # complete already: the host knows, so everything issued from now on comes after it
        streams = None if self.to_host or host else _device_streams.of(self.device)
        if streams is None:
            self.wait()
        else:
            assert self.device is not None
            streams.wait_event(streams.current(self.device), event)  # (an event complete by now: no wait)

    def retire(self) -> None:
        """The transfer is over for its optimizer: order what comes next after it and run the done-callbacks (the
        host waits for the copies only where there are callbacks)."""
        self.order_before_use()
        if self._callbacks:
            self.wait()

    def __repr__(self) -> str:
        return f"PendingTransfer(device={self.device}, done={self.done()})"


Positions = tuple[tuple[int, tuple[int, ...]], ...]  # (id(group), the ids of its params) per group


def positions_of(optimizer: Any) -> Positions:
    """Which group and which params sit at each position: what the positions a record's sites name stand for."""
    return tuple((id(g), tuple(map(id, g["params"]))) for g in optimizer.param_groups)


@dataclass
class Record:
    """What an offload took: where each tensor (by site ident, its positions as ``positions`` had them) and each
    param (by id) was, the pool buffers its host copies live in, its grads (``{id(param): (param, host grad)}``)."""

    devices: dict[Ident, torch.device] = field(default_factory=dict)
    param_devices: dict[int, torch.device] = field(default_factory=dict)
    param_flags: dict[int, tuple[Any, ...]] = field(default_factory=dict)  # its group's implementation flags
    buffers: list[torch.Tensor] = field(default_factory=list)
    grads: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    hooks: list[Any] = field(default_factory=list)  # handles of the hooks installed while offloaded
    token: Any = None  # the serial of the cached offload plan's build that made this record (what a reload undoes)
    keep_addresses: frozenset[torch.device] = frozenset()  # devices whose reload puts the state back at its addresses
    positions: Positions = ()  # what the positions in ``devices`` stand for (see sites)
    took: bool = False  # an offload took something off an accelerator (see moved_any)
    # the group tensors (a tensor lr) an offload took from an accelerator, by id: where from, and the tensor (held
    # while offloaded: its id names it), so that a reload puts it back there whatever group site holds it now
    taken: dict[int, tuple[torch.device, torch.Tensor]] = field(default_factory=dict)

    def extended(self, optimizer: Any) -> Record:
        """A copy to add to (a second offload of an offloaded optimizer keeps what the first recorded), its sites
        named by today's positions."""
        return Record(
            dict(self.sites(optimizer)),  # (a copy: a failed offload leaves this record as it was)
            dict(self.param_devices),
            dict(self.param_flags),
            list(self.buffers),
            dict(self.grads),
            list(self.hooks),
            keep_addresses=self.keep_addresses,
            positions=positions_of(optimizer),
            took=self.took,
            taken=dict(self.taken),
        )

    def sites(self, optimizer: Any) -> dict[Ident, torch.device]:
        """``devices`` by the positions each site's group (its dict and params) and param have now: groups reordered
        while offloaded would give one param's device to another; a site not there now is left out."""
        now = positions_of(optimizer)
        if self.positions == now:
            return self.devices
        group_at = {group: gi for gi, group in enumerate(now)}  # (a reused id(dict) alone would match a new group)
        param_at = {pid: (gi, pi) for gi, (_, pids) in enumerate(now) for pi, pid in enumerate(pids)}
        devices: dict[Ident, torch.device] = {}
        for (gi, pi, path), device in self.devices.items():
            if gi < 0 or gi >= len(self.positions):  # (the optimizer-wide entries: they go with the first group)
                devices[(gi, pi, path)] = device
                continue
            pids = self.positions[gi][1]
            if pi is None:
                at = group_at.get(self.positions[gi])
                if at is not None:
                    devices[(at, None, path)] = device
            elif pi < len(pids):
                where = param_at.get(pids[pi])
                if where is not None:
                    devices[(where[0], where[1], path)] = device
        return devices

    @property
    def moved_any(self) -> bool:
        """Whether offload took anything off an accelerator (else the state sits where it belongs)."""
        return self.took or bool(self.grads)


_lock = threading.Lock()  # guards the session fields this module reads and writes
_unweakable_lock = threading.RLock()  # for optimizers that cannot be weakly referenced (no session)


@contextlib.contextmanager
def exclusive(optimizer: Any) -> Iterator[None]:
    """Run one operation on ``optimizer`` at a time, from any thread (re-entrant: reload calls move): interleaved,
    an offload and a reload could record the host as the original device, stranding the state there."""
    session = _session.get(optimizer)
    with _unweakable_lock if session is None else session.lock:
        yield


def record_of(optimizer: Any) -> Record | None:
    session = _session.of(optimizer)  # (an optimizer that cannot have one, a wrapper, was never offloaded)
    return None if session is None else session.record


def guard(optimizer: Any, record: Record, *, grads: bool = False) -> list[Any]:
    """Before an offload copies anything: refuse an optimizer whose record cannot be kept, and install the hooks
    guarding offloaded state the first time (the ``zero_grad`` front the first time it takes ``grads``); returns
    those installed now, for the caller to remove on a failure."""
    name = type(optimizer).__name__
    if _session.get(optimizer) is None:
        raise TypeError(f"{name} cannot be weakly referenced: its offload cannot be remembered; nothing was changed")
    zeroing = grads and hasattr(optimizer, "__dict__")
    zeroing = zeroing and not any(isinstance(h, Front) and h.name == "zero_grad" for h in record.hooks)
    handles: list[Any] = []
    try:
        # (while offloaded, step() refuses at once and state_dict(), a deepcopy or a pickle, give compact copies)
        if not record.hooks:
            handles += install_guards(optimizer, {"register_step_pre_hook": _refuse_step}, None, compact=True)
        if zeroing:  # (before the commit: one failing once the grads were on the host left them in no record)
            handles.append(Front(optimizer, "zero_grad", _ZeroGradFront(weakref.ref(optimizer))))
    except BaseException as e:
        for handle in handles:
            handle.remove()
        if not isinstance(e, Exception):
            raise
        raise TypeError(  # (a class that never ran Optimizer.__init__ has no hook dicts)
            f"{name}: the hooks that guard its offloaded state cannot be registered "
            f"({type(e).__name__}: {e}); nothing was changed"
        ) from e
    record.hooks.extend(handles)
    return handles


def set_record(optimizer: Any, record: Record) -> None:
    """Keep ``record`` for ``optimizer`` (:func:`guard` installed its hooks): after the commit, nothing can fail."""
    session = _session.get(optimizer)
    assert session is not None  # (guard checked)
    with _lock:
        session.record = record


def install_guards(
    optimizer: Any, pre: Mapping[str, Callable[..., None]], wait: Callable[[Any], None] | None, *, compact: bool
) -> list[Any]:
    """Each of ``pre``'s hooks (by its register method, skipped where the optimizer has none) registered first,
    :func:`compact_state_dict` as the state_dict post-hook where ``compact``, and :func:`copy_guard`; all or none."""
    handles: list[Any] = []
    try:
        for register, hook in pre.items():
            method = getattr(optimizer, register, None)
            if method is not None:
                handles.append(registered_first(method(hook)))
        post = getattr(optimizer, "register_state_dict_post_hook", None)
        if compact and post is not None:
            handles.append(post(compact_state_dict))
        handles += copy_guard(optimizer, wait, compact=compact)
    except BaseException:  # (a Ctrl-C too)
        for handle in handles:
            handle.remove()
        raise
    return handles


def registered_first(handle: Any) -> Any:
    """The hook just registered (``handle``) moved first: a user's pre-hook must not run before optimshift's
    refusal or its wait for a transfer in flight."""
    hooks = handle.hooks_dict_ref()
    if hooks is not None:
        hooks.move_to_end(handle.id, last=False)
    return handle


_MISSING = object()


class Front:
    """A front in the optimizer's ``__dict__``, before the class's method of that name, until ``remove()`` puts
    back what was there (``front.previous``: :func:`behind`); it holds the optimizer and its front weakly."""

    def __init__(self, optimizer: Any, name: str, front: Any) -> None:
        self.ref, self.name = weakref.ref(optimizer), name
        self.front = weakref.ref(front)
        front.previous = optimizer.__dict__.get(name, _MISSING)
        optimizer.__dict__[name] = front

    def remove(self) -> None:
        optimizer, front = self.ref(), self.front()
        if optimizer is not None and front is not None and optimizer.__dict__.get(self.name) is front:
            if front.previous is _MISSING:
                del optimizer.__dict__[self.name]
            else:
                optimizer.__dict__[self.name] = front.previous


def behind(front: Any, optimizer: Any, name: str) -> Any:
    """What ``front`` (installed by :class:`Front` as ``name``) stands before: the optimizer's own entry it
    replaced, else the class's method, bound to ``optimizer``."""
    return front.previous if front.previous is not _MISSING else getattr(type(optimizer), name).__get__(optimizer)


def copy_guard(optimizer: Any, wait: Callable[[Any], None] | None, *, compact: bool = False) -> list[Front]:
    """A ``__getstate__`` front (deepcopy, pickle and ``torch.save`` of the optimizer, which no hook reaches) that
    calls ``wait(optimizer)`` first and, if ``compact``, hands out :func:`compact_state_dict`'s copies, as
    ``state_dict()`` does; none for an object without a ``__dict__``."""
    if not isinstance(getattr(optimizer, "__dict__", None), dict):
        return []
    return [Front(optimizer, "__getstate__", _GetStateFront(weakref.ref(optimizer), wait, compact))]


class _GetStateFront:
    """:func:`copy_guard`'s front."""

    __slots__ = ("ref", "wait", "compact", "previous", "__weakref__")

    def __init__(self, ref: weakref.ref[Any], wait: Callable[[Any], None] | None, compact: bool) -> None:
        self.ref, self.wait, self.compact = ref, wait, compact

    def __call__(self) -> Any:
        optimizer = self.ref()
        if optimizer is None:  # (only the optimizer's own attribute lookup reaches it)
            return {}
        if self.wait is not None:
            self.wait(optimizer)
        state = behind(self, optimizer, "__getstate__")()
        if isinstance(state, dict) and state.get("__getstate__") is self:  # (a class that pickles its __dict__)
            state = {k: v for k, v in state.items() if k != "__getstate__"}
        if self.compact and isinstance(state, dict) and isinstance(state.get("state"), Mapping):
            live = state["state"]
            state = compact_state_dict(optimizer, state)
            if isinstance(live, defaultdict) and not isinstance(state["state"], defaultdict):
                state["state"] = defaultdict(live.default_factory, state["state"])  # (torch's: missing keys default)
        return state


class _ZeroGradFront:
    """``optimizer.zero_grad`` while grads are offloaded: clears them too (by the ``set_to_none`` the one behind it
    reads: ``model.zero_grad()`` cannot see them), then calls that one; its signature is that one's (Accelerate
    reads it)."""

    __slots__ = ("ref", "previous", "__weakref__")

    def __init__(self, ref: weakref.ref[Any]) -> None:
        self.ref = ref

    @property
    def __signature__(self) -> inspect.Signature:
        optimizer = self.ref()
        return inspect.Signature() if optimizer is None else inspect.signature(behind(self, optimizer, "zero_grad"))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        optimizer = self.ref()
        if optimizer is None:
            return None
        zero = behind(self, optimizer, "zero_grad")
        try:
            bound = inspect.signature(zero).bind(*args, **kwargs)
            bound.apply_defaults()
            set_to_none = bool(bound.arguments.get("set_to_none", True))
        except (TypeError, ValueError):  # (no signature to read, or arguments it refuses: it raises below)
            set_to_none = True
        with exclusive(optimizer):
            if record_of(optimizer) is not None:
                pending_of(optimizer).order_before_use(host=True)  # (an offload in flight still writes them)
        result = zero(*args, **kwargs)  # (before any is cleared: where it raises, a bad argument, they are kept)
        with exclusive(optimizer):
            record = record_of(optimizer)
            if record is not None:
                held = param_positions(optimizer)
                with torch.no_grad():
                    for key in [key for key in record.grads if key in held]:
                        if set_to_none:
                            del record.grads[key]
                        else:
                            record.grads[key][1].zero_()
        return result

    def __reduce__(self) -> tuple[Any, ...]:
        return (_class_zero_grad, (self.ref(),))


def _class_zero_grad(optimizer: Any) -> Any:
    """The class's own ``zero_grad``, bound to ``optimizer`` (what a copy of a front stands for)."""
    return type(optimizer).zero_grad.__get__(optimizer)


def _refuse_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    record = record_of(optimizer)
    if record is not None and record.moved_any:
        raise RuntimeError(
            f"{type(optimizer).__name__}.step() while its state is offloaded to the host: call "
            f"optimshift.reload(optimizer) first (nothing was stepped)"
        )


def compact_state_dict(optimizer: Any, state_dict: dict[str, Any]) -> dict[str, Any]:
    """The ``state_dict()`` post-hook of an offloaded or streamed optimizer: its views into pool buffers cloned, as
    ``torch.save`` writes a view's whole storage (other tensors' bytes). The live dicts are copied, never mutated."""
    # (an offload from another thread since the state_dict() pre-hook waited: its copies still write host
    # buffers the copies below read; after it, under its lock, they are waited for)
    with exclusive(optimizer):
        pending_of(optimizer).order_before_use(host=True)
        with torch.inference_mode(False):  # (copies made under the caller's inference mode: inference tensors)
            return _compact(state_dict)


def _compact(state_dict: dict[str, Any]) -> dict[str, Any]:
    compact: dict[int, torch.Tensor] = {}
    # (only views into pool buffers: tensors that share a storage of their own keep sharing it, see _alias)
    pooled = host_pool.in_use_storages()
    states = state_dict.get("state", {})
    groups = state_dict.get("param_groups", [])
    for walk in [leaves(value) for value in states.values()] + [group_tensors(g) for g in groups]:
        for _, t in walk:
            local = local_tensor(t)  # (a DTensor: its shard is what sits in a pool buffer; its clone clones that)
            storage = local.untyped_storage()
            if (
                id(t) not in compact
                and storage.nbytes() > local.numel() * local.element_size()
                and storage.data_ptr() in pooled
            ):
                compact[id(t)] = t.clone()
    if not compact:
        return state_dict
    return {
        **state_dict,
        # (state_dict()'s groups are new dicts, but their values are the live ones: containers are copied)
        "param_groups": [{k: v if k in GROUP_SKIP else _compacted(v, compact) for k, v in g.items()} for g in groups],
        "state": {
            key: {k: _compacted(v, compact) for k, v in value.items()}
            if isinstance(value, dict)
            else _compacted(value, compact)
            for key, value in states.items()
        },
    }


def _compacted(value: Any, compact: dict[int, torch.Tensor]) -> Any:
    """``value`` with the tensors in ``compact`` swapped for their copies, the containers holding one copied."""
    if isinstance(value, torch.Tensor):
        return compact.get(id(value), value)
    found = [t for _, t in leaves(value)]
    if not any(id(t) in compact for t in found):
        return value
    return copy.deepcopy(value, {id(t): compact.get(id(t), t) for t in found})


def end_pending(optimizer: Any) -> None:
    """Before an operation changes the state: retire the transfer in flight and remove the hooks guarding it."""
    session = _session.of(optimizer)
    if session is None:
        return
    pending = session.pending
    if pending is not None:
        pending.retire()  # (first: a Ctrl-C in its wait leaves it remembered and guarded)
    with _lock:
        session.pending = None
        handles, session.guards = session.guards, []
    for handle in handles:
        handle.remove()


def pending_of(optimizer: Any) -> PendingTransfer:
    """The transfer in flight on this optimizer (a done one when none is): what a read orders itself after."""
    session = _session.of(optimizer)
    pending = None if session is None else session.pending
    return pending or PendingTransfer()


def remember_pending(optimizer: Any, pending: PendingTransfer) -> None:
    """Keep a transfer in flight; the optimizer's ``step()``, ``state_dict()`` and ``load_state_dict()`` pre-hooks
    wait for it first. They stay until the next operation (``end_pending``): a hook cannot remove itself while
    torch iterates the hook dict."""
    if pending.done():
        return
    session = _session.get(optimizer)
    if session is None:  # an optimizer that cannot be weakly referenced: nothing can remember it, wait now
        pending.wait()
        return
    with _lock:
        session.pending = pending
        hooked = bool(session.guards)
    if hooked:
        return
    handles: list[Any] = []
    try:
        # (after the commit: hooks that fail to register are no error, the copies are waited for instead)
        with contextlib.suppress(Exception):
            if all(getattr(optimizer, name, None) is not None for name in _WAITING):  # (a torch.optim.Optimizer)
                handles = install_guards(
                    optimizer, dict.fromkeys(_WAITING, _wait_before_use), _wait_before_use, compact=False
                )
    finally:
        if not handles:  # unguarded: waited for now (a Ctrl-C, once it is)
            end_pending(optimizer)
            pending.wait()
    if handles:
        with _lock:
            session.guards = handles


_WAITING = ("register_step_pre_hook", "register_state_dict_pre_hook", "register_load_state_dict_pre_hook")


def _wait_before_use(optimizer: Any, *_: Any) -> None:
    """The pre-hook of ``step()``, ``state_dict()`` and ``load_state_dict()`` while a transfer is in flight."""
    pending_of(optimizer).order_before_use()


def forget(optimizer: Any, pending: PendingTransfer | None = None) -> None:
    """Drop the offload record and give its host buffers back to the pool, reused once ``pending``'s copies are
    done and nothing looks into them."""
    session = _session.of(optimizer)
    if session is None:
        return
    with _lock:
        record, session.record = session.record, None
    if record is None:
        return
    for handle in record.hooks:
        handle.remove()
    give_back(record.buffers, pending.event if pending is not None else None)


def give_back(buffers: Sequence[torch.Tensor], event: Any | None) -> None:
    """Return pool ``buffers`` to the pool, reused once ``event`` (copies still writing them) is done."""
    for buf in buffers:
        host_pool.release(buf, event)


def grads_back(optimizer: Any, record: Record | None) -> list[tuple[torch.Tensor, torch.Tensor, str]]:
    """(param, host grad, label) for each offloaded grad going back to its param, checked before any copy: it must
    match the param, and a grad set meanwhile is never overwritten."""
    if record is None:
        return []
    name = optimizer_name(optimizer)
    at = param_positions(optimizer)
    out = []
    for p, host_grad in record.grads.values():
        where = at.get(id(p))  # (None: a param taken out of the optimizer while offloaded still gets its grad)
        label = "a param no longer in the optimizer" if where is None else label_in(optimizer, *where)
        if p.grad is not None:
            raise ValueError(
                f"{name}: {label} got a new .grad while its offloaded grad was held; giving it back would "
                f"overwrite one of them. Set param.grad = None to keep the offloaded one, or del it first."
            )
        allowed = _grad_dtype(p)
        if host_grad.shape != p.shape or (allowed is not None and host_grad.dtype != allowed):
            raise ValueError(
                f"{name}: {label} is now {p.dtype}{tuple(p.shape)} (grads of "
                f"{'any dtype' if allowed is None else allowed}), its offloaded grad "
                f"{host_grad.dtype}{tuple(host_grad.shape)}: it cannot be given back. Give the param back its "
                f"shape and dtype (or a grad_dtype that allows the grad's), then reload"
            )
        out.append((p, host_grad, f"the offloaded .grad of {label}"))
    return out


def _grad_dtype(p: torch.Tensor) -> torch.dtype | None:
    """The dtype ``p.grad`` may have (torch's ``grad_dtype``: the param's own by default, None: any)."""
    try:
        allowed: torch.dtype | None = p.grad_dtype  # (torch >= 2.9; a leaf's only)
    except (AttributeError, RuntimeError):
        return p.dtype
    return allowed


def group_tensors_at(optimizer: Any) -> dict[Ident, torch.Tensor]:
    """Each tensor the param groups hold among their hyperparameters, by its site (a plan's ident)."""
    return {(gi, None, path): t for gi, group in enumerate(optimizer.param_groups) for path, t in group_tensors(group)}


def remember_sides(optimizer: Any, moves: Sequence[tuple[Ident, torch.device, torch.device]]) -> None:
    """Group tensors an operation took from an accelerator to the host (``moves``: site, from, to) remember where
    from (``policy.Placer.side``); one placed on an accelerator, or held by no group, forgets it."""
    session = _session.get(optimizer)
    if session is None or not (moves or session.group_sides):
        return
    sides, held = session.group_sides, group_tensors_at(optimizer)
    for ident, was, now in moves:
        t = held.get(ident)  # (the object the commit left there)
        if t is not None and now.type == "cpu" and was.type not in HOSTS:
            sides[id(t)] = (was, t)
        elif t is not None and now.type != "cpu":
            sides.pop(id(t), None)
    live = {id(t) for t in held.values()}
    for key in [key for key in sides if key not in live]:
        del sides[key]


def left_in_buffers(
    buffers: Sequence[torch.Tensor],
    transfers: Sequence[Transfer],
    extra: Sequence[tuple[torch.Tensor, torch.device, str]] = (),
) -> set[int]:
    """ids of the tensors of ``transfers`` and ``extra`` that stay on the host as views into ``buffers``, which the
    caller gives back: each is given a storage of its own (a view kept the buffer, and ``torch.save`` wrote it)."""
    if not buffers:
        return set()
    pooled = {storage_of(buf) for buf in buffers}
    # (every reload asks, over every transfer: a device compare each, their storages in one pass in C)
    host = [tr[2] for tr in transfers if tr[4] == HOST] + [t for t, target, _ in extra if target == HOST]
    keys: list[int | None]
    try:
        keys = list(map(storage_of, host))
    except Exception:  # (a DTensor, a tensor without a storage: asked one by one)
        keys = list(map(storage_key, host))
    return {id(t) for t, key in zip(host, keys) if key in pooled}


def give_grads_back(
    grads: Sequence[tuple[torch.Tensor, torch.Tensor, str]], copies: Mapping[int, torch.Tensor]
) -> None:
    """Each of :func:`grads_back`'s grads back on its param, the same object holding its copy (``copies``, by id)."""
    for p, host_grad, _ in grads:
        copy = copies.get(id(host_grad))
        p.grad = host_grad if copy is None else kept(host_grad, copy)


def prepare_discard(optimizer: Any) -> Callable[[], None]:
    """For a load replacing the state: copy offloaded grads back now (may raise, nothing changed); the returned
    function, once the new state is installed, gives them back and forgets the record."""
    end_pending(optimizer)
    record = record_of(optimizer)
    held = grads_back(optimizer, record)  # (refused as a reload refuses them, before anything changes)
    back: Mapping[int, torch.Tensor] = {}
    if record is not None:
        extra = [(host_grad, p.device, what) for p, host_grad, what in held]
        own = left_in_buffers(record.buffers, (), extra)
        what = f"{optimizer_name(optimizer)}: load_state_dict"
        back = _engine.run(Plan(optimizer, repeats=False), extra=extra, own=own, what=what).new

    def finish() -> None:
        give_grads_back(held, back)
        forget(optimizer)  # (none without a record)
        session = _session.of(optimizer)
        if session is not None:  # the loaded groups placed their own tensors
            session.group_sides.clear()

    return finish
