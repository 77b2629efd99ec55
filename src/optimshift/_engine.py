"""Execute a plan: copy every tensor that must move, synchronize once, then commit, keeping every object.

The one data path of every operation (move, offload, reload, rebind, load_state_dict, the stream layout):
:func:`run` copies (grouped by :mod:`optimshift._copy`), :func:`commit` installs the copies; :func:`lend` gives a
streamed step's window to the state for a while by the same decisions.

All or nothing: every copy is made before any state entry changes. An exception while copying (an OOM on the
900th tensor) drops the copies made so far and leaves the optimizer exactly as it was. The commit first
decides, for every tensor, how it will take its copy's contents (:func:`optimshift._adopt.mechanism`, pure),
then applies those decisions, which cannot fail.

Identity: committed tensors stay the same Python objects (``id()`` unchanged) wherever the installed torch
allows it for the pair of devices, so a compiled ``step()`` that guards on them does not recompile. Where it
does not (see :mod:`optimshift._adopt`), the copy takes the old object's place in the state.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import gc
import itertools
import operator
import signal
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from operator import attrgetter, itemgetter
from typing import Any, cast

import torch

from . import _alias, _device_streams
from ._adopt import Mechanism, adopt, decide_all, still_valid
from ._copy import BLOCKING, Batch, Options, Side, copy_into, copy_many, pinned_sources
from ._device_streams import in_pinned_memory, synchronize
from ._devices import HOSTS, _fake_mode_active
from ._errors import dtype_name
from ._plan import Plan, Transfer
from ._state import GROUP_SKIP, Setter, rebuild
from .pool import host_pool
from .syncs import async_copies

__all__ = [
    "Copies",
    "run",
    "copy_items",
    "commit",
    "adoptions",
    "lend",
    "no_gc",
    "uninterrupted",
    "operation",
]


@dataclass
class Copies:
    """What :func:`run` made: ``new[id(t)]`` is the copy of input tensor ``t``; ``pairs`` lists
    ``(t, copy)`` for the plan's tensors (what :func:`commit` installs), in plan order, each tensor once, then
    ``(t, destination)`` for those copied into a destination the caller gave (``run(into=...)``).

    ``event``/``device``: set when the copies may still be running on a side stream (non-blocking on a device
    with streams, see :mod:`optimshift._device_streams`);
    ``batch`` holds the pool buffers the host copies live in (offloaded state).
    """

    items: list[tuple[torch.Tensor, torch.device]]  # (tensor, target) of every copy, in batch order
    pairs: list[tuple[torch.Tensor, torch.Tensor]]
    batch: Batch
    event: Any | None = None
    device: torch.device | None = None
    to_host: bool = False  # some copies in flight write host memory (what a reader of a pending transfer waits for)
    mechanisms: dict[str, int] = field(default_factory=dict)  # filled by commit: how many tensors each way
    # (a load's: by device, (live tensors, sources), pair by pair, of one dtype, shape and strides, that the commit
    # writes in place, no copy made: see commit)
    in_place: Mapping[torch.device, tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]]] = field(default_factory=dict)
    fresh: bool = False  # every pair's copy is fresh (_copy.Batch.fresh): what decide_all need not ask of it

    @functools.cached_property
    def new(self) -> dict[int, torch.Tensor]:
        """id(input tensor) -> its copy (built when asked: most operations only commit the pairs)."""
        return {id(t): c for (t, _), c in zip(self.items, self.batch.copies) if c is not None}


def copy_items(
    items: Sequence[tuple[torch.Tensor, torch.device]],
    options: Options = BLOCKING,
    *,
    describe: Callable[[int], str] | None = None,
    side: Side | None = None,
    together: Sequence[tuple[list[int], torch.device]] = (),
    columns: Sequence[tuple[Sequence[torch.Tensor], torch.device]] = (),
    casts: Mapping[int, torch.dtype] | None = None,
) -> Batch:
    """Copy each ``(tensor, target)`` (grouped), then synchronize once unless the copies may run on.

    Host memory that state will point at is always written before this returns, except for a non-blocking
    offload (``keep_host_views`` with ``non_blocking``), which hands out an event to wait on instead.
    ``side``: the copies are queued on that stream; the caller records its event and completes the batch.
    ``together``: the groups to copy as one storage (:func:`run`'s); ``columns``: instead of items, a plan's
    ``columns``;
    ``casts``: the dtype of each item's copy that is cast (see :func:`copy_many`).
    """
    pool = host_pool
    batch = copy_many(
        items, options, pool=pool, describe=describe, side=side, together=together, columns=columns, casts=casts
    )
    if (
        batch.after_sync
        or not options.non_blocking
        or (
            not options.keep_host_views
            and any(target.type == "cpu" and t.device.type not in HOSTS for t, target in items)
        )
    ):
        synchronize(batch.devices)
        batch.complete(pool)
    elif side is None:
        batch.complete(pool, _current_stream_event(batch.devices))
    return batch


def _current_stream_event(devices: Iterable[torch.device]) -> Any | None:
    """An event after the copies queued on the current stream of the (one) device with streams among
    ``devices`` (staging buffers wait for it); None where no device has streams."""
    for device in sorted({d for d in devices if d.type not in HOSTS}, key=str):
        streams = _device_streams.of(device)
        if streams is not None:
            event = streams.new_event(device)
            streams.record(event, streams.current(device))
            return event
    return None


def _single_stream_device(items: Sequence[tuple[torch.Tensor, torch.device]]) -> torch.device | None:
    """The one accelerator ``items`` touch, if it has streams (several devices: synchronous copies)."""
    devices = {d for t, target in items for d in (t.device, target) if d.type not in HOSTS}
    if len(devices) != 1:
        return None
    device = devices.pop()
    return device if _device_streams.of(device) is not None else None


def run(
    plan: Plan,
    options: Options = BLOCKING,
    *,
    extra: Sequence[tuple[torch.Tensor, torch.device, str]] = (),
    into: Sequence[torch.Tensor | None] | None = None,
    own: set[int] | frozenset[int] = frozenset(),
    what: str | None = None,
    site: Callable[[Transfer], object] = attrgetter("site"),
) -> Copies:
    """Copy every tensor of ``plan`` that is not where it belongs or carries a dtype (cast as it is copied), and
    ``extra`` (grads: each with its target and what it is, for errors), grouped; ``own``: ids of tensors copied
    where they are (views into pool buffers the operation gives back: :func:`optimshift._offload.left_in_buffers`;
    a load's sources, never installed themselves). Errors and their notes name the operation (``what``, else the
    optimizer's class) and the entry (``site(transfer)``). A plan of ``columns`` (a fresh load's) is copied
    whole, blocking, with no transfers, ``extra``, ``into`` or ``own``: its copies are ``batch.copies``, in the
    columns' order (no items, no pairs: none is committed).

    With ``options.non_blocking`` on one device that has streams (:mod:`optimshift._device_streams`: CUDA, any
    accelerator with device-generic streams, the simulated one) the copies run on a side stream: buffers they read go
    back to the pool with their event, and device memory they read is protected with ``record_stream`` so the
    caching allocator never reuses it early. Nothing in the optimizer changes here.

    ``into``: one destination per transfer of the plan, allocated by the caller (a streamed chunk's pooled host
    view), or None (the engine makes the copy): a tensor given one is copied into it wherever it is (the
    destination is its place, whatever its target), by the same streams, events and ``record_stream`` rules,
    and commits to it.
    """
    placed: list[tuple[Transfer, torch.Tensor]] = []  # (transfer, its destination), each tensor once
    what = what or type(plan.optimizer).__name__
    if plan.columns:  # (every tensor copied where it is too, blocking, in the columns' order: the batch's copies)
        assert not (plan.transfers or extra or into is not None or own), "a plan of columns is copied whole, alone"
        starts = list(itertools.accumulate((len(tensors) for tensors, _ in plan.columns), initial=0))

        def column_entry(i: int) -> str:  # (the transfer of the column's entry, built now)
            j = bisect.bisect_right(starts, i) - 1
            return f"{what}: {site(cast(Callable[[int, int], Transfer], plan.entry)(j, i - starts[j]))}"

        blocking = replace(options, non_blocking=False)
        return Copies([], [], copy_items((), blocking, describe=column_entry, columns=plan.columns))
    hyperparameters = _moving_group_tensors(plan) if options.non_blocking else set()
    if into is not None:
        plan, placed = _placed(plan, into, what, site)
    transfers = plan.transfers
    tensors = list(map(_tensor, transfers))
    # (each tensor's device and storage asked in one walk: a walk each read 50k tensors' memory twice, ~2x the time)
    devices, keys = _alias.located(tensors)
    targets = list(map(_target, transfers))
    picked = list(map(operator.ne, devices, targets))  # (what moves, a load's own and casts too: each tensor once)
    if own or plan.casts:
        picked = [p or id(tr[2]) in own or tr[6] is not None for p, tr in zip(picked, transfers)]
    if plan.repeats:  # (a tensor several entries hold: copied for the first that picks it)
        seen: set[int] = set()
        for i in itertools.compress(range(len(picked)), picked):
            picked[i] = id(tensors[i]) not in seen
            seen.add(id(tensors[i]))
    items = list(itertools.compress(zip(tensors, targets), picked))
    names = list(itertools.compress(transfers, picked))  # (what each item is, for errors)
    # (item index -> the dtype its copy is cast to)
    casts = {i: tr[6] for i, tr in enumerate(names) if tr[6] is not None} if plan.casts else {}
    n_plan = len(items)
    extra_names: list[str] = []  # (what each of the extra items copied is)
    if extra:
        seen = {id(t) for t, _ in items}
        for t, target, name in extra:
            if (t.device != target or id(t) in own) and id(t) not in seen:
                seen.add(id(t))
                items.append((t, target))
                extra_names.append(name)
    # (nothing moves: nothing can stop sharing, nor be copied as a storage)
    together = _shared_storages(plan, tensors, keys, extra, items, placed, what, site) if items or placed else []
    into_pairs = [(tr[2], dst) for tr, dst in placed]

    def placed_site(i: int) -> str:
        return f"{what}: {site(placed[i][0])}"

    def describe(i: int) -> str:
        if i >= n_plan:
            return f"{what}: {extra_names[i - n_plan]}"
        return f"{what}: {site(names[i])}"

    # (fake tensors have no copies to overlap: they never need a stream, nor should they probe one; a cast, only
    # a load's, which blocks, is made on the current stream)
    every = items + [(t, dst.device) for t, dst in into_pairs] if into_pairs else items
    on_side = options.non_blocking and not casts and not _fake_mode_active()
    device = _single_stream_device(every) if on_side else None
    if device is None:
        # NOTE: no side stream (several devices, a device without streams, fake tensors): the blocking path,
        # synchronized at the end. A copy between two devices left queued would be ordered after neither
        # device's next side-stream copies; one on a device whose streams are unknown has no event to wait on.
        batch = _copy_here(
            items, options, describe=describe, together=together, into=into_pairs, where=placed_site, casts=casts
        )
        event, to_host = None, False
    else:
        batch, event, to_host = _run_on_side_stream(
            items,
            device,
            options,
            describe=describe,
            together=together,
            into=into_pairs,
            placed_site=placed_site,
            now=_split(items, n_plan, together, into_pairs, hyperparameters) if hyperparameters else ([], []),
        )
    pairs = [(t, c) for (t, _), c in zip(items[:n_plan], batch.copies) if c is not None] + into_pairs
    fresh = batch.fresh and not into_pairs
    return Copies(items, pairs, batch, event, device if event is not None else None, to_host, fresh=fresh)


def _copy_here(
    items: Sequence[tuple[torch.Tensor, torch.device]],
    options: Options,
    *,
    describe: Callable[[int], str],
    together: Sequence[tuple[list[int], torch.device]],
    into: Sequence[tuple[torch.Tensor, torch.Tensor]] = (),
    where: Callable[[int], str] | None = None,
    wait: bool = True,
    casts: Mapping[int, torch.dtype] | None = None,
) -> Batch:
    """The copies of ``items`` (and into each destination of ``into``) on the current stream: complete when this
    returns (the host synchronized), or, without ``wait``, queued on the current stream (a non-blocking
    transfer's param-group tensors bound for an accelerator: whatever runs there next comes after them)."""
    queued = copy_into(into, describe=where) if into else set()
    try:
        batch = copy_items(
            items,
            replace(options, non_blocking=False) if wait and options.non_blocking else options,
            describe=describe,
            together=together,
            casts=casts,
        )
    except BaseException:
        synchronize(queued)  # (a queued copy writes the caller's destinations)
        raise
    if wait:
        synchronize(queued)
    return batch


def _placed(
    plan: Plan, into: Sequence[torch.Tensor | None], what: str, site: Callable[[Transfer], object]
) -> tuple[Plan, list[tuple[Transfer, torch.Tensor]]]:
    """``plan`` without the transfers ``into`` gives a destination, and those transfers with it, each tensor once.
    ValueError, before anything is copied, for one tensor held by several entries that are given places of
    their own (or a place and the engine's copy): it cannot be in both, and an update through one entry would
    no longer show through the other."""
    rest: list[Transfer] = []
    placed: list[tuple[Transfer, torch.Tensor]] = []
    where: dict[int, tuple[Transfer, torch.Tensor]] = {}
    twice: tuple[Transfer, Transfer] | None
    for tr, dst in zip(plan.transfers, into):
        if dst is None:
            rest.append(tr)
            continue
        prior = where.get(id(tr[2]))
        if prior is None:
            where[id(tr[2])] = (tr, dst)
            placed.append((tr, dst))
        elif prior[1] is not dst:
            twice = (prior[0], tr)
            break
    else:
        twice = next(((where[id(tr[2])][0], tr) for tr in rest if id(tr[2]) in where), None) if plan.repeats else None
    if twice is not None:
        raise ValueError(
            f"{what}: one tensor is shared by {site(twice[0])} and {site(twice[1])}, which are "
            f"each given a place of their own: it cannot be in both, and an update through one would no longer "
            f"show through the other. Give one of them its own tensor (.clone()); nothing was changed"
        )
    return replace(plan, transfers=rest), placed


def _shared_storages(
    plan: Plan,
    plan_tensors: list[torch.Tensor],
    keys: list[int | None],
    extra: Sequence[tuple[torch.Tensor, torch.device, str]],
    items: Sequence[tuple[torch.Tensor, torch.device]],
    placed: Sequence[tuple[Transfer, torch.Tensor]],
    what: str,
    site: Callable[[Transfer], object],
) -> list[tuple[list[int], torch.device]]:
    """The groups of ``items`` to copy as one storage (:func:`optimshift._alias.shared`, asked once for the
    whole plan), with their target. ValueError, before anything is copied, when tensors that share a storage
    belong on different devices or in different dtypes (a cast of some, or casts of different kinds), or are
    copied into places the caller gave (``placed``, each its own): copied apart, an update through one would no
    longer show through the other. ``plan_tensors``, ``keys``: the plan's tensors and their storages' keys."""
    transfers = plan.transfers
    tensors = plan_tensors
    if extra or placed:
        more = [e[0] for e in extra] + [tr[2] for tr, _ in placed]
        tensors, keys = tensors + more, keys + _alias.located(more)[1]
    groups = _alias.shared(tensors, keys)
    if not groups:
        return []
    first_placed = len(transfers) + len(extra)

    def where(i: int) -> object:
        if i < len(transfers):
            return site(transfers[i])
        return extra[i - len(transfers)][2] if i < first_placed else site(placed[i - first_placed][0])

    for group in groups:
        if any(i >= first_placed for i in group) and not _placed_together(group, first_placed, placed):
            a, b = group[:2]
            raise ValueError(
                f"{what}: {where(a)} and {where(b)} share one storage, but are each copied into a place of their own "
                f"(a streamed chunk keeps each entry apart): an update through one would no longer show through the "
                f"other. Give one of them its own storage (.clone()); nothing was changed"
            )
    groups = [group for group in groups if all(i < first_placed for i in group)]  # (the rest: placed together)
    if not groups:
        return []
    targets = [tr[4] for tr in transfers] + [e[1] for e in extra]
    dtypes = [tr[6] for tr in transfers] + [None] * len(extra)
    by_id: dict[int, list[int]] = {}  # (each entry of a member: a load's tensor may be asked for in two dtypes)
    for i, t in enumerate(tensors[:first_placed]):
        by_id.setdefault(id(t), []).append(i)
    for group in groups:  # (every group checked before any is copied)
        at = [j for i in group for j in by_id[id(tensors[i])]]
        cast_too = any(dtypes[j] is not None for j in at)  # (then the storage is cast: one dtype to one dtype)
        kinds = [(targets[j], tensors[j].dtype, dtypes[j] or tensors[j].dtype) if cast_too else targets[j] for j in at]
        n = next((n for n in range(1, len(at)) if kinds[n] != kinds[0]), None)
        if n is not None:
            a, b = at[0], at[n]
            apart = targets[a] != targets[b]
            bounds = [_bound(targets[j], tensors[j].dtype if cast_too else None, dtypes[j]) for j in (a, b)]
            raise ValueError(
                f"{what}: {where(a)} and {where(b)} share one storage, but belong "
                f"{'on different devices' if apart else 'in different dtypes'} ({bounds[0]} and {bounds[1]}): copied "
                f"apart, an update through one would no longer show through the other. Give one of them its own "
                f"storage (.clone()){', or put their params on one device' * apart}; nothing was changed"
            )
    # NOTE: the members of a group share a device and (checked above) a target: they all move or none does.
    index = {id(t): i for i, (t, _) in enumerate(items)}
    together = []
    for group in groups:
        at_items = [index.get(id(tensors[i])) for i in group]
        if at_items[0] is not None:
            together.append((cast(list[int], at_items), targets[group[0]]))
    return together


def _bound(target: torch.device, source: torch.dtype | None, dtype: torch.dtype | None) -> str:
    """Where a copy goes, in words: its device, and (``source``: where a member of its storage is cast) the
    source's dtype and the one it is cast to, if any: a kept member's dtype is what the cast ones differ from."""
    if source is None:
        return str(target)
    return f"{dtype_name(source)}{f' cast to {dtype_name(dtype)}' if dtype not in (None, source) else ''} on {target}"


def _placed_together(group: Sequence[int], first_placed: int, placed: Sequence[tuple[Transfer, torch.Tensor]]) -> bool:
    """Whether the caller placed every member of a storage group (indices from ``first_placed`` on) into one
    storage of its own, each at its member's offset (a keep_addresses slot): copied view by view, they keep
    sharing it."""
    if any(i < first_placed for i in group):
        return False
    members = [placed[i - first_placed] for i in group]
    storage, first = _alias.storage_of(members[0][1]), _alias.span([tr[2] for tr, _ in members])[0]
    return all(
        _alias.storage_of(dst) == storage and dst.storage_offset() == _alias.offset_in(tr[2], first)
        for tr, dst in members
    )


def _moving_group_tensors(plan: Plan) -> set[int]:
    """ids of the tensors ``plan``'s param groups hold among their hyperparameters (a tensor ``lr``, tensor
    ``betas``) that it moves: what code outside the optimizer reads and writes from the host with no wait for a
    transfer (an LR scheduler's ``sched.step()``, between a non-blocking reload and ``opt.step()``)."""
    return {id(tr[2]) for tr in plan.group_entries() if tr[2].device != tr[4]}


def _split(
    items: Sequence[tuple[torch.Tensor, torch.device]],
    n_plan: int,
    together: Sequence[tuple[list[int], torch.device]],
    into: Sequence[tuple[torch.Tensor, torch.Tensor]],
    now: set[int],
) -> tuple[list[int], list[int]]:
    """The indices of the plan's ``items`` (the first ``n_plan``) whose tensor is in ``now``, with every other
    member of a storage they share (copied as one), and those of ``into``'s pairs. Found from the end: the
    plan's group tensors come after its params' state (one a group shares with a state entry, LBFGS's tensor
    lr, sits with that entry: the walk then goes on until every one is found)."""
    at: set[int] = set()
    for i in range(n_plan - 1, -1, -1):
        if id(items[i][0]) in now:
            at.add(i)
            if len(at) == len(now):
                break
    found = len(at)  # (the rest are given places of their own: into's)
    for members, _ in together:
        if not at.isdisjoint(members):
            at.update(members)
    into_at = [j for j, (t, _) in enumerate(into) if id(t) in now] if found < len(now) else []
    return sorted(at), into_at


def _run_on_side_stream(
    items: Sequence[tuple[torch.Tensor, torch.device]],
    device: torch.device,
    options: Options,
    *,
    describe: Callable[[int], str],
    together: Sequence[tuple[list[int], torch.device]],
    into: Sequence[tuple[torch.Tensor, torch.Tensor]] = (),
    placed_site: Callable[[int], str] | None = None,
    now: tuple[list[int], list[int]] = ([], []),
) -> tuple[Batch, Any, bool]:
    """The copies on a side stream, one event after them; returns the batch, the event and whether a copy still
    in flight writes host memory (what a reader of a transfer in flight waits for: see ``Copies.to_host``).

    ``now``: the indices of the items and of ``into``'s pairs copied before this returns, on the current stream,
    by the blocking path's function (:func:`_copy_here`): a param group's tensors, which code outside the
    optimizer touches from the host with no wait (an LR scheduler). Where one lands in host memory (an offload)
    the host waits for those copies; else whatever runs on the current stream next comes after them. The event
    comes after them too (the side stream waits for the current one before it is recorded): every copy is
    complete once it is."""
    streams = _device_streams.of(device)
    assert streams is not None  # (_single_stream_device checked)
    side = streams.side(device, options.lane)
    at, into_at = now
    rest: list[int] = []
    first: Batch | None = None
    waited = True
    if at or into_at:
        ahead, ahead_into = [items[i] for i in at], [into[j] for j in into_at]
        index = {i: n for n, i in enumerate(at)}
        # (into host memory: the host waits for them; onto the device: ordered on the current stream)
        waited = any(target.type == "cpu" for _, target in ahead) or any(
            dst.device.type == "cpu" for _, dst in ahead_into
        )
        first = _copy_here(
            ahead,
            options,
            describe=functools.partial(_at, describe, at),
            together=[([index[i] for i in members], target) for members, target in together if members[0] in index],
            into=ahead_into,
            where=None if placed_site is None else functools.partial(_at, placed_site, into_at),
            wait=waited,
        )
        rest = [i for i in range(len(items)) if i not in index]
        skip = set(into_at)
        into_rest = [j for j in range(len(into)) if j not in skip]
        later = {i: n for n, i in enumerate(rest)}
        items = [items[i] for i in rest]
        together = [([later[i] for i in members], target) for members, target in together if members[0] in later]
        into = [into[j] for j in into_rest]
        describe = functools.partial(_at, describe, rest)
        placed_site = None if placed_site is None else functools.partial(_at, placed_site, into_rest)
    # (every copy waits for the current stream, where the last step wrote and where every device tensor the
    # side stream touches is allocated, and records those tensors for the side one: see _copy.Side)
    on = Side(streams, side, streams.current(device))
    try:
        queued = copy_into(into, side=on, describe=placed_site) if into else set()
        try:
            # (an offload's host views are read once its event completed: the host does not wait for these
            # copies here, and optimshift.count_syncs lists them apart from syncs)
            with async_copies(options.keep_host_views):
                batch = copy_items(items, options, describe=describe, side=on, together=together)
        except BaseException:
            synchronize(queued)  # (a queued copy writes the caller's destinations: done before they are freed)
            raise
        event = streams.new_event(device)
        if not waited:
            streams.wait_stream(side, on.current)  # (the event comes after the current stream's copies too)
        streams.record(event, side)
    except BaseException:
        if first is not None:  # (its copies are complete, or queued on the current stream; nothing installed)
            synchronize({device})
            for buf in first.held:
                host_pool.release(buf)
        raise
    batch.complete(host_pool, event)
    to_host = any(target.type == "cpu" for _, target in items) or any(dst.device.type == "cpu" for _, dst in into)
    if first is None:
        return batch, event, to_host
    copies: list[torch.Tensor | None] = [None] * (len(at) + len(rest))
    for i, c in zip(at, first.copies):
        copies[i] = c
    for i, c in zip(rest, batch.copies):
        copies[i] = c
    return Batch(copies, held=first.held + batch.held, devices=first.devices | batch.devices), event, to_host


def _at(name: Callable[[int], str], indices: Sequence[int], n: int) -> str:
    """``name`` of the original index of a part's ``n``-th item."""
    return name(indices[n])


def adoptions(
    pairs: Sequence[tuple[torch.Tensor, torch.Tensor]],
    protect: frozenset[int] | set[int] = frozenset(),
    hint: list[Mechanism] | None = None,
    *,
    distinct: bool = False,
    fresh: bool = False,
) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], Callable[[], dict[str, int]], list[Mechanism]]:
    """Decide how each ``old`` takes its ``new``'s contents (pure). Returns the pairs that cannot keep their
    object (the caller puts ``new`` in ``old``'s place) and a function that applies the rest (cannot fail)
    and returns how many tensors went each way.

    ``protect``: ids of tensors that must not change in place because something outside the optimizer's state
    owns them (a model's params and their grads kept in state): they are replaced instead. Each ``old`` must
    come with one copy (the caller resolves tensors shared between places first). ``hint``: the decisions of an
    earlier commit of the same (cached) plan, reused where :func:`optimshift._adopt.still_valid` says they hold.
    ``distinct``: the caller promises each ``old`` once and never its own copy (:class:`Copies` pairs).
    ``fresh``: every ``new`` is a copy just made (:attr:`Copies.fresh`). Also returns the decisions made.
    """
    if distinct:
        unique = pairs
    else:
        done: set[int] = set()
        unique = []
        for pair in pairs:
            old = pair[0]
            if old is not pair[1] and id(old) not in done:
                done.add(id(old))
                unique.append(pair)
    # (each old's id, in one pass in C: whether any is protected)
    clear = not protect or protect.isdisjoint(map(id, map(_first, unique)))
    if hint is not None and clear and still_valid(unique, hint):
        hows = hint
    else:
        hows = decide_all(unique, fresh=fresh)
        if not clear:
            hows = ["replace" if id(old) in protect else how for (old, _), how in zip(unique, hows)]
    replaced = [pair for pair, how in zip(unique, hows) if how == "replace"] if "replace" in hows else []

    def apply() -> dict[str, int]:
        adopt(unique, hows)
        return {"data": hows.count("data"), "swap": hows.count("swap"), "replace": len(replaced)}

    return replaced, apply, hows


