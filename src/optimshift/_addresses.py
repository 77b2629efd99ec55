"""Where state lives when it keeps its device addresses (ARCHITECTURE.md, "Keeping device addresses"): reserved
ranges, a slot per storage, mapped in blocks. A site keeps its slot while its storage fits (else it gets one in a
new range); a slot is in use while a :class:`_Lease` held by its tensors' storage lives."""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from . import _alias, _device_streams, _session
from ._copy import copy_strides
from ._devices import HOSTS
from ._errors import warn
from ._plan import Ident, Plan
from ._state import group_tensors, tensors, untensored
from ._vmm import Driver, DriverError, DriverOutOfMemory, driver_for, unsupported

__all__ = ["Layout", "Placement", "keeping", "stage", "release", "layout_of", "devices_of", "mapped_bytes"]

_log = logging.getLogger("optimshift")

_ALIGN = 512  # where a slot may start (what CUDA's caching allocator guarantees its blocks)
_BLOCK_GRANULES = 32  # a block: 32 granules (64 MiB on CUDA's 2 MiB), one physical allocation


def _up(n: int, to: int) -> int:
    return -(-n // to) * to


class _Mapped:
    """A range's driver-side state, shared with its finalizer (which must not hold the range itself)."""

    __slots__ = ("driver", "device", "address", "size", "block", "handles")

    def __init__(self, driver: Driver, device: torch.device, address: int, size: int, block: int) -> None:
        self.driver, self.device, self.address, self.size, self.block = driver, device, address, size, block
        self.handles: list[int | None] = [None] * (-(-size // block))  # per block: its physical allocation

    def span(self, i: int) -> tuple[int, int]:
        start = i * self.block
        return self.address + start, min(self.block, self.size - start)

    def unmap(self, i: int) -> None:
        """Unmap block ``i`` and free its memory (a failure leaves it recorded as mapped, for a later try)."""
        handle = self.handles[i]
        if handle is None:
            return
        address, size = self.span(i)
        self.driver.unmap(self.device, address, size)
        self.handles[i] = None  # (unmapped: should the release fail, the driver frees the handle at exit)
        self.driver.release(self.device, handle)


def _close(mapped: _Mapped) -> None:
    """Unmap every block and give the reservation back once the work queued on its device ran (an offload's copies
    may still read it when its tensors are gone: an optimizer dropped right after a non-blocking offload)."""
    try:
        capture = getattr(getattr(torch, mapped.device.type, None), "is_current_stream_capturing", None)
        if capture is not None and capture():  # (a sync would invalidate the graph being captured)
            _log.warning(
                "optimshift: a reserved range on %s is left to the process's exit (freed while a graph was captured)",
                mapped.device,
            )
            return
        if any(handle is not None for handle in mapped.handles):
            _device_streams.synchronize([mapped.device])
        for i in range(len(mapped.handles)):
            mapped.unmap(i)
        mapped.driver.free_reserved(mapped.device, mapped.address, mapped.size)
    except Exception as e:  # noqa: BLE001 - a finalizer must not raise; the process frees it at exit
        _log.warning("optimshift: could not free a reserved range on %s: %s", mapped.device, str(e))


class _Range:
    """A reserved virtual range on one device and the slots laid out in it."""

    def __init__(self, driver: Driver, device: torch.device, size: int) -> None:
        granularity = driver.granularity(device)
        size = _up(max(size, 1), granularity)
        address = driver.reserve(device, size)
        self.mapped = _Mapped(driver, device, address, size, granularity * _BLOCK_GRANULES)
        self.slots: list[_Slot] = []
        self.close = weakref.finalize(self, _close, self.mapped)
        self.close.atexit = False  # (at exit the process gives everything back)

    def blocks(self, slot: _Slot) -> range:
        block = self.mapped.block
        return range(slot.offset // block, (slot.offset + slot.nbytes - 1) // block + 1)


class _Slot:
    __slots__ = ("offset", "nbytes", "leases")

    def __init__(self, offset: int, nbytes: int) -> None:
        self.offset, self.nbytes = offset, nbytes
        self.leases: list[weakref.ref[_Lease]] = []

    def live(self) -> bool:
        self.leases = [ref for ref in self.leases if ref() is not None]
        return bool(self.leases)


class _Lease:
    """Held by the storage of a tensor over a slot: keeps its range alive and, by living, the slot in use."""

    __slots__ = ("range", "__weakref__")

    def __init__(self, owner: _Range) -> None:
        self.range = owner


@dataclass(eq=False)
class Layout:
    """One optimizer's ranges (per device) and the slot of each site: kept in its session."""

    ranges: list[_Range] = field(default_factory=list)
    places: dict[Ident, tuple[_Range, _Slot]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)


def layout_of(optimizer: Any) -> Layout | None:
    session = _session.of(optimizer)
    return None if session is None else session.addresses


def devices_of(optimizer: Any) -> list[torch.device]:
    """The accelerators the optimizer's params and state are on (what keeping addresses would concern)."""
    found = {p.device: None for group in optimizer.param_groups for p in group["params"] if isinstance(p, torch.Tensor)}
    found.update((t.device, None) for state in optimizer.state.values() for t in tensors(state))
    return [d for d in found if d.type not in HOSTS]


def keeping(optimizer: Any, keep: bool | str, name: str) -> frozenset[torch.device]:
    """The devices on which an offload keeps addresses: True raises ValueError, before anything changes, where a
    device cannot; ``"auto"`` logs one line and keeps them where it can."""
    if keep is False:
        return frozenset()
    if keep is not True and keep != "auto":
        raise ValueError(f"{name}: keep_addresses must be True, False or 'auto', got {keep!r}")
    devices = devices_of(optimizer)
    why = {d: unsupported(d) for d in devices}
    refused = {d: w for d, w in why.items() if w is not None}
    if refused and keep is True:
        device, reason = next(iter(refused.items()))
        raise ValueError(
            f"{name}: offload(keep_addresses=True): {device} cannot keep addresses ({reason}); nothing "
            f"was changed. Pass keep_addresses='auto' to offload without keeping them there"
        )
    if refused:
        _log.info(
            "optimshift: %s: keep_addresses='auto': %s; offloading %s without keeping addresses",
            name,
            "; ".join(f"{d}: {w}" for d, w in refused.items()),
            ", ".join(map(str, refused)),
        )
    return frozenset(d for d in devices if d not in refused)


def _slottable(t: torch.Tensor) -> bool:
    """Whether ``t`` can be given a slot (plain, dense bytes of its own); others reload as before."""
    return type(t) is torch.Tensor and t.layout == torch.strided and not (t.requires_grad or t.is_conj() or t.is_neg())


@dataclass
class _Unit:
    """What one slot holds in a reload: a tensor, or tensors sharing one storage (``shared``)."""

    idents: list[Ident]
    members: list[torch.Tensor]
    device: torch.device
    nbytes: int
    shared: bool
    place: tuple[_Range, _Slot] | None = None


class Placement:
    """One reload's destinations (:meth:`into`), until :meth:`keep` (the commit went through) or :meth:`abandon`."""

    def __init__(self, layout: Layout, units: list[_Unit], fresh: list[_Range]) -> None:
        self._layout = layout
        self._units = units
        self._fresh = fresh
        self._mapped: list[tuple[_Mapped, int]] = []  # (range, block) this reload mapped
        self._dests: dict[int, torch.Tensor] = {}
        self._leases: list[tuple[_Slot, _Lease]] = []

    def into(self, t: torch.Tensor) -> torch.Tensor | None:
        """The destination of ``t``'s copy (a view over its slot), or None: allocated as before."""
        return self._dests.get(id(t))

    def _map(self, name: str, empty_cache: Callable[[], None]) -> None:
        needed: dict[tuple[int, int], tuple[_Mapped, int]] = {}
        for unit in self._units:
            assert unit.place is not None
            owner, slot = unit.place
            for i in owner.blocks(slot):
                if owner.mapped.handles[i] is None:
                    needed.setdefault((id(owner.mapped), i), (owner.mapped, i))
        for mapped, i in needed.values():
            address, size = mapped.span(i)
            try:
                handle = mapped.driver.create(mapped.device, size)
            except DriverOutOfMemory:
                empty_cache()  # the caching allocator's unused blocks, then once more
                try:
                    handle = mapped.driver.create(mapped.device, size)
                except DriverOutOfMemory as e:
                    total = sum(m.span(j)[1] for m, j in needed.values())
                    raise torch.cuda.OutOfMemoryError(
                        f"{name}: reload(keep_addresses) could not map {total} bytes of state on {mapped.device}: "
                        f"out of device memory ({e}), also after emptying the cache; the state is still offloaded "
                        f"on the host, nothing was changed"
                    ) from e
            try:
                mapped.driver.map(mapped.device, address, size, handle)
            except BaseException:
                mapped.driver.release(mapped.device, handle)
                raise
            mapped.handles[i] = handle
            self._mapped.append((mapped, i))
            mapped.driver.set_access(mapped.device, address, size)

    def _wrap(self) -> None:
        for unit in self._units:
            assert unit.place is not None
            owner, slot = unit.place
            lease = _Lease(owner)
            mapped = owner.mapped
            flat = mapped.driver.wrap(mapped.device, mapped.address + slot.offset, slot.nbytes, lease)
            self._leases.append((slot, lease))
            if unit.shared:
                # (a shared storage gets its Python storage object from the copy anyway: see _alias.copy_storage)
                storage = flat.untyped_storage()
                first = _alias.span(unit.members)[0]
                for t in unit.members:
                    view = torch.empty(0, dtype=t.dtype, device=mapped.device)
                    self._dests[id(t)] = view.set_(storage, _alias.offset_in(t, first), t.shape, t.stride())
                del storage
            else:
                # NOTE: no Python storage object for a tensor's own slot (torch keeps one for the storage's
                # lifetime, and it counts as a second user: a load would no longer write the tensor in place); a
                # tensor set_ to a view takes its storage and metadata without becoming a view itself.
                t = unit.members[0]
                size = t.element_size()
                typed = flat[: slot.nbytes // size * size].view(t.dtype)
                view = torch.empty(0, dtype=t.dtype, device=mapped.device)
                source = typed.as_strided(t.shape, copy_strides(t), 0)
                self._dests[id(t)] = view.set_(source)  # type: ignore[call-overload]  # (set_(Tensor): not in the stubs)
                del typed
            del flat, lease

    def keep(self) -> None:
        """The commit went through: the ranges, slots and leases are the layout's."""
        layout = self._layout
        layout.ranges.extend(self._fresh)
        for unit in self._units:
            assert unit.place is not None
            for ident in unit.idents:
                layout.places[ident] = unit.place
        for slot, lease in self._leases:
            slot.leases.append(weakref.ref(lease))
        self._dests.clear()
        self._leases.clear()

    def abandon(self) -> None:
        """The reload failed: what it mapped or reserved is given back, once the copies it queued into it ran."""
        self._dests.clear()
        self._leases.clear()
        fresh = {id(r.mapped) for r in self._fresh}
        _device_streams.synchronize({unit.device for unit in self._units})
        for mapped, i in self._mapped:
            if id(mapped) not in fresh:
                try:
                    mapped.unmap(i)
                except DriverError as e:  # pragma: no cover - a second failure; the next release tries again
                    _log.warning(
                        "optimshift: could not unmap a block on %s while rolling back: %s", mapped.device, str(e)
                    )
        for owner in self._fresh:
            for slot in owner.slots:
                slot.leases.clear()
            owner.close()


def stage(optimizer: Any, plan: Plan, devices: Iterable[torch.device], name: str) -> Placement | None:
    """Lay out, map and wrap the slots of every tensor ``plan`` brings from the host to ``devices`` (None: none);
    raises (out of memory, a driver error) with nothing changed and nothing left mapped."""
    keep = frozenset(devices)
    session = _session.get(optimizer)
    assert session is not None  # (an offloaded optimizer has one)
    idents: dict[int, list[Ident]] = {}
    found: list[tuple[torch.Tensor, torch.device]] = []
    for tr in plan.transfers:
        t, target = tr[2], tr[4]
        if target in keep and t.device.type == "cpu":
            if id(t) not in idents:
                found.append((t, target))
            ident = tr[0]  # (a site under a param key by the param's id: the layout holds no param)
            idents.setdefault(id(t), []).append((ident[0], ident[1], untensored(ident[2])))
    units: list[_Unit] = []
    grouped: set[int] = set()
    # (tensors that share a storage are grouped among all the plan brings here, as the engine groups them: a
    # group with a member that cannot be placed reloads as before, whole)
    for group in _alias.shared([t for t, _ in found]):
        members = [found[i][0] for i in group]
        grouped.update(group)
        nbytes = _alias.span(members)[1] if all(map(_slottable, members)) else 0
        if nbytes:
            units.append(_Unit([i for t in members for i in idents[id(t)]], members, found[group[0]][1], nbytes, True))
    for i, (t, target) in enumerate(found):
        if i not in grouped and _slottable(t) and t.numel():
            units.append(_Unit(list(idents[id(t)]), [t], target, t.numel() * t.element_size(), False))
    if not units:
        return None
    layout = session.addresses
    if layout is None:
        layout = session.addresses = Layout()
    with layout.lock:
        claimed: set[int] = set()
        fresh_units: dict[torch.device, list[_Unit]] = {}
        # (units the layout knows at every site claim their slots first: one it knows at some sites only, a
        # group added while offloaded sharing the lr, takes that tensor's slot if no better claimant did)
        for unit in sorted(units, key=lambda u: not all(i in layout.places for i in u.idents)):
            known = [layout.places[i] for i in unit.idents if i in layout.places]
            place = known[0] if known else None
            if (
                place is not None
                and len({id(p[1]) for p in known}) == 1
                and id(place[1]) not in claimed
                and place[1].nbytes >= unit.nbytes
                and place[0].mapped.device == unit.device
            ):
                unit.place = place
                claimed.add(id(place[1]))
            else:
                fresh_units.setdefault(unit.device, []).append(unit)
        fresh: list[_Range] = []
        placement = Placement(layout, units, fresh)  # (abandoned: gives back the ranges reserved so far, too)
        try:
            for device, new in fresh_units.items():
                driver = driver_for(device)
                assert driver is not None  # (keeping() checked)
                offsets, end = [], 0
                for unit in new:
                    end = _up(end, _ALIGN)
                    offsets.append(end)
                    end += unit.nbytes
                owner = _Range(driver, device, end)
                fresh.append(owner)
                for unit, offset in zip(new, offsets):
                    slot = _Slot(offset, unit.nbytes)
                    owner.slots.append(slot)
                    unit.place = (owner, slot)
            placement._map(name, _device_streams.empty_cache)
            placement._wrap()
        except BaseException:
            placement.abandon()
            raise
    return placement


def release(optimizer: Any, name: str, *, queued: bool = False) -> None:
    """Unmap every block of the optimizer's ranges that no slot in use touches; a slot in use outside the state (a
    caller's view) stays mapped, warned, as does a block a driver error kept. ``queued``: the devices' queued work
    may still use a block: synchronized first. Nothing while a transfer to the host is in flight."""
    session = _session.of(optimizer)
    if session is None or session.addresses is None:
        return
    layout: Layout = session.addresses
    foreign, foreign_bytes = 0, 0
    # (under the operation lock: a release run by another thread's wait() for an offload unmapped what a reload had
    # just mapped, before its copies)
    with session.lock, layout.lock:
        # (run late by another thread's wait(): a later offload's copies may still read the blocks; its own follows)
        pending = session.pending
        if pending is not None and pending.to_host and pending.event is not None:
            return
        # (each storage's data pointer, without a Python storage object: torch would keep one, a second user of it)
        held = [t for state in list(optimizer.state.values()) for t in tensors(state)]
        held += [t for g in optimizer.param_groups for _, t in group_tensors(g)]  # (not the params: outside)
        inside = {
            t.data_ptr() - t.storage_offset() * t.element_size()
            for t in held
            if t.device.type not in HOSTS and t.layout == torch.strided
        }
        unmap: list[tuple[_Range, int]] = []
        for owner in layout.ranges:
            keep: set[int] = set()
            for slot in owner.slots:
                if slot.live():
                    keep.update(owner.blocks(slot))
                    if owner.mapped.address + slot.offset not in inside:
                        foreign += 1
                        foreign_bytes += slot.nbytes
            unmap.extend((owner, i) for i, h in enumerate(owner.mapped.handles) if h is not None and i not in keep)
        if unmap and queued:
            # NOTE: unmapping does not wait for queued work that still uses a block (torch's expandable segments
            # synchronize before they unmap too)
            _device_streams.synchronize({owner.mapped.device for owner, _ in unmap})
        for owner, i in unmap:
            try:
                owner.mapped.unmap(i)
            except DriverError as e:
                _log.warning(
                    "optimshift: %s: could not unmap %s memory (%s); it stays mapped", name, owner.mapped.device, str(e)
                )
    if foreign:
        warn(
            f"{name}: {foreign} slot{'s' if foreign != 1 else ''} of state ({foreign_bytes} bytes) kept at fixed "
            f"addresses {'are' if foreign != 1 else 'is'} still viewed by tensors outside the optimizer: that "
            f"memory stays mapped instead of being freed under them (drop those views to free it)",
            UserWarning,
        )


def mapped_bytes(optimizer: Any) -> int:
    """Bytes of the optimizer's ranges mapped now (what keeping addresses holds on its devices)."""
    layout = layout_of(optimizer)
    if layout is None:
        return 0
    return sum(
        owner.mapped.span(i)[1] for owner in layout.ranges for i, h in enumerate(owner.mapped.handles) if h is not None
    )
