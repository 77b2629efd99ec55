"""The uniform load: a checkpoint whose every param's state is what its class's step creates, each entry a plain
dense tensor that stays where the plan puts it, staged in one pass with its checks made in C.

Most resumes load such a checkpoint (``opt.state_dict()`` of the same class, saved and read back). The general
staging (:class:`._staging.Staging`) looks at each tensor in Python, a dozen attribute reads each; here each
*kind* of entry (a group, a key, a param shape, dtype and device) is checked once in Python, on its first tensor,
exactly as the general path checks it, and every tensor is then compared with its kind's first in one C call
(``TensorGuards``, what ``torch.compile`` checks its inputs with: class, dispatch keys, dtype, device,
``requires_grad``, sizes, strides). Anything else (a mismatch, a tensor shared, a cast, a container, a group
tensor) returns None and the general path stages the load, with its errors. Same result, same placement (the
plan's target function), same copies: a clone each, a live tensor that fits taking the values in place.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from itertools import chain, repeat
from operator import attrgetter
from typing import Any, Protocol

import torch

from .. import _alias, _engine
from .._dtypes import Rejection
from .._errors import add_note
from .._plan import policy_target
from .._probe import StateSpec
from .._state import group_tensors
from ..policy import Placer, has_registered_policy
from ._checks import NOT_REAL


class Staging(Protocol):
    """What the uniform load reads and fills of a :class:`._staging.Staging` (which imports this module)."""

    opt: torch.optim.Optimizer
    name: str
    cast: str | None
    copy: bool
    device: torch.device | None
    strict: bool
    base: type[torch.optim.Optimizer] | None
    torch_setstate: bool
    wide: list[Any]
    cloned: list[torch.Tensor]
    in_place: defaultdict[torch.device, list[tuple[torch.Tensor, torch.Tensor]]]

    @property
    def what(self) -> str: ...

    def spec(self, gi: int, group: Mapping[str, Any], ndim: int) -> StateSpec: ...
    def rejected(
        self, group: Mapping[str, Any], p: torch.Tensor, gi: int, dtypes: tuple[tuple[Any, torch.dtype], ...]
    ) -> list[Rejection]: ...
    def not_in_place(self, sources: list[torch.Tensor]) -> set[int]: ...
    def site_words(self, gi: int, pi: int, key: Any) -> str: ...


__all__ = ["build_uniform", "fits_in_place"]

TensorGuards: Any  # (torch's stub types its sizes and strides as one flat list: it takes one list per tensor)
try:  # (private to torch: without it, every load takes the general path)
    from torch._C._dynamo import guards as _guards

    TensorGuards = _guards.TensorGuards
except (ImportError, AttributeError):  # pragma: no cover - every supported torch has it
    TensorGuards = None

# NOTE: TensorGuards compares dispatch keys as the thread's dispatch state shows them: under inference mode (which
# excludes the autograd keys) an inference tensor would look like any other. Only the state it is imported under
# (the default one) is trusted.
_DEFAULT_EXCLUDED = repr(torch._C._dispatch_tls_local_exclude_set())


class _Kind:
    """One kind of entry row: the checkpoint state of a param of one shape, dtype and device in one group, as its
    first param holds it. ``order``: its keys in their order (every row of the kind holds them in it: each entry
    is checked against its own key's); ``refs``/``sizes``/``strides``: per entry, the tensor every other row's
    entry must match (its sizes and strides given apart: the shaped entries have the param's, the scalars none);
    ``devices``: where each entry goes; ``moves``: whether that is another device than the one it is on (a host
    checkpoint onto an accelerator: the entry is copied there with the others, in one engine batch)."""

    __slots__ = ("order", "keys", "refs", "sizes", "strides", "devices", "moves")

    def __init__(
        self,
        order: tuple[Any, ...],
        keys: frozenset[Any],
        refs: list[torch.Tensor],
        sizes: list[list[int]],
        strides: list[list[int]],
        devices: list[torch.device],
        moves: list[bool],
    ) -> None:
        self.order, self.keys = order, keys
        self.refs, self.sizes, self.strides, self.devices, self.moves = refs, sizes, strides, devices, moves


def _usable(st: Staging, new_groups: Sequence[Mapping[str, Any]]) -> bool:
    """Whether this load may be uniform at all (per load, before any param)."""
    if TensorGuards is None or st.cast is not None or st.wide or not st.strict or st.base is None:
        return False
    if torch.is_inference_mode_enabled() or repr(torch._C._dispatch_tls_local_exclude_set()) != _DEFAULT_EXCLUDED:
        return False
    # A group's own tensors (a tensor lr, one inside a container) are placed, copied and shared by the general
    # path's rules.
    return all(next(group_tensors(g), None) is None for g in new_groups)


def build_uniform(
    st: Staging, saved_groups: list[Mapping[str, Any]], states: Mapping[Any, Any], new_groups: list[dict[str, Any]]
) -> defaultdict[Any, Any] | None:
    """The new state of a uniform load (filling ``st``'s copies and in-place pairs), or None: the general path's."""
    if not _usable(st, new_groups):
        return None
    if has_registered_policy(st.opt):  # (it may place each param apart: kinds are placed once each)
        return None
    target = policy_target(st.opt, st.device, remembered=False)
    lives = st.copy and bool(st.opt.state) and st.torch_setstate
    # (by id: a tensor's hash is a Python call)
    live_get = {id(p): live for p, live in st.opt.state.items()}.get if lives else None
    got: list[torch.Tensor] = []  # every checkpoint tensor, row by row
    olds: list[Any] = []  # the live tensor at each entry (lives)
    rows: list[tuple[torch.Tensor, Mapping[Any, Any], int, int]] = []  # (param, its saved state, group, index)
    row_kinds: list[_Kind] = []
    for gi, (lg, sg, ng) in enumerate(zip(st.opt.param_groups, saved_groups, new_groups)):
        kinds: dict[tuple[Any, ...], _Kind | None] = {}
        for pi, (sid, p) in enumerate(zip(sg["params"], lg["params"])):
            saved = states.get(sid)
            if saved is None:
                if st.spec(gi, ng, p.dim()).eager:
                    return None  # (an error: the general path says which)
                continue
            if type(saved) is not dict:
                return None
            kind_key = (p.shape, p.dtype, p.device)
            kind = kinds.get(kind_key)
            if kind is None:
                kind = kinds[kind_key] = _kind(st, target, gi, pi, ng, p, saved)
                if kind is None:
                    return None
            # NOTE: in the kind's order, not merely the same keys: the guard compares entry by entry, and each entry
            # must meet its own key's reference (a moment of another dtype under another key is no such entry).
            if tuple(saved) != kind.order:
                return None
            got.extend(saved.values())
            row_kinds.append(kind)
            if lives:
                live = live_get(id(p))  # type: ignore[misc]  # (lives: a getter)
                if not live:
                    olds.extend([None] * len(saved))  # (no live state: copies)
                elif live.keys() == kind.keys:
                    olds.extend(map(live.__getitem__, saved))  # (by key: the same order as the checkpoint's)
                else:
                    return None  # (live entries under other keys: the general path pairs them key by key)
            rows.append((p, saved, gi, pi))

    def entries(field: str) -> list[Any]:  # (each row's kind's, entry by entry, in C)
        return list(chain.from_iterable(map(attrgetter(field), row_kinds)))

    refs, sizes, strides, devices = entries("refs"), entries("sizes"), entries("strides"), entries("devices")
    try:
        guard = TensorGuards(*refs, dynamic_dims_sizes=sizes, dynamic_dims_strides=strides)
        matches = guard.check(*got)
    except Exception:  # (a torch whose TensorGuards takes other arguments: the general path)
        return None
    if not matches:
        return None
    # (one tensor in two places, or tensors on one storage: the general path keeps them shared; every entry is a
    # plain dense tensor now, see _kind)
    if not _alias.own_storages(got):
        return None
    new_state: defaultdict[Any, Any] = defaultdict(dict)
    if not st.copy:  # the checkpoint's own tensors, installed as they are
        for p, saved, _, _ in rows:
            new_state[p] = dict(saved)
        return new_state
    moves = entries("moves")
    installed = _in_place(st, guard, got, olds, devices, moves) if lives and olds else None
    done = _copies(
        st,
        got,
        devices,
        moves,
        installed,
        olds,
        st.what,
        lambda n: _site_at(st, rows, n),
    )
    it = iter(done)
    for p, saved, _, _ in rows:
        new_state[p] = dict(zip(saved, it))  # (zip stops at the last key: exactly this param's entries)
    return new_state


def _copies(
    st: Staging,
    got: list[torch.Tensor],
    devices: list[torch.device],
    moves: list[bool],
    installed: list[torch.Tensor | None] | None,
    olds: list[Any],
    what: str,
    site: Callable[[int], str],
) -> list[torch.Tensor]:
    """Each entry's new tensor: the live one where it takes the values in place (``installed``), else a copy on
    its device: a clone each for a fresh optimizer's load where nothing moves (the common resume), else the
    engine's (:func:`optimshift._engine.copy_each`, as the general path's). An error (an OOM on the 900th tensor)
    says which entry (``site(n)``); nothing was installed yet."""
    if installed is olds:  # (every live tensor taking the values)
        return olds
    cloned = st.cloned
    if installed is None and not any(moves):  # (a fresh optimizer, the checkpoint where it belongs: the common)
        done: list[torch.Tensor] = []
        append = done.append
        try:
            for t in got:
                append(t.clone())  # (keeps the strides, and is the cheapest copy)
        except Exception as e:  # (the note copy_each adds, for the same error on the general path)
            n = len(done)
            add_note(e, f"{what}: while copying {site(n)} to {devices[n]}; the optimizer is unchanged")
            raise
        cloned.extend(done)
        return done
    at = [i for i, old in enumerate(installed or repeat(None, len(got))) if old is None]
    made = _engine.copy_each(
        [(got[i], devices[i], got[i].dtype) for i in at], what, lambda n: site(at[n]), own_storages=True
    )
    cloned.extend(made)
    slots: list[Any] = list(got if installed is None else installed)  # (a live tensor in its slot, or a copy below)
    for i, new in zip(at, made):
        slots[i] = new
    return slots


def _kind(
    st: Staging,
    target: Placer,
    gi: int,
    pi: int,
    group: Mapping[str, Any],
    p: torch.Tensor,
    saved: Mapping[Any, Any],
) -> _Kind | None:
    """The kind of ``p``'s row, checked in Python as the general path checks each entry, or None if any entry is
    not the common one (a plain, dense, contiguous tensor right under its key, staying where it is, not
    requiring grad) or a check fails (the general path raises, naming it)."""
    spec = st.spec(gi, group, p.dim())
    if spec.keys != saved.keys() or spec.tensors != spec.keys or spec.shaped | spec.scalars != spec.tensors:
        return None
    pshape = list(p.shape)
    contiguous = _contiguous_strides(pshape)
    kind = _Kind(tuple(saved), frozenset(saved), [], [], [], [], [])
    dtypes: list[tuple[Any, torch.dtype]] = []
    for key, value in saved.items():
        if type(value) is not torch.Tensor or value.requires_grad or value.layout != torch.strided:
            return None
        if value.is_inference():  # (nor is a live tensor matching it ever written in place: see fits_in_place)
            return None
        if key in spec.scalars:
            if value.dim() != 0 or value.dtype in NOT_REAL:
                return None
            kind.sizes.append([])
            kind.strides.append([])
        else:  # shaped: the param's shape, contiguous
            if list(value.shape) != pshape or list(value.stride()) != contiguous:
                return None
            if key in spec.floating and not (value.is_floating_point() or value.is_complex()):
                return None
            kind.sizes.append(pshape)
            kind.strides.append(contiguous)
        device = target((gi, pi, (("key", key),)), p, group, key, value)[0]
        if value.is_meta and device.type != "meta":
            return None  # (no values to copy: the general path says so)
        kind.refs.append(value)
        kind.devices.append(device)
        kind.moves.append(value.device != device)
        dtypes.append((key, value.dtype))
    if st.rejected(group, p, gi, tuple(dtypes)):
        return None
    return kind


def _in_place(
    st: Staging,
    guard: Any,
    got: list[torch.Tensor],
    olds: list[Any],
    devices: list[torch.device],
    moves: list[bool],
) -> list[torch.Tensor | None] | None:
    """Per entry, the live tensor that takes the checkpoint's values in place (recorded in ``st.in_place``), or
    None (a clone is installed, and ``_resume._install`` adopts it into the live tensor); None if none does.
    The general path's rule (``Staging._live_states``, :func:`fits_in_place`): distinct live tensors, none of
    them a param, grad, group tensor or checkpoint tensor (``got``), each of the checkpoint tensor's kind
    (``guard``: one C call), all that uses its storage, and the checkpoint's tensor already where it belongs (one
    that ``moves`` is copied there with the others and the copy adopted, as the general path does)."""
    try:
        alike = guard.check(*olds)
    except Exception:  # (a live entry that is no tensor, or none)
        alike = False
    live = olds if alike else [t for t in olds if isinstance(t, torch.Tensor)]
    ids = set(map(id, live))
    if len(ids) != len(live):
        return None  # (a live tensor in two places: it must stop being shared)
    protect = st.not_in_place([])  # (the params, their grads, the live groups' tensors; the checkpoint's: got_ids)
    got_ids = set(map(id, got))
    clear = ids.isdisjoint(got_ids) and ids.isdisjoint(protect)
    if not clear:
        protect |= got_ids
    if alike and clear and not any(moves) and _alias.sole_users(olds) and devices.count(devices[0]) == len(devices):
        st.in_place[devices[0]].extend(zip(olds, got))  # (the common case: every one, on one device)
        return olds
    sole = _alias.sole_user
    out: list[torch.Tensor | None] = []
    append = out.append
    pairs = st.in_place
    for old, new, device, move in zip(olds, got, devices, moves):
        if not move and (clear or id(old) not in protect) and (sole(old) if alike else fits_in_place(old, new, device)):
            pairs[device].append((old, new))
            append(old)
        else:
            append(None)
    return out


def fits_in_place(old: torch.Tensor, new: torch.Tensor, device: torch.device) -> bool:
    """Whether live tensor ``old`` can take checkpoint tensor ``new``'s values by ``old.copy_(new)`` and end up
    exactly as a clone of ``new`` adopted into it would be: both plain and dense with the same shape and strides
    (``new``, on ``device``, is plain, dense and contiguous: the caller checked), on one device, of one dtype;
    ``old`` nobody's but the optimizer's (no grad, not an inference tensor, all that uses its storage) and not
    ``new`` itself (the caller's state dict would keep holding it). The caller also keeps out live tensors that
    are params, grads, group tensors or the checkpoint's own."""
    return (
        type(old) is torch.Tensor
        and old is not new
        and old.layout == torch.strided  # (before stride(), which a sparse tensor refuses)
        and old.dtype == new.dtype
        and old.device == device
        and new.device == device  # (the general path writes in place only what is already where it belongs)
        and old.shape == new.shape
        and old.stride() == new.stride()  # (so contiguous as ``new``; alike where a size-1 dimension's is free)
        and not old.requires_grad
        and not old.is_inference()
        and _alias.sole_user(old)
    )


def _contiguous_strides(shape: list[int]) -> list[int]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return strides[::-1]


def _site_at(st: Staging, rows: list[tuple[torch.Tensor, Mapping[Any, Any], int, int]], n: int) -> str:
    """Entry ``n`` of the rows, in words (for an error)."""
    for _, saved, gi, pi in rows:
        if n < len(saved):
            return st.site_words(gi, pi, list(saved)[n])
        n -= len(saved)
    return "?"  # pragma: no cover - n is always an entry
