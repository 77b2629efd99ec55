"""Streamed optimizer state: it lives in host memory and is stepped on the device, one chunk of params at a time.

:func:`stream` keeps every state entry that belongs on an accelerator by the rule (Adam's ``exp_avg`` and
``exp_avg_sq``, a fused or capturable ``step``) in host memory: pinned on CUDA, from the host pool, laid out
chunk by chunk in one flat buffer per chunk. Entries that belong on the host (Adam's non-fused ``step``) stay
there as they would anyway; params and grads never move. Each ``optimizer.step()`` then runs the optimizer's
own step function (foreach, fused, capturable: as configured) over one chunk of params at a time, with that
chunk's state in a flat device window: while chunk *i* is stepped, chunk *i+1* is loaded on the device's copy
stream and chunk *i-1* is written back. Two windows per device are reused chunk after chunk; a chunk holding a
single param whose state is larger than ``chunk_bytes`` gets a window of its own, never next to another such
window. So the state on the device during a step is at most two chunks plus the largest such param's state.

Why a step over a chunk is the same step: every ``torch.optim`` class but LBFGS updates each param from its
own grad and state alone (:func:`optimshift.policy.separable`), so running it over a subset of a group's params,
with that group's hyperparameters and flags, computes exactly what the whole step computes for them, bitwise.
For each chunk the real group dict is shown to the step with ``params`` cut down to the chunk (and
``optimizer.param_groups`` cut down to that group); both are restored before anything else can look.

What the user sees does not change: the step pre/post hooks (global and per optimizer) fire once per user
step, around all chunks (the class's step is called undecorated, inside one hooked wrapper); a closure is
called once; LR schedulers, ``GradScaler`` (also its fused ``grad_scale``/``found_inf`` path), gradient
clipping and ``zero_grad`` see the real groups. Every state tensor stays the same Python object across chunks
and steps: it takes its device window's contents for its chunk and its host buffer's back afterwards
(:mod:`optimshift._adopt`). ``state_dict()`` returns compact host copies of the streamed tensors (no pool
bytes around them) and ``load_state_dict`` loads straight into host state (no device memory on resume).

The copies go through :mod:`optimshift._copystream` (copy on the copy stream, record an event, wait for one):
the loads wait for the previous occupant's write-back of their window (same copy stream, in order), a chunk's
compute waits for its load, its write-back waits for its compute. After ``step()`` returns, the last
write-backs may still be running on CUDA: ``state_dict()``, ``load_state_dict()``, every optimshift function,
:func:`unstream` and :meth:`Streamed.wait` wait for them; the next step orders its loads after them on the
device. So a streamed step adds no host sync.
"""

from __future__ import annotations

import contextlib
import logging
import time
import types
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar, cast

import torch

from . import _alias, _mode, engine
from . import policy as _policy
from ._adopt import Mechanism, adopt, decide_all
from ._copystream import CopyStream, copy_stream, pinned_for
from ._devices import DeviceLike, resolve
from ._offload import record_of, settle
from ._state import _ATOMS, leaves
from .api import move
from .checkpoint import load_state_dict as _load_state_dict
from .plan import Ident, check_optimizer, optimizer_name, policy_target
from .pool import host_pool

__all__ = ["stream", "unstream", "streamed", "is_streamed", "Streamed", "DEFAULT_CHUNK_BYTES"]

Opt = TypeVar("Opt", bound=torch.optim.Optimizer)

DEFAULT_CHUNK_BYTES = 64 << 20
"""64 MiB: one copy of this size runs at close to the link's bandwidth (PCIe or NVLink-C2C), and the first load
and last write-back that cannot overlap a compute cost about a millisecond each."""

# NOTE: every tensor starts at a multiple of 64 bytes in its chunk, on the host and in the window alike, so that
# a window view is as aligned as the vectorized multi-tensor kernels need (16 bytes x 4 lanes for complex128).
_ALIGN = 64
_HOST = torch.device("cpu")
_HOSTS = ("cpu", "meta")

_log = logging.getLogger("optimshift")

Group = dict[str, Any]
"""A param group (an entry of ``optimizer.param_groups``)."""
ParamState = dict[Any, Any]
"""One param's state (``optimizer.state[p]``), keyed as the optimizer keys it."""
_Item = tuple[Group, torch.Tensor, ParamState, list[tuple[Any, torch.Tensor]]]
"""A param to lay out: its group, the param, its state and the (key, tensor) entries of it to stream."""