def lend(
    pairs: Sequence[tuple[torch.Tensor, torch.Tensor]],
    homes: Sequence[torch.Tensor],
    sites: Sequence[tuple[Any, Any]],
) -> Callable[[], None]:
    """For a while (a streamed step's device window): each ``old`` takes its ``new``'s contents, decided as a
    commit decides (:func:`adoptions`) and applied by the same loop; where no mechanism keeps the object,
    ``new`` stands in its place at its site (``(mapping, key)``). The function returned undoes it by the same
    decisions: ``old`` takes back its ``home`` (what it held) by ``set_data``, or swaps back (a swap is its own
    inverse), or returns to its site where its stand-in still is. Each ``old`` once, never its own ``new``."""
    _, apply, hows = adoptions(pairs, distinct=True)
    apply()
    stand_ins = [(site, old, new) for (old, new), how, site in zip(pairs, hows, sites) if how == "replace"]
    for (mapping, key), _, new in stand_ins:
        mapping[key] = new
    returns = [(pair[0], home) if how == "data" else pair for pair, home, how in zip(pairs, homes, hows)]

    def back() -> None:
        adopt(returns, hows)
        for (mapping, key), old, new in stand_ins:
            if mapping.get(key) is new:
                mapping[key] = old

    return back


def commit(
    optimizer: Any,
    copies: Copies,
    hint: list[Mechanism] | None = None,
    *,
    rewrite: Callable[[], None] | None = None,
    installed: Sequence[Sequence[tuple[Any, Any]]] | None = None,
    finish: Sequence[Setter] = (),
) -> list[Mechanism]:
    """Install the copies in ``optimizer``: each tensor adopts its copy's contents and stays the same object;
    where that is impossible, the copy takes its place in the state, param groups and containers.
    Everything is decided and prepared first, then applied; ``copies.mechanisms`` counts how many tensors went
    each way. Returns the decisions (``hint``: an earlier commit's, see :func:`adoptions`).

    ``rewrite``: a change of the optimizer's own structure that is part of the operation (a rebind's new params,
    a load's new dicts), made once every decision is, right before they are applied; it may raise only having
    left the optimizer as it was (nothing else is applied then). ``installed``: for each pair, the places
    ``(mapping, key)`` where ``rewrite`` installs the copy itself (a load's new dicts): the old object takes them
    back once it holds its copy's contents, and a copy no mechanism can give an old object stays there, as does
    whatever the rewrite put in a copy's place (decided once it ran).
    ``copies.in_place``: live tensors that take their sources' values in place, after the rewrite.
    ``finish``: in-place updates the caller prepared (they cannot fail), applied last, after the copies that
    replace a tensor took its place: those places were found in the structure as it was (a rebind's mappings
    keyed by params, :func:`optimshift._state.rekey`, are renamed once they hold their replacements).
    """
    protect: frozenset[int] | set[int] = outside_owned(optimizer) if copies.pairs else frozenset()
    # (sources on the host bound for an accelerator, staged in pinned memory first: may fail, nothing changed yet)
    in_place, staging = _pinned_in_place(copies.in_place) if copies.in_place else (copies.in_place, [])
    try:
        return _commit(optimizer, copies, hint, rewrite, installed, protect, in_place, finish)
    finally:
        for buf in staging:  # (the copies from them completed: _write_in_place synchronized)
            host_pool.release(buf)


