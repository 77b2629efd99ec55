"""Copying many tensors between the host and an accelerator at once.

Per-tensor ``.to()`` loops (verl, NeMo-RL, Megatron's fallback) pay a launch, and for device-to-host a sync,
per tensor. Here transfers are grouped by (source device, target device, dtype) and cut into chunks:

- device -> host: one ``torch.cat`` on the device, one copy into a host buffer from the pool (pinned where the
  accelerator can pin host memory, see :func:`optimshift._device_streams.pins_host_for`);
- host -> device: one copy of a host buffer (no staging at all when the tensors already sit side by side in a
  pool buffer, as offloaded state does) into a flat device buffer, then one ``_foreach_copy_`` into separate
  device tensors;
- anything else (device to device, tensor subclasses, non-contiguous or autograd tensors) tensor by tensor.

Every copy is queued first; the caller synchronizes once per device. Nothing here touches an optimizer:
the engine (:mod:`optimshift._engine`) decides what to copy and commits the copies.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import operator
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from operator import attrgetter, itemgetter
from typing import Any, cast

import torch

from . import _alias
from ._device_streams import Streams, in_pinned_memory, pins_copy, pins_host_for, synchronize
from ._devices import HOSTS, _fake_mode_active
from ._dtensor import is_dtensor, local_tensor, wrap_local
from ._errors import add_note
from ._state import like_source
from .pool import HostPool

__all__ = [
    "Batch",
    "Options",
    "BLOCKING",
    "Side",
    "copy_many",
    "cast_tensor",
    "copy_strides",
    "contiguous_strides",
    "copy_into",
    "note_copy",
    "copy_tensor",
    "CHUNK_BYTES",
    "pinned_sources",
    "SOLO_BYTES",
]

CHUNK_BYTES = 64 << 20  # staging chunk: bounds the extra device memory a coalesced copy needs
SOLO_BYTES = 4 << 20  # tensors at least this big are copied on their own (bandwidth-bound already)


@dataclass(frozen=True)
class Options:
    """How a transfer copies, passed down whole from the operation to the copies (never as loose flags).

    ``non_blocking``: copies may run on after the call (on a side stream where the device has streams);
    ``pin_memory``: host buffers are pinned where the accelerator pins host memory; ``keep_host_views``: host
    copies stay views into pool buffers (offloaded state) instead of tensors of their own; ``lane``: which side
    stream of the device a non-blocking transfer queues on (:meth:`optimshift._device_streams.Streams.side`: the
    streamed step's layout queues on its own lane, so its step's loads are ordered after it). Destinations a
    caller allocated (a streamed chunk's host views, a keep_addresses reload's slots) are
    :func:`optimshift._engine.run`'s ``into``.
    """

    non_blocking: bool = False
    pin_memory: bool = False
    keep_host_views: bool = False
    lane: str = "engine"


BLOCKING = Options()


class Side:
    """Copies issued on another stream than the current one (the engine's side stream).

    # NOTE: CUDA's caching allocator keeps a freed block for the stream that allocated it. Every device tensor
    # a side-stream copy makes (outputs, staging temporaries) is therefore allocated on the current stream,
    # which keeps using the outputs (a block the side stream allocated could not be reused by the next step
    # without an empty_cache or an allocation failure, which synchronizes); only the copies are issued on the
    # side stream, and every device tensor they read or write is ``record_stream``-ed to it, so freeing one
    # early never hands its memory out under a queued copy.
    """

    def __init__(self, streams: Streams, stream: Any, current: Any) -> None:
        self.streams = streams
        self.stream = stream
        self.current = current

    def issue(self) -> contextlib.AbstractContextManager[None]:
        """The ``with`` body queues its work on the side stream, after everything queued on the current stream
        so far.

        # NOTE: the wait covers the allocations just made: a block the current stream freed may still be in use
        # by its queued work when the allocator hands it out again, and only that stream's order protects it.
        """
        self.streams.wait_stream(self.stream, self.current)
        return self.streams.use(self.stream)

    def uses(self, *tensors: torch.Tensor) -> None:
        """The side stream reads or writes these (device tensors are recorded for it; host ones need nothing)."""
        for t in tensors:
            local = local_tensor(t)
            if local.device.type not in HOSTS:
                self.streams.record_stream(local, self.stream)


def _issue(side: Side | None) -> contextlib.AbstractContextManager[None]:
    return contextlib.nullcontext() if side is None else side.issue()


def copy_tensor(
    t: torch.Tensor,
    device: torch.device,
    non_blocking: bool = False,
    pin_memory: bool = False,
    side: Side | None = None,
) -> torch.Tensor:
    """A copy of ``t`` on ``device`` with the same dtype, shape, strides and values (a move is not a cast).
    ``side``: the copy is queued on that stream, a device output allocated on the current one (:class:`Side`)."""
    if side is None and type(t) is torch.Tensor and not pin_memory and not t.requires_grad:  # common, kept cheap
        if non_blocking or (pins_host_for(device) and in_pinned_memory(t)):
            return t.to(device, non_blocking=True)
        return t.to(device)  # (keyword arguments alone double the cost of a small .to())
    if is_dtensor(t):  # FSDP2/TP state: the local shard moves by the same rules; mesh, placements, shape stay
        shard = t._local_tensor
        local = copy_tensor(shard, device, non_blocking, pin_memory, side)
        if local is shard:  # (.to() of a shard already there is the shard itself: a copy is never the original)
            local = shard.clone()
        return like_source(t, wrap_local(t, local.detach()))
    pin = pins_copy(t, device, pin_memory)
    src = t.detach() if t.requires_grad or pin else t
    if pin or (side is not None and device.type not in HOSTS):  # allocated here, filled on the copy's stream
        new = torch.empty_strided(
            t.shape,
            copy_strides(t),
            dtype=t.dtype,
            device=device,
            pin_memory=pin,
        )
        with _issue(side):
            new.copy_(src, non_blocking=True)  # completed by the caller's synchronize or event
    else:
        with _issue(side):
            new = src.to(device, copy=True, non_blocking=non_blocking or in_pinned_memory(t))
    if side is not None:
        side.uses(t, new)
    return like_source(t, new)


def cast_tensor(t: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A copy of ``t`` on ``device`` in ``dtype`` (a load's cast), never ``t`` itself: cast as it is copied, one
    allocation (a parameter, a subclass: :func:`copy_tensor`'s copy, then cast)."""
    if type(t) is torch.Tensor and not t.requires_grad:
        return t.to(device, dtype, False, True)
    new = copy_tensor(t, device)  # (a copy, where it is too: only a plain tensor is handed back itself)
    return new if new.dtype == dtype else new.to(dtype)


def copy_strides(t: torch.Tensor) -> tuple[int, ...]:
    """The strides ``t``'s copy has (as a copy keeps them: its own where dense, else contiguous)."""
    return tuple(t.stride()) if _dense_non_overlapping(t) else contiguous_strides(t.shape)


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, running = [], 1
    for size in reversed(shape):
        strides.append(running)
        running *= max(size, 1)
    return tuple(reversed(strides))


def _dense_non_overlapping(t: torch.Tensor) -> bool:
    if t.is_contiguous():
        return True
    # Sort dims by stride and check the strides tile the storage exactly (as empty_like's preserve_format does).
    dims = sorted((s, n) for s, n in zip(t.stride(), t.shape) if n != 1)
    expected = 1
    for stride, size in dims:
        if stride != expected:
            return False
        expected *= size
    return True


@dataclass
class Batch:
    """The result of :func:`copy_many`: ``copies[i]`` is the copy of input ``i``.

    ``held``: pool buffers that the returned host tensors live in (offloaded state) — the caller owns them.
    ``after_sync``: host-side work that needs the copies complete (splitting staged host data into separate
    tensors). ``staging``: pool buffers to give back once the copies that read them are complete. ``fresh``: every
    copy a ``.to`` or ``clone`` just made of a plain tensor not requiring grad, outside inference mode and any torch
    mode: a plain tensor, no inference tensor, requiring no grad, its TensorImpl held by nothing else (what
    ``_adopt.decide_all`` need not ask, of it or of whether its source requires grad).
    """

    copies: list[torch.Tensor | None]
    held: list[torch.Tensor] = field(default_factory=list)
    after_sync: list[Callable[[], None]] = field(default_factory=list)
    staging: list[torch.Tensor] = field(default_factory=list)
    devices: set[torch.device] = field(default_factory=set)
    fresh: bool = False

    def complete(self, pool: HostPool, event: object | None = None) -> None:
        """Finish on the host: run ``after_sync`` work (the caller synchronized first) and give the staging
        buffers back (with ``event``, when the copies may still be in flight, they are reused after it)."""
        work, self.after_sync = self.after_sync, []
        try:
            for step in work:
                step()
        finally:  # (a step that fails, or a Ctrl-C in one, must not keep the buffers from the pool for good)
            staging, self.staging = self.staging, []
            for buf in staging:
                pool.release(buf, event)


def _coalescible(t: torch.Tensor) -> bool:
    """Whether ``t`` can be staged through a flat buffer (the caller checked: host <-> accelerator)."""
    return (
        type(t) is torch.Tensor
        and t.layout == torch.strided
        and not t.requires_grad
        and t.is_contiguous()
        and t.numel() > 0
    )


def _pair_kind(pair: tuple[torch.device, torch.device], group: bool) -> tuple[bool, bool, bool]:
    """How copies from ``pair[0]`` to ``pair[1]`` go: (whether they may be staged through flat pool buffers: host
    <-> accelerator, data to stage; whether a pinned source may be copied asynchronously; whether it stays where
    it is)."""
    source, target = pair
    grouped = group and (source.type == "cpu") != (target.type == "cpu") and "meta" not in (source.type, target.type)
    return grouped, pins_host_for(target), source == target


_first = itemgetter(0)
_second = itemgetter(1)
_where = attrgetter("device", "requires_grad")


def _one_pair(items: Sequence[tuple[torch.Tensor, torch.device]], pair: tuple[torch.device, torch.device]) -> bool:
    """Whether every item is a plain tensor, not requiring grad, on ``pair[0]`` and bound for ``pair[1]``: then they
    are one column, each copied as :func:`copy_many`'s loop would copy it (asked in a few passes in C)."""
    tensors = list(map(_first, items))
    return (
        set(map(type, tensors)) == {torch.Tensor}
        and set(map(_second, items)) == {pair[1]}
        and set(map(_where, tensors)) == {(pair[0], False)}
    )


def copy_many(
    items: Sequence[tuple[torch.Tensor, torch.device]],
    options: Options,
    *,
    pool: HostPool,
    describe: Callable[[int], str] | None = None,
    side: Side | None = None,
    together: Sequence[tuple[list[int], torch.device]] = (),
    columns: Sequence[tuple[Sequence[torch.Tensor], torch.device]] = (),
    casts: Mapping[int, torch.dtype] | None = None,
) -> Batch:
    """Queue a copy of each ``(tensor, target)``; see the module docstring for how they are grouped.

    ``keep_host_views``: host results are views into pool buffers listed in ``Batch.held`` (offload);
    otherwise they are separate tensors and every staging buffer goes back to the pool.
    ``together``: groups of items that share a storage, each copied as that storage (:mod:`optimshift._alias`),
    bound for the device given. What cannot be grouped is copied by
    :func:`copy_tensor`. ``describe(i)`` names input ``i`` in the note added to an exception (an OOM says which
    entry it hit). ``side``: the copies are queued on that stream (:class:`Side`). ``columns``, with no
    ``items``: ``(tensors, target)`` each of which the caller checked alike (plain, dense, contiguous tensors not
    requiring grad, no two on one storage, of one source device and dtype, all bound for one target, all empty or
    none), copied in their order: how a column is copied is decided once, on its first (no item built for a
    column copied in one pass). ``casts``: item index -> the dtype its copy is made in (a load's ``cast``), cast
    as it is copied, one by one (a group of ``together`` by its first item's; never with ``columns``).

    On an exception nothing is returned: every device involved is synchronized first (copies already queued
    read and write memory that is freed as the exception unwinds), then every buffer goes back to the pool.
    """
    non_blocking, pin_memory, keep_host_views = options.non_blocking, options.pin_memory, options.keep_host_views
    group = not _fake_mode_active()  # fake tensors have no data to stage: copy them one by one
    # (source, target) -> (may be grouped, a pinned source may be copied asynchronously, the same place)
    kinds: dict[tuple[torch.device, torch.device], tuple[bool, bool, bool]] = {}
    inline = side is None and not pin_memory
    fresh = False  # (each item copied by one .to of a plain tensor: see Batch.fresh)
    if items and not columns and inline and not non_blocking and not together and not casts:
        # (plain tensors all from one device to one other, neither grouped nor pinned there (a move to meta, across
        # two accelerators): one column, each copied as the loop below would, in one pass in C)
        pair = (items[0][0].device, items[0][1])
        how = kinds[pair] = _pair_kind(pair, group)
        if not (how[0] or how[1]) and _one_pair(items, pair):
            columns = [(list(map(_first, items)), pair[1])]
            fresh = not (
                torch.is_inference_mode_enabled()
                or torch._C._len_torch_function_stack()
                or torch._C._len_torch_dispatch_stack()
            )
    listed: list[Any] = []  # (columns: an item each only where one is copied grouped or one by one, below)
    if columns:
        items = listed = [None] * sum(len(ts) for ts, _ in columns)
    batch = Batch([None] * len(items), fresh=fresh)
    groups: dict[tuple[torch.device, torch.device, torch.dtype], list[int]] = {}
    copies = batch.copies
    current = 0
    wrapped: dict[int, Any] = {}  # index -> the DTensor whose local shard was copied there
    plain = torch.Tensor
    try:
        rest: Iterable[tuple[int, tuple[torch.Tensor, torch.device]]] = enumerate(items)  # (copied one by one)
        if columns:  # (how each column is copied is decided on its first tensor)
            left: list[int] = []
            stop = 0
            for tensors, target in columns:
                start, stop = stop, stop + len(tensors)
                if not tensors:
                    continue
                current = start  # (an error as its copy is decided names its first)
                first = tensors[0]
                pair = (first.device, target)
                how = kinds.get(pair) or kinds.setdefault(pair, _pair_kind(pair, group))
                grouped = how[0] and _coalescible(first)
                if not grouped and inline and (how[2] or not (non_blocking or how[1])):
                    made: list[torch.Tensor] = []  # (a clone or a .to each, in one pass in C)
                    try:
                        made.extend(
                            map(plain.clone, tensors) if how[2] else map(plain.to, tensors, itertools.repeat(target))
                        )
                    except BaseException:
                        current = min(start + len(made), stop - 1)  # (the one that failed)
                        raise
                    # (.to() of a tensor already there, on a device named without its index, hands the tensor back:
                    # a copy never is the original)
                    if not how[2] and any(map(operator.is_, made, tensors)):
                        made = [c.clone() if c is t else c for c, t in zip(made, tensors)]
                    copies[start:stop] = made
                    continue
                listed[start:stop] = zip(tensors, itertools.repeat(target))
                if grouped:
                    groups.setdefault((pair[0], target, first.dtype), []).extend(range(start, stop))
                else:
                    left.extend(range(start, stop))
            rest = zip(left, map(items.__getitem__, left))
        done: set[int] = set()  # tensors that share a storage: copied as that storage (optimshift._alias)
        for indices, target in together if group else ():
            current = indices[0]
            batch.devices.update(d for d in (items[current][0].device, target) if d.type not in HOSTS)
            to = casts.get(current) if casts else None  # (its storage's elements cast: see _alias.copy_storage)
            news = _alias.copy_storage(
                [items[i][0] for i in indices],
                target,
                functools.partial(cast_tensor, dtype=to)
                if to is not None
                else lambda src, dst: copy_tensor(src, dst, non_blocking, pin_memory, side),
                dtype=to,
            )
            for i, new in zip(indices, news):
                copies[i] = new
            done.update(indices)
        # what the grouped copies read: DTensors' local shards in their place (a list of its own once one is)
        work: Sequence[tuple[torch.Tensor, torch.device]] = items
        for i, (t, target) in rest:
            if done and i in done:
                continue
            if casts and i in casts:
                current = i
                copies[i] = cast_tensor(t, target, casts[i])
                continue
            original = t
            if type(t) is not plain and group and is_dtensor(t) and not t.requires_grad:
                # NOTE: FSDP2/TP state: the local shard goes through the grouped, pooled copies as a plain
                # tensor would; the copy is wrapped back with the same mesh, placements and global shape.
                t = t._local_tensor  # (the shard itself: to_local() may add an autograd view)
            source = t.device
            pair = (source, target)
            kind = kinds.get(pair)
            if kind is None:
                kind = kinds[pair] = _pair_kind(pair, group)
            if kind[0] and _coalescible(t):
                groups.setdefault((source, target, t.dtype), []).append(i)
                if t is not original:
                    if work is items:
                        work = list(items)
                    cast(list[tuple[torch.Tensor, torch.device]], work)[i] = (t, target)
                    wrapped[i] = original
                continue
            current = i
            if inline and t is original and type(t) is plain and not t.requires_grad:
                # NOTE: copy_tensor's common case (a plain tensor, not a DTensor's shard, which copy_tensor wraps
                # back), inlined: this runs once per tensor. Asked where it is (a load's): a clone, which keeps the
                # strides and is the cheapest copy.
                if kind[2]:
                    copies[i] = t.clone()
                    continue
                fast = non_blocking or (kind[1] and in_pinned_memory(t))
                copies[i] = t.to(target, non_blocking=True) if fast else t.to(target)
            else:
                copies[i] = copy_tensor(original, target, non_blocking, pin_memory, side)
            if copies[i] is original:  # (asked where it is: .to() hands the tensor itself back, a copy never is)
                copies[i] = original.clone()
        batch.devices.update(d for pair in kinds for d in pair if d.type not in HOSTS)
        for (src, dst, dtype), indices in groups.items():
            batch.devices.update((src, dst))
            for chunk in _chunks(indices, work):
                current = chunk[0]
                if dst.type == "cpu":
                    _to_host(
                        chunk,
                        work,
                        batch,
                        pool,
                        pinned=pin_memory and pins_host_for(src),
                        keep=keep_host_views,
                        non_blocking=non_blocking,
                        side=side,
                    )
                else:
                    _to_device(
                        chunk,
                        work,
                        batch,
                        pool,
                        dst,
                        dtype,
                        pinned=src.type == "cpu" and pins_host_for(dst),
                        non_blocking=non_blocking,
                        side=side,
                    )
    except BaseException as error:
        # Nothing was committed; give back every buffer once no queued copy can still be using it.
        # NOTE: every device the items copied so far touch, not only those copied in groups: a copy queued tensor
        # by tensor (on a side stream too) reads or writes memory that the unwinding frees. (``kinds`` has every
        # pair reached, the failing one included.)
        synchronize(batch.devices | {d for pair in kinds for d in pair if d.type not in HOSTS})
        for buf in batch.held + batch.staging:
            pool.release(buf)
        if describe is not None and items:
            if columns:  # (every item, a column copied in one pass included, which lists none)
                items = [(t, target) for tensors, target in columns for t in tensors]
            note_copy(error, describe(current), *items[current], casts.get(current) if casts else None)
        raise
    for i, dtensor in wrapped.items():
        local = copies[i]
        assert local is not None
        copies[i] = wrap_local(dtensor, local)
    return batch


def note_copy(
    error: BaseException, what: str, t: torch.Tensor, target: torch.device, dtype: torch.dtype | None = None
) -> None:
    """The note a failed copy (an OOM on the 900th tensor) gets: the entry it hit (``what``), the tensor, where it
    went, the dtype a cast made it in (a load's ``cast``), and that nothing was installed yet."""
    cast_to = f", cast to {dtype}" if dtype is not None and dtype != t.dtype else ""
    add_note(
        error,
        f"optimshift: while copying {what} ({tuple(t.shape)}, {t.dtype}) from {t.device} to {target}{cast_to}; the "
        f"optimizer was left unchanged",
    )


def copy_into(
    pairs: Sequence[tuple[torch.Tensor, torch.Tensor]],
    *,
    side: Side | None = None,
    describe: Callable[[int], str] | None = None,
) -> set[torch.device]:
    """Copy each ``(source, destination)`` into the destination the caller allocated (same dtype, shape and
    strides: a streamed chunk's pooled host view), one foreach copy per pair of devices; on ``side`` when given
    (after the current stream's work so far, every device tensor recorded for it: :class:`Side`). Returns the
    accelerators involved: the caller synchronizes them, or waits for the side stream's event, before the host
    reads a destination. On an exception those are synchronized first (a queued copy may still write one), and
    ``describe(i)`` names the first pair of the copy that failed."""
    by_devices: dict[tuple[torch.device, torch.device], list[int]] = {}
    for i, (src, dst) in enumerate(pairs):
        by_devices.setdefault((src.device, dst.device), []).append(i)
    devices = {d for pair in by_devices for d in pair if d.type not in HOSTS}
    current = 0
    try:
        for (source, target), indices in by_devices.items():
            current = indices[0]
            srcs = [pairs[i][0].detach() for i in indices]
            dsts = [pairs[i][1] for i in indices]
            if source.type in HOSTS and target.type in HOSTS:
                torch._foreach_copy_(dsts, srcs)
                continue
            # (into or from pinned memory, or on a side stream, queued: the caller waits once for all)
            queued = side is not None or in_pinned_memory(dsts[0]) or in_pinned_memory(srcs[0])
            with _issue(side):
                torch._foreach_copy_(dsts, srcs, non_blocking=queued)
            if side is not None:
                side.uses(*srcs, *dsts)  # (a source adopted away is freed before the side stream has read it)
    except BaseException as error:
        synchronize(devices)
        if describe is not None:
            add_note(error, f"optimshift: while copying {describe(current)} into its place; nothing was changed")
        raise
    return devices


def pinned_sources(
    sources: Sequence[torch.Tensor], device: torch.device, pool: HostPool
) -> tuple[Sequence[torch.Tensor], list[torch.Tensor]]:
    """Each of ``sources`` that is a small host tensor bound for ``device`` as a view of a pinned pool buffer
    holding its values (chunked by dtype, as the grouped copies stage them), so the copies from them can be
    queued and waited for once; and those buffers, which go back to the pool once the copies completed.
    ``sources`` as they are where the host is not pinned for ``device``; a tensor of ``SOLO_BYTES`` or more (a
    copy bound by bandwidth, which the grouped copies make directly too) is copied from where it is, as is
    everything once the pool hands out pageable memory (its pinned limit reached: staging would only copy the
    values once more on the host)."""
    if not pins_host_for(device):
        return sources, []
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(sources):
        if (
            t.device.type == "cpu"
            and _coalescible(t)
            and t.numel() * t.element_size() < SOLO_BYTES
            and not in_pinned_memory(t)
        ):
            by_dtype.setdefault(t.dtype, []).append(i)
    if not by_dtype:
        return sources, []
    out = list(sources)
    buffers: list[torch.Tensor] = []
    items = [(t, device) for t in sources]
    try:
        for dtype, indices in by_dtype.items():
            for chunk in _chunks(indices, items):
                tensors = [sources[i] for i in chunk]
                numels = [t.numel() for t in tensors]
                nbytes = sum(numels) * tensors[0].element_size()
                buf = pool.acquire(nbytes, pinned=True, pageable=False)
                if buf is None:
                    return out, buffers  # (the rest from where it is)
                buffers.append(buf)  # (at once: a failing cat must not leak it)
                flat = buf[:nbytes].view(dtype)
                torch.cat([_flat(t) for t in tensors], out=flat)
                for i, view in zip(chunk, _shaped(flat.split(numels), tensors)):  # type: ignore[no-untyped-call]
                    out[i] = view
    except BaseException:
        for buf in buffers:
            pool.release(buf)
        raise
    return out, buffers


def _chunks(indices: list[int], items: Sequence[tuple[torch.Tensor, torch.device]]) -> list[list[int]]:
    chunks: list[list[int]] = []
    current: list[int] = []
    size = 0
    for i in indices:
        t = items[i][0]
        nbytes = t.numel() * t.element_size()
        if nbytes >= SOLO_BYTES:
            chunks.append([i])
            continue
        if size + nbytes > CHUNK_BYTES and current:
            chunks.append(current)
            current, size = [], 0
        current.append(i)
        size += nbytes
    if current:
        chunks.append(current)
    return chunks


# NOTE: a flat part of a chunk is reshaped only where its tensor is not flat already (most state is: a bias, a
# norm's weight, every 1-D param's moments): each view is one more dispatch per tensor, which costs a few
# microseconds on a real device and more on a Python backend.
def _flat(t: torch.Tensor) -> torch.Tensor:
    """``t`` as the flat run of its values that a chunk's concatenation reads (``t`` itself when 1-D)."""
    return t if t.dim() == 1 else t.reshape(-1)


def _shaped(parts: Sequence[torch.Tensor], tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Each flat part of a chunk viewed with its tensor's shape (the part itself for a 1-D tensor)."""
    return [v if t.dim() == 1 else v.view(t.shape) for v, t in zip(parts, tensors)]


def _to_host(
    chunk: list[int],
    items: Sequence[tuple[torch.Tensor, torch.device]],
    batch: Batch,
    pool: HostPool,
    *,
    pinned: bool,
    keep: bool,
    non_blocking: bool = False,
    side: Side | None = None,
) -> None:
    """``non_blocking``: the caller waits for the copies' event before the host reads them (the copies may
    then be asynchronous even into pageable memory, where a backend allows it)."""
    tensors = [items[i][0] for i in chunk]
    if side is not None:
        side.uses(*tensors)
    if len(tensors) == 1 and not keep:  # one big tensor to keep on the host: a plain copy, no staging
        with _issue(side):
            batch.copies[chunk[0]] = tensors[0].to("cpu", non_blocking=non_blocking)
        return
    dtype = tensors[0].dtype
    numels = [t.numel() for t in tensors]
    total = sum(numels)
    buf = pool.acquire(total * tensors[0].element_size(), pinned=pinned)
    (batch.held if keep else batch.staging).append(buf)  # at once: a failing cat must not leak it
    flat = buf[: total * tensors[0].element_size()].view(dtype)
    if len(tensors) == 1:
        source = tensors[0].reshape(-1)
    elif side is None:
        source = torch.cat([_flat(t) for t in tensors])
    else:
        source = torch.empty(total, dtype=dtype, device=tensors[0].device)  # (on the current stream: see Side)
        side.uses(source)
        with side.issue():
            torch.cat([_flat(t) for t in tensors], out=source)
    with _issue(side):
        flat.copy_(source, non_blocking=pinned or non_blocking)  # completed by the caller's synchronize or event
    views = _shaped(flat.split(numels), tensors)  # type: ignore[no-untyped-call]  # unannotated in torch
    if keep:
        for i, v in zip(chunk, views):
            batch.copies[i] = v
        return
    outs = [torch.empty(t.shape, dtype=dtype) for t in tensors]
    for i, out in zip(chunk, outs):
        batch.copies[i] = out

    def split() -> None:  # only once the device-to-host copy is complete
        torch._foreach_copy_(outs, views)

    batch.after_sync.append(split)


def _side_by_side(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """The flat host span that ``tensors`` fill in order, if they are consecutive views of one storage."""
    storage = tensors[0].untyped_storage()
    ptr = storage.data_ptr()
    offset = tensors[0].storage_offset()
    for t in tensors:
        if t.untyped_storage().data_ptr() != ptr or t.storage_offset() != offset:
            return None
        offset += t.numel()
    start = int(tensors[0].storage_offset())
    span: torch.Tensor = tensors[0].new_empty(0).set_(storage, start, (int(offset) - start,), (1,))
    return span


def _to_device(
    chunk: list[int],
    items: Sequence[tuple[torch.Tensor, torch.device]],
    batch: Batch,
    pool: HostPool,
    dst: torch.device,
    dtype: torch.dtype,
    *,
    pinned: bool,
    non_blocking: bool = False,
    side: Side | None = None,
) -> None:
    tensors = [items[i][0] for i in chunk]
    if len(tensors) == 1:
        t = tensors[0]
        if side is None:
            batch.copies[chunk[0]] = t.to(dst, non_blocking=non_blocking or (pinned and in_pinned_memory(t)))
        else:
            batch.copies[chunk[0]] = copy_tensor(t, dst, non_blocking, side=side)
        return
    numels = [t.numel() for t in tensors]
    total = sum(numels)
    host = _side_by_side(tensors)
    if host is None or (pinned and not host.is_pinned()):
        nbytes = total * tensors[0].element_size()
        buf = pool.acquire(nbytes, pinned=pinned)
        batch.staging.append(buf)  # at once (a failing cat must not leak it); reusable once the copy completed
        host = buf[:nbytes].view(dtype)
        torch.cat([_flat(t) for t in tensors], out=host)
    flat = torch.empty(total, dtype=dtype, device=dst)  # (outputs and temporaries on the current stream: Side)
    outs = [torch.empty(t.shape, dtype=dtype, device=dst) for t in tensors]
    if side is not None:
        side.uses(flat, *outs)
    parts = flat.split(numels)  # type: ignore[no-untyped-call]  # unannotated in torch
    with _issue(side):
        flat.copy_(host, non_blocking=pinned or non_blocking)
        torch._foreach_copy_(outs, _shaped(parts, tensors))
    for i, out in zip(chunk, outs):
        batch.copies[i] = out
