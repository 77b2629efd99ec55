"""The uniform load: a checkpoint whose every param's state is what its class's step creates, each entry a plain
dense tensor (most resumes), staged in one pass: each *kind* of entry checked once in Python, on its first tensor,
as the general path checks it, every other against it in one C call (``TensorGuards``, ``torch.compile``'s input
check). Anything else returns None, for the general path and its errors. Same result, placement and copies.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from itertools import accumulate, chain, repeat, starmap
from operator import attrgetter
from typing import Any, NamedTuple, Protocol, cast

import torch

from .. import _alias, _engine
from .._copy import contiguous_strides
from .._plan import Plan, Transfer, _new_transfer, policy_target
from .._probe import Rejection, StateSpec
from .._state import group_tensors
from ..policy import Placer, has_registered_policy
from ._checks import NOT_REAL


class Staging(Protocol):
    """What the uniform load uses of a :class:`._staging.Staging` (which imports this module)."""

    opt: torch.optim.Optimizer
    cast: str | None
    copy: bool
    device: torch.device | None
    strict: bool
    base: type[torch.optim.Optimizer] | None
    torch_setstate: bool
    wide: list[Any]
    cloned: list[torch.Tensor]
    in_place: defaultdict[torch.device, tuple[list[torch.Tensor], list[torch.Tensor]]]

    @property
    def what(self) -> str: ...

    def spec(self, gi: int, group: Mapping[str, Any], ndim: int) -> StateSpec: ...
    def rejected(
        self, group: Mapping[str, Any], p: torch.Tensor, gi: int, dtypes: tuple[tuple[Any, torch.dtype], ...]
    ) -> list[Rejection]: ...
    def not_in_place(self, sources: list[torch.Tensor]) -> set[int]: ...
    def site_words(self, tr: Transfer) -> str: ...


__all__ = ["build_uniform", "fits_in_place"]

TensorGuards: Any  # (torch's stub types its sizes and strides as one flat list: it takes one list per tensor)
try:  # (private to torch: without it, every load takes the general path)
    from torch._C._dynamo import guards as _guards

    TensorGuards = _guards.TensorGuards
except (ImportError, AttributeError):  # pragma: no cover - every supported torch has it
    TensorGuards = None

# NOTE: TensorGuards compares dispatch keys as the thread's state shows them: under inference mode an inference
# tensor would look like any other. Only the default state, as imported, is trusted.
_DEFAULT_EXCLUDED = repr(torch._C._dispatch_tls_local_exclude_set())


class _Layout:
    """The rows whose entries are copied alike, column by column (same keys in order, each column of one dtype and
    device bound for one device, all empty or none). ``got``: the checkpoint tensors, row by row; ``olds``: the live
    tensor at each (None where none); ``verbatim``: every row's live dict holds them under the same keys in order."""

    __slots__ = ("order", "devices", "moves", "got", "olds", "verbatim")

    def __init__(self, order: tuple[Any, ...], devices: list[torch.device], moves: list[bool]) -> None:
        self.order, self.devices, self.moves = order, devices, moves
        self.got: list[torch.Tensor] = []
        self.olds: list[Any] = []
        self.verbatim = True

    def placed(self, rows: list[_Rows]) -> list[tuple[torch.Tensor, int, int]]:
        """Each of this layout's rows (``rows``: every layout's) as its param, group and index."""
        return [(p, gi, pi + j) for ps, _, layout, gi, pi, _ in rows if layout is self for j, p in enumerate(ps)]

    def entry(self, placed: list[tuple[torch.Tensor, int, int]], i: int) -> Transfer:
        """The transfer of ``got[i]`` (``placed``: :meth:`placed`): where it sits, its param, its place."""
        width = len(self.order)
        p, gi, pi = placed[i // width]
        key, device = self.order[i % width], self.devices[i % width]
        return _new_transfer(Transfer, ((gi, pi, (("key", key),)), None, self.got[i], p, device, "load", None))


# (consecutive params of one group, their saved states, their layout, the group, the first's index, their live
# states or None): a whole group's rows in one, or one row
_Rows = tuple[Sequence[torch.Tensor], Sequence[Mapping[Any, Any]], _Layout, int, int, Sequence[Any] | None]
_kind_key = attrgetter("shape", "dtype", "device")  # (a param's kind: what its row's checks and placement read)


class _Kind(NamedTuple):
    """The checkpoint state of a param of one shape, dtype and device in one group, as its first param holds it:
    ``check`` a row's entries against it in one C call, ``both`` a row's followed by its live tensors, ``param``
    another param against the first (None where TensorGuards cannot), ``layout`` how its entries are copied."""

    order: tuple[Any, ...]
    keys: frozenset[Any]
    check: Callable[..., bool]
    both: Callable[..., bool]
    param: Callable[[torch.Tensor], bool] | None
    layout: _Layout


def build_uniform(
    st: Staging, saved_groups: list[Mapping[str, Any]], states: Mapping[Any, Any], new_groups: list[dict[str, Any]]
) -> defaultdict[Any, Any] | None:
    """The new state of a uniform load (filling ``st``'s copies and in-place pairs), or None: the general path's."""
    if TensorGuards is None or st.cast is not None or st.wide or not st.strict or st.base is None:
        return None
    if torch.is_inference_mode_enabled() or repr(torch._C._dispatch_tls_local_exclude_set()) != _DEFAULT_EXCLUDED:
        return None
    # (a registered policy may place each param apart; a group's own tensors go by the general path's rules)
    if has_registered_policy(st.opt) or any(next(group_tensors(g), None) is not None for g in new_groups):
        return None
    target = policy_target(st.opt, st.device, remembered=False)
    lives = st.copy and bool(st.opt.state) and st.torch_setstate
    # (by id: a tensor's hash is a Python call)
    live_get = dict(zip(map(id, st.opt.state), st.opt.state.values())).get if lives else None
    alike = lives  # (every live entry of the kind of its checkpoint tensor, so far)
    rows: list[_Rows] = []
    layouts: dict[tuple[Any, ...], _Layout] = {}
    for gi, (lg, sg, ng) in enumerate(zip(st.opt.param_groups, saved_groups, new_groups)):
        kinds: dict[tuple[Any, ...], _Kind] = {}
        if _whole_group(st, target, gi, lg["params"], sg["params"], ng, states, kinds, layouts, rows, live_get, alike):
            continue
        for pi, (sid, p) in enumerate(zip(sg["params"], lg["params"])):
            saved = states.get(sid)
            if saved is None:
                if st.spec(gi, ng, p.dim()).eager:
                    return None  # (an error: the general path says which)
                continue
            if type(saved) is not dict:
                return None
            kind = _kind_of(st, target, gi, pi, ng, p, saved, kinds, layouts)
            if kind is None:
                return None
            # NOTE: in the kind's order, not merely the same keys: the guard checks each entry against its key's.
            if tuple(saved) != kind.order:
                return None
            values = saved.values()
            checked = False  # (values against the kind, with the live tensors of the row)
            layout = kind.layout
            live = None
            if lives:
                live = live_get(id(p))  # type: ignore[misc]  # (lives: a getter)
                olds: Any
                if live is not None and not isinstance(live, Mapping):
                    return None  # (live state that is no dict, a tensor, whose truth is ambiguous: the general path)
                if not live:
                    olds = [None] * len(saved)  # (no live state: copies)
                    alike = layout.verbatim = False
                elif tuple(live) == kind.order:
                    olds = live.values()
                elif live.keys() == kind.keys:
                    olds = list(map(live.__getitem__, saved))  # (by key: the same order as the checkpoint's)
                    layout.verbatim = False
                else:
                    return None  # (live entries under other keys: the general path pairs them key by key)
                if alike:
                    try:
                        checked = alike = kind.both(*values, *olds)
                    except Exception:  # (a live entry that is no tensor)
                        alike = False
                layout.olds.extend(olds)
            if not checked:
                try:
                    if not kind.check(*values):
                        return None
                except Exception:  # (an entry that is no tensor)
                    return None
            layout.got.extend(values)
            rows.append(([p], [saved], layout, gi, pi, [live]))
    every = list(layouts.values())
    got = every[0].got if len(every) == 1 else list(chain.from_iterable(layout.got for layout in every))
    # (one tensor in two places, or tensors on one storage: the general path keeps them shared; every entry is a
    # plain dense tensor now, see _kind)
    if not _alias.own_storages(got):
        return None
    new_state: defaultdict[Any, Any] = defaultdict(dict)
    if not st.copy:  # the checkpoint's own tensors, installed as they are: only where each belongs
        if any(any(layout.moves) for layout in every):
            return None  # (moved by the general path, which copies only what must move)
        for params, saved_states, *_ in rows:
            new_state.update(zip(params, map(dict, saved_states)))
        return new_state
    its: dict[int, Iterator[tuple[torch.Tensor, ...]] | None] = {}  # (None: each row a copy of its live dict)
    if lives and rows:
        for layout, done in zip(every, _into_existing(st, every, got, alike, rows)):
            verbatim = done is layout.olds and layout.verbatim
            its[id(layout)] = None if verbatim else zip(*[iter(done)] * len(layout.order))  # (a tuple a row)
    else:  # a fresh optimizer, the common resume: every entry copied, a plan of columns (no transfer built)
        at = [(layout, j) for layout in every for j in range(len(layout.order))]
        columns = [(layout.got[j :: len(layout.order)], layout.devices[j]) for layout, j in at]

        def entry(c: int, n: int) -> Transfer:
            layout, j = at[c]
            return layout.entry(layout.placed(rows), n * len(layout.order) + j)

        plan = Plan(st.opt, columns=columns, entry=entry)
        copies = cast("list[torch.Tensor]", _engine.run(plan, what=st.what, site=st.site_words).batch.copies)
        st.cloned.extend(copies)
        bounds = list(accumulate((len(tensors) for tensors, _ in columns), initial=0))
        made = [copies[start:stop] for start, stop in zip(bounds, bounds[1:])]
        start = 0
        for layout in every:
            width = len(layout.order)
            its[id(layout)] = zip(*made[start : start + width])
            start += width
    for params, _, layout, _, _, live_states in rows:  # (each chunk's dicts in one pass in C)
        it = its[id(layout)]  # (zip stops at the chunk's last param before taking another row from it)
        news = map(dict, live_states) if it is None else map(dict, map(zip, repeat(layout.order), it))  # type: ignore[arg-type]
        new_state.update(zip(params, news))
    return new_state


def _whole_group(
    st: Staging,
    target: Placer,
    gi: int,
    params: Sequence[torch.Tensor],
    ids: Sequence[Any],
    group: Mapping[str, Any],
    states: Mapping[Any, Any],
    kinds: dict[tuple[Any, ...], _Kind],
    layouts: dict[tuple[Any, ...], _Layout],
    rows: list[_Rows],
    live_get: Callable[[int], Any] | None,
    alike: bool,
) -> bool:
    """Add group ``gi``'s rows at once where every param has state (and live state) of its param's kind, every kind
    of one layout (a model's shapes in turn too): :func:`build_uniform`'s checks, one C call a row. False (nothing
    added) leaves the group to its loop."""
    if not params:
        return False
    saved: list[Any] = list(map(states.get, ids))
    if set(map(type, saved)) != {dict}:  # (None: a param without state)
        return False
    first = _kind_of(st, target, gi, 0, group, params[0], saved[0], kinds, layouts)
    if first is None:
        return False
    layout, order = first.layout, first.order
    checks: Iterable[Callable[..., bool]] | None = None  # (per row, its kind's check; None: every row the first's)
    try:
        if first.param is None or not all(map(first.param, params)):  # (params of several kinds)
            keys = list(map(_kind_key, params))
            found: dict[tuple[Any, ...], Callable[..., bool]] = {}
            for key, pi in dict(zip(reversed(keys), range(len(keys) - 1, -1, -1))).items():  # (each kind's first)
                kind = _kind_of(st, target, gi, pi, group, params[pi], saved[pi], kinds, layouts)
                if kind is None or kind.layout is not layout:
                    return False
                found[key] = kind.check
            checks = list(map(found.__getitem__, keys))
        if not all(map(order.__eq__, map(tuple, saved))):
            return False
        values = list(map(dict.values, saved))
        lives: list[Any] | None = None
        olds: list[Any] | None = None
        if live_get is not None:
            lives = list(map(live_get, map(id, params)))
            if not all(map(order.__eq__, map(tuple, lives))):  # (None, no live state: tuple() raises, caught below)
                return False
            olds = list(map(dict.values, lives))
        # (the live tensors against the same references, apart: a live tensor that is the checkpoint's own is
        # found by the in-place rule, see _into_existing)
        for row in (values, olds if alike else None):
            if row is not None and not all(
                starmap(first.check, row) if checks is None else map(lambda check, r: check(*r), checks, row)
            ):
                return False
    except Exception:  # (an entry that is no tensor)
        return False
    layout.got.extend(chain.from_iterable(values))
    if olds is not None:
        layout.olds.extend(chain.from_iterable(olds))
    rows.append((params, saved, layout, gi, 0, lives))
    return True


def _into_existing(
    st: Staging, every: list[_Layout], got: list[torch.Tensor], alike: bool, rows: list[_Rows]
) -> list[list[Any]]:
    """Each layout's new tensors into existing state: the live one where it takes the values in place
    (:func:`_in_place`), else a copy made by :func:`optimshift._engine.run`, which the install adopts."""
    olds = every[0].olds if len(every) == 1 else list(chain.from_iterable(layout.olds for layout in every))
    live = olds if alike else [t for t in olds if isinstance(t, torch.Tensor)]
    ids = set(map(id, live))
    if len(ids) != len(live):
        return _copied(st, every, [None] * len(every), rows)  # (a live tensor in two places: it must stop being shared)
    protect = st.not_in_place([])  # (the params, their grads, the live groups' tensors; the checkpoint's: below)
    clear = ids.isdisjoint(protect) and ids.isdisjoint(map(id, got))  # (no live tensor protected, nor the sd's)
    if not clear:
        protect.update(map(id, got))
    return _copied(st, every, [_in_place(st, layout, alike, clear, protect) for layout in every], rows)


def _copied(st: Staging, every: list[_Layout], installed: list[list[Any] | None], rows: list[_Rows]) -> list[list[Any]]:
    """Per layout, its entries: the live tensor in its slot where ``installed`` has one, else a copy."""
    out = []
    for layout, slots in zip(every, installed):
        if slots is layout.olds:  # (every live tensor taking the values)
            out.append(slots)
            continue
        got = layout.got
        at = [i for i, old in enumerate(slots or repeat(None, len(got))) if old is None]
        placed = layout.placed(rows) if at else []
        plan = Plan(st.opt, [layout.entry(placed, i) for i in at], repeats=False)  # (copied where it stays too)
        pairs = _engine.run(plan, own=set(map(id, got)), what=st.what, site=st.site_words).pairs if at else []
        made = [new for _, new in pairs]
        st.cloned.extend(made)
        filled: list[Any] = list(got if slots is None else slots)  # (a live tensor in its slot, or a copy below)
        for i, new in zip(at, made):
            filled[i] = new
        out.append(filled)
    return out


def _kind_of(
    st: Staging,
    target: Placer,
    gi: int,
    pi: int,
    group: Mapping[str, Any],
    p: torch.Tensor,
    saved: Mapping[Any, Any],
    kinds: dict[tuple[Any, ...], _Kind],
    layouts: dict[tuple[Any, ...], _Layout],
) -> _Kind | None:
    """The kind of ``p``'s row (``kinds``: this group's, by :data:`_kind_key`), made from it the first time, checked
    as the general path checks each entry; None where an entry is not a plain dense contiguous tensor under its key
    or a check fails (the general path raises). Adds its layout."""
    kind_key = _kind_key(p)
    if kind_key in kinds:
        return kinds[kind_key]
    if not saved:  # (a row of no entries, which an access to opt.state[p] leaves: a layout of no columns has no rows)
        return None
    spec = st.spec(gi, group, p.dim())
    if spec.keys != saved.keys() or spec.tensors != spec.keys or spec.shaped | spec.scalars != spec.tensors:
        return None
    pshape = list(p.shape)
    contiguous = list(contiguous_strides(pshape))
    refs: list[torch.Tensor] = []
    sizes: list[list[int]] = []
    strides: list[list[int]] = []
    devices: list[torch.device] = []
    dtypes: list[tuple[Any, torch.dtype]] = []
    for key, value in saved.items():
        if type(value) is not torch.Tensor or value.requires_grad or value.layout != torch.strided:
            return None
        if value.is_inference():  # (nor is a live tensor matching it ever written in place: see fits_in_place)
            return None
        if key in spec.scalars:
            if value.dim() != 0 or value.dtype in NOT_REAL:
                return None
            sizes.append([])
            strides.append([])
        else:  # shaped: the param's shape, contiguous
            if list(value.shape) != pshape or list(value.stride()) != contiguous:
                return None
            if key in spec.floating and not (value.is_floating_point() or value.is_complex()):
                return None
            sizes.append(pshape)
            strides.append(contiguous)
        device = target((gi, pi, (("key", key),)), p, group, key, value)[0]
        if value.is_meta and device.type != "meta":
            return None  # (no values to copy: the general path says so)
        refs.append(value)
        devices.append(device)
        dtypes.append((key, value.dtype))
    if st.rejected(group, p, gi, tuple(dtypes)):
        return None
    try:
        guard = TensorGuards(*refs, dynamic_dims_sizes=sizes, dynamic_dims_strides=strides)
        both = TensorGuards(*refs, *refs, dynamic_dims_sizes=sizes * 2, dynamic_dims_strides=strides * 2)
    except Exception:  # (a torch whose TensorGuards takes other arguments: the general path)
        return None
    try:  # (another param of this kind: the same class, dtype, device, sizes and strides as ``p``)
        param = TensorGuards(p, dynamic_dims_sizes=[pshape], dynamic_dims_strides=[list(p.stride())]).check
    except Exception:  # (a param TensorGuards cannot check: its group's rows go one by one)
        param = None
    order = tuple(saved)
    sources = tuple((t.device, t.dtype) for t in refs)
    layout_key = (order, sources, tuple(devices), 0 in pshape)  # (a column's tensors all empty, or none)
    layout = layouts.get(layout_key)
    if layout is None:
        layout = layouts[layout_key] = _Layout(order, devices, [t.device != d for t, d in zip(refs, devices)])
    kind = kinds[kind_key] = _Kind(order, frozenset(saved), guard.check, both.check, param, layout)
    return kind


def _in_place(
    st: Staging, layout: _Layout, alike: bool, clear: bool, protect: set[int]
) -> list[torch.Tensor | None] | None:
    """Per entry of ``layout``, the live tensor that takes the checkpoint's values in place (recorded in
    ``st.in_place``) or None (a copy is adopted); None if none does. The general path's rule (:func:`fits_in_place`;
    ``clear``: none is protected, else ``protect``; ``alike``: every one of its entry's kind, checked in C)."""
    olds, got, width = layout.olds, layout.got, len(layout.order)
    devices = layout.devices
    if alike and clear and not any(layout.moves) and len(set(devices)) == 1 and _alias.sole_users(olds):
        into, news = st.in_place[devices[0]]  # (the common case: every one, on one device)
        into.extend(olds)
        news.extend(got)
        return olds
    sole = _alias.sole_user
    out: list[torch.Tensor | None] = []
    append = out.append
    pairs = st.in_place
    moves = layout.moves
    for i, (old, new) in enumerate(zip(olds, got)):
        device = devices[i % width]
        if (clear or id(old) not in protect) and (
            (not moves[i % width] and sole(old)) if alike else fits_in_place(old, new, device)
        ):
            into, news = pairs[device]
            into.append(old)
            news.append(new)
            append(old)
        else:
            append(None)
    return out if any(t is not None for t in out) else None


def fits_in_place(old: torch.Tensor, new: torch.Tensor, device: torch.device) -> bool:
    """Whether live ``old`` can take ``new``'s values by ``old.copy_(new)`` and end up as a copy of ``new`` on
    ``device`` adopted into it: alike, on ``device``, the optimizer's alone, and not ``new`` (the caller's state
    dict would keep holding it); the caller keeps out params, grads, group tensors and the checkpoint's."""
    return (
        type(old) is torch.Tensor
        and old is not new
        and old.layout == torch.strided  # (before stride(), which a sparse tensor refuses)
        and old.dtype == new.dtype
        and old.device == device  # (``new`` may be elsewhere: a host checkpoint into state on an accelerator)
        and not new.is_meta  # (no values to copy)
        and old.shape == new.shape
        and old.stride() == new.stride()  # (so contiguous as ``new``; alike where a size-1 dimension's is free)
        and not old.requires_grad
        and not old.is_inference()
        and _alias.sole_user(old)
    )