def _commit(
    optimizer: Any,
    copies: Copies,
    hint: list[Mechanism] | None,
    rewrite: Callable[[], None] | None,
    installed: Sequence[Sequence[tuple[Any, Any]]] | None,
    protect: frozenset[int] | set[int],
    in_place: Mapping[torch.device, tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]]],
    finish: Sequence[Setter],
) -> list[Mechanism]:
    assignments: list[tuple[Any, Any, Any]] = []  # (mapping, key, new value)
    setters: list[Setter] = []  # in-place updates inside nested containers
    if installed is None:
        replaced, apply, hows = adoptions(copies.pairs, protect=protect, hint=hint, distinct=True, fresh=copies.fresh)
        if replaced:
            _prepare_replacements(optimizer, {id(old): new for old, new in replaced}, assignments, setters)
    with uninterrupted():
        if rewrite is not None:
            rewrite()
        if installed is not None:
            # (decided once the rewrite ran, pure: a pair whose copy a class's fix-up replaced somewhere, e.g. a
            # __setstate__ that recasts an entry, is left as the fix-up made it; the rest take their places back)
            at = [
                i
                for i, places in enumerate(installed)
                if all(mapping.get(key) is copies.pairs[i][1] for mapping, key in places)
            ]
            pairs = [copies.pairs[i] for i in at]
            _, apply, hows = adoptions(pairs, protect=protect, hint=hint, distinct=True)
            assignments = [
                (mapping, key, old)
                for (old, _), how, i in zip(pairs, hows, at)
                if how != "replace"
                for mapping, key in installed[i]
            ]
        if in_place:
            _write_in_place(in_place)
        counts = apply()
        for mapping, key, value in assignments:
            mapping[key] = value
        for apply_one in setters:
            apply_one()
        for apply_one in finish:
            apply_one()
    copies.mechanisms = counts
    return hows


