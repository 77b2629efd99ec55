"""Tensors that share a storage are copied as one storage: its bytes once, each copy a view of the new storage at
the same offset, size and stride. Why: per-param views of a flat buffer must still see ``flat.add_()`` after a copy.

Tensors on a storage nothing else uses are copied together; on one something else uses too (a param, a pool
buffer, a base held only by the views' ``_base``, which no count tells apart), only those whose bytes overlap.
"""

from __future__ import annotations

import itertools
import operator
import sys
from collections import Counter
from collections.abc import Callable, Sequence

import torch

from ._devices import _fake_mode_active
from ._dtensor import is_dtensor, wrap_local
from ._state import like_source

__all__ = ["located", "shared", "copy_storage", "sole_user", "span", "storage_key"]

_address: Callable[[torch.Tensor], int] = getattr(
    torch._C, "_storage_address", lambda t: int(t.untyped_storage()._cdata)
)
_use_count: Callable[[int], int] = torch._C._storage_Use_Count
_PLAIN = (torch.Tensor, torch.nn.Parameter)
_PLAIN_SET = frozenset(_PLAIN)
_NBYTES = operator.attrgetter("nbytes")
_DEVICE = operator.attrgetter("device")


storage_of = _address
"""The identity of a plain tensor's storage (an empty one's too), without making a Python storage object."""


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor that holds the storage: a DTensor's local shard (its own object, not a ``to_local()`` view,
    which would hold the storage once more), else ``t``."""
    return getattr(t, "_local_tensor", t) if is_dtensor(t) else t


def storage_key(t: torch.Tensor) -> int | None:
    """The identity of ``t``'s storage (a DTensor's local shard's), or None where it is not copied as a storage: other
    subclasses (FakeTensor, wrapper subclasses) may keep their data elsewhere, and are copied one by one."""
    if type(t) not in _PLAIN and not is_dtensor(t):
        return None
    try:
        return _address(_local(t))
    except Exception:  # a layout without a storage (sparse, nested): copied one by one
        return None


def located(tensors: Sequence[torch.Tensor]) -> tuple[list[torch.device], list[int | None]]:
    """Each tensor's device and its storage's key (:func:`storage_key`; None under FakeTensorMode, where no bytes
    are shared), asked in one walk: a walk each read every tensor's memory twice (50k do not fit in a cache)."""
    if _fake_mode_active():
        return list(map(_DEVICE, tensors)), [None] * len(tensors)
    if set(map(type, tensors)) <= _PLAIN_SET:
        keys: list[int | None] = []
        key = keys.append  # (returns None: the keys listed as the devices are, no pair built per tensor)
        try:
            return [key(_address(t)) or t.device for t in tensors], keys
        except Exception:  # a plain tensor without a storage (sparse): asked one by one
            pass
    return list(map(_DEVICE, tensors)), list(map(storage_key, tensors))


def shared(tensors: Sequence[torch.Tensor], keys: Sequence[int | None] | None = None) -> list[list[int]]:
    """Groups of indices into ``tensors`` (distinct, two or more each) to copy as one storage with
    :func:`copy_storage`; one C call per tensor when nothing is shared. ``keys``: :func:`located`'s, if asked."""
    # NOTE: under FakeTensorMode there are no bytes to share (and FakeTensors outside one have no key): located's
    # keys are None there, asked once for the caller that gave them.
    if not tensors:
        return []
    if keys is None:
        keys = located(tensors)[1]
    if len(set(keys)) == len(keys):
        return []
    many = {k for k, n in Counter(keys).items() if n > 1 and k is not None}
    if not many:
        return []
    members: dict[int, dict[int, int]] = {}  # storage -> {id(tensor): index of its first occurrence}
    for i, k in enumerate(keys):
        if k in many:
            members.setdefault(k, {}).setdefault(id(tensors[i]), i)
    groups = []
    for k, found in members.items():
        indices = list(found.values())
        if len(indices) < 2:
            continue
        first = _local(tensors[indices[0]])
        if first.is_meta:
            continue  # (no bytes to share)
        storage = first.untyped_storage()  # (held while counting: one Python storage object, see below)
        if storage.nbytes() == 0:
            continue
        # NOTE: a storage's use count is one per TensorImpl on it, plus one for its Python storage object (which
        # torch keeps alive with the storage once created; `storage` above makes sure there is one). Anything
        # more is a user outside the members: a param, a grad, a pool buffer, a base (held or not).
        whole = _use_count(k) == len(indices) + 1
        del storage
        for group in [indices] if whole else _overlapping(indices, tensors):
            if _rebuildable([tensors[i] for i in group]):
                groups.append(group)
    return groups


def _rebuildable(members: list[torch.Tensor]) -> bool:
    """Whether each of ``members`` can be rebuilt as a view of a copy of their storage: on one device, no
    conjugate or negative view (its bit is kept outside the storage, which a rebuilt view would lose)."""
    locals_ = [_local(t) for t in members]
    device = locals_[0].device
    return not any(t.is_conj() or t.is_neg() or t.device != device for t in locals_)


