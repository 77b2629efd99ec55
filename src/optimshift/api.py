"""The public functions: thin layers over the plan (where each tensor goes) and the engine (moving it)."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import logging
import threading
import time
import weakref
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from operator import itemgetter
from typing import Any, Literal, TypeVar, cast, overload

import torch

from . import _addresses, _device_streams, _engine, _mode, _offload, _plan_cache, _session
from . import policy as _policy
from ._adopt import keeps_object_across_host, kept
from ._copy import BLOCKING, Options
from ._devices import HOST, HOSTS, DeviceLike, resolve
from ._dtensor import row_fields, tensor_bytes
from ._errors import add_note, dtype_name, warn, with_article
from ._offload import (
    PendingTransfer,
    Record,
    end_pending,
    exclusive,
    forget,
    give_back,
    give_grads_back,
    grads_back,
    group_tensors_at,
    left_in_buffers,
    pending_of,
    record_of,
    remember_pending,
    remember_sides,
)
from ._plan import Ident, Plan, Site, TargetFn, build_plan, check_optimizer, optimizer_name, policy_target
from ._probe import Rejection, entry_dtypes, rejected_dtypes
from ._state import (
    GROUP_SKIP,
    OPTIMIZER_WIDE,
    Path,
    Setter,
    format_path,
    group_device,
    group_flags,
    group_tensors,
    inner_optimizers,
    keyed_by,
    label_in,
    leaves,
    param_positions,
    rekey,
    unwrap,
)
from .report import Finding, PlacementRow, Report, assumed, default_rule_note, sync_cost

__all__ = [
    "move",
    "offload",
    "reload",
    "offloaded",
    "keep_addresses",
    "check",
    "placement",
    "rebind",
    "is_offloaded",
    "wait",
]

Opt = TypeVar("Opt", bound=torch.optim.Optimizer)

_log = logging.getLogger("optimshift")

F = TypeVar("F", bound=Callable[..., Any])


def _one_at_a_time(fn: F, name: str = "") -> F:
    """Operations on one optimizer serialize, the cyclic collector paused; given a delegating wrapper, the operation
    is the wrapped optimizer's, and what it returns for it is the wrapper. ``name``: the operation's (``fn``'s)."""

    @functools.wraps(fn)
    def wrapper(optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        inner = unwrap(optimizer)
        _warn_unreached(inner, name or fn.__name__)
        # NOTE: the collector stays off until the operation's temporaries are freed by refcount: a collection
        # scanning them would cost ~0.5 us per tensor, a third of a bare move.
        with exclusive(inner), _engine.no_gc(), _engine.operation(), _warned():
            out = fn(inner, *args, **kwargs)
        return optimizer if out is inner else out

    return wrapper  # type: ignore[return-value]


_warning = threading.local()  # (.done: this thread is inside an operation that warned, or had nothing to warn of)


@contextlib.contextmanager
def _warned() -> Iterator[None]:
    """The operations called inside (``reload``'s move, ``offloaded``'s offload and reload) warn nothing more."""
    was = getattr(_warning, "done", False)
    try:
        _warning.done = True
        yield
    finally:
        _warning.done = was


def _warn_unreached(inner: Any, operation: str) -> None:
    """Warn, at the user's line, for each optimizer ``inner`` holds with a state of its own (Lookahead's), which
    ``operation`` does not reach; not inside another operation, which warned."""
    if getattr(_warning, "done", False):
        return
    for attr, held in inner_optimizers(inner):
        warn(
            f"optimshift.{operation}: {optimizer_name(inner)} holds another optimizer ({attr}: "
            f"{optimizer_name(held)}) with a state of its own, which this call does not reach: call "
            f"optimshift.{operation} on it too (check() reports its entries)"
        )


def _begin(optimizer: Any, what: str, **flags: Any) -> None:
    """An operation's first checks: an optimizer, not streamed, each flag a bool (``pin_memory`` may be None): torch's
    own error for ``non_blocking=1`` named neither the optimizer nor the call, and ``pin_memory="no"`` read as True."""
    check_optimizer(optimizer)
    for flag, value in flags.items():
        if not isinstance(value, bool) and not (value is None and flag == "pin_memory"):
            raise TypeError(
                f"{optimizer_name(optimizer)}: {what}: {flag} must be a bool"
                f"{' or None' if flag == 'pin_memory' else ''}, got {value!r}"
            )
    _mode.refuse(optimizer, what)


def _group_moved(record: Record, group: Mapping[str, Any]) -> bool:
    """Whether a param of ``group`` is on another device than when the offload recorded it, or its group's
    implementation flags changed since (``capturable`` switched: its tensors are placed anew either way)."""
    flags = group_flags(group)
    return any(
        record.param_devices.get(id(p), p.device) != p.device or record.param_flags.get(id(p), flags) != flags
        for p in group["params"]
        if isinstance(p, torch.Tensor)
    )


def _refuse_meta(
    optimizer: Any, plan: Plan, extra: Sequence[tuple[torch.Tensor, torch.device, str]], what: str
) -> None:
    """``resolve``'s refusal of meta for a tensor of ``plan`` (or a grad of ``extra``) with values that would follow
    its param there (``model.to("meta")`` before ``move(opt)``)."""
    targets = set(map(itemgetter(4), plan.transfers)) | {device for _, device, _ in extra}  # (4: a Transfer's target)
    if all(device.type != "meta" for device in targets):
        return  # (nothing bound for meta: the distinct targets in one pass in C, the common case)
    lost = [(str(tr.site), tr[2]) for tr in plan.transfers if tr[4].type == "meta" and tr[2].device.type != "meta"]
    lost += [(label, t) for t, device, label in extra if device.type == "meta" and t.device.type != "meta"]
    if lost:
        site, tensor = lost[0]
        resolve(
            torch.device("meta"),
            what=f"{optimizer_name(optimizer)}: {what}: {site} (on {tensor.device}) follows its param, whose device",
        )


def _refuse_from_meta(
    optimizer: Any, plan: Plan, extra: Sequence[tuple[torch.Tensor, torch.device, str]], what: str
) -> None:
    """ValueError naming a tensor of ``plan`` (or a grad of ``extra``) on meta bound for a device with storage: it
    has no values. Asked only once a copy failed (torch's error names nothing), so the common case pays no walk."""
    lost = [(str(tr.site), tr[4]) for tr in plan.transfers if tr[2].is_meta and tr[4].type != "meta"]
    lost += [(label, device) for t, device, label in extra if t.is_meta and device.type != "meta"]
    if lost:
        site, device = lost[0]
        more = f" (and {len(lost) - 1} more)" if len(lost) > 1 else ""
        raise ValueError(
            f"{optimizer_name(optimizer)}: {what}: {site}{more} is on meta, which holds no data: it has no values to "
            f"take to {device}. Give the state values where its params have storage (load a checkpoint into it); "
            f"nothing was changed"
        ) from None


def _transfer(
    optimizer: Any,
    target: TargetFn,
    *,
    what: str,
    options: Options = BLOCKING,
    extra: Sequence[tuple[torch.Tensor, torch.device, str]] = (),
    cache_key: Hashable | None = None,
    grads: bool = False,
    eager: bool = False,
    rewrite: Callable[[], None] | None = None,
    finish: Sequence[Setter] = (),
    place: Callable[[Plan], _addresses.Placement | None] | None = None,
    ends: Sequence[torch.Tensor] = (),
    follows: bool = False,
) -> tuple[_engine.Copies, PendingTransfer, _plan_cache.Cached | None, Plan]:
    """The one path of every operation: plan by ``target`` (cached under ``cache_key``), copy (into ``place``'s
    destinations; ``ends``: pool buffers given back), commit (``rewrite``, ``finish``); ``follows``: meta refused."""
    start = time.perf_counter()
    plan, cached = _plan_cache.plan_for(optimizer, target, cache_key, grads=grads, eager=eager)
    if follows:
        _refuse_meta(optimizer, plan, extra, what)
    placement = None if place is None else place(plan)  # (raises with nothing changed, nothing mapped)
    copies = None
    try:
        into = None if placement is None else [placement.into(tr[2]) for tr in plan.transfers]
        own = left_in_buffers(ends, plan.transfers, extra)
        copies = _engine.run(plan, options, extra=extra, into=into, own=own)
        group_moves = plan.group_moves()
        hows = _engine.commit(
            optimizer, copies, hint=None if cached is None else cached.hows, rewrite=rewrite, finish=finish
        )
    except BaseException as e:
        if copies is not None:  # (the commit failed: what comes next is ordered after its copies, on the device,
            # which still read the state a step writes; the buffers they write go back, as an ended offload's)
            PendingTransfer(copies.event, copies.device).order_before_use()
            give_back(copies.batch.held, copies.event)
        if placement is not None:
            placement.abandon()
        if isinstance(e, NotImplementedError):
            _refuse_from_meta(optimizer, plan, extra, what)
        raise
    if placement is not None:
        placement.keep()
    remember_sides(optimizer, group_moves)  # (a move of a device lr offloaded puts it back; a reload forgets it)
    if cached is not None and cached.kept:  # (a marker keeps nothing per tensor)
        cached.hows = hows
    if _log.isEnabledFor(logging.DEBUG):
        moved = list(copies.new.values())
        _log.debug(
            "%s %s: %d tensors (%d bytes) in %.2f ms, %d device synchronizations; objects kept: %d by "
            "set_data, %d by swap, %d replaced%s",
            what,
            optimizer_name(optimizer),
            len(moved),
            sum(tensor_bytes(t) for t in moved),
            (time.perf_counter() - start) * 1e3,
            0 if copies.event is not None else sum(d.type not in HOSTS for d in copies.batch.devices),
            *(copies.mechanisms.get(how, 0) for how in ("data", "swap", "replace")),
            " (non-blocking: still in flight)" if copies.event is not None else "",
        )
    return copies, PendingTransfer(copies.event, copies.device, to_host=copies.to_host), cached, plan


@_one_at_a_time
def move(optimizer: Opt, device: DeviceLike | None = None, *, non_blocking: bool = False) -> Opt:
    """Move every state tensor to where a fresh optimizer over these params on ``device`` (``None``: each param's)
    would hold it; values, dtypes and tensor objects never change. All or nothing."""
    return _move(optimizer, device, non_blocking=non_blocking)


def _move(
    optimizer: Opt, device: DeviceLike | None, *, non_blocking: bool = False, pooled: Sequence[torch.Tensor] = ()
) -> Opt:
    """:func:`move` (under its lock); ``pooled``: pool buffers holding host state, which the caller gives back after
    it (``unstream``'s chunks): an entry that stays on the host gets a storage of its own."""
    _begin(optimizer, "move", non_blocking=non_blocking)
    target = None
    if device is not None:  # (named: "device cuda is not available" alone does not say which call)
        tensors = [p for g in optimizer.param_groups for p in g["params"] if isinstance(p, torch.Tensor)]
        target = resolve(device, what=f"{optimizer_name(optimizer)}: device", tensors=tensors)
    end_pending(optimizer)
    record = record_of(optimizer)
    grads = grads_back(optimizer, record)
    key = None if grads else _move_key(optimizer, target)
    copies, pending, _, _ = _transfer(
        optimizer,
        policy_target(optimizer, target),
        what="move",
        options=Options(non_blocking=non_blocking),
        extra=[(g, p.device, what) for p, g, what in grads],
        cache_key=key,
        ends=[*record.buffers, *pooled] if record is not None else pooled,
        follows=target is None,
    )
    if grads:  # (copies.new, a dict over every copy, is built only when there is a grad to find)
        give_grads_back(grads, copies.new)
        pending.order_before_use()  # grads are read before step() (clipping, scaling), as after a reload
    del copies  # (before a release: a swap leaves the old device tensors in the copies' objects)
    forget(optimizer, pending)  # whatever was offloaded now sits where it was asked to
    _release_when_done(optimizer, pending)  # state that left a reserved range frees its memory there
    remember_pending(optimizer, pending)
    return optimizer


_move_ending = _one_at_a_time(_move, "move")  # (``unstream``'s: ``_move_ending(opt, None, pooled=its chunks)``)


def _release_when_done(optimizer: Any, pending: PendingTransfer) -> None:
    """Once ``pending``'s copies are complete, unmap the reserved ranges' memory no state uses any more."""
    if _addresses.layout_of(optimizer) is None:
        return
    ref, name = weakref.ref(optimizer), optimizer_name(optimizer)  # (weak: the callback waits in its session)

    def release() -> None:
        alive = ref()
        if alive is not None:
            _addresses.release(alive, name)

    pending.add_done_callback(release)


def _move_key(optimizer: Any, target: torch.device | None) -> Hashable | None:
    """The cache key of a move's plan: its target and where the group tensors a move took to the host came from;
    None under a registered policy (it may look at anything)."""
    session = _session.get(optimizer)
    if session is None or _policy.has_registered_policy(optimizer):
        return None
    return ("move", target, frozenset((key, side[0]) for key, side in session.group_sides.items()))


_INCLUDE = ("grads",)


@overload
def offload(
    optimizer: Opt,
    *,
    pin_memory: bool | None = None,
    non_blocking: Literal[False] = False,
    include: Iterable[str] = (),
    empty_cache: bool = False,
    keep_addresses: bool | Literal["auto"] = False,
) -> Opt: ...


@overload
def offload(
    optimizer: torch.optim.Optimizer,
    *,
    pin_memory: bool | None = None,
    non_blocking: Literal[True],
    include: Iterable[str] = (),
    empty_cache: bool = False,
    keep_addresses: bool | Literal["auto"] = False,
) -> PendingTransfer: ...


@_one_at_a_time
def offload(
    optimizer: Opt,
    *,
    pin_memory: bool | None = None,
    non_blocking: bool = False,
    include: Iterable[str] = (),
    empty_cache: bool = False,
    keep_addresses: bool | Literal["auto"] = False,
) -> Opt | PendingTransfer:
    """Move all state (``include=("grads",)``: the ``.grad``s too) to a host pool (pinned where the accelerator pins),
    the same objects, for :func:`reload` to put back; ``non_blocking=True`` returns a :class:`PendingTransfer`.
    ``keep_addresses``: reload puts each tensor back at its ``data_ptr()`` (``"auto"``: where the device can)."""
    _begin(optimizer, "offload", non_blocking=non_blocking, pin_memory=pin_memory, empty_cache=empty_cache)
    include = _included(optimizer, include, "offload")
    _session.rememberable(optimizer, "offload")
    keep = _addresses.keeping(optimizer, keep_addresses, optimizer_name(optimizer))
    end_pending(optimizer)
    previous = record_of(optimizer)
    record = Record(positions=_offload.positions_of(optimizer)) if previous is None else previous.extended(optimizer)
    record.keep_addresses = record.keep_addresses | keep
    grads = []
    for gi, group in enumerate(optimizer.param_groups):
        flags = group_flags(group)
        for pi, p in enumerate(group["params"]):
            record.param_devices.setdefault(id(p), p.device)
            record.param_flags.setdefault(id(p), flags)
            if "grads" in include and p.grad is not None and id(p) in record.grads:
                raise ValueError(
                    f"{optimizer_name(optimizer)}: {label_in(optimizer, gi, pi)} got a new .grad while its "
                    f"offloaded grad was held; offloading it too would drop one of them. Set param.grad = None to "
                    f"keep the offloaded one, or reload first; nothing was changed"
                )
            if "grads" in include and p.grad is not None and p.grad.device.type not in HOSTS:
                grads.append(((gi, pi), p))  # (one on meta, as a state tensor there, holds nothing to free)

    sources: dict[Ident, torch.device] = {}  # (this offload: where each tensor was before it)

    def to_host(
        ident: Ident, param: torch.Tensor | None, group: Mapping[str, Any], key: str, tensor: torch.Tensor
    ) -> tuple[torch.device, str]:
        record.devices.setdefault(ident, tensor.device)  # (the record is kept only once every copy exists)
        sources[ident] = tensor.device
        # (one on meta holds no memory to free and no values to take: it stays, and reload leaves it)
        return tensor.device if tensor.is_meta else HOST, "offload"

    # (only a first offload is cached: it records every device, and a reload can undo exactly that plan)
    key = ("offload", "grads" in include) if previous is None else None
    installed: list[Any] = []
    try:
        # (a Ctrl-C while the guards are registered is raised once they are in ``installed``, to be removed: one
        # landing in the registration left a step pre-hook and a __getstate__ front on an optimizer not offloaded)
        with _engine.uninterrupted(to_the_end=False):
            installed = _offload.guard(
                optimizer, record, grads=bool(grads)
            )  # (before anything is copied: it may refuse)
        copies, pending, cached, plan = _transfer(
            optimizer,
            to_host,
            what="offload",
            options=Options(non_blocking=non_blocking, pin_memory=pin_memory is not False, keep_host_views=True),
            extra=[(p.grad, HOST, f"the .grad of {label_in(optimizer, *where)}") for where, p in grads],
            cache_key=key,
            grads="grads" in include,
        )
    except BaseException:
        for handle in installed:
            handle.remove()
        raise
    if cached is not None:
        if cached.hits:  # (to_host() was not called: the plan knows where every tensor was)
            sources = dict(cached.sources_of(plan))
            record.devices.update(sources)
        # (this build of the offload plan, which a cached reload undoes, and whether it is kept)
        record.token = (cached.serial, cached.kept)
    for _, p in grads:  # only now: every copy exists
        grad = p.grad
        if grad is None or id(grad) not in copies.new:  # (zeroed or replaced meanwhile, from another thread)
            continue
        p.grad = None  # (first: the param no longer holds it, so it can be swapped)
        record.grads[id(p)] = (p, kept(grad, copies.new[id(grad)]))  # the same object, on the host
    group_entries = plan.group_entries()
    if group_entries:  # the group tensors taken from an accelerator, by the object the commit left at their site
        held = group_tensors_at(optimizer)
        for tr in group_entries:
            was, t = sources.get(tr[0]), held.get(tr[0])
            if was is not None and was.type not in HOSTS and t is not None and t.device.type == "cpu":
                record.taken[id(t)] = (was, t)
    record.took = record.took or any(d.type != "cpu" for d in record.devices.values())
    record.buffers.extend(copies.batch.held)
    del copies  # (before a release: a swap leaves the old device tensors in the copies' objects)
    _offload.set_record(optimizer, record)
    _release_when_done(optimizer, pending)  # once the host copies landed: unmap what kept addresses
    remember_pending(optimizer, pending)
    if empty_cache:
        _device_streams.empty_cache()
    return pending if non_blocking else optimizer


def wait(optimizer: Any) -> None:
    """Block the host until a non-blocking transfer in flight and a streamed optimizer's last write-backs are
    complete: call it before reading ``optimizer.state`` directly."""
    # (wait(model) waited for nothing, silently; the groups are not walked: a wait per iteration would pay for it)
    receiver = check_optimizer(unwrap(optimizer), groups=False)
    pending_of(receiver).order_before_use(host=True)
    mode = _mode.mode_of(receiver)
    if mode is not None:
        mode.wait()


def is_offloaded(optimizer: Any) -> bool:
    """Whether :func:`offload` moved this optimizer's state to the host and it was not reloaded since (TypeError for
    what is no optimizer: a model or a list of optimizers was never offloaded, and False would say so)."""
    return record_of(check_optimizer(unwrap(optimizer), groups=False)) is not None


def _reload_target(optimizer: Any, record: Record) -> TargetFn:
    """Where :func:`reload` puts each tensor of an offloaded optimizer (what :func:`check` judges it by)."""
    by_policy = policy_target(optimizer, None)
    sites = record.sites(optimizer)  # (named by today's positions)
    # a group tensor the offload took, still at a site it was taken from: judged with that site's group, also
    # where another group holds it now
    held_now = group_tensors_at(optimizer)
    origin = {
        id(t): optimizer.param_groups[gi]
        for (gi, _, path), t in held_now.items()
        if (w := sites.get((gi, None, path))) is not None and w.type not in HOSTS
    }
    # a host tensor at a site the record knows as a host site: a group given it meanwhile keeps it there too
    on_host = {id(t) for site, t in held_now.items() if (w := sites.get(site)) is not None and w.type in HOSTS}

    placers: dict[torch.device, _policy.Placer] = {}
    bound: dict[tuple[int, int], set[torch.device]] | None = None  # (group, index) -> where its state was

    def state_device(gi: int, pi: int, param: torch.Tensor) -> torch.device | None:
        """The accelerator a param's state was on: its own device where an entry was there, else the one its
        entries were on (a move to another device); None where they were all on the host."""
        nonlocal bound
        if bound is None:  # (asked once a plan is built: a cached one asks nothing)
            bound = {}
            for (g, i, _), device in sites.items():
                if i is not None and device.type != "cpu":
                    bound.setdefault((g, i), set()).add(device)
        found = bound.get((gi, pi), set())
        return param.device if param.device in found else min(found, key=str, default=None)

    def back(
        ident: Ident, param: torch.Tensor | None, group: Mapping[str, Any], key: str, tensor: torch.Tensor
    ) -> tuple[torch.device, str]:
        if (
            param is not None
            and record.param_devices.get(id(param)) == param.device
            and record.param_flags.get(id(param), group_flags(group)) != group_flags(group)
            and (device := state_device(ident[0], cast(int, ident[1]), param)) is not None
        ):
            # NOTE: the group's flags changed while offloaded: where a fresh optimizer with them keeps it, there
            placer = placers.get(device) or placers.setdefault(device, policy_target(optimizer, device))
            return placer(ident, param, group, key, tensor)
        was = sites.get(ident)
        if param is None and ident[0] != OPTIMIZER_WIDE:
            # NOTE: a group tensor goes back where the offload took it from, whatever group holds it now; another
            # on the host stays; one given meanwhile where the offload took one, or on a device: by the policy
            taken = record.taken.get(id(tensor))
            if taken is not None and taken[1] is tensor:
                own = was is not None and was.type not in HOSTS  # (a site taken from: judged with its own group)
                was, group = taken[0], group if own else origin.get(id(tensor), group)
                if not _group_moved(record, group) and (there := by_policy.params_at(group, tensor)) != was:
                    # (held now by a group on another device, swapped or given meanwhile: its side, there)
                    return by_policy.at(None, group, key, tensor, there, side=was)
            elif was is None and tensor.is_cpu and id(tensor) in on_host:
                was = tensor.device
            elif not tensor.is_cpu or (was is not None and was.type not in HOSTS):
                was = None
        if param is None and was is not None and _group_moved(record, group):
            # the group's params moved (or its flags changed) while offloaded: placed for them now, on the side they
            # were given on (one found on the host: the side the session remembers)
            side = was if was.type not in HOSTS else by_policy.side(tensor) or was
            return by_policy.at(None, group, key, tensor, by_policy.params_at(group, tensor), side=side)
        if param is not None and record.param_devices.get(id(param)) != param.device:
            was = None  # the param moved while its state was away: place the state for where it is now
        if was is not None:
            return was, "recorded"
        return by_policy(ident, param, group, key, tensor)  # added after the offload: place it by the policy

    return back


@overload
def reload(optimizer: Opt, device: DeviceLike | None = None, *, non_blocking: Literal[False] = False) -> Opt: ...


@overload
def reload(
    optimizer: torch.optim.Optimizer, device: DeviceLike | None = None, *, non_blocking: Literal[True]
) -> PendingTransfer: ...


@_one_at_a_time
def reload(optimizer: Opt, device: DeviceLike | None = None, *, non_blocking: bool = False) -> Opt | PendingTransfer:
    """Put offloaded state back where it was (a moved param's or a changed group's: where a fresh optimizer keeps it
    now), the same objects; without ``device``, a no-op for an optimizer that is not offloaded. With ``device``, the
    state goes where a fresh optimizer on ``device`` keeps it, offloaded or not (as :func:`move` puts it)."""
    _begin(optimizer, "reload", non_blocking=non_blocking)
    if device is not None:
        _move(optimizer, device, non_blocking=non_blocking)  # (not move: under this lock, warned once, as reload)
        return pending_of(optimizer) if non_blocking else optimizer
    end_pending(optimizer)
    record = record_of(optimizer)
    if record is None:
        return PendingTransfer() if non_blocking else optimizer
    grads = grads_back(optimizer, record)
    back = _reload_target(optimizer, record)
    # (cached only when the offload's plan was kept, the sign of a loop: its next build would bump the serial)
    cacheable = record.token is not None and record.token[1] and not _policy.has_registered_policy(optimizer)
    key = _plan_cache.undoing(record.token[0]) if cacheable else None
    keep, name = record.keep_addresses, optimizer_name(optimizer)
    copies, pending, _, _ = _transfer(
        optimizer,
        back,
        what="reload",
        options=Options(non_blocking=non_blocking),
        extra=[(g, p.device, what) for p, g, what in grads],
        cache_key=key,
        grads=bool(grads),
        eager=cacheable,
        place=(lambda plan: _addresses.stage(optimizer, plan, keep, name)) if keep else None,
        ends=record.buffers,
        follows=True,
    )
    if grads:  # (copies.new, a dict over every copy, is built only when there is a grad to find)
        give_grads_back(grads, copies.new)
        pending.order_before_use()  # grads are read before step() (clipping, scaling, accumulation)
    forget(optimizer, pending)
    remember_pending(optimizer, pending)
    return pending if non_blocking else optimizer


def _included(optimizer: Any, include: Iterable[str], what: str) -> tuple[str, ...]:
    """``include=`` of :func:`offload` and :func:`offloaded` as a tuple of names, checked before anything changes."""
    try:
        # (include="grads": one name, not letters; bytes are no names, not a sequence of ints)
        if isinstance(include, (bytes, bytearray, memoryview)):
            raise TypeError
        include = (include,) if isinstance(include, str) else tuple(include)
        if not all(isinstance(i, str) for i in include):
            raise TypeError
    except TypeError:
        raise TypeError(
            f"{optimizer_name(optimizer)}: {what} include= must be names such as ('grads',) (a str or an "
            f"iterable of str), got {include!r}"
        ) from None
    unknown = [i for i in include if i not in _INCLUDE]
    if unknown:
        raise ValueError(f"{optimizer_name(optimizer)}: {what} include= may contain {_INCLUDE}, got {unknown}")
    return include


@contextlib.contextmanager
def offloaded(
    optimizer: Opt,
    *,
    pin_memory: bool | None = None,
    include: Iterable[str] = (),
    keep_addresses: bool | Literal["auto"] = False,
) -> Iterator[Opt]:
    """Offload on enter, reload on exit (also when the body raises); a no-op if it is already offloaded, but by
    another ``offloaded`` block (in any thread: the last of them out reloads)."""
    inner = unwrap(optimizer)
    include = _included(inner, include, "offloaded")  # (also where it is offloaded already, and offload is not run)
    session = _session.get(inner)  # (None where it cannot be remembered: offload refuses it, it is never offloaded)
    with _last_out_ends(
        inner,
        "offloaded",
        lambda: session if is_offloaded(inner) else None,
        "offloaded_in",
        lambda: offload(optimizer, pin_memory=pin_memory, include=include, keep_addresses=keep_addresses),
        lambda: reload(optimizer),
    ):
        yield optimizer


@contextlib.contextmanager
def _last_out_ends(
    inner: Any, operation: str, on: Callable[[], Any], count: str, begin: Callable[[], Any], end: Callable[[], Any]
) -> Iterator[Any]:
    """An ``offloaded``/``streamed`` block: ``begin`` where the mode is not on, else a no-op unless the mode's
    blocks made it; the last block out (any thread) ``end``s it. ``on()``: what counts them, in ``count``, or None;
    yields it."""
    _warn_unreached(inner, operation)  # (once, at the with statement: begin and end inside warn nothing more)
    counter, began, counted = None, False, False
    # NOTE: from begin() on, inside the try: a Ctrl-C once it returned (a Ctrl-C its commit held, or one landing
    # before the block was counted, or after, before the body) left the mode on for good, its block never entered
    try:
        with exclusive(inner), _warned():
            counter = on()
            mine = counter is None or getattr(counter, count) > 0
            if counter is None:
                began = True
                begin()
                counter = on()
            if mine:
                with _engine.uninterrupted(to_the_end=False):  # (counted and noted so, never one without the other)
                    setattr(counter, count, getattr(counter, count) + 1)
                    counted = True
        yield counter
    finally:
        if counted or began:
            # (a Ctrl-C at the exit, before the block was uncounted, left it counted for good: no later block of the
            # optimizer was ever the last out, its offload outlived every one; held until the block is out)
            with _engine.uninterrupted(to_the_end=False), exclusive(inner), _warned():
                if counted:
                    setattr(counter, count, getattr(counter, count) - 1)
                else:  # (begun, never counted: ended unless another block counts it now)
                    counter = on()
                if counter is not None and getattr(counter, count) == 0:
                    end()


@_one_at_a_time
def keep_addresses(optimizer: Opt) -> Opt:
    """Lay the state out at addresses every later ``offload(keep_addresses=True)`` and reload keep (call it before
    capturing a CUDA graph): an offload and a reload; where it cannot map them, reloaded as usual and said so."""
    # (one hold of the lock: no other thread's operation between the offload and the reload; a Ctrl-C waits for it)
    _mode.refuse(optimizer, "keep_addresses")  # (before its offload: that would name the offload)
    record = record_of(optimizer)
    if record is not None:
        record.keep_addresses |= _addresses.keeping(optimizer, True, optimizer_name(optimizer))
        return optimizer
    kept = _addresses.mapped_bytes(optimizer) > 0  # (some state at kept addresses: a graph may use them)
    with _engine.uninterrupted():
        offload(optimizer, keep_addresses=True)
        try:
            reload(optimizer)
        except Exception as error:  # (mapping the range ran out of memory, a driver failed): back as it was
            if kept:
                add_note(
                    error,
                    "optimshift: keep_addresses offloaded the state to lay it out again; it stays offloaded, so that "
                    "the state kept at addresses keeps them (a captured graph's): free device memory, then "
                    "optimshift.reload(optimizer) lays it out",
                )
                raise
            record = record_of(optimizer)
            if record is None:
                raise
            keep, record.keep_addresses = record.keep_addresses, frozenset()
            try:  # reloaded allocated as usual
                reload(optimizer)
            except Exception as again:
                record.keep_addresses = keep  # (its reload, when the memory is there, lays it out as asked)
                add_note(
                    error,
                    f"optimshift: keep_addresses: reloading the state as usual failed too ({type(again).__name__}: "
                    f"{again}): it is still offloaded on the host; call optimshift.reload(optimizer)",
                )
            else:
                done = "it was reloaded where it was, allocated as usual (at other addresses), and nothing else changed"
                if type(error) is torch.OutOfMemoryError:  # (the common case: said in the error itself)
                    raise torch.OutOfMemoryError(
                        f"{optimizer_name(optimizer)}: keep_addresses could not lay the state out at kept "
                        f"addresses (out of device memory: the error above); {done}"
                    ) from error
                add_note(
                    error, f"optimshift: keep_addresses could not lay the state out at kept addresses; then {done}"
                )
            raise
    return optimizer


def placement(optimizer: torch.optim.Optimizer) -> list[PlacementRow]:
    """One :class:`PlacementRow` per entry holding a tensor (state and param groups; a tensor two entries hold has
    two rows)."""
    optimizer = check_optimizer(unwrap(optimizer))  # (a wrapper: the optimizer it delegates to)
    pending_of(optimizer).order_before_use()
    rows = []
    for transfer in build_plan(optimizer, lambda ident, param, group, key, tensor: (tensor.device, "")).transfers:
        t = transfer.tensor
        site = transfer.site  # (row_fields: a DTensor's local shape and placements)
        row = (site.param_label, site.key_label, str(t.device), dtype_name(t.dtype), tuple(t.shape), tensor_bytes(t))
        rows.append(PlacementRow(*row, **row_fields(t)))
    return rows


def check(optimizer: torch.optim.Optimizer) -> Report:
    """Compare every state entry with where a fresh optimizer would keep it (an offloaded one's: where :func:`reload`
    puts it) and say what each misplacement costs."""
    optimizer = check_optimizer(unwrap(optimizer))  # (a wrapper: the optimizer it delegates to)
    pending_of(optimizer).order_before_use()
    name = optimizer_name(optimizer)
    target: TargetFn = policy_target(optimizer, None)
    streamed_mode = _mode.mode_of(optimizer) is not None
    if streamed_mode:
        target = _mode.hosted(target)
    report = Report(name, rows=placement(optimizer))
    record = None if streamed_mode else record_of(optimizer)
    record = record if record is not None and record.moved_any else None  # (judged as offloaded)
    back: dict[Ident, torch.device] = {}  # offloaded: where reload() puts each tensor
    hosted = 0  # offloaded: the tensors in host memory that reload() takes elsewhere
    if record is not None:
        reloaded = build_plan(optimizer, _reload_target(optimizer, record)).transfers
        for tr in reloaded:
            back[tr.ident] = tr.target
            hosted += tr.tensor.device.type == "cpu" and tr.target.type != "cpu"
        # a group tensor is judged from the side reload() puts it on, not from the host it waits on
        sides = {
            id(tr.tensor): (tr.target, tr.tensor)
            for tr in reloaded
            if tr.ident[1] is None and tr.ident[0] != OPTIMIZER_WIDE and tr.target.type != "cpu"
        }
        session = _session.of(optimizer)
        target = _policy.Placer(optimizer, None, {**(session.group_sides if session else {}), **sides})
    plan = build_plan(optimizer, target)
    guessed: dict[str, None] = {}  # why the default rule was used, each reason once, in order
    defaults: dict[int, bool] = {}  # group -> whether torch's default picks foreach for its params (asked once)
    for tr in plan.transfers:
        if tr.source == "default" and tr.param is not None:
            group = optimizer.param_groups[tr.site.group]
            guessed[_policy.why_guessed(type(optimizer), group, tr.param.dim(), tr.site.key)] = None
        t, site = tr.tensor, tr.site
        at = back.get(tr.ident, t.device)  # where the entry is (offloaded: where reload() puts it)
        in_group = tr.param is None and site.group != OPTIMIZER_WIDE
        # (where the step raises with a group tensor: read once, its value asked by a sync on a device)
        raises = (
            _policy.group_raises(type(optimizer), optimizer.param_groups[site.group], site.key, t)
            if in_group
            else frozenset()
        )
        if at == tr.target and len(raises) != 2:  # (raising on either side is an error where it belongs too)
            continue
        severity, why, cost = _explain(optimizer, tr.param, site, t, tr.target, at, defaults, raises)
        if tr.source == "default":  # (no probe or table: a guess, which the last finding explains)
            why = assumed(name) + why
        why = f"after reload(): {why}" if record is not None else why
        shown = (site.param_label, site.key_label, str(at), dtype_name(t.dtype), str(tr.target), why)
        report.findings.append(Finding(severity, *shown, site.group, site.index, cost))
    if record is not None:
        grads = len(record.grads)
        # (the offload took state off an accelerator, since replaced; else it found all of it on meta, left there)
        took = any(d.type not in HOSTS for d in record.devices.values())
        note = (
            f"offloaded by optimshift.offload: {hosted} state tensor{'s' if hosted != 1 else ''}"
            f"{f' and {grads} grad' + ('s' if grads != 1 else '') if grads else ''} in host memory on purpose"
            if hosted or grads
            else "offloaded by optimshift.offload, but no state is in host memory any more (something replaced it, "
            "such as optimizer.load_state_dict)"
            if took
            else "offloaded by optimshift.offload, which found no state in device memory to take to the host (state "
            "on meta holds no data: it stays there)"
        ) + (
            "; call optimshift.reload(optimizer) before step() (which refuses until then). The other findings, if "
            "any, are where reload() puts an entry; placement() lists where each tensor is now."
        )
        report.findings.insert(0, Finding("info", "-", "-", "cpu", "-", "-", note))
    report.findings.extend(_dtype_findings(optimizer))  # entries whose dtype the next step() would refuse
    if guessed:
        report.findings.append(Finding("info", "-", "-", "-", "-", "-", default_rule_note(name, guessed)))
    pinned = [tr for tr in plan.transfers if not keeps_object_across_host(tr.tensor)]
    if pinned:
        site, device = pinned[0].site, pinned[0].tensor.device
        note = (
            f"{len(pinned)} state tensor{'s' if len(pinned) != 1 else ''} on {device.type} "
            f"{'are' if len(pinned) != 1 else 'is'} weakly referenced (dynamo does this once it traced a step over "
            f"them), and torch can exchange {device.type} tensors with host ones in place only by "
            f"swap_tensors, which weak references forbid: an offload/reload or a move to or from the host replaces "
            f"these objects (values and placement stay right; a compiled step recompiles once)."
        )
        report.findings.append(Finding("info", site.param_label, site.key_label, str(device), "-", "-", note))
    checking = _checking.__dict__.setdefault("ids", set())  # (optimizers holding each other: each checked once)
    checking.add(id(optimizer))
    try:
        for attr, held in inner_optimizers(optimizer):  # (a wrapper's inner optimizer: its entries, named so)
            if id(held) not in checking:
                found = check(held).findings
                report.findings.extend(dataclasses.replace(f, param=f"{attr}: {f.param}") for f in found)
    finally:
        checking.discard(id(optimizer))
    return report


_checking = threading.local()


def _explain(
    optimizer: Any,
    param: torch.Tensor | None,
    site: Site,
    t: torch.Tensor,
    expected: torch.device,
    at: torch.device,
    defaults: dict[int, bool],
    raises: frozenset[str],
) -> tuple[str, str, int | None]:
    """Why ``t`` (on ``at``: its device, or where a reload puts it) belongs on ``expected``, and its cost.
    ``defaults``: whether torch's default picks foreach for a group's params, by group (filled as asked);
    ``raises``: where the step raises with a group tensor (:func:`policy.group_raises`)."""
    name = optimizer_name(optimizer)
    gi = max(site.group, 0)
    group = optimizer.param_groups[gi]  # optimizer-wide entries: the first group
    on_host = at.type == "cpu"
    own = param is None and site.group != OPTIMIZER_WIDE  # (a tensor the group holds: a tensor lr, betas)
    if ("host" if on_host else "device") in raises:  # (where a probe step raised, not a cost: an error)
        where = "either device" if len(raises) == 2 else f"{at} (a probe step did; on {expected} it runs)"
        return "error", f"{name}'s step() raises with it on {where}", None
    if own and expected.type == "cpu" and not on_host:
        cost = _policy.group_read_cost(optimizer, group, site.key, t)
        others = ", ".join(sorted({str(p.device) for p in group["params"] if p.device != at}))
        mixing = f"group {gi} holds params on {others} too: a step computing with it beside them raises"
        if others and cost is None:  # (placed on the host for a group over several devices: policy.params_device)
            return "warning", f"{mixing} (on the host it serves params on any device)", None
        # (the step reads it on the host: how often where the probe counted it; none after a param's first step:
        # Rprop's lr, read only where it makes a param's state; a group of no params reads it nowhere)
        when = " each step" if cost else " where it makes a param's state" if cost == 0 and group["params"] else ""
        if cost and _policy.priced_nonzero(type(optimizer), group, site.key, t):
            when += " (the figure is for a nonzero value, which takes a branch it decides)"
        why = f"{name} reads this on the host{when}: on {at} every read is a device-to-host sync"
        return "warning", f"{why}; {mixing}" if others else why, cost
    if t.dim() == 0 and expected.type == "cpu":
        on_device = at.type != "cpu"
        held_by = param if param is not None and param.device.type != "cpu" else None  # (a probe's count)
        base = _policy.stepping_base(type(optimizer))
        default = defaults.get(gi)
        if default is None:  # (torch's pick for the whole group: a host param or a subclass's makes it single-tensor)
            # (torch picks it over the params with a grad: those a step reached, with state; all if none has any)
            stepped = [p for p in group["params"] if optimizer.state.get(p)] or group["params"]
            default = defaults[gi] = _policy.default_foreach(stepped)
        if (
            held_by is not None
            and on_device
            and at != held_by.device
            and len(site.path) == 1
            and base is not None
            and _policy.runs_foreach(base.__name__, group.get("foreach"), default, group)
        ):
            # (torch's foreach kernels group a param's tensors by device, a host scalar excepted: on another, refused)
            return (
                "error",
                f"the foreach step groups a param's tensors by device (a scalar on the host excepted): on {at}, "
                f"beside its param on {held_by.device}, step() raises",
                None,
            )
        cost = (
            sync_cost(
                type(optimizer),
                name,
                site.key,
                group.get("foreach"),
                on_device,
                None if held_by is None else group,
                1 if held_by is None else held_by.dim(),
                hyper=group,
                default=default,
            )
            if len(site.path) == 1
            else None
        )
        return (
            "warning",
            f"{name} reads this scalar on the host each step: on {at} every read is a device-to-host sync",
            cost,
        )
    if t.dim() == 0 and on_host:
        if group.get("fused"):
            return "error", "the fused kernel rejects a host tensor: step() will raise", None
        if group.get("capturable"):
            return "error", "capturable step() asserts its scalars are on the param's device: it will raise", None
        if param is not None and _policy.foreach_refuses_on_host(type(optimizer), group, t, param.device):
            return (
                "error",
                f"the foreach step refuses a {dtype_name(t.dtype)} scalar on the host beside its param on "
                f"{param.device} (it takes float32/float64 ones there): step() raises",
                None,
            )
        return "warning", f"{name} keeps this scalar on the param's device ({expected})", None
    if param is not None and at != param.device:
        return "error", f"the param is on {param.device}: step() fails mixing devices", None
    return "warning", f"a fresh {name} keeps it on {expected}", None


def _dtype_findings(optimizer: Any) -> list[Finding]:
    """:func:`check`'s findings for entries whose dtype the next step would refuse (a host trial of the class's
    torch.optim base, never a user's own step)."""
    base = _policy.stepping_base(type(optimizer))
    if base is None:
        return []
    name = type(optimizer).__name__
    findings: list[Finding] = []
    for gi, group in enumerate(optimizer.param_groups):
        own = {id(t) for _, t in group_tensors(group)}
        memo: dict[tuple[torch.dtype, int, tuple[tuple[str, str], ...]], list[Rejection]] = {}
        for pi, p in enumerate(group["params"]):
            state = optimizer.state.get(p)
            if not isinstance(p, torch.Tensor) or not isinstance(state, Mapping):
                continue
            dtypes = entry_dtypes(state, own)
            memo_key = (p.dtype, p.dim(), tuple(sorted((str(k), str(d)) for k, d in dtypes.items())))
            if memo_key not in memo:
                memo[memo_key] = rejected_dtypes(base, group, p, dtypes)
            label = label_in(optimizer, gi, pi)
            # (PyTorch's cast, which cast='param' applies, leaves a complex param's state as saved)
            load = (
                "" if p.is_complex() else ", or load the checkpoint with optimshift.load_state_dict(..., cast='param')"
            )
            for r in memo[memo_key]:
                t = next(t for _, t in leaves(state[r.key]) if id(t) not in own)
                why = (
                    f"step() rejects {dtype_name(r.dtype)} here with {dtype_name(p.dtype)} params "
                    f"({r.error.splitlines()[0]}); a fresh {name} keeps it as {dtype_name(r.fresh)}: cast it{load}"
                )
                shown = (label, str(r.key), str(t.device), dtype_name(r.dtype), dtype_name(r.fresh), why)
                findings.append(Finding("error", *shown, gi, pi))
    return findings


def _refuse_dtypes(optimizer: Any, gi: int, pi: int, old: torch.Tensor, new: torch.Tensor) -> None:
    """ValueError where the step of a torch.optim class refuses ``old``'s state under ``new``, a param of another
    dtype (fp32 Adam moments under bf16 params; SGD's fp32 momentum is taken), as check() would find after."""
    state, base = optimizer.state.get(old), _policy.stepping_base(type(optimizer))
    if not isinstance(state, Mapping) or not state or base is None:
        return
    group = optimizer.param_groups[gi]
    dtypes = entry_dtypes(state, {id(t) for _, t in group_tensors(group)})
    new_is = f"{optimizer_name(optimizer)}: rebind: the new param for group {gi}, param {pi} is {dtype_name(new.dtype)}"
    load = "Load the state with optimshift.load_state_dict(..., cast='param') on an optimizer over the new params"
    if not (new.is_floating_point() or new.is_complex()) and old.dtype in dtypes.values():
        # (a host trial judges floating-point and complex params only: another's state in its old dtype is refused)
        key = next(k for k, d in dtypes.items() if d == old.dtype)
        raise ValueError(
            f"{new_is}, and its state {key!r} was kept for the old param's {dtype_name(old.dtype)}. {load}; nothing "
            f"was changed"
        )
    rejected = rejected_dtypes(base, group, new, dtypes)
    if rejected:
        r = rejected[0]
        # (PyTorch's cast, which cast='param' applies, leaves a complex param's state as saved)
        fix = f"Cast its state to {dtype_name(r.fresh)} first" if new.is_complex() else load
        raise ValueError(
            f"{new_is}, and a step rejects its state {r.key!r} in {dtype_name(r.dtype)} with it "
            f"({r.error.splitlines()[0]}); a fresh {base.__name__} keeps it as {dtype_name(r.fresh)}. {fix}; nothing "
            f"was changed"
        )


def _rekeys(optimizer: Any, renames: Mapping[int, torch.Tensor]) -> list[Setter]:
    """The updates re-keying each mapping keyed by an old param (TRAC's ``state["_trac"][param]``; ``renames`` by old
    id) to its new one, found before anything changes; TypeError/ValueError naming one that cannot be."""
    if not renames:
        return []
    state = optimizer.state
    # (roots by (where, key); labelled only for an error: this runs over every param's state)
    roots: list[tuple[Path, Any]] = [((("state", k),), v) for k, v in state.items()]
    roots += [
        ((("group", gi), ("key", k)), v)
        for gi, group in enumerate(optimizer.param_groups)
        for k, v in group.items()
        if k not in GROUP_SKIP
    ]
    seen = {id(state), id(optimizer.param_groups)}  # (the rewrite renames the state's own keys)
    out = []
    for path, found in keyed_by(roots, renames, seen):
        try:
            out.append(rekey(found, renames))
        except (TypeError, ValueError) as e:
            positions = {i: label_in(optimizer, gi, pi) for i, (gi, pi) in param_positions(optimizer).items()}
            (kind, root), rest = path[0], path[1:]
            if kind == "group":
                label, rest = f"param_groups[{root}][{rest[0][1]!r}]", rest[1:]
            elif isinstance(root, torch.Tensor):
                label = f"the state of {positions.get(id(root), 'a param')}"
            else:
                label = f"optimizer.state[{root!r}]"
            where = "".join(
                f"[{positions.get(id(k), 'a param')}]" if isinstance(k, torch.Tensor) else format_path(((kind, k),))
                for kind, k in rest
            )
            raise type(e)(
                f"{optimizer_name(optimizer)}: rebind: {label}{where} is keyed by the params and {e}: it cannot "
                f"be re-keyed to the new params, and the old ones would stay there; nothing was changed"
            ) from None
    return out


def _shared_params(held: Any, optimizer: Any) -> set[int]:
    """The ids of ``optimizer``'s params that its rebind puts in ``held``'s groups too: those of each group ``held``
    holds as the very dict, or whose very params list it holds (a list is rewritten in place)."""
    theirs = {id(x) for g in held.param_groups for x in (g, g["params"])}
    return {
        id(p)
        for g in optimizer.param_groups
        if id(g) in theirs or (isinstance(g["params"], list) and id(g["params"]) in theirs)
        for p in g["params"]
    }


def _stale(optimizer: Any, held: Iterable[Any]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(old, new) for each param ``optimizer``'s state is keyed by that its groups no longer list since a rebind of
    an optimizer in ``held`` sharing them (Lookahead's inner one, rebound first) put ``new`` in its place."""
    located = {id(p) for g in optimizer.param_groups for p in g["params"]}
    renamed = [s.rebound for h in held if (s := _session.of(h)) is not None and s.rebound]
    out = []
    for k in list(optimizer.state) if renamed else ():
        if isinstance(k, torch.Tensor) and id(k) not in located:
            q = next((r() for m in renamed if (r := m.get(k)) is not None), None)
            if q is not None and id(q) in located and q not in optimizer.state:
                out.append((k, q))
    claims = collections.Counter(id(q) for _, q in out)  # (two old params for one new: neither, the plan refuses)
    return [(k, q) for k, q in out if claims[id(q)] == 1]


def _remember(optimizer: Any, renamed: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Record a rebind's (old, new) params in the session (earlier renames followed to the new ones) for the rebind
    of a wrapper sharing its groups whose state is still keyed by the old ones (:func:`_stale`)."""
    session = _session.get(optimizer)
    if session is not None:
        session.rebound.record(renamed)


@_one_at_a_time
def rebind(optimizer: Opt, params: Iterable[Any]) -> Opt:
    """Point the optimizer at new params (same order and shapes; ``(name, param)`` pairs rename them too), their state
    placed for the new params' devices, all or nothing; an optimizer held over its groups (Lookahead's) is re-keyed."""
    check_optimizer(optimizer)
    with contextlib.ExitStack() as held:  # (one operation at a time on those it holds too: their state may change)
        for inner in sorted({id(o): o for _, o in inner_optimizers(optimizer)}.values(), key=id):
            held.enter_context(exclusive(inner))
        return _rebind(optimizer, params)


def _rebind(optimizer: Opt, params: Iterable[Any]) -> Opt:
    """:func:`rebind`, under the locks of the optimizer and of those it holds."""
    name = optimizer_name(optimizer)
    # (an optimizer it holds over the same group dicts or params lists, Lookahead's, all or some of them: the new
    # params land in its groups too, so its state is re-keyed with them, or its groups would name params its state
    # is not keyed by)
    sharing = [(held, ids) for _, held in inner_optimizers(optimizer) if (ids := _shared_params(held, optimizer))]
    for opt in (optimizer, *(held for held, _ in sharing)):
        _mode.refuse(opt, "rebind" if opt is optimizer else f"rebind of {name}, which holds it,")
        end_pending(opt)
        if is_offloaded(opt):
            raise ValueError(
                f"{name}: rebind while {optimizer_name(opt)} is offloaded would lose where the state was; reload() "
                f"it first"
            )
    if isinstance(params, torch.nn.Module) and not isinstance(params, torch.nn.ParameterList):
        # (iterating a module yields its children, not its params; a ParameterList yields its params)
        raise TypeError(f"{name}: rebind takes the new params (model.parameters()), got a {type(params).__name__}")
    try:
        given = list(params)
    except TypeError:
        raise TypeError(
            f"{name}: rebind takes the new params (model.parameters()), got {with_article(type(params).__name__)}"
        ) from None
    old = [(gi, pi, p) for gi, g in enumerate(optimizer.param_groups) for pi, p in enumerate(g["params"])]
    pairs = [isinstance(p, tuple) and len(p) == 2 for p in given]  # (model.named_parameters())
    named = bool(given) and all(pairs)
    if any(pairs) and not named:
        where = [f"group {gi}, param {pi}" for gi, pi, _ in old]  # (each param given, by its position)
        where += [f"param {i} past the last group" for i in range(len(given))]
        raise TypeError(
            f"{name}: rebind got (name, param) pairs for some params (group and index: "
            f"{where[pairs.index(True)]}) and bare params for others "
            f"({where[pairs.index(False)]}): give all of them one way, so that no name is dropped"
        )
    new = [p[1] if named else p for p in given]
    if len(new) != len(old):
        raise ValueError(f"{name}: rebind got {len(new)} params, the optimizer holds {len(old)}")
    seen: set[int] = set()
    for (gi, pi, p), q in zip(old, new):
        if not isinstance(q, torch.Tensor):
            raise TypeError(
                f"{name}: rebind: new param for group {gi}, param {pi} is {with_article(type(q).__name__)}, not a "
                f"tensor"
            )
        if tuple(q.shape) != tuple(p.shape):
            raise ValueError(
                f"{name}: rebind: group {gi}, param {pi} has shape {tuple(p.shape)}, the new param {tuple(q.shape)}"
            )
        if not (q.is_leaf or q.retains_grad) and not getattr(optimizer, "defaults", {}).get("differentiable"):
            # (torch's own refusal where a group is added: its .grad would never be filled)
            raise ValueError(f"{name}: rebind: the new param for group {gi}, param {pi} is a non-leaf tensor")
        if q.dtype != p.dtype:
            _refuse_dtypes(optimizer, gi, pi, p, q)
        if id(q) in seen:
            raise ValueError(f"{name}: rebind: the new param for group {gi}, param {pi} is given twice")
        seen.add(id(q))
    mapping = {id(p): q for (_, _, p), q in zip(old, new)}
    renames = {id(p): q for (_, _, p), q in zip(old, new) if p is not q}
    # (state a rebind of an optimizer it holds left keyed by the params that rebind replaced in the shared groups:
    # re-keyed to them, as if this rebind had come first)
    stale = _stale(optimizer, [held for held, _ in sharing])
    finish = [
        *_rekeys(optimizer, {**renames, **{id(k): renames.get(id(q), q) for k, q in stale}}),
        *(f for held, ids in sharing for f in _rekeys(held, {i: q for i, q in renames.items() if i in ids})),
    ]
    by_policy = policy_target(optimizer, None)
    renewed = {id(g): {"params": [mapping[id(p)] for p in g["params"]]} for g in optimizer.param_groups}

    def target(
        ident: Ident, param: torch.Tensor | None, group: Mapping[str, Any], key: str, tensor: torch.Tensor
    ) -> tuple[torch.device, str]:
        if param is not None:
            return by_policy(ident, mapping[id(param)], group, key, tensor)
        news = renewed[id(group)]  # a group entry follows the group's new params (as a move's: params_at)
        if ident[0] == OPTIMIZER_WIDE:
            return by_policy.wide_entry(ident, group, key, tensor, group_device(news, tensor))
        return by_policy.group_entry(ident, group, key, tensor, by_policy.params_at(news, tensor))

    committed = False

    def rewrite() -> None:
        """The new params in the groups, their state re-keyed (dict and list operations: they cannot fail)."""
        nonlocal committed
        committed = True  # (the commit runs to its end from here: the stale keys' undo must not run)
        rebuilt: dict[int, list[Any]] = {}  # (a group whose params are a tuple, set by hand: torch steps it too)
        for (gi, pi, _), q in zip(old, new):
            held = optimizer.param_groups[gi]["params"]
            if isinstance(held, list):
                held[pi] = q
            else:
                rebuilt.setdefault(gi, list(held))[pi] = q
        for gi, params in rebuilt.items():
            optimizer.param_groups[gi]["params"] = tuple(params)
        if named:  # (the groups that name their params take the new names)
            for (gi, pi, _), (param_name, _) in zip(old, given):
                names = optimizer.param_groups[gi].get("param_names")
                if isinstance(names, list) and pi < len(names):
                    names[pi] = param_name
        for state, ids in ((optimizer.state, None), *((held.state, ids) for held, ids in sharing)):
            states = {id(p): state[p] for (_, _, p) in old if (ids is None or id(p) in ids) and p in state}
            for (_, _, p), q in zip(old, new):
                if id(p) in states and p is not q:
                    del state[p]
            for (_, _, p), q in zip(old, new):
                if id(p) in states:
                    state[q] = states[id(p)]

    # (the collector is paused by _one_at_a_time; not cached: the next call has other params)
    state, before = optimizer.state, list(optimizer.state.items()) if stale else []
    try:
        # (before the plan, which refuses state for a param in no group; held from a Ctrl-C, never popped first:
        # an interrupt leaves each entry under one key or both, which the undo restores)
        with _engine.uninterrupted(to_the_end=False):
            for k, q in stale:
                state[q] = state[k]
                del state[k]
        copies, pending, _, _ = _transfer(
            optimizer, target, what="rebind", rewrite=rewrite, finish=finish, follows=True
        )
    except BaseException:
        if stale and not committed:
            with _engine.uninterrupted(to_the_end=False):
                state.clear()
                state.update(before)
        raise
    _remember(optimizer, [(p, q) for (_, _, p), q in zip(old, new) if p is not q])
    del copies  # (before a release: a swap leaves the old device tensors in the copies' objects)
    _release_when_done(optimizer, pending)  # state that left a reserved range frees its memory there, as a move's
    return optimizer