# The operations under way in the main thread (nested ones join the outermost): each [the SIGINT handler a commit
# section replaced (None: none yet), the signals it held].
_operations: list[list[Any]] = []


@contextlib.contextmanager
def operation() -> Iterator[None]:
    """The span of one operation (``api``'s, a load, ``stream``/``unstream``): a Ctrl-C that a commit section
    (:func:`uninterrupted`) holds is handed to its handler at the operation's end, once the operation's own
    records (the offload record, the transfer in flight, grads given back, a mode) are in place too, not at the
    commit's. Nested operations join the outermost. Never under the caller's inference mode: a copy made there
    would be an inference tensor, which the next step outside it may not update in place."""
    if _operations or threading.current_thread() is not threading.main_thread():
        with torch.inference_mode(False):
            yield
        return
    frame: list[Any] = [None, []]
    try:
        _operations.append(frame)  # (inside the try: a Ctrl-C right after it left the frame there for good)
        with torch.inference_mode(False):
            yield
    finally:
        if _operations and _operations[-1] is frame:
            _operations.pop()
        previous, caught = frame
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
            if caught:
                previous(caught[0][0], sys._getframe())  # (a frame, as Python gives one: this one, where it lands)


@contextlib.contextmanager
def uninterrupted(*, to_the_end: bool = True) -> Iterator[None]:
    """A commit runs to its end: a SIGINT (Ctrl-C, ``KeyboardInterrupt``) that arrives from here on is held and
    handed to its handler when the operation ends (:func:`operation`), or this section where none is under way,
    so an interrupt never leaves part of the state installed. Several held are handed over once. Only in the
    main thread (the one Python delivers signals to) and for a Python-level handler (torch's default included).
    ``to_the_end=False``: held for this section only (a few statements a Ctrl-C must not cut in two, hooks
    registered and their handles kept by a caller who removes them if the operation fails), handed over at its end.

    # NOTE: what is held is the signal number, never the frame it landed in: that frame's locals (the old device
    # tensors a commit replaced) would stay alive until the operation's end, past its release of their memory. The
    # handler is given the frame it is handed over in (a handler may read it: ``frame.f_lineno``), as Python gives
    # the frame a signal lands in."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    if _operations and _operations[-1][0] is not None:  # (held already, by this operation)
        yield
        return
    previous = signal.getsignal(signal.SIGINT)
    if not callable(previous):  # (ignored, or the OS default: nothing Python would raise)
        yield
        return
    joins = to_the_end and bool(_operations)  # (the operation hands it over at its end)
    caught: list[tuple[int, Any]] = _operations[-1][1] if joins else []
    signal.signal(signal.SIGINT, lambda signum, frame: caught.append((signum, None)))
    if joins:
        _operations[-1][0] = previous
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if caught:
            previous(caught[0][0], sys._getframe())


def _write_in_place(
    pairs_by_device: Mapping[torch.device, tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]]],
) -> None:
    """Each live tensor takes its source's values (``old.copy_(new)``; by device, the live tensors and their
    sources, pair by pair), one foreach copy per device, as part of a commit (:func:`commit`'s
    ``copies.in_place``). The caller chose pairs of one dtype, shape and strides, each ``old`` on its device: a
    per-tensor copy allocates nothing and cannot fail. The foreach copy may refuse or allocate where per-tensor
    copies do not (a dtype a device's foreach kernel lacks, such as uint32 on CUDA; a conjugate or negative view,
    which torch resolves into a temporary first): then every pair of that device is copied one by one (writing
    the same values again). On the host under inference mode: torch's CPU foreach copy is a per-tensor ``copy_``
    each, which then skips the autograd layers (no live tensor here requires grad or is an inference tensor, and
    in-place writes still bump their version counters)."""
    queued: set[torch.device] = set()
    try:
        with torch.no_grad():
            for device, (olds, news) in pairs_by_device.items():
                # (a source elsewhere: a host checkpoint into state on an accelerator, queued from pinned memory
                # where it is staged there; a copy into host memory is never queued)
                # (into host memory a copy is never queued, and none needs a synchronize: not asked, one C call
                # per tensor saved on the common load into host state)
                across = device.type not in HOSTS and any(new.device != device for new in news)
                queue = across and any(map(in_pinned_memory, news))
                if across:
                    queued.add(device)
                with torch.inference_mode() if device.type == "cpu" else contextlib.nullcontext():
                    try:
                        torch._foreach_copy_(list(olds), list(news), non_blocking=queue)
                    except Exception:
                        for old, new in zip(olds, news):
                            old.copy_(new, non_blocking=queue)
    finally:
        synchronize(queued)  # (before the pinned sources go back to the pool, and the load returns)


def _pinned_in_place(
    pairs_by_device: Mapping[torch.device, tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]]],
) -> tuple[dict[torch.device, tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]]], list[torch.Tensor]]:
    """``pairs_by_device`` with each host source bound for an accelerator as a view of a pinned pool buffer
    (:func:`optimshift._copy.pinned_sources`), so :func:`_write_in_place` queues those copies and waits once; and
    the buffers, for the pool once it has."""
    out: dict[torch.device, tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]]] = {}
    buffers: list[torch.Tensor] = []
    try:
        for device, (olds, news) in pairs_by_device.items():
            staged, held = pinned_sources(news, device, host_pool)
            buffers.extend(held)
            out[device] = (olds, staged)
    except BaseException:
        for buf in buffers:
            host_pool.release(buf)
        raise
    return out, buffers


_grad_of = attrgetter("grad")
_first = itemgetter(0)
_tensor, _target = itemgetter(2), itemgetter(4)


def outside_owned(optimizer: Any) -> set[int]:
    """ids of the optimizer's params and their grads: a state entry that *is* one of them (a frozen param kept
    as state) must be replaced, never changed in place, or the model would move with the state."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    owned = set(map(id, params))
    try:
        grads = list(map(_grad_of, params))  # (in one pass in C: every param a tensor, as torch.optim requires)
    except AttributeError:
        grads = [p.grad for p in params if isinstance(p, torch.Tensor)]
    owned.update(map(id, grads))
    owned.discard(id(None))  # (a param without a grad)
    return owned