def _bytes(t: torch.Tensor) -> tuple[int, int]:
    """The bytes of its storage that ``t`` (a local tensor) reads: ``[start, end)``, empty for no element."""
    size = t.element_size()
    start = int(t.storage_offset()) * size
    if t.numel() == 0:
        return start, start
    return start, start + (1 + sum((int(n) - 1) * s for n, s in zip(t.shape, t.stride()))) * size


def _overlapping(indices: list[int], tensors: Sequence[torch.Tensor]) -> list[list[int]]:
    """The members of one storage (``indices`` into ``tensors``) in groups of two or more that share bytes. A few C
    calls per member and no tensor made where none share (offloaded state in a pool buffer: many disjoint views)."""
    members = [tensors[i] for i in indices]
    locals_ = members if set(map(type, members)) <= _PLAIN_SET else list(map(_local, members))
    # (byte positions from data pointers: one C call for where each starts, one for its bytes if contiguous)
    starts = list(map(torch.Tensor.data_ptr, locals_))
    lengths = list(map(_NBYTES, locals_))
    for k, contiguous in enumerate(map(torch.Tensor.is_contiguous, locals_)):
        if not contiguous:
            start, end = _bytes(locals_[k])
            lengths[k] = end - start
    ends = list(map(operator.add, starts, lengths))
    order = [k for k, n in enumerate(lengths) if n]  # (an empty tensor shares no byte)
    at = [starts[k] for k in order]
    if not all(map(operator.le, at, at[1:])):  # (views cut in order: sorted already)
        order.sort(key=starts.__getitem__)
        at = [starts[k] for k in order]
    reach = list(itertools.accumulate((ends[k] for k in order), max))
    # (each member whose interval starts inside the ones before it joins them)
    joins = list(map(operator.lt, at[1:], reach[:-1]))
    if not any(joins):
        return []
    components: list[list[int]] = []
    for k, joined in zip(order, [False, *joins]):
        if joined:
            components[-1].append(k)
        else:
            components.append([k])
    groups: list[list[int]] = []
    for component in components:
        if len(component) < 2:
            continue
        # (dense members read every byte of their interval: chained intervals share bytes; others are checked)
        parts = [component] if all(_dense(locals_[k]) for k in component) else _sharing(component, locals_)
        groups.extend(sorted(indices[k] for k in part) for part in parts if len(part) > 1)
    return groups


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t`` reads every element of its byte interval (contiguous in some order of its dimensions)."""
    start, end = _bytes(t)
    return end - start == t.numel() * t.element_size()


_EXACT_LIMIT = 1 << 24
"""At most this many elements compared one by one (the members of one component); past it they count as sharing."""


def _sharing(component: list[int], locals_: list[torch.Tensor]) -> list[list[int]]:
    """``component`` (members whose intervals chain) split into the groups that share elements (all of it where
    their element sizes differ or past :data:`_EXACT_LIMIT` elements)."""
    members = [locals_[k] for k in component]
    if len({t.element_size() for t in members}) > 1 or sum(t.numel() for t in members) > _EXACT_LIMIT:
        return [component]
    offsets = torch.cat([_elements(t) for t in members])
    owners = torch.cat([torch.full((t.numel(),), k, dtype=torch.int64) for k, t in zip(component, members)])
    offsets, order = torch.sort(offsets, stable=True)
    owners = owners[order]
    same = (offsets[1:] == offsets[:-1]) & (owners[1:] != owners[:-1])
    parent = {k: k for k in component}

    def root(k: int) -> int:
        while parent[k] != k:
            k = parent[k]
        return k

    for a, b in set(zip(owners[:-1][same].tolist(), owners[1:][same].tolist())):
        parent[root(b)] = root(a)
    parts: dict[int, list[int]] = {}
    for k in component:
        parts.setdefault(root(k), []).append(k)
    return list(parts.values())


def _elements(t: torch.Tensor) -> torch.Tensor:
    """The storage offsets of ``t``'s elements (on the host)."""
    out = torch.full((1,) * t.dim(), int(t.storage_offset()), dtype=torch.int64)
    for dim, (n, stride) in enumerate(zip(t.shape, t.stride())):
        shape = [1] * t.dim()
        shape[dim] = int(n)
        out = out + torch.arange(int(n), dtype=torch.int64).mul_(stride).view(shape)
    return out.reshape(-1)


_ALIGN = 256
"""A copied span starts at a multiple of this many bytes of its storage: each member keeps its alignment (what
vectorized kernels and compiled code check) in an allocation aligned as well."""