# NOTE: policy_target never reads the ident (its rules depend on the param, group, key and tensor only).
_NO_IDENT = cast(Ident, ())


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class _Entry:
    """One streamed state tensor: where it sits (``state[key]``), its object, its place in the chunk."""

    __slots__ = ("state", "key", "obj", "host", "offset", "nbytes", "dtype", "shape", "stride")

    def __init__(self, state: ParamState, key: Any, obj: torch.Tensor, offset: int) -> None:
        self.state, self.key, self.obj, self.offset = state, key, obj, offset
        self.nbytes = _nbytes(obj)
        self.dtype, self.shape = obj.dtype, tuple(obj.shape)
        # Strides kept when the tensor is dense (as a fresh optimizer's zeros_like(p) of a permuted param is).
        self.stride = obj.stride() if obj.is_contiguous() else torch.empty_like(obj, device="meta").stride()
        self.host: torch.Tensor | None = None  # a view of the host buffer (what the object points at between steps)

    def view(self, flat: torch.Tensor) -> torch.Tensor:
        """This tensor's place in a flat uint8 buffer laid out like its chunk (the host buffer or a window)."""
        return _views(flat, [self])[0]


def _views(flat: torch.Tensor, entries: Sequence[_Entry]) -> list[torch.Tensor]:
    """Each entry's place in ``flat`` (a whole uint8 buffer, its size a multiple of 64): one ``as_strided``
    per tensor over a view of the buffer in the tensor's dtype."""
    typed: dict[torch.dtype, torch.Tensor] = {}
    out = []
    for e in entries:
        t = typed.get(e.dtype)
        if t is None:
            t = typed[e.dtype] = flat.view(e.dtype)
        out.append(t.as_strided(e.shape, e.stride, e.offset // t.element_size()))
    return out


class _Chunk:
    """Params of one group on one device whose streamed state shares one host buffer (and, in a step, one
    window). ``counts``: how many tensors each param's state held when laid out (a step that adds or drops one
    makes the chunk laid out again)."""

    __slots__ = ("group", "device", "params", "entries", "nbytes", "buffer", "counts", "oversized")

    def __init__(
        self,
        group: Group,
        device: torch.device,
        params: list[torch.Tensor],
        entries: list[_Entry],
        nbytes: int,
        buffer: torch.Tensor,
        counts: list[tuple[torch.Tensor, int]],
        oversized: bool,
    ) -> None:
        self.group, self.device, self.params, self.entries = group, device, params, entries
        self.nbytes, self.buffer, self.counts, self.oversized = nbytes, buffer, counts, oversized


def _raw_step(cls: type) -> Callable[..., Any]:
    """The class's step without torch's hook wrapper (``Optimizer._patch_step_function`` puts it on the class)."""
    fn = getattr(cls, "step")  # noqa: B009  (typed: a class, not an Optimizer)
    raw: Callable[..., Any] = fn.__wrapped__ if getattr(fn, "hooked", False) else fn
    return raw


_MISSING = object()


def _is_device(t: torch.Tensor) -> bool:
    return t.device.type not in _HOSTS


class Streamed:
    """What :func:`stream` returns: the streamed mode of one optimizer.

    ``chunk_bytes`` and ``device`` as given; :attr:`chunks` and :attr:`state_bytes` describe the host layout now;
    :meth:`wait` blocks until the last step's write-backs are in host memory (only needed to read a state
    tensor directly on CUDA; everything optimshift and torch do with the state waits by itself).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, chunk_bytes: int, device: torch.device | None) -> None:
        self._ref = weakref.ref(optimizer)
        self.chunk_bytes = chunk_bytes
        self.device = device
        self._raw = _raw_step(type(optimizer))
        self._chunk_of: dict[int, _Chunk] = {}  # id(param) -> its chunk
        self._chunks: dict[int, _Chunk] = {}  # id(chunk) -> chunk (in layout order)
        self._objects: dict[int, _Entry] = {}  # id(streamed tensor object) -> entry
        self._examined: set[int] = set()  # params whose state holds nothing to stream (host-only or none)
        self._pending: dict[torch.device, Any] = {}  # device -> event after its last queued write-back
        self._stale = False  # a load replaced the state and laying it out failed: retried at the next step
        self._saved: dict[str, Any] = {}
        self._installed: dict[str, Callable[..., Any]] = {}
        self._handles: list[Any] = []
        self._active = False

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        opt = self._ref()
        if opt is None:
            raise RuntimeError("optimshift: the streamed optimizer no longer exists")
        return opt

    @property
    def chunks(self) -> int:
        return len(self._chunks)

    @property
    def state_bytes(self) -> int:
        """Bytes of streamed state laid out in host memory (alignment included)."""
        return sum(c.nbytes for c in self._chunks.values())

    def __repr__(self) -> str:
        return (
            f"Streamed({type(self._ref()).__name__}, chunks={self.chunks}, state_bytes={self.state_bytes}, "
            f"chunk_bytes={self.chunk_bytes})"
        )

    # -- waiting (the _mode.Mode protocol) ----------------------------------------------------------------------

    def wait(self) -> None:
        """Block until every queued write-back of streamed state has reached host memory."""
        pending, self._pending = self._pending, {}
        for device, event in pending.items():
            copy_stream(device).host_wait(event)

    settle = wait

    def after_load(self) -> None:
        """A load put plain host tensors in the state: lay every param's state out again in pinned chunks."""
        old = list(self._chunks.values())
        self._forget(old)
        self._examined.clear()
        try:
            self._lay_out(self._members(None))
        except Exception as error:  # (an OOM pinning memory) the loaded state is valid; the next step retries
            self._stale = True
            _log.warning(
                "optimshift: laying out %s's loaded state in host buffers failed (%s: %s); the next step retries",
                optimizer_name(self.optimizer),
                type(error).__name__,
                error,
            )
        self._release(old)

    # -- layout --------------------------------------------------------------------------------------------------

    def _members(self, wanted: set[int] | None) -> list[tuple[Group, torch.Tensor]]:
        """(group, param) for every param (or those whose id is in ``wanted``), in group order."""
        return [(g, p) for g in self.optimizer.param_groups for p in g["params"] if wanted is None or id(p) in wanted]

    def _lay_out(self, members: Sequence[tuple[Group, torch.Tensor]], *, wait: bool = True) -> None:
        """Put the state of ``members`` where streaming keeps it: each tensor that belongs on an accelerator into
        a new chunk's host buffer (the object adopts its place there), each one that belongs on the host onto
        the host. All copies are made before any object changes; an error leaves the state as it was."""
        opt = self.optimizer
        name = optimizer_name(opt)
        target = policy_target(opt, None)
        buckets: dict[tuple[int, torch.device], list[_Item]] = {}
        host_moves: list[tuple[ParamState, Any, torch.Tensor]] = []
        for group, p in members:
            st = opt.state.get(p)
            if not st:
                self._examined.add(id(p))
                continue
            streamed: list[tuple[Any, torch.Tensor]] = []
            for key, value in st.items():
                if isinstance(value, torch.Tensor):
                    device = target(_NO_IDENT, p, group, key, value)[0]
                    if device.type in _HOSTS:
                        if value.device != device:
                            host_moves.append((st, key, value))
                    elif self.device is not None and device != self.device:
                        raise ValueError(
                            f"{name}: {_where(opt, p)}: state {key!r} belongs on {device}, but "
                            f"stream(device={self.device}) streams through {self.device} only"
                        )
                    elif type(value) is not torch.Tensor:
                        raise ValueError(
                            f"{name}: {_where(opt, p)}: state {key!r} is a {type(value).__name__}; "
                            f"streaming lays out plain tensors only (sharded DTensor state is not "
                            f"streamed). Keep this optimizer's state on the device (optimshift.move)."
                        )
                    else:
                        streamed.append((key, value))
                elif not isinstance(value, _ATOMS):
                    for _path, t in leaves(value):
                        if target(_NO_IDENT, p, group, key, t)[0].type not in _HOSTS:
                            raise ValueError(
                                f"{name}: {_where(opt, p)}: state {key!r} holds a tensor inside a "
                                f"{type(value).__name__} that belongs on {p.device}; streaming moves top-level state "
                                f"tensors only. Keep this optimizer's state on the device (optimshift.move)."
                            )
            if streamed:
                buckets.setdefault((id(group), p.device), []).append((group, p, st, streamed))
            else:
                self._examined.add(id(p))
        chunks: list[_Chunk] = []
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = []  # (host view, source)
        try:
            for items in buckets.values():
                for part in self._partition(items):
                    chunk, fills = self._new_chunk(part)
                    chunks.append(chunk)
                    pairs.extend(fills)
            moved = engine.copy_items([(t, _HOST) for _, _, t in host_moves]).copies if host_moves else []
            devices = self._fill(pairs)
        except BaseException:
            self._release(chunks)
            raise
        if wait:
            for device in devices:
                s = copy_stream(device)
                s.host_wait(s.record())
        else:
            for device in devices:
                self._pending[device] = copy_stream(device).record()
        # Every copy exists: now the objects take their new places (cannot fail).
        # (every entry of a new chunk has its host view: _new_chunk set it; copy_items copied every input)
        adoptions = [(e.obj, cast(torch.Tensor, e.host)) for c in chunks for e in c.entries]
        adoptions += [(t, cast(torch.Tensor, new)) for (_, _, t), new in zip(host_moves, moved)]
        replaced, apply = engine.adopt_all(adoptions)
        apply()
        instead = {id(old): new for old, new in replaced}
        for st, key, t in host_moves:
            if id(t) in instead:
                st[key] = instead[id(t)]
        for c in chunks:
            for e in c.entries:
                new = instead.get(id(e.obj))
                if new is not None:  # no mechanism keeps this object: its host view takes its place
                    e.state[e.key] = e.obj = new
            for e, host in zip(c.entries, _views(c.buffer, c.entries)):
                e.host = host  # (after a swap, the view made for the fill holds the old contents)
            self._chunks[id(c)] = c
            for p in c.params:
                self._chunk_of[id(p)] = c
                self._examined.discard(id(p))
            for e in c.entries:
                self._objects[id(e.obj)] = e

    def _partition(self, items: list[_Item]) -> Iterator[list[_Item]]:
        """Consecutive params of one group and device, cut where the next param's state would take the chunk
        past ``chunk_bytes`` (a param is never split: its step needs all its state)."""
        part: list[_Item] = []
        size = 0
        for item in items:
            n = sum(_aligned(_nbytes(t)) for _, t in item[3])
            if part and size + n > self.chunk_bytes:
                yield part
                part, size = [], 0
            part.append(item)
            size += n
        if part:
            yield part

    def _new_chunk(self, part: list[_Item]) -> tuple[_Chunk, list[tuple[torch.Tensor, torch.Tensor]]]:
        group, device = part[0][0], part[0][1].device
        entries: list[_Entry] = []
        offset = 0
        for _, _, st, streamed in part:
            for key, t in streamed:
                entries.append(_Entry(st, key, t, offset))
                offset += _aligned(entries[-1].nbytes)
        buffer = host_pool.acquire(max(offset, 1), pinned=pinned_for(device))
        counts = [(p, sum(isinstance(v, torch.Tensor) for v in st.values())) for _, p, st, _ in part]
        chunk = _Chunk(
            group,
            device,
            [p for _, p, _, _ in part],
            entries,
            offset,
            buffer,
            counts,
            oversized=len(part) == 1 and offset > self.chunk_bytes,
        )
        hosts = _views(buffer, entries)
        for e, host in zip(entries, hosts):
            e.host = host
        return chunk, [(host, e.obj) for e, host in zip(entries, hosts)]

    def _fill(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.device]:
        """Copy each source into its host view: host sources at once, device sources on their device's copy
        stream (after the work queued on the current stream, e.g. the step that made them). Returns the devices
        whose copy streams hold copies still to wait for."""
        by_device: dict[torch.device, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        for view, source in pairs:
            dsts, srcs = by_device.setdefault(source.device, ([], []))
            dsts.append(view)
            srcs.append(source.detach())
        devices = []
        for device, (dsts, srcs) in by_device.items():
            if device.type in _HOSTS:
                torch._foreach_copy_(dsts, srcs)
                continue
            s = copy_stream(device)
            s.after_current()
            s.copy_all(dsts, srcs)
            for t in srcs:
                s.keep(t)  # the source may be freed (adopted away) before the copy stream has read it
            devices.append(device)
        return devices

    def _forget(self, chunks: Sequence[_Chunk]) -> None:
        for c in chunks:
            self._chunks.pop(id(c), None)
            for p in c.params:
                if self._chunk_of.get(id(p)) is c:
                    del self._chunk_of[id(p)]
            for e in c.entries:
                if self._objects.get(id(e.obj), None) is e:
                    self._objects.pop(id(e.obj))

    def _release(self, chunks: Sequence[_Chunk]) -> None:
        """Give the chunks' host buffers back to the pool (reused only once nothing looks into them)."""
        for c in chunks:
            for e in c.entries:
                e.host = None
            host_pool.release(c.buffer)

    def _relay(self, chunks: Sequence[_Chunk], extra: Sequence[tuple[Group, torch.Tensor]] = ()) -> None:
        """Lay out again the params of ``chunks`` (their host state is complete) and ``extra``."""
        wanted = {id(p) for c in chunks for p in c.params} | {id(p) for _, p in extra}
        self._forget(chunks)
        try:
            self._lay_out(self._members(wanted))
        except BaseException:
            for c in chunks:  # nothing changed: the old layout stands
                self._chunks[id(c)] = c
                for p in c.params:
                    self._chunk_of[id(p)] = c
                for e in c.entries:
                    self._objects[id(e.obj)] = e
            raise
        self._release(chunks)

    # -- the step -----------------------------------------------------------------------------------------------

    def _step(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        opt = self.optimizer
        setattr(opt, "_opt_called", True)  # noqa: B010  # what an LR scheduler's step wrapper records (see _install)
        closure = args[0] if args else kwargs.pop("closure", None)
        rest = (None,) + tuple(args[1:]) if len(args) > 1 else ()
        loss = None
        if closure is not None:
            with torch.enable_grad():  # as torch.optim's steps call it: once, before any update
                loss = closure()
        if self._stale:
            self.after_load()
            if self._stale:
                raise RuntimeError(
                    f"{optimizer_name(opt)}: its loaded state could not be laid out in host "
                    f"buffers (see the warning above); nothing was stepped"
                )
        active, plain = self._schedule(opt)
        out = None
        try:
            for group, params in plain:
                out = self._plain(group, params, rest, kwargs)
            if active:
                out = self._pipeline(active, rest, kwargs)
        except BaseException:
            self.wait()  # copies queued so far complete; the state is consistent with what was stepped
            raise
        return loss if closure is not None else out

    def _schedule(self, opt: Any) -> tuple[list[_Chunk], list[tuple[Group, list[torch.Tensor]]]]:
        """The chunks to stream this step (those with a param that has a grad, in group order) and, per group,
        the params with grads and no chunk (stepped in place; state they create is laid out afterwards)."""
        active: list[_Chunk] = []
        seen: set[int] = set()
        plain: list[tuple[Group, list[torch.Tensor]]] = []
        moved: list[_Chunk] = []
        unlaid: list[tuple[Group, torch.Tensor]] = []
        chunk_of, examined, state = self._chunk_of, self._examined, opt.state
        for group in opt.param_groups:
            rest: list[torch.Tensor] = []
            for p in group["params"]:
                c = chunk_of.get(id(p))
                if c is None:
                    if p.grad is not None:
                        if id(p) not in examined and state.get(p):
                            unlaid.append((group, p))  # state set from outside (a manual edit): place it first
                        rest.append(p)
                elif c.group is not group or p.device != c.device:
                    if id(c) not in seen:
                        seen.add(id(c))
                        moved.append(c)
                elif p.grad is not None and id(c) not in seen:
                    seen.add(id(c))
                    active.append(c)
            if rest:
                plain.append((group, rest))
        if moved or unlaid:
            # Params moved (model.to) or changed groups since their state was laid out: lay it out for where
            # they are now, then schedule again.
            self.wait()
            self._relay(moved, unlaid)
            return self._schedule(opt)
        return active, plain

    def _compute(self, group: Group, params: list[torch.Tensor], rest: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The optimizer's own step over ``params`` (a part of ``group``), with the real group dict."""
        opt = self.optimizer
        groups, everyone = opt.param_groups, group["params"]
        group["params"] = params
        opt.param_groups = [group]
        try:
            return self._raw(opt, *rest, **kwargs)
        finally:
            group["params"] = everyone
            opt.param_groups = groups

    def _plain(self, group: Group, params: list[torch.Tensor], rest: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Params without streamed state: stepped where their state is (on the host, or none yet). The first
        step creates their state on the device, so they go in parts of about ``chunk_bytes`` of new state (two
        param-sized moments assumed), each laid out in host buffers before the next part is stepped."""
        opt = self.optimizer
        out = None
        part: list[torch.Tensor] = []
        size = 0
        for p in params + [None]:
            n = 2 * _nbytes(p) if p is not None else 0
            if p is None or (part and size + n > self.chunk_bytes):
                if part:
                    out = self._compute(group, part, rest, kwargs)
                    made = []
                    for q in part:
                        if any(isinstance(v, torch.Tensor) and _is_device(v) for v in opt.state.get(q, {}).values()):
                            made.append((group, q))
                        else:
                            self._examined.add(id(q))
                    if made:
                        self._lay_out(made, wait=False)
                part, size = [], 0
            if p is not None:
                part.append(p)
                size += n
        return out

    def _pipeline(self, chunks: list[_Chunk], rest: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        n = len(chunks)
        capacity: dict[torch.device, int] = {}
        for c in chunks:
            if not c.oversized:
                capacity[c.device] = max(capacity.get(c.device, 0), c.nbytes)
        rings: dict[torch.device, list[torch.Tensor | None]] = {}
        turn: dict[torch.device, int] = {}
        windows: list[Any] = [None] * n
        loaded: list[Any] = [None] * n

        def load(k: int) -> None:
            c = chunks[k]
            s = copy_stream(c.device)
            if c.oversized:  # a window of its own, freed after its write-back
                window = torch.empty(c.nbytes, dtype=torch.uint8, device=c.device)
                fresh = True
            else:  # two windows per device, taken in turn: a window's previous chunk was written back before
                # (the same copy stream runs its copies in order)
                ring = rings.setdefault(c.device, [None, None])
                i = turn.get(c.device, 0)
                turn[c.device] = 1 - i
                found = ring[i]
                fresh = found is None
                if found is None:
                    found = ring[i] = torch.empty(capacity[c.device], dtype=torch.uint8, device=c.device)
                window = found
            if fresh:
                # NOTE: memory just allocated on the current stream may still be in use by work queued there
                # (the caching allocator reuses a block in stream order): the copy stream waits for it first.
                s.after_current()
                s.keep(window)
            s.copy(window[: c.nbytes], c.buffer[: c.nbytes])
            windows[k], loaded[k] = window, s.record()

        out = None
        used: set[torch.device] = set()
        try:
            load(0)
            for k, c in enumerate(chunks):
                used.add(c.device)
                ahead = k + 1 < n and not (c.oversized and chunks[k + 1].oversized)
                if ahead:
                    load(k + 1)
                s = copy_stream(c.device)
                s.current_waits(loaded[k])
                out = self._chunk_step(c, windows[k], s, rest, kwargs)
                windows[k] = None
                if k + 1 < n and not ahead:
                    load(k + 1)  # two oversized chunks in a row: never on the device together
        finally:
            for device in used:
                self._pending[device] = copy_stream(device).record()
        return out

    def _chunk_step(
        self, c: _Chunk, window: torch.Tensor, s: CopyStream, rest: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """Step one chunk with its state in ``window``, then queue its write-back."""
        entries = c.entries
        views = _views(window, entries)
        hows = decide_all([(e.obj, v) for e, v in zip(entries, views)])
        for e, v, how in zip(entries, views, hows):
            if how == "data":
                e.obj.data = v
            elif how == "swap":
                adopt(e.obj, v, "swap")
            else:  # only on a Python backend for a weakly referenced tensor: the view stands in for the step
                e.state[e.key] = v
        changed = False
        try:
            out = self._compute(c.group, c.params, rest, kwargs)
            changed = self._changed(c, views, hows)
        finally:
            for e, v, how in zip(entries, views, hows):
                if how == "data":
                    e.obj.data = cast(torch.Tensor, e.host)  # (a laid-out entry has its host view)
                elif how == "swap":
                    adopt(e.obj, v, "swap")
                elif e.state.get(e.key) is v:
                    e.state[e.key] = e.obj
            s.after_current()
            s.copy(c.buffer[: c.nbytes], window[: c.nbytes])
        if changed:
            # The step added, dropped or replaced a state tensor of this chunk: lay its params out again.
            s.host_wait(s.record())
            self._relay([c])
        return out

    def _changed(self, c: _Chunk, views: list[torch.Tensor], hows: list[Mechanism]) -> bool:
        state = self.optimizer.state
        for p, count in c.counts:
            st = state.get(p)
            if st is None or sum(isinstance(v, torch.Tensor) for v in st.values()) != count:
                return True
        for e, v, how in zip(c.entries, views, hows):
            if e.state.get(e.key) is not (v if how == "replace" else e.obj):
                return True
        return False

    # -- entering and leaving ----------------------------------------------------------------------------------

    def _install(self, opt: Any) -> None:
        streamed = self
        raw = self._raw

        def step(self_: Any, *args: Any, **kwargs: Any) -> Any:
            if not streamed._active:  # unstreamed, yet still called through a wrapper made meanwhile
                return raw(self_, *args, **kwargs)
            return streamed._step(args, kwargs)

        hooked = torch.optim.Optimizer.profile_hook_step(step)  # torch's wrapper: the step hooks fire once
        # NOTE: an LR scheduler wraps optimizer.step to record that it ran (_opt_called), unless the step says
        # it is wrapped already. Ours records it itself, and so is never wrapped: unstream() can restore
        # exactly what was there before.
        hooked._wrapped_by_lr_sched = True  # type: ignore[attr-defined]

        def load(self_: Any, state_dict: Any) -> None:
            _load_state_dict(self_, state_dict, flags="checkpoint", cast="param")  # torch's choices, into host state

        self._installed = {"step": hooked, "load_state_dict": load}
        for attr, fn in self._installed.items():
            self._saved[attr] = opt.__dict__.get(attr, _MISSING)
            setattr(opt, attr, types.MethodType(fn, opt))
        self._handles = [
            opt.register_state_dict_pre_hook(lambda _opt: self.wait()),
            opt.register_state_dict_post_hook(self._compact),
        ]
        self._active = True
        _mode.enter(opt, self)

    def _uninstall(self, opt: Any) -> None:
        self._active = False
        for handle in self._handles:
            handle.remove()
        self._handles = []
        for attr, previous in self._saved.items():
            current = opt.__dict__.get(attr)
            if getattr(current, "__func__", None) is self._installed[attr]:
                if previous is _MISSING:
                    del opt.__dict__[attr]
                else:
                    opt.__dict__[attr] = previous
            # else: replaced by someone since; our step then falls through to the plain step (see _install)

    def _compact(self, opt: Any, sd: dict[str, Any]) -> dict[str, Any]:
        """state_dict() post-hook: each streamed tensor as a compact host copy (not a view into a pool buffer,
        which torch.save would write whole), in new per-param dicts (the live ones stay as they are)."""
        objects = self._objects
        state = {}
        for k, st in sd["state"].items():
            if isinstance(st, dict) and any(isinstance(v, torch.Tensor) and id(v) in objects for v in st.values()):
                st = {
                    kk: vv.clone() if isinstance(vv, torch.Tensor) and id(vv) in objects else vv
                    for kk, vv in st.items()
                }
            state[k] = st
        sd["state"] = state
        return sd


def _where(opt: Any, p: torch.Tensor) -> str:
    for gi, group in enumerate(opt.param_groups):
        for pi, q in enumerate(group["params"]):
            if q is p:
                names = group.get("param_names")
                label = f"group {gi}, param {pi}"
                return f"{label} ({names[pi]})" if names and pi < len(names) else label
    return "a param in no group"


def _check(optimizer: Any, chunk_bytes: Any, device: DeviceLike | None) -> torch.device | None:
    """Every reason not to stream ``optimizer``, raised before anything changes."""
    check_optimizer(optimizer)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"stream: {type(optimizer).__name__} is not a torch.optim.Optimizer; pass the optimizer it "
            f"wraps (e.g. its .optimizer)"
        )
    name = optimizer_name(optimizer)
    if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes <= 0:
        raise ValueError(
            f"{name}: stream: chunk_bytes must be a positive int (bytes of state per chunk), got {chunk_bytes!r}"
        )
    ok, why = _policy.separable(type(optimizer))
    if not ok:
        cls = type(optimizer).__name__
        reasons = {
            "not separable": f"{cls}'s step is not a per-param update (it flattens every grad into one vector, keeps "
            f"its history over all params and runs one line search over all of them), so it cannot "
            f"be stepped a chunk at a time. Keep its state on the device, or offload() it between "
            f"steps.",
            "overrides step": f"{cls} overrides step(): optimshift cannot tell whether it updates each param from "
            f"that param's grad and state alone, which stepping a chunk at a time needs. If it "
            f"does, declare it: optimshift.register_policy({cls}, lambda *a: None, separable=True).",
            "registered": f"the policy registered for {cls} does not declare it separable; if its step updates each "
            f"param from that param's grad and state alone, register it with separable=True.",
            "unknown": f"{cls} is not a torch.optim optimizer, and nothing says its step updates each param from "
            f"that param's grad and state alone, which stepping a chunk at a time needs. If it does, "
            f"declare it: optimshift.register_policy({cls}, lambda *a: None, separable=True).",
        }
        raise ValueError(f"{name}: stream: {reasons[why]}")
    if _mode.mode_of(optimizer) is not None:
        raise ValueError(
            f"{name}: stream: already streamed; optimshift.unstream(optimizer) first to change chunk_bytes or device"
        )
    if record_of(optimizer) is not None:
        raise ValueError(f"{name}: stream: its state is offloaded; optimshift.reload(optimizer) first")
    if "param_groups" not in optimizer.__dict__:
        raise TypeError(
            f"{name}: stream: param_groups is not a plain attribute of this optimizer; it cannot be cut down to a chunk"
        )
    params = [(gi, pi, p) for gi, g in enumerate(optimizer.param_groups) for pi, p in enumerate(g["params"])]
    target = None
    if device is not None:
        target = resolve(device, what="device", tensors=[p for _, _, p in params])
        if target.type in _HOSTS:
            raise ValueError(f"{name}: stream: device must be an accelerator (state streams through it), got {target}")
        for gi, pi, p in params:
            if p.device.type not in _HOSTS and p.device != target:
                raise ValueError(
                    f"{name}: stream(device={target}): group {gi}, param {pi} is on {p.device}; its "
                    f"state would have to stream through {p.device}. Pass device=None to stream each "
                    f"param's state through its own device."
                )
    if not any(p.device.type not in _HOSTS for _, _, p in params):
        raise ValueError(
            f"{name}: stream: no param is on an accelerator, so there is nothing to stream through; "
            f"move the model first (model.to(device))"
        )
    for gi, pi, p in params:
        if p.device.type == "meta":
            raise ValueError(f"{name}: stream: group {gi}, param {pi} is on the meta device (no values)")
    seen: dict[int, str] = {}
    for gi, pi, p in params:
        for key, value in optimizer.state.get(p, {}).items():
            if isinstance(value, torch.Tensor):
                where = f"group {gi}, param {pi}, state {key!r}"
                if id(value) in seen:
                    raise ValueError(
                        f"{name}: stream: one tensor is shared by {seen[id(value)]} and {where}; "
                        f"streaming gives each entry its own place"
                    )
                seen[id(value)] = where
    entries = [
        (f"group {gi}, param {pi}, state {key!r}", value)
        for gi, pi, p in params
        for key, value in optimizer.state.get(p, {}).items()
        if isinstance(value, torch.Tensor)
    ]
    groups = _alias.shared([value for _, value in entries])
    if groups:  # (a flat buffer and views of it: each entry would get its own place, and stop sharing)
        a, b = groups[0][:2]
        raise ValueError(
            f"{name}: stream: {entries[a][0]} and {entries[b][0]} share one storage; streaming gives each entry "
            f"its own place, so an update through one would no longer show through the other"
        )
    return target


def stream(optimizer: Any, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES, device: DeviceLike | None = None) -> Streamed:
    """Keep the optimizer's state in host memory and stream it through the device at every ``step()``.

    Every state entry that belongs on an accelerator moves to host memory (pinned on CUDA, from the host pool),
    laid out in chunks of about ``chunk_bytes`` (consecutive params of one group; a param whose state is larger
    gets a chunk of its own). Each ``step()`` loads a chunk's state to the param's device, runs the optimizer's
    own step over that chunk's params while the next chunk loads and the previous one is written back, so the
    device holds at most two chunks of state at once (plus one larger param's). The result is bitwise the step
    with all state on the device. Hooks, closures, LR schedulers, ``GradScaler``, clipping, ``state_dict()``
    and ``load_state_dict`` work unchanged; tensor objects are kept.

    ``device``: the accelerator to stream through (every param on an accelerator must be on it); ``None``: each
    param's own device. Every ``torch.optim`` class but LBFGS can be streamed; a third-party class when
    :func:`optimshift.register_policy` declares it ``separable``. Refused (with the reason) before anything
    changes: another class, an offloaded or already streamed optimizer, no param on an accelerator.
    Returns a :class:`Streamed` handle; :func:`unstream` ends it.
    """
    target = _check(optimizer, chunk_bytes, device)
    settle(optimizer)
    start = time.perf_counter()
    mode = Streamed(optimizer, chunk_bytes, target)
    with engine.no_gc():
        mode._lay_out(mode._members(None))
    mode._install(optimizer)
    if _log.isEnabledFor(logging.DEBUG):
        _log.debug(
            "stream %s: %d chunks, %d bytes of state in host memory, in %.2f ms",
            optimizer_name(optimizer),
            mode.chunks,
            mode.state_bytes,
            (time.perf_counter() - start) * 1e3,
        )
    return mode


def _mode_of(optimizer: Any) -> Streamed | None:
    mode = _mode.mode_of(optimizer)
    return mode if isinstance(mode, Streamed) else None


def is_streamed(optimizer: Any) -> bool:
    """Whether :func:`stream` put this optimizer in streamed mode (and :func:`unstream` did not end it)."""
    return _mode_of(optimizer) is not None


def unstream(optimizer: Opt) -> Opt:
    """End streamed mode: every state entry goes where a fresh optimizer over the params, where they are now,
    keeps it (same objects, values bitwise), ``step``/``load_state_dict`` are the optimizer's own again and the
    host buffers go back to the pool. All or nothing; a no-op for an optimizer that is not streamed."""
    mode = _mode_of(optimizer)
    if mode is None:
        return optimizer
    mode.wait()
    _mode.leave(optimizer)
    try:
        move(optimizer)
    except BaseException:
        _mode.enter(optimizer, mode)
        raise
    mode._uninstall(optimizer)
    chunks = list(mode._chunks.values())
    mode._forget(chunks)
    mode._release(chunks)
    return optimizer


@contextlib.contextmanager
def streamed(
    optimizer: Any, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES, device: DeviceLike | None = None
) -> Iterator[Streamed]:
    """:func:`stream` on enter, :func:`unstream` on exit (also when the body raises); yields the
    :class:`Streamed` handle. A no-op if it is already streamed (then its handle is yielded)."""
    mode = _mode_of(optimizer)
    already = mode is not None
    if mode is None:
        mode = stream(optimizer, chunk_bytes=chunk_bytes, device=device)
    try:
        yield mode
    finally:
        if not already:
            unstream(optimizer)