def _prepare_replacements(
    optimizer: Any, replace: Mapping[int, torch.Tensor], assignments: list[tuple[Any, Any, Any]], setters: list[Setter]
) -> None:
    memo: dict[int, Any] = {}
    for key, state in optimizer.state.items():
        if isinstance(state, dict):
            _prepare_mapping(state, (), replace, assignments, setters, memo)
        else:  # an optimizer-wide entry under a plain key
            new = rebuild(state, replace, setters, memo)
            if new is not state:
                assignments.append((optimizer.state, key, new))
    for group in optimizer.param_groups:
        _prepare_mapping(group, GROUP_SKIP, replace, assignments, setters, memo)


def _prepare_mapping(
    mapping: Any,
    skip: tuple[str, ...],
    replace: Mapping[int, torch.Tensor],
    assignments: list[tuple[Any, Any, Any]],
    setters: list[Setter],
    memo: dict[int, Any],
) -> None:
    for key, value in mapping.items():
        if isinstance(value, torch.Tensor):  # the common case, kept cheap
            new = replace.get(id(value))
            if new is not None:
                assignments.append((mapping, key, new))
        elif key not in skip:
            new = rebuild(value, replace, setters, memo)
            if new is not value:
                assignments.append((mapping, key, new))


@contextlib.contextmanager
def no_gc() -> Iterator[None]:
    """Pause the cyclic garbage collector while a plan runs: it creates many small objects next to many live
    tensors, and collections triggered by them would cost more than the copies themselves. The collector is
    one per process: the first of the operations in flight (in any thread) pauses it, and the last one out turns
    it back on if it was on then (a gc.disable() made meanwhile by other code is not seen).

    # NOTE: a Ctrl-C lands after any call returns (CPython checks for signals there, at a loop's jump back and
    # at a function's start): every step that changes the bookkeeping is inside the ``try``, and each change is
    # one statement with no call (a dict store or delete), so an interrupt anywhere leaves it as no operation
    # had begun. (A stack of flags, pushed before the ``try`` and popped before the collector was turned back
    # on, left it off for good: each later operation found it off when it began.)"""
    token = object()
    try:
        with _paused_lock:
            if not _pausing:
                _paused[0] = gc.isenabled()
            _pausing[token] = None
            gc.disable()
        yield
    finally:
        with _paused_lock:
            if token in _pausing:
                del _pausing[token]
                if not _pausing and _paused[0]:
                    gc.enable()


_paused_lock = threading.Lock()
_paused = [True]  # whether the collector was on when the first of the operations in flight paused it
_pausing: dict[object, None] = {}  # a token per operation in flight that paused it