def span(members: Sequence[torch.Tensor]) -> tuple[int, int]:
    """``(first, count)``: the bytes of their storage that ``members`` (one group of :func:`shared`) cover, the
    first one a multiple of :data:`_ALIGN` (each keeps a whole storage offset in a copy, and its alignment)."""
    bounds = [_bytes(_local(t)) for t in members]
    first = min(b[0] for b in bounds) // _ALIGN * _ALIGN
    return first, max(b[1] for b in bounds) - first


def offset_in(t: torch.Tensor, first: int) -> int:
    """``t``'s storage offset in a copy of its storage's bytes from ``first`` on (see :func:`span`)."""
    local = _local(t)
    return int(local.storage_offset()) - first // local.element_size()


def sole_user(t: torch.Tensor) -> bool:
    """Whether ``t`` (a plain tensor) is all that uses its storage: no view of it, no tensor on the same storage,
    no Python storage object of it that anyone holds (a caller may read or write through one), so writing into
    it in place changes nothing else."""
    count = _use_count(_address(t))
    return count == 1 or (count == 2 and _only_kept_storage_object(t))


def _storage_refs(t: torch.Tensor) -> int:
    """The Python references to ``t``'s storage object, counted from here (made if there was none)."""
    storage = t.untyped_storage()
    return sys.getrefcount(storage)


def _kept_object_counts() -> bool:
    """Whether this torch keeps a storage's Python object, once made, for as long as the storage lives, and counts
    it as a use of the storage (torch >= 2.10: ``torch.save`` and ``deepcopy`` of a tensor leave one). An older
    torch counts it only while something holds it: there a count of 2 is always a second tensor."""
    t = torch.empty(1)
    before = _use_count(_address(t))
    _storage_refs(t)
    return _use_count(_address(t)) == before + 1


_KEPT_OBJECT_COUNTS = _kept_object_counts()
_PROBE = torch.empty(1)  # (a storage object nobody holds, to count against: see _only_kept_storage_object)
_storage_refs(_PROBE)


def _only_kept_storage_object(t: torch.Tensor) -> bool:
    """Whether the second use of ``t``'s storage is a Python storage object torch keeps (``torch.save`` and
    ``deepcopy`` leave one) and nobody holds: its references counted against :data:`_PROBE`'s, counted the same way
    (a tracer holding frames' locals adds one to both). Where there was none, asking makes one: the count is 3."""
    if not _KEPT_OBJECT_COUNTS:
        return False
    refs = _storage_refs(t)
    return refs == _storage_refs(_PROBE) and _use_count(_address(t)) == 2


def own_storages(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether no two of ``tensors`` (plain tensors with storages) are on one storage, which also means none is
    there twice: one C call per tensor."""
    return len(set(map(_address, tensors))) == len(tensors)


def sole_users(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether each of ``tensors`` (plain tensors) is all that uses its storage (see :func:`sole_user`)."""
    # (a count is at least 1: the common case, in one pass in C)
    return max(map(_use_count, map(_address, tensors)), default=1) == 1 or all(map(sole_user, tensors))


def copy_storage(
    members: Sequence[torch.Tensor],
    target: torch.device,
    copy: Callable[[torch.Tensor, torch.device], torch.Tensor],
    *,
    dtype: torch.dtype | None = None,
) -> list[torch.Tensor]:
    """Copies of ``members`` (one group of :func:`shared`) on ``target``, views of one copy of the :func:`span` they
    cover, made by the caller's ``copy(src, target)`` (of the bytes; with ``dtype``, of the elements, cast)."""
    locals_ = [_local(t) for t in members]
    first = locals_[0]
    storage = first.untyped_storage()
    start, nbytes = span(members)
    if dtype is None:
        src = torch.empty(0, dtype=torch.uint8, device=first.device).set_(storage, start, (nbytes,), (1,))
    else:
        if any(t.dtype != first.dtype for t in locals_):  # pragma: no cover - a caller bug
            raise ValueError("copy_storage: a cast needs members of one dtype")
        size = first.element_size()
        src = torch.empty(0, dtype=first.dtype, device=first.device).set_(
            storage, start // size, (nbytes // size,), (1,)
        )
    if target == first.device and dtype is None:
        new_bytes = src.clone()  # (a copy to the same device: ``copy`` may hand the tensor itself back)
    else:
        new_bytes = copy(src, target)
    new_storage = new_bytes.untyped_storage()
    out = []
    for t, local in zip(members, locals_):
        view = torch.empty(0, dtype=local.dtype if dtype is None else dtype, device=new_bytes.device)
        view.set_(new_storage, offset_in(local, start), local.size(), local.stride())
        out.append(_like(t, view))
    return out


def _like(t: torch.Tensor, view: torch.Tensor) -> torch.Tensor:
    """``view`` dressed as ``t`` was: a DTensor around it, a Parameter, ``requires_grad``. (A DTensor other DTensors in
    state view cannot be swapped, torch's swap_tensors counts them: it is replaced, still sharing.)"""
    return like_source(t, wrap_local(t, view) if is_dtensor(t) else view)
