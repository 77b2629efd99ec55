"""Streamed optimizer state: it lives in host memory and is stepped on the device, one chunk of params at a time.

Entries that belong on an accelerator by the rule live in host chunks (:mod:`optimshift._chunks`); the others stay
where they are. Each step loads a chunk into one of two device windows per device (a param larger than
``chunk_bytes``: a window of its own), runs the class's own step over the chunk's params with the real group dict,
``params`` cut down to the chunk (bitwise the whole step for a separable class: :func:`optimshift.policy.separable`),
and writes the chunk back, each copy on the device's own side stream, after what it depends on. Hooks, closures,
schedulers and tensor objects are unchanged (:func:`optimshift._engine.lend`). The last write-backs may still run
once ``step()`` returns: whatever reads the state's values (``state_dict()``, a load, :func:`unstream`,
:meth:`Streamed.wait`) waits for them, so a step adds no host sync.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Any, TypeVar, cast

import torch
from torch.optim import optimizer as _torch_optimizer

from . import _addresses, _device_streams, _engine, _mode, _offload, _session
from . import _chunks as layout
from . import policy as _policy
from ._chunks import Chunk, Group, Item, ParamState
from ._copy import Options, Side
from ._devices import HOSTS, DeviceLike, resolve
from ._dtensor import tensor_bytes
from ._errors import add_note, with_article
from ._offload import end_pending, exclusive, install_guards, record_of
from ._plan import Transfer, build_plan, check_optimizer, optimizer_name, policy_target, states_by_id
from ._state import label_in, param_positions, unwrap
from .api import _last_out_ends, _move_ending, _refuse_from_meta, _warn_unreached, _warned
from .checkpoint import load_state_dict as _load_state_dict
from .syncs import async_copies

__all__ = ["stream", "unstream", "streamed", "is_streamed", "Streamed", "DEFAULT_CHUNK_BYTES"]

Opt = TypeVar("Opt", bound=torch.optim.Optimizer)

DEFAULT_CHUNK_BYTES = 64 << 20
"""64 MiB: one copy of this size runs at close to the link's bandwidth (PCIe or NVLink-C2C), and the first load
and last write-back that cannot overlap a compute cost about a millisecond each."""


_log = logging.getLogger("optimshift")

# The layout's copies, on the streamed step's own lane (its loads come after them in order)
_LAYOUT = Options(non_blocking=True, lane="stream")


def _lane(device: torch.device) -> Side | None:
    """The streamed step's own side stream on ``device`` (never behind an engine transfer), as a
    :class:`optimshift._copy.Side`; None: no streams, each copy completes at once."""
    streams = _device_streams.of(device)
    return None if streams is None else Side(streams, streams.side(device, "stream"), streams.current(device))


def _queue(side: Side | None, dst: torch.Tensor, src: torch.Tensor, *, wait: bool = True) -> None:
    """Copy ``src`` into ``dst`` on ``side`` (``wait``: after the current stream's work so far: the compute that
    wrote the source, a window's allocation); a device-to-host copy counts as one of ``async_copies``."""
    to_host = dst.device.type == "cpu" and src.device.type != "cpu"
    on = contextlib.nullcontext() if side is None else side.issue() if wait else side.streams.use(side.stream)
    with on, async_copies(to_host):
        dst.copy_(src, non_blocking=side is not None)


class Streamed:
    """What :func:`stream` returns: the streamed mode of one optimizer (``chunk_bytes`` and ``device`` as given;
    :attr:`chunks` and :attr:`state_bytes`: the host layout now; :meth:`wait`: the last step's write-backs, only
    before reading a state tensor directly, as every read by optimshift or torch waits by itself)."""

    def __init__(self, optimizer: torch.optim.Optimizer, chunk_bytes: int, device: torch.device | None) -> None:
        self._ref = weakref.ref(optimizer)
        self.chunk_bytes = chunk_bytes
        self.device = device
        self._raw = _policy.step_of(type(optimizer))  # (we fire the step hooks: see _install)
        self._chunk_of: dict[int, Chunk] = {}  # id(param) -> its chunk
        self._chunks: dict[int, Chunk] = {}  # id(chunk) -> chunk (in layout order)
        # params whose state holds nothing to stream (host-only or none): id(param) -> the device it was on then
        self._examined: dict[int, torch.device] = {}
        self._pending: dict[torch.device, Any] = {}  # device -> event after its last queued write-back
        self._stale = False  # a load replaced the state and laying it out failed: retried at the next step
        self._unwritten: dict[int, Chunk] = {}  # id(chunk) -> it, its write-back failed: its state still in a window
        self._handles: list[Any] = []
        self.blocks = 0  # streamed() blocks (any thread) inside the stream() one of them made: the last out unstreams
        self._active = False
        self._stepping = threading.local()  # (.on: this thread is inside the streamed step: see _refuse_bypass)

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

    def wait(self) -> None:
        """Block until every queued write-back of streamed state has reached host memory."""
        pending = dict(self._pending)
        for event in pending.values():
            event.synchronize()
        for device, event in pending.items():  # (forgotten once waited for: another thread's wait() meanwhile
            if self._pending.get(device) is event:  # found them still pending, and waited too)
                del self._pending[device]

    def settle(self, *_: Any) -> None:
        """:meth:`wait`, then lay out again a chunk whose write-back failed (its state still in views of a device
        window): what reads the state's values (``state_dict()``, a copy, :func:`unstream`) must find first."""
        self.wait()
        if self._unwritten:
            # (an operation: a Ctrl-C the layout's commit holds is raised once the relay kept it, not as a failure)
            with exclusive(self.optimizer), _engine.operation():
                self._relay(list(self._unwritten.values()))
            self.wait()

    def after_load(self) -> None:
        """A load put plain host tensors in the state: lay every param's state out again in pinned chunks."""
        old = list(self._chunks.values())
        self._forget(old)
        self._examined.clear()
        try:
            self._lay_out(self._members(None))
            self._stale = False  # (laid out: a step that retried after a failed layout steps now)
        except Exception as error:  # (an OOM pinning memory) the loaded state is valid; the next step retries
            self._stale = True
            _log.warning(
                "optimshift: laying out %s's loaded state in host buffers failed (%s: %s); the next step retries",
                optimizer_name(self.optimizer),
                type(error).__name__,
                error,
            )
        layout.release(old)

    def _members(self, wanted: set[int] | None) -> list[tuple[Group, torch.Tensor]]:
        """(group, param) for every param (or those whose id is in ``wanted``), in group order."""
        return [(g, p) for g in self.optimizer.param_groups for p in g["params"] if wanted is None or id(p) in wanted]

    def _lay_out(self, members: Sequence[tuple[Group, torch.Tensor]], *, wait: bool = True) -> None:
        """Put the state of ``members`` where streaming keeps it, on the one road (plan, ``engine.run(into=)`` the
        new chunks' host views, ``engine.commit``: all or nothing). ``wait``: the host waits for the copies here
        (else the next step's loads, on the same lane, come after them)."""
        opt = self.optimizer
        state = opt.state
        # (an entry that is no dict, a tensor, is refused by the plan, naming it: its truth is not asked here)
        held = {p: state[p] for _, p in members if state.get(p) is not None}
        plan = build_plan(opt, policy_target(opt, None), state=held)
        group_moves = plan.group_moves()  # (before the commit)
        kept: list[Transfer] = []  # bound for the host, and group tensors (the engine copies those not there)
        by_param: dict[int, list[Transfer]] = {}  # id(param) -> its entries that belong on an accelerator
        buckets: dict[tuple[int, torch.device], list[Item]] = {}
        for tr in plan.transfers:
            gi, pi, _ = tr[0]
            if pi is None or tr[4].type in HOSTS:  # (a group's tensors go where the plan places them, as a move's)
                kept.append(tr)
                continue
            p = cast(torch.Tensor, tr[3])
            self._refuse(tr, state[p])
            if id(p) not in by_param:
                group = opt.param_groups[gi]
                buckets.setdefault((id(group), p.device), []).append((group, p, state[p], []))
            by_param.setdefault(id(p), []).append(tr)
        for item in (item for items in buckets.values() for item in items):
            item[3].extend((tr[0][2][0][1], tr[2]) for tr in by_param[id(item[1])])
        self._examined.update((id(p), p.device) for _, p in members if id(p) not in by_param)
        chunks: list[Chunk] = []
        copies = None
        try:
            # (each streamed entry is copied into its host view: its place, whatever its target says)
            transfers, into = list(kept), cast("list[torch.Tensor | None]", [None] * len(kept))
            for items in buckets.values():
                for part in layout.partition(items, self.chunk_bytes, layout.item_bytes):
                    chunks.append(chunk := layout.new_chunk(part, self.chunk_bytes))
                    for p in chunk.params:
                        transfers.extend(by_param[id(p)])
                    into.extend(e.host for e in chunk.entries)
            with async_copies(not wait):  # (the host does not wait for them here)
                copies = _engine.run(replace(plan, transfers=transfers), _LAYOUT, into=into)
            if wait and copies.event is not None:
                copies.event.synchronize()
            with _engine.operation():  # (an interrupt the commit holds waits for the chunks to be recorded too)
                hows = _engine.commit(opt, copies)
                instead = {id(old): new for (old, new), how in zip(copies.pairs, hows) if how == "replace"}
                for c in chunks:
                    for e, host in zip(c.entries, layout.views(c.buffer, c.entries)):
                        e.obj = instead.get(id(e.obj), e.obj)  # (no mechanism kept it: its host view took its place)
                        e.host = host  # (after a swap, the view made for the copy holds the old contents)
                self._keep(chunks)
                chunks = []  # (kept: an interrupt the commit held, raised on the way out, gives none back)
                if copies.event is not None and not wait:  # (the next step's loads wait for them)
                    self._pending[cast(torch.device, copies.device)] = copies.event
        except BaseException as error:
            if chunks and copies is not None and copies.event is not None:
                copies.event.synchronize()  # (copies still queued write the chunks' buffers: done before reuse)
            layout.release(chunks)
            if isinstance(error, NotImplementedError):  # (an entry on meta: no values; named as a move names it)
                _refuse_from_meta(opt, plan, (), "stream")
            raise
        _offload.remember_sides(opt, group_moves)  # (where a group tensor taken to the host came from, as a move)

    def _refuse(self, tr: Transfer, st: ParamState) -> None:
        """Raises, before anything changes, why an entry that belongs on an accelerator cannot be streamed."""
        key, value = tr[0][2][0][1], tr[2]
        keep = "Keep this optimizer's state on the device (optimshift.move)."
        if self.device is not None and tr[4] != self.device:
            why = f"belongs on {tr[4]}, but stream(device={self.device}) streams through {self.device} only"
        elif len(tr[0][2]) > 1:
            why = (
                f"holds a tensor inside a {type(st[key]).__name__} that belongs on {tr[4]}; streaming moves "
                f"top-level state tensors only. {keep}"
            )
        elif type(value) is not torch.Tensor:
            why = (
                f"is {with_article(type(value).__name__)}; streaming lays out plain tensors only (sharded DTensor "
                f"state is not streamed). {keep}"
            )
        else:
            return
        raise ValueError(f"{optimizer_name(self.optimizer)}: {tr.site.param_label}: state {key!r} {why}")

    def _keep(self, chunks: Sequence[Chunk]) -> None:
        for c in chunks:
            self._chunks[id(c)] = c
            for p in c.params:
                self._chunk_of[id(p)] = c
                self._examined.pop(id(p), None)

    def _forget(self, chunks: Sequence[Chunk]) -> None:
        for c in chunks:
            self._chunks.pop(id(c), None)
            self._unwritten.pop(id(c), None)
            for p in c.params:
                if self._chunk_of.get(id(p)) is c:
                    del self._chunk_of[id(p)]

    def _relay(self, chunks: Sequence[Chunk], extra: Sequence[tuple[Group, torch.Tensor]] = ()) -> None:
        """Lay out again the params of ``chunks`` (their host state is complete, or in its window where the
        write-back failed) and ``extra``."""
        wanted = {id(p) for c in chunks for p in c.params} | {id(p) for _, p in extra}
        unwritten = {id(c): c for c in chunks if id(c) in self._unwritten}
        self._forget(chunks)
        try:
            self._lay_out(self._members(wanted))
        except BaseException:
            self._keep(chunks)  # nothing changed: the old layout stands
            self._unwritten.update(unwritten)
            raise
        layout.release(chunks)

    def _step(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        opt = self.optimizer
        setattr(opt, "_opt_called", True)  # noqa: B010  # what an LR scheduler's step wrapper records (see _install)
        closure = args[0] if args else kwargs.pop("closure", None)
        rest = (None,) + tuple(args[1:]) if len(args) > 1 else ()
        loss = None
        if closure is not None:
            with torch.enable_grad():  # as torch.optim's steps call it: once, before any update
                loss = closure()
        # (a Ctrl-C is held until every chunk is written back: between a step and its write-back it lost the chunk's
        # moments; under the lock: another thread's unstream() or state_dict() would see the groups cut down)
        with exclusive(opt), _engine.operation(), _engine.uninterrupted():
            out = self._chunks_step(opt, rest, kwargs)
        return loss if closure is not None else out

    def _chunks_step(self, opt: Any, rest: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
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
        if opt._optimizer_step_post_hooks or getattr(_torch_optimizer, "_global_optimizer_post_hooks", None):
            self.wait()  # (torch runs the step's post-hooks next: they read the state the write-backs write)
        return out

    def _schedule(self, opt: Any) -> tuple[list[Chunk], list[tuple[Group, list[torch.Tensor]]]]:
        """The chunks to stream this step (those with a param that has a grad, in group order) and, per group,
        the params with grads and no chunk (stepped in place; state they create is laid out afterwards)."""
        found: dict[int, tuple[Chunk, set[int], bool]] = {}  # id(chunk) -> it, ids of its params in place, a grad
        misplaced: set[int] = set()
        plain: list[tuple[Group, list[torch.Tensor]]] = []
        unlaid: list[tuple[Group, torch.Tensor]] = []
        chunk_of, examined, state = self._chunk_of, self._examined, opt.state
        for group in opt.param_groups:
            rest: list[torch.Tensor] = []
            for p in group["params"]:
                c = chunk_of.get(id(p))
                if c is None:
                    if p.grad is not None:
                        if examined.get(id(p)) != p.device and state.get(p):
                            # (state set from outside, or a host param's once the param moved: placed first)
                            unlaid.append((group, p))
                        rest.append(p)
                    continue
                _, here, grad = found.get(id(c), (c, set(), False))
                if c.group is not group or p.device != c.device or state.get(p) is not c.laid[id(p)]:
                    # (or its state is another dict, set from outside: laid out before the step reads it)
                    misplaced.add(id(c))
                else:
                    here.add(id(p))
                found[id(c)] = (c, here, grad or p.grad is not None)
            if rest:
                plain.append((group, rest))
        # (a chunk is stepped whole: one with a param no longer where it was laid out is laid out again, as is one
        # whose write-back failed, from its window)
        misplaced.update(self._unwritten)
        moved = [c for c, here, _ in found.values() if id(c) in misplaced or len(here) != len(c.params)]
        if moved or unlaid:
            # (params moved, changed groups or got another state dict since: laid out for now, then scheduled again)
            self.wait()
            self._relay(moved, unlaid)
            return self._schedule(opt)
        return [c for c, _, grad in found.values() if grad], plain

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
        """Params without streamed state, stepped where it is (none yet: on the device) in parts of about
        ``chunk_bytes`` of new state (two moments a param), each laid out before the next part is stepped."""
        opt = self.optimizer
        out = None
        for part in layout.partition(params, self.chunk_bytes, lambda p: 2 * tensor_bytes(p)):
            out = self._compute(group, part, rest, kwargs)
            made = []
            for q in part:
                held = opt.state.get(q, {}).values()
                if any(isinstance(v, torch.Tensor) and v.device.type not in HOSTS for v in held):
                    made.append((group, q))
                else:
                    self._examined[id(q)] = q.device
            if made:
                try:
                    self._lay_out(made, wait=False)
                except BaseException as error:  # (refused after the class's own step made the state)
                    add_note(error, self._stepped_note(made))
                    raise
        return out

    def _stepped_note(self, made: Sequence[tuple[Group, torch.Tensor]]) -> str:
        """What a refusal to lay out the state a first step has just made must add (its message may say that
        nothing changed: true of the layout, not of the step): which params that step updated."""
        opt = self.optimizer
        at = param_positions(opt)
        labels = [label_in(opt, *at[id(p)]) for _, p in made if id(p) in at]
        shown = "; ".join(labels[:3]) + (f" and {len(labels) - 3} more" if len(labels) > 3 else "")
        return (
            f"optimshift: raised laying out the state {optimizer_name(opt)}.step() has just made for {shown}: "
            f"those params were stepped (updated), and their new state stays where the step made it, on the "
            f"device; the params after them were not stepped"
        )

    def _pipeline(self, chunks: list[Chunk], rest: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        n = len(chunks)
        capacity: dict[torch.device, int] = {}
        for c in chunks:
            if not c.oversized:
                capacity[c.device] = max(capacity.get(c.device, 0), c.nbytes)
        rings: dict[torch.device, list[torch.Tensor | None]] = {}
        turn: dict[torch.device, int] = {}
        windows: list[Any] = [None] * n
        loaded: list[Any] = [None] * n
        lanes: dict[torch.device, Side | None] = {}

        def load(k: int) -> None:
            c = chunks[k]
            if c.device not in lanes:
                lanes[c.device] = _lane(c.device)
            side = lanes[c.device]
            if c.oversized:  # a window of its own, freed after its write-back
                window = torch.empty(c.nbytes, dtype=torch.uint8, device=c.device)
                fresh = True
            else:  # two windows per device, taken in turn: a window's previous chunk was written back before
                # (the same lane runs its copies in order)
                ring = rings.setdefault(c.device, [None, None])
                i = turn.get(c.device, 0)
                turn[c.device] = 1 - i
                fresh = ring[i] is None
                if fresh:
                    ring[i] = torch.empty(capacity[c.device], dtype=torch.uint8, device=c.device)
                window = cast(torch.Tensor, ring[i])
            # NOTE: memory just allocated on the current stream may still be in use by work queued there (the
            # caching allocator reuses a block in stream order): the lane waits for it first.
            _queue(side, window[: c.nbytes], c.buffer[: c.nbytes], wait=fresh)
            if side is not None:
                if fresh:
                    side.uses(window)
                loaded[k] = side.streams.recorded(c.device, side.stream)
            windows[k] = window

        out = None
        try:
            load(0)
            for k, c in enumerate(chunks):
                ahead = k + 1 < n and not (c.oversized and chunks[k + 1].oversized)
                if ahead:
                    load(k + 1)
                side = lanes[c.device]
                if side is not None:
                    side.streams.wait_event(side.current, loaded[k])  # the compute waits for its load
                out = self._chunk_step(c, windows[k], side, rest, kwargs)
                windows[k] = None
                if k + 1 < n and not ahead:
                    load(k + 1)  # two oversized chunks in a row: never on the device together
        finally:
            for device, side in lanes.items():
                if side is not None:
                    self._pending[device] = side.streams.recorded(device, side.stream)
        return out

    def _chunk_step(
        self, c: Chunk, window: torch.Tensor, side: Side | None, rest: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """Step one chunk with its state in ``window``, then queue its write-back."""
        entries = c.entries
        # One adoption in, one back (the engine's): each object takes its window view (a view stands in where
        # no mechanism keeps the object: a Python backend's weakly referenced tensor), then its host view again.
        back = _engine.lend(
            [(e.obj, v) for e, v in zip(entries, layout.views(window, entries))],
            [cast(torch.Tensor, e.host) for e in entries],  # (a laid-out entry has its view)
            [(e.state, e.key) for e in entries],
        )
        try:
            out = self._compute(c.group, c.params, rest, kwargs)
        finally:
            try:
                _queue(side, c.buffer[: c.nbytes], window[: c.nbytes])  # the write-back, after the compute
            except BaseException:
                # (the stepped state is in the window only: its objects keep their window views, laid out again
                # from there before the chunk is next read, as a chunk whose state changed is)
                self._unwritten[id(c)] = c
                raise
            back()
        if self._changed(c):
            if side is not None:
                side.streams.recorded(c.device, side.stream).synchronize()
            self._relay([c])
        return out

    def _changed(self, c: Chunk) -> bool:
        """Whether the step added, dropped or replaced a state tensor of this chunk (asked once it is back), or
        the state of one of its params is another dict now (``opt.state.clear()``: the step built it anew)."""
        state = self.optimizer.state
        for p, laid, count in c.counts:
            st = state.get(p)
            if st is not laid or sum(isinstance(v, torch.Tensor) for v in st.values()) != count:
                return True
        return any(e.state.get(e.key) is not e.obj for e in c.entries)

    def _install(self, opt: Any) -> None:
        streamed = self

        def step(self_: Any, *args: Any, **kwargs: Any) -> Any:
            if not streamed._active:  # unstreamed, yet still called through a wrapper made meanwhile
                return streamed._raw(self_, *args, **kwargs)
            return streamed._step(args, kwargs)

        hooked = torch.optim.Optimizer.profile_hook_step(step)  # torch's wrapper: the step hooks fire once

        def run(*args: Any, **kwargs: Any) -> Any:
            streamed._stepping.on = True
            try:
                return hooked(streamed.optimizer, *args, **kwargs)
            finally:
                streamed._stepping.on = False

        # NOTE: a graph break under torch.compile; installed as a plain function (streamed_step), since compiling a
        # disabled function compiles the function it wraps (dynamo's innermost_fn).
        eager = torch.compiler.disable(run)  # type: ignore[no-untyped-call]

        # NOTE: plain functions finding the optimizer through the mode's weak reference: a bound method in its own
        # __dict__ would be a cycle, holding a dropped optimizer's host buffers until the collector ran.
        def streamed_step(*args: Any, **kwargs: Any) -> Any:
            return eager(*args, **kwargs)

        def streamed_load_state_dict(state_dict: Any) -> None:
            # torch's choices, into host state
            _load_state_dict(streamed.optimizer, state_dict, flags="checkpoint", cast="param")

        def streamed_state_dict() -> Any:
            optimizer = streamed.optimizer
            with exclusive(optimizer):  # (not while a streamed step in another thread has the groups cut down)
                streamed.settle()  # (before any pre-hook: a user's registered with prepend=True runs before ours)
                # (through its front, held weakly: a reference to itself would be a cycle)
                return _offload.behind(front.front(), optimizer, "state_dict")()

        # (an LR scheduler wraps a step not marked so to record _opt_called: ours records it itself, and stays
        # unwrapped, so that unstream() restores exactly what was there)
        streamed_step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
        # (each handle kept as it is installed: stream() removes those in place if the next fails)
        self._handles.append(_offload.Front(opt, "step", streamed_step))
        self._handles.append(_offload.Front(opt, "load_state_dict", streamed_load_state_dict))
        self._handles.append(front := _offload.Front(opt, "state_dict", streamed_state_dict))
        # (state_dict(), a deepcopy or a pickle of it: after the write-backs, copies owning their bytes, no pool)
        pre = {"register_step_pre_hook": self._refuse_bypass, "register_state_dict_pre_hook": self.settle}
        self._handles += install_guards(opt, pre, self.settle, compact=True)

    def _refuse_bypass(self, opt: Any, args: Any, kwargs: Any) -> None:
        """The optimizer's first step pre-hook: refuses the class's own step called by anything but the streamed step
        in this thread (a bound ``opt.step`` kept from before :func:`stream`): it would run over host state."""
        if len(opt._optimizer_step_pre_hooks) > 1:
            self.wait()  # (a user's pre-hook reads the state the last step's write-backs still write)
        if not getattr(self._stepping, "on", False):
            raise RuntimeError(
                f"{optimizer_name(opt)} is streamed (optimshift.stream), but its step() was called through a step "
                f"kept from before stream() (a bound optimizer.step saved by a wrapper, such as Accelerate's with "
                f"a GradScaler, or a torch.compile of it): that step would run over state held on the host. Call "
                f"stream() before wrapping or compiling the step, or keep the state on the device; nothing was "
                f"stepped"
            )

    def _uninstall(self) -> None:
        self._active = False
        self._remove()
        _track_step_called(self.optimizer)

    def _remove(self) -> None:
        """Remove the fronts and guards :meth:`_install` put in place (what replaced a front since stays: our step
        then falls through, see :meth:`_install`)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []


def _track_step_called(opt: torch.optim.Optimizer) -> None:
    """Wrap the step back in place as an LR scheduler made while streamed (a group holds ``initial_lr``) would have,
    had ours not been marked wrapped: else its first ``step()`` warns that ``optimizer.step()`` was overridden."""
    method: Any = opt.step
    if hasattr(method, "_wrapped_by_lr_sched") or getattr(method, "__self__", None) is not opt:
        return
    if not any("initial_lr" in group for group in opt.param_groups):
        return
    ref, func = weakref.ref(opt), method.__func__

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        optimizer: Any = ref()
        optimizer._opt_called = True
        return func.__get__(optimizer, type(optimizer))(*args, **kwargs)

    wrapper._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    opt.step = wrapper


def _check(optimizer: Any, chunk_bytes: Any, device: DeviceLike | None) -> torch.device | None:
    """Every reason not to stream ``optimizer``, raised before anything changes."""
    check_optimizer(optimizer)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"stream: {type(optimizer).__name__} is not a torch.optim.Optimizer; pass the optimizer it "
            f"wraps (e.g. its .optimizer)"
        )
    _session.rememberable(optimizer, "stream")
    states_by_id(optimizer)  # (state for a param in no group: unstream() could place it nowhere)
    name = optimizer_name(optimizer)
    if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes <= 0:
        raise ValueError(
            f"{name}: stream: chunk_bytes must be a positive int (bytes of state per chunk), got {chunk_bytes!r}"
        )
    ok, why = _policy.separable(type(optimizer))
    if not ok:
        cls = type(optimizer).__name__
        alone = "updates each param from that param's grad and state alone"
        needs = f"{alone}, which stepping a chunk at a time needs. If it does, declare it: optimshift.register_policy("
        needs += f"{cls}, lambda *a: None, separable=True)."
        reasons = {
            "not separable": f"{cls}'s step is not a per-param update (it flattens every grad into one vector, keeps "
            f"its history over all params and runs one line search over all of them), so it cannot be stepped a "
            f"chunk at a time. Keep its state on the device, or offload() it between steps.",
            "overrides step": f"{cls} overrides step(): optimshift cannot tell whether it {needs}",
            "registered": f"the policy registered for {cls} does not declare it separable; if its step {alone}, "
            f"register it with separable=True.",
            "unknown": f"{cls} is not a torch.optim optimizer, and nothing says its step {needs}",
        }
        raise ValueError(f"{name}: stream: {reasons[why]}")
    tracked = next((f"group {gi} has" for gi, g in enumerate(optimizer.param_groups) if g.get("differentiable")), None)
    if tracked is None and getattr(optimizer, "defaults", {}).get("differentiable"):
        tracked = "its defaults have"  # (torch's step enables grad by them, whatever its groups say)
    if tracked is not None:
        raise ValueError(
            f"{name}: stream: {tracked} differentiable=True: its step keeps autograd's graph through the "
            f"state, which streaming cuts (each step copies the state to host memory and back). Keep its state on "
            f"the device, or build it with differentiable=False"
        )
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
        target = resolve(device, what=f"{name}: stream: device", tensors=[p for _, _, p in params])
        if target.type in HOSTS:
            raise ValueError(f"{name}: stream: device must be an accelerator (state streams through it), got {target}")
        for gi, pi, p in params:
            if p.device.type not in HOSTS and p.device != target:
                raise ValueError(
                    f"{name}: stream(device={target}): group {gi}, param {pi} is on {p.device}; its "
                    f"state would have to stream through {p.device}. Pass device=None to stream each "
                    f"param's state through its own device."
                )
    if not any(p.device.type not in HOSTS for _, _, p in params):
        raise ValueError(
            f"{name}: stream: no param is on an accelerator, so there is nothing to stream through; "
            f"move the model first (model.to(device))"
        )
    for gi, pi, p in params:
        if p.device.type == "meta":
            raise ValueError(f"{name}: stream: group {gi}, param {pi} is on the meta device (no values)")
    return target


def stream(optimizer: Any, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES, device: DeviceLike | None = None) -> Streamed:
    """Keep the optimizer's state in host memory and stream it through the device at every ``step()``.

    State that belongs on an accelerator moves to pinned host memory in chunks of about ``chunk_bytes``; each
    ``step()`` runs the optimizer's own step one chunk at a time, the next chunk loading and the previous one written
    back meanwhile (at most two chunks of state on the device, plus one larger param's): bitwise the step with all
    state on the device; hooks, schedulers, ``GradScaler``, ``state_dict()`` and tensor objects unchanged.
    ``device``: the accelerator to stream through (every param on an accelerator on it; ``None``: each param's own).
    Every ``torch.optim`` class but LBFGS (not a subclass with a ``step`` of its own), and a third-party class
    :func:`optimshift.register_policy` declares ``separable``; refused, before anything changes, for another,
    ``differentiable=True``, an offloaded or streamed optimizer, no param on an accelerator. Returns a
    :class:`Streamed` handle; :func:`unstream` ends it.
    """
    optimizer = unwrap(optimizer)  # (a wrapper delegating to an optimizer: that optimizer is streamed)
    _warn_unreached(optimizer, "stream")
    with exclusive(optimizer):  # (one operation at a time: two streams, or a stream and an offload, from threads)
        end_pending(optimizer)  # a transfer still in flight: its copies write the state laid out here
        target = _check(optimizer, chunk_bytes, device)
        start = time.perf_counter()
        mode = Streamed(optimizer, chunk_bytes, target)
        with _engine.operation():  # (a Ctrl-C the layout's commit holds waits for the mode to be in place)
            try:
                # NOTE: the fronts before the layout, inactive until it is committed: one failing to install left the
                # state laid out in the chunks, on an optimizer not streamed (a Ctrl-C here: raised once they are
                # in mode._handles, to be removed)
                with _engine.uninterrupted(to_the_end=False):
                    mode._install(optimizer)
                with _engine.no_gc():
                    mode._lay_out(mode._members(None))
            except BaseException:
                mode._remove()
                raise
            mode._active = True
            _mode.enter(optimizer, mode)
        # (state that sat at fixed addresses left its range: freed as after a move, under the lock, since another
        # thread's reload maps into the same layout; once the mode is in place: a warning raised as an error there
        # leaves a streamed optimizer)
        _addresses.release(optimizer, optimizer_name(optimizer))
    _log.debug(
        "stream %s: %d chunks, %d bytes of state in host memory, in %.2f ms",
        optimizer_name(optimizer),
        mode.chunks,
        mode.state_bytes,
        (time.perf_counter() - start) * 1e3,
    )
    return mode


def _mode_of(optimizer: Any) -> Streamed | None:
    mode = _mode.mode_of(unwrap(optimizer))
    return mode if isinstance(mode, Streamed) else None


def is_streamed(optimizer: Any) -> bool:
    """Whether :func:`stream` put this optimizer in streamed mode (and :func:`unstream` did not end it); TypeError for
    what is no optimizer, as :func:`optimshift.is_offloaded`."""
    return _mode_of(check_optimizer(unwrap(optimizer), groups=False)) is not None


def unstream(optimizer: Opt) -> Opt:
    """End streamed mode: every state entry goes where a fresh optimizer over the params, where they are now,
    keeps it (same objects, values bitwise), ``step``/``load_state_dict`` are the optimizer's own again and the
    host buffers go back to the pool. All or nothing; a no-op for an optimizer that is not streamed."""
    check_optimizer(unwrap(optimizer))  # (unstream(model) ended nothing, silently)
    _warn_unreached(unwrap(optimizer), "unstream")
    with exclusive(unwrap(optimizer)), _warned():  # (one operation at a time, from any thread; its move warns not)
        mode = _mode_of(optimizer)
        if mode is None:
            return optimizer
        mode.settle()  # (a failed write-back left a chunk's state in views of one window: laid out first)
        inner = mode.optimizer
        with _engine.operation():  # (a Ctrl-C the move's commit holds waits for the mode to be gone)
            chunks = list(mode._chunks.values())
            try:
                # (inside the try: a Ctrl-C landing once leave() returned left the streamed step installed on an
                # optimizer no longer streamed, its state in the chunks, which unstream then took for done)
                _mode.leave(inner)
                # (state left on the host, its params there, gets storage of its own: the chunks go back to the pool)
                _move_ending(inner, None, pooled=[c.buffer for c in chunks])
            except BaseException:
                _mode.enter(inner, mode)
                raise
            mode._uninstall()
            mode._forget(chunks)
            layout.release(chunks)
    return optimizer


@contextlib.contextmanager
def streamed(
    optimizer: Any, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES, device: DeviceLike | None = None
) -> Iterator[Streamed]:
    """:func:`stream` on enter, :func:`unstream` on exit (also when the body raises); yields the
    :class:`Streamed` handle. A no-op if it is already streamed (then its handle is yielded), but by another
    ``streamed`` block, in any thread: the last of them out unstreams."""
    inner = unwrap(optimizer)
    with _last_out_ends(
        inner,
        "streamed",
        lambda: _mode_of(inner),
        "blocks",
        lambda: stream(optimizer, chunk_bytes=chunk_bytes, device=device),
        lambda: unstream(optimizer),
    ) as mode:
        yield mode
