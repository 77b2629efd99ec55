"""Staging a load: a state dict validated against the live optimizer and turned into its new state and groups,
placed by the planner and copied by one ``engine.run`` before :mod:`._resume` installs anything (an error leaves the
optimizer as it was). The common checkpoint is staged in one pass by :mod:`._uniform`, with the same result.
"""

from __future__ import annotations

import contextlib
import copy as _copy
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, MutableMapping
from itertools import chain, repeat
from operator import is_
from types import MappingProxyType
from typing import Any

import torch

from .. import _alias, _engine
from .. import policy as _policy
from .._errors import dtype_name, with_article
from .._plan import Plan, TargetFn, Transfer, _new_transfer, build_plan, listed_twice, policy_target
from .._probe import NO_SPEC, Rejection, StateSpec, entry_dtypes, expected_state, rejected_dtypes
from .._state import (
    _ATOMS,
    IMPLEMENTATION_FLAGS,
    MAX_DEPTH,
    OPTIMIZER_WIDE,
    Path,
    Setter,
    format_path,
    group_tensors,
    leaves,
    param_label,
    param_name,
    rebuild,
    too_deep,
)
from . import _files
from ._checks import check_entries, check_group, keys_shown, torch_cast
from ._uniform import build_uniform, fits_in_place

__all__ = ["Staging", "CastNeeded"]


class CastNeeded(ValueError):
    """A load keeping the checkpoint's dtypes (``cast=None``) would leave state the optimizer's step refuses;
    ``cast='param'`` (PyTorch's cast) loads it."""


_Site = tuple[int, int | None, Any, Path]  # (group or OPTIMIZER_WIDE, param index or None, key, path inside)
_Ticket = tuple[int, torch.device, torch.dtype]  # (id(source), device, dtype): one copy each
_Wanted = torch.Tensor | _Ticket  # a tensor that fits as it is, or the ticket of its copy
_DtypeKey = tuple[int, torch.dtype, int, tuple[tuple[Any, torch.dtype], ...]]  # (group, param dtype, rank, entries)

# NOTE: each torch.optim class's __setstate__ as imported: one patched in since may read the state it is handed, so
# live tensors never take the loaded values after it (see Staging.torch_setstate).
_TORCH_SETSTATE: dict[type, Any] = {
    cls: cls.__setstate__
    for cls in vars(torch.optim).values()
    if isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)
}


class Staging:
    """Validates a state dict against the live optimizer and builds its new state and groups from copies, which
    only ``_resume._install`` assigns."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        name: str,
        sd: Any,
        *,
        flags: str,
        cast: str | None,
        copy: bool,
        device: torch.device | None,
        what: str,
        streamed: bool = False,
        saved: Mapping[int, str] | None = None,
    ) -> None:
        self.opt, self.name, self.sd = optimizer, name, sd
        self.saved = saved  # (a file's: where each storage was saved, by data_ptr; see _files.load_located)
        self.what = what  # the operation, as errors name it: the optimizer, load_state_dict and the file, if any
        self.streamed = streamed  # (its state on the host, its groups' tensors where a move puts them)
        self.flags, self.cast, self.copy, self.device = flags, cast, copy, device
        self.wide: list[Any] = []  # optimizer-wide state keys (set by validate_structure)
        self.base = _policy.builtin_base(type(optimizer))
        # (what a torch.optim step creates is checked in full; a subclass with its own step: only shapes)
        self.strict = _policy.stepping_base(type(optimizer)) is not None
        # (the __setstate__ a load calls is torch's own for the class: it fixes up non-tensor entries only, so live
        # tensors may take the loaded values after it)
        self.torch_setstate = (
            self.base is not None
            and type(optimizer).__setstate__ is _TORCH_SETSTATE.get(self.base)
            and "__setstate__" not in getattr(optimizer, "__dict__", {})
        )
        self._wanted: dict[_Ticket, Transfer] = {}  # ticket -> the transfer of its copy, made by _resolve()
        self._casts = False  # (whether a ticket's copy is cast)
        self._made: dict[_Ticket, torch.Tensor] = {}
        self._uses: dict[_Ticket, int] = {}  # how many places (planned transfers) each copy is installed in
        self._dtype_checks: dict[_DtypeKey, list[Rejection]] = {}
        # by device: (live tensors, checkpoint tensors) pairs, each live one installed as it is and written once the
        # class's __setstate__ accepted the new state
        self.in_place: defaultdict[torch.device, tuple[list[torch.Tensor], list[torch.Tensor]]] = defaultdict(
            lambda: ([], [])
        )
        self.cloned: list[torch.Tensor] = []  # copies made with no ticket (see build), each installed once
        self._specs: dict[tuple[int, int], StateSpec] = {}  # (group, param rank) -> what a step keeps

    def fail(self, message: str, exc: type[Exception] = ValueError) -> Exception:
        return exc(f"{self.what}: {message}")

    # -- structure ------------------------------------------------------------------------------------------

    def validate_structure(self) -> tuple[list[Mapping[str, Any]], Mapping[Any, Any]]:
        sd = self.sd
        if not isinstance(sd, Mapping):
            raise self.fail(f"state_dict must be a dict, got {type(sd).__name__}", TypeError)
        missing = [k for k in ("state", "param_groups") if k not in sd]
        if missing:
            keys = ", ".join(repr(k) for k in list(sd)[:8])
            raise self.fail(
                f"state_dict has no {' or '.join(repr(k) for k in missing)} entry (its keys: {keys}); "
                f"it is not an optimizer state dict"
            )
        groups, states = sd["param_groups"], sd["state"]
        if not isinstance(states, Mapping):
            raise self.fail(f"state_dict['state'] must be a dict, got {type(states).__name__}", TypeError)
        if not isinstance(groups, (list, tuple)) or not all(isinstance(g, Mapping) for g in groups):
            raise self.fail("state_dict['param_groups'] must be a list of dicts", TypeError)
        live = self.opt.param_groups
        if len(groups) != len(live):
            raise self.fail(
                f"the checkpoint has {len(groups)} param group{'s' if len(groups) != 1 else ''}, "
                f"the optimizer has {len(live)}"
            )
        for gi, (g, lg) in enumerate(zip(groups, live)):
            saved_params = g.get("params")
            if not isinstance(saved_params, (list, tuple)):
                raise self.fail(f"param group {gi} of the checkpoint has no 'params' list", TypeError)
            if len(saved_params) != len(lg["params"]):
                raise self.fail(
                    f"param group {gi} has {len(saved_params)} params in the checkpoint and "
                    f"{len(lg['params'])} in the optimizer"
                )
        # NOTE: one pass in C over each side's params; the loop that names the culprit runs only when one finds
        # a param listed twice or an id that is not hashable.
        n = sum(len(lg["params"]) for lg in live)
        seen_ids: dict[Any, Any] = {}
        with contextlib.suppress(TypeError):
            seen_ids = dict.fromkeys(chain.from_iterable(g["params"] for g in groups))
        if len(seen_ids) != n or len(set(map(id, chain.from_iterable(lg["params"] for lg in live)))) != n:
            self._refuse_listed_twice(groups, live)
        id_types = set(map(type, seen_ids))
        # (optimizer-wide entries, text ids, strays: none when every key is a listed id, one set operation)
        others = [] if seen_ids.keys() >= states.keys() else [k for k in states if k not in seen_ids]
        texts = _files.stringified_ids(others, seen_ids)
        if texts:
            raise self.fail(
                f"state_dict['state'] is keyed by text ({', '.join(repr(k) for k in texts[:3])}"
                f"{', …' if len(texts) > 3 else ''}) while the param groups list the ids "
                f"{_ids_shown(seen_ids)}: it went through JSON or another round trip that turns keys into text, "
                f"and PyTorch would silently drop every param's state. Turn the keys back first: "
                f"sd['state'] = {{int(k): v for k, v in sd['state'].items()}}"
            )
        # Keys of another kind than the params' ids are optimizer-wide entries (MADGRAD's "k"): PyTorch keeps them.
        self.wide = [k for k in others if type(k) not in id_types] if id_types else []
        if self.wide and self.base is not None and type(self.opt) is self.base:
            raise self.fail(
                f"state_dict['state'] has entries {self.wide[:5]!r} that are no param's id, but "
                f"{self.base.__module__}.{self.base.__qualname__} keeps all of its state per param (only other "
                f"optimizer classes keep optimizer-wide entries); the param groups list the ids "
                f"{_ids_shown(seen_ids)}"
            )
        stray = [k for k in others if k not in self.wide]
        if stray:
            raise self.fail(
                f"state_dict['state'] has entries for param ids {stray[:5]!r} that no param group lists; "
                f"they could not be matched to a param"
            )
        if any(map(is_, states.values(), repeat(None))):  # (PyTorch fails on it: not "no state", a param's state lost)
            for gi, g in enumerate(groups):
                for pi, sid in enumerate(g["params"]):
                    if states.get(sid, ()) is None:
                        raise self.fail(f"{self._param_label(gi, pi)}: its state is None, expected a dict", TypeError)
        return list(groups), states

    def _refuse_listed_twice(self, groups: Any, live: list[dict[str, Any]]) -> None:
        """Raise naming the first param the optimizer lists twice, or the first checkpoint id listed twice or
        not hashable."""
        twice = listed_twice(live)
        if twice is not None:
            raise self.fail(twice)
        seen_ids: dict[Any, tuple[int, int]] = {}
        for gi, g in enumerate(groups):
            for pi, sid in enumerate(g["params"]):
                try:
                    prior = seen_ids.get(sid)
                except TypeError:
                    raise self.fail(
                        f"group {gi}, param {pi}: the checkpoint's param id {sid!r} is not hashable", TypeError
                    ) from None
                if prior is not None:
                    raise self.fail(
                        f"the checkpoint lists param id {sid!r} twice (group {prior[0]}, param {prior[1]} and "
                        f"group {gi}, param {pi})"
                    )
                seen_ids[sid] = (gi, pi)

    # -- placement ------------------------------------------------------------------------------------------

    def _cast_dtype(
        self,
        group: Mapping[str, Any],
        param: torch.Tensor | None,
        inner_key: Any,
        tensor: torch.Tensor,
        device: torch.device,
    ) -> torch.dtype:
        """``cast="param"``: PyTorch's rule; otherwise the saved dtype. A host scalar beside a param elsewhere
        (NAdam's ``mu_product``) keeps its saved dtype: PyTorch casts it only as it sends it to the param, and a
        foreach step refuses a host scalar in a bf16 param's dtype."""
        if self.cast != "param" or param is None:
            return tensor.dtype
        if tensor.dim() == 0 and device.type == "cpu" and param.device.type != "cpu":
            return tensor.dtype
        return torch_cast(inner_key, group, (param.dtype, param.device), (tensor.dtype, tensor.device))[0]

    def _param_label(self, gi: int, pi: int) -> str:
        names = self.opt.param_groups[gi].get("param_names") or self.sd["param_groups"][gi].get("param_names")
        return param_label(gi, pi, param_name(pi, names))

    def _site(self, site: _Site) -> str:
        """``(group, param index or None, key, path)`` as words, for errors."""
        gi, pi, key, path = site
        if gi == OPTIMIZER_WIDE:
            return f"optimizer-wide entry {key!r}{format_path(path)}"
        if pi is None:
            return f"param group {gi}, key {key!r}{format_path(path)}"
        return f"{self._param_label(gi, pi)}, state key {key!r}{format_path(path)}"

    def site_words(self, tr: Transfer) -> str:
        """Where a planned tensor sits, in words, for errors."""
        gi, pi, path = tr[0]
        return self._site((gi, pi, path[0][1], path[1:]))

    def _where(self, gi: int, pi: int) -> Callable[[Any], str]:
        """Param ``pi`` of group ``gi`` (``None``), or its state entry ``key``, in words: made only for an error."""
        return lambda key: self._param_label(gi, pi) if key is None else self._site((gi, pi, key, ()))

    def made_any(self) -> bool:
        """Whether this staging made any copy (else :meth:`made_ids` is empty)."""
        return bool(self._made or self.cloned)

    def made_ids(self) -> set[int]:
        """The ids of the copies this staging made (never the caller's own tensors)."""
        return {id(t) for t in self._made.values()}.union(map(id, self.cloned))

    def shared_uses(self) -> dict[int, int]:
        """id -> how many places, of each copy installed in more than one place (a tensor the checkpoint shares:
        LBFGS's ``state['t']`` is its group's ``lr``), which must stay one object."""
        return {id(self._made[ticket]): n for ticket, n in self._uses.items() if n > 1}

    def _plan(self, groups: list[dict[str, Any]], state: Mapping[Any, Any]) -> Plan:
        """The plan of the state about to be installed: where the policy (:class:`optimshift.policy.Placer`) puts each
        tensor for the live optimizer's class, with the loaded groups' hyperparameters and the live flags."""
        sides = self.sides(groups, state)
        target: TargetFn = _policy.Placer(self.opt, self.device, sides)
        if self.streamed:  # (the state on the host, where a streamed optimizer keeps it; its groups' as stream() lays
            # them out: where a move puts them)
            state_target, groups_target = target, _policy.Placer(self.opt, None, sides)

            def target(
                ident: Any, param: torch.Tensor | None, group: Mapping[str, Any], key: str, tensor: torch.Tensor
            ) -> tuple[torch.device, str]:
                if param is None:  # (optimizer-wide entries too, as stream() lays them out)
                    return groups_target(ident, param, group, key, tensor)
                return state_target(ident, param, group, key, tensor)

        try:
            return build_plan(self.opt, target, groups=groups, state=state)
        except ValueError as e:  # a tensor the checkpoint shares between entries that belong on two devices
            raise self.fail(str(e).removeprefix(f"{self.name}: ")) from None

    def sides(
        self, groups: list[dict[str, Any]], state: Mapping[Any, Any]
    ) -> dict[int, tuple[torch.device, torch.Tensor]]:
        """Each loaded group tensor's side (:class:`optimshift.policy.Placer`'s ``sides``), the one rule of every
        load: a live tensor that takes its value stays the object it is, on its side (its device, or the one a move
        or an offload took it from: the session's); else where the file saved it (not map_location's host); else
        where it is, as one whose storage a state entry also holds (LBFGS's ``t``, a view of a ``(1,)`` lr) is: that
        entry stays on its own side, and the storage cannot be copied apart."""
        live = policy_target(self.opt, None)  # (the session's sides, for the live tensors)
        pairs, _ = pair_places(zip(self.opt.param_groups, groups), lambda old, new: True)  # (the commit's pairing)
        kept = {id(new): live.side(old) or old.device for old, new in pairs}
        sides: dict[int, tuple[torch.device, torch.Tensor]] = {}
        for group in groups:
            for _, tensor in group_tensors(group):
                at = kept.get(id(tensor))
                if at is None and self.saved is not None:
                    at = _files.tag_device(_files.saved_location(tensor, self.saved))
                sides[id(tensor)] = (at or tensor.device, tensor)
        moved = {_alias.storage_key(t): i for i, (at, t) in sides.items() if (at.type == "cpu") != t.is_cpu}
        moved.pop(None, None)
        if moved:  # (rare: only then is the state walked)
            for _, t in leaves(state):
                i = moved.get(_alias.storage_key(t)) if id(t) not in sides else None
                if i is not None:
                    sides[i] = (sides[i][1].device, sides[i][1])
        return sides

    def _resolve(self, lone: list[tuple[MutableMapping[Any, Any], Any, torch.Tensor, Transfer]]) -> None:
        """Make every ticket's copy and each ``lone`` entry's (installed at ``holder[key]``) by one
        :func:`optimshift._engine.run`, each cast as its transfer says."""
        transfers = [*self._wanted.values(), *(tr for _, _, _, tr in lone)]
        if not transfers:
            return
        plan = Plan(self.opt, transfers, repeats=False, casts=self._casts)
        own = {id(tr[2]) for tr in transfers}
        copies = _engine.run(plan, own=own, what=self.what, site=self.site_words).pairs
        for ticket, (_, new) in zip(self._wanted, copies):
            self._made[ticket] = new
        n = len(self._wanted)
        for (holder, key, _, _), (_, new) in zip(lone, copies[n:]):
            holder[key] = new
        self.cloned.extend(new for _, new in copies[n:])

    def _live_states(
        self, pending: list[tuple[dict[Any, Any], torch.Tensor, int, int, Any]]
    ) -> dict[tuple[int, int | None], Mapping[Any, Any]]:
        """(group, index) -> the live state of each param the load gives state to, where live tensors may take the
        loaded values in place (``in_place``): only under ``torch_setstate``, and each live tensor in one place (one
        given two values must stop being shared); else empty."""
        if not self.opt.state or not self.strict or not self.torch_setstate:
            return {}  # (no live state: a fresh optimizer, the common resume)
        get = self.opt.state.get
        lives: dict[tuple[int, int | None], Mapping[Any, Any]] = {
            # (live state that is no dict, a tensor set by hand, takes nothing in place: the load replaces it)
            (gi, pi): live
            for _, p, gi, pi, _ in pending
            if isinstance(live := get(p), Mapping) and live
        }
        ids = [id(v) for live in lives.values() for v in live.values() if isinstance(v, torch.Tensor)]
        return lives if len(set(ids)) == len(ids) else {}

    def not_in_place(self, sources: list[torch.Tensor]) -> set[int]:
        """ids of live tensors that must not take loaded values in place: params and grads (a module's), the groups'
        own tensors (LBFGS's ``state['t']`` is its ``lr``: the group's adoption would overwrite it), and
        ``sources``, the checkpoint's (``opt.state_dict()`` permuted: one written would be read by another's copy)."""
        protect = _engine.outside_owned(self.opt)
        for group in self.opt.param_groups:
            protect.update(id(t) for _, t in group_tensors(group))
        protect.update(map(id, sources))
        return protect

    # -- the whole state --------------------------------------------------------------------------------------

    def build(self) -> tuple[defaultdict[Any, Any], list[dict[str, Any]]]:
        saved_groups, states = self.validate_structure()
        live_groups = self.opt.param_groups
        new_groups = [self._new_group(gi, lg, sg) for gi, (lg, sg) in enumerate(zip(live_groups, saved_groups))]
        new_state: defaultdict[Any, Any] = defaultdict(dict)
        # (new state dict, param, group, index, its tensors' (key, dtype) when it holds no container)
        pending: list[tuple[dict[Any, Any], torch.Tensor, int, int, tuple[tuple[Any, torch.dtype], ...] | None]] = []
        strict = self.base if self.strict else None  # (strict: a torch.optim class)
        if strict is not None:
            for gi, ng in enumerate(new_groups):
                check_group(self.fail, type(self.opt), strict, gi, ng)
        uniform = build_uniform(self, saved_groups, states, new_groups)
        if uniform is not None:  # (the common checkpoint, staged in one pass: see _uniform)
            return uniform, new_groups
        for gi, (lg, sg, ng) in enumerate(zip(live_groups, saved_groups, new_groups)):
            for pi, (sid, p) in enumerate(zip(sg["params"], lg["params"])):
                saved = states.get(sid)
                ndim, pshape = p.dim(), p.shape
                spec = self.spec(gi, ng, ndim)
                if saved is None:
                    if strict is not None and spec.eager:
                        raise self.fail(
                            f"{self._param_label(gi, pi)}: the checkpoint has no state for it, but "
                            f"{strict.__name__} creates every param's state when it is built "
                            f"({keys_shown(spec.keys)}); this state dict is incomplete"
                        )
                    continue
                if type(saved) is not dict and not isinstance(saved, Mapping):
                    raise self.fail(
                        f"{self._param_label(gi, pi)}: its state is {with_article(type(saved).__name__)}, expected "
                        f"a dict",
                        TypeError,
                    )
                if strict is not None and (saved or spec.eager):  # {}: a param that never stepped, for a lazy class
                    check_entries(self.fail, self._where(gi, pi), strict, p, saved, spec)
                new: dict[Any, Any] = {}
                dtypes: list[tuple[Any, torch.dtype]] | None = []  # (key, dtype) of each tensor; None: containers
                for key, value in saved.items():
                    if isinstance(value, torch.Tensor):
                        if key in spec.shaped and value.shape != pshape:
                            raise self.fail(
                                f"{self._site((gi, pi, key, ()))}: the checkpoint's tensor has shape "
                                f"{tuple(value.shape)}, the param has shape {tuple(p.shape)}; this checkpoint was "
                                f"made for other params (or another model)"
                            )
                        new[key] = value  # a placeholder (keeps the key order), replaced by its placed copy
                        if dtypes is not None:
                            dtypes.append((key, value.dtype))
                    elif isinstance(value, _ATOMS):
                        new[key] = value
                    else:
                        new[key] = self._copy_container(value, (gi, pi, key, ()))
                        dtypes = None
                new_state[p] = new
                pending.append((new, p, gi, pi, None if dtypes is None else tuple(dtypes)))

        for key in self.wide:  # optimizer-wide entries (placed as the plan places them: with the first group's)
            value = states[key]
            if not isinstance(value, (torch.Tensor, *_ATOMS)):
                value = self._copy_container(value, (OPTIMIZER_WIDE, None, key, ()))
            new_state[key] = value

        # Where each tensor goes (the planner's), in which dtype; then every copy, before the optimizer changes (an
        # error leaves it as it was); then the new dicts and containers are filled in.
        plan = self._plan(new_groups, new_state)
        owned = {id(tr[2]) for tr in plan.transfers if tr[0][1] is None and tr[0][0] != OPTIMIZER_WIDE}
        if self.cast is None:  # (containers too: LBFGS's old_dirs/old_stps; a group's own tensor is the group's)
            for new, p, gi, pi, held in pending:
                if held is None or owned:
                    held = tuple(entry_dtypes(new, owned).items())
                self._check_dtypes(new_groups[gi], p, gi, pi, held)
        holders: dict[tuple[int, int | None], MutableMapping[Any, Any]] = {
            (gi, pi): new for new, _, gi, pi, _ in pending
        }
        holders.update({(gi, None): group for gi, group in enumerate(new_groups)})
        holders[(OPTIMIZER_WIDE, None)] = new_state
        cast, always_copy, uses, wanted_by = self.cast, self.copy, self._uses, self._wanted
        strided, plain = torch.strided, torch.Tensor
        # (whether no two of the checkpoint's tensors share a storage: the common case, one C call per tensor)
        sources = [tr[2] for tr in plan.transfers]
        top: list[tuple[MutableMapping[Any, Any], Any]] = []  # holder[key] is a ticket
        # NOTE: the common entry (a plain dense tensor right under a param's key, in its own dtype, nothing shared)
        # needs no ticket where a live tensor takes its values or where it stays; only it can take them in place.
        lone = not plan.repeats and not _alias.shared(sources)
        lives = self._live_states(pending) if lone else {}
        protect = self.not_in_place(sources) if lives else set()
        in_place, fits = self.in_place, fits_in_place
        lone_copies: list[tuple[MutableMapping[Any, Any], Any, torch.Tensor, Transfer]] = []  # (copied in _resolve)
        inside: dict[tuple[int, int | None, Any], dict[int, _Wanted]] = {}  # the tensors in holder[key], by id
        for tr in plan.transfers:
            (tgi, tpi, path), tensor, param, device = tr[0], tr[2], tr[3], tr[4]
            key = path[0][1]
            if (
                lone
                and tpi is not None
                and len(path) == 1
                and type(tensor) is plain
                and not tensor.requires_grad
                and tensor.layout == strided
                and tensor.is_contiguous()  # (so not overexpanded)
                and (not owned or id(tensor) not in owned)
                and (cast is None or self._cast_dtype(new_groups[tgi], param, key, tensor, device) == tensor.dtype)
            ):
                # (a live tensor that fits takes the values wherever the checkpoint's is; else one that stays is
                # copied in _resolve, or installed itself with copy=False; one that moves takes a ticket below)
                live = lives.get((tgi, tpi)) if lives and always_copy else None
                old = live.get(key) if live else None
                if old is not None and id(old) not in protect and fits(old, tensor, device):
                    olds, news = in_place[device]
                    olds.append(old)
                    news.append(tensor)
                    holders[(tgi, tpi)][key] = old
                    continue
                if tensor.device == device:
                    if always_copy:
                        lone_copies.append((holders[(tgi, tpi)], key, tensor, tr))
                    holders[(tgi, tpi)][key] = tensor  # (its copy replaces it in _resolve)
                    continue
            nested = None
            if len(path) > 1:
                nested = inside.setdefault((tgi, tpi, key), {})
                if id(tensor) in nested:  # one tensor twice in a container: one copy, installed in both places
                    if type(nested[id(tensor)]) is tuple:
                        uses[nested[id(tensor)]] += 1  # type: ignore[index]
                    continue
            ggi = 0 if tgi == OPTIMIZER_WIDE else tgi
            if tpi is not None and id(tensor) in owned:
                # NOTE: it holds its group's own tensor: it gets the group entry's copy (same device, dtype and a
                # copy whatever `copy` says, as the group's), so the two stay one tensor, as in PyTorch.
                dtype, always = tensor.dtype, True
            else:
                if cast is None:
                    dtype = tensor.dtype
                else:  # PyTorch casts by the innermost dict key
                    dtype = self._cast_dtype(
                        new_groups[ggi], param, path[-1][1] if path[-1][0] == "key" else None, tensor, device
                    )
                # PyTorch deep-copies the groups, so their tensors are copied whatever ``copy`` says.
                always = always_copy or (tpi is None and tgi != OPTIMIZER_WIDE)
            # NOTE: the tensor itself where it fits and no copy was asked for, else a ticket: one copy per
            # (source, device, dtype), so tensors shared in the checkpoint stay shared (the state dict keeps the
            # sources, and so their ids, alive).
            # (only a strided view with overlapping strides can be overexpanded; sparse layouts have no strides)
            if tensor.layout == strided and not tensor.is_contiguous() and (why := _files.overexpanded(tensor)):
                raise self.fail(
                    f"{self.site_words(tr)}: {why}; copying it would allocate every element (a corrupt or hostile "
                    f"checkpoint)"
                )
            wanted: _Wanted
            if not always and tensor.dtype == dtype and tensor.device == device:
                wanted = tensor
            else:
                wanted = (id(tensor), device, dtype)
                if wanted not in wanted_by:
                    if tensor.is_meta and device.type != "meta":
                        raise self.fail(f"{self.site_words(tr)}: a meta tensor has no values to load")
                    # (its copy's transfer: the plan's, with the dtype of a cast)
                    if dtype == tensor.dtype:
                        wanted_by[wanted] = tr
                    else:
                        wanted_by[wanted] = _new_transfer(Transfer, (*tr[:6], dtype))
                        self._casts = True
                    uses[wanted] = 1
                else:
                    uses[wanted] += 1  # a copy: count the places it is installed in
            if nested is None:
                holder = holders[(tgi, tpi)]
                holder[key] = wanted  # (its placeholder was the checkpoint's tensor)
                if type(wanted) is tuple:
                    top.append((holder, key))
            else:
                nested[id(tensor)] = wanted
        self._resolve(lone_copies)
        for holder, key in top:  # (tickets: their copies)
            holder[key] = self._made[holder[key]]
        for (tgi, tpi, key), nested in inside.items():
            holder = holders[(tgi, tpi)]
            holder[key] = self._fill_nested(holder[key], nested)
        return new_state, new_groups

    def _fill_nested(self, value: Any, wanted: Mapping[int, _Wanted]) -> Any:
        """``value`` (our own copy of a checkpoint's container) with each tensor replaced by its copy."""
        made = self._made
        replace = {ident: w if isinstance(w, torch.Tensor) else made[w] for ident, w in wanted.items()}
        if isinstance(value, torch.Tensor):
            return replace.get(id(value), value)
        setters: list[Setter] = []
        result = rebuild(value, replace, setters, {})
        for apply in setters:
            apply()
        return result

    def _new_group(self, gi: int, live: Mapping[str, Any], saved: Mapping[str, Any]) -> dict[str, Any]:
        """The group as PyTorch builds it (the saved one deep-copied, with the live params, and the live names where
        it has none), with the live flags for ``flags="live"``; its tensors are left for the plan to place."""
        out: dict[str, Any] = {}
        for key, value in saved.items():
            if key == "params":
                continue
            if isinstance(value, (torch.Tensor, *_ATOMS)):
                out[key] = value
            else:
                out[key] = self._copy_container(value, (gi, None, key, ()))
        if self.flags == "live":
            for flag in IMPLEMENTATION_FLAGS:
                if flag in live:
                    out[flag] = live[flag]
                else:
                    out.pop(flag, None)
        out["params"] = live["params"]
        if "param_names" in live and "param_names" not in out:
            out["param_names"] = live["param_names"]
        return out

    def _check_dtypes(
        self, group: Mapping[str, Any], p: torch.Tensor, gi: int, pi: int, dtypes: tuple[tuple[Any, torch.dtype], ...]
    ) -> None:
        """CastNeeded, before anything is copied, if a step refuses a dtype the checkpoint keeps (``cast=None``:
        float64 moments for float32 params in Adam)."""
        rejected = self.rejected(group, p, gi, dtypes)
        if rejected:
            r, n = rejected[0], dtype_name
            others = "".join(f" (and {x.key!r}, {n(x.dtype)})" for x in rejected[1:])
            fix = (
                # (PyTorch's cast, torch_cast, casts to the param's dtype only where that is floating-point)
                f"PyTorch's cast (cast='param') leaves a {n(p.dtype)} param's state as saved: cast the "
                f"checkpoint's entries to {n(r.fresh)} before loading"
                if p.is_complex()
                else "Load with cast='param' to cast the state to the params' dtype as PyTorch does"
            )
            raise self.fail(
                f"{self._site((gi, pi, r.key, ()))}: the checkpoint holds it as {n(r.dtype)}{others}, and a step of "
                f"{self.name} over {n(p.dtype)} params rejects that ({r.error.splitlines()[0]}); a fresh "
                f"{self.name} keeps it as {n(r.fresh)}. {fix}; the optimizer is unchanged",
                CastNeeded,
            )

    def rejected(
        self, group: Mapping[str, Any], p: torch.Tensor, gi: int, dtypes: tuple[tuple[Any, torch.dtype], ...]
    ) -> list[Rejection]:
        """The entries (key, dtype) of param ``p`` of group ``gi`` that a step refuses (only where ``strict``),
        memoized by the param's dtype and rank."""
        if not self.strict or self.base is None or not dtypes:
            return []
        memo_key = (gi, p.dtype, p.dim(), dtypes)  # (in the entries' order: a miss costs a check)
        rejected = self._dtype_checks.get(memo_key)
        if rejected is None:
            rejected = self._dtype_checks[memo_key] = rejected_dtypes(self.base, group, p, dict(dtypes))
        return rejected

    def spec(self, gi: int, group: Mapping[str, Any], ndim: int) -> StateSpec:
        """What this optimizer class keeps per param of rank ``ndim`` in (new) group ``gi`` (probed)."""
        spec = self._specs.get((gi, ndim))
        if spec is None:
            spec = self._specs[(gi, ndim)] = NO_SPEC if self.base is None else expected_state(self.base, group, ndim)
        return spec

    def _copy_container(self, value: Any, site: _Site) -> Any:
        """Our own copy of a checkpoint's container (its tensors stay the checkpoint's, to be placed), depth-checked;
        an uncopyable object is a clear error."""
        if too_deep(value):
            raise self.fail(
                f"{self._site(site)}: nested more than {MAX_DEPTH} levels deep; no optimizer keeps state like "
                f"this (a corrupt or hostile checkpoint)"
            )
        memo: dict[int, Any] = {id(t): t for _, t in leaves(value)}
        try:
            return _copy.deepcopy(value, memo)
        except Exception as e:
            raise self.fail(
                f"{self._site(site)}: cannot copy its {type(value).__name__} ({type(e).__name__}: {e})", TypeError
            ) from e


def _ids_shown(ids: Mapping[Any, Any]) -> str:
    shown = list(ids)[:4]
    return ", ".join(repr(i) for i in shown) + (", …" if len(ids) > len(shown) else "")


def pair_places(
    holders: Iterable[tuple[Mapping[Any, Any], dict[Any, Any]]],
    takes: Callable[[torch.Tensor, torch.Tensor], bool],
    shared: Mapping[int, int] = MappingProxyType({}),
) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], list[list[tuple[Any, Any]]]]:
    """(old tensor, the new one installed at its place that it ``takes``), each old tensor once, with the places
    ``(new holder, key)`` it takes back, over (live holder, new holder) pairs: each key, and each tensor of a tuple
    or list of equal length there (a group's tensor betas, by :class:`_Slot`). The one pairing rule of a load's
    commit and of the DCP load."""
    places: list[tuple[Any, Any, torch.Tensor, torch.Tensor]] = []  # (new holder or _Slot, key, old tensor, new)
    append, plain = places.append, torch.Tensor
    for holder, fresh in holders:
        get = fresh.get
        for key, old in holder.items():
            new: Any = get(key)
            if isinstance(old, plain):
                if isinstance(new, plain) and new is not old and takes(old, new):
                    append((fresh, key, old, new))
            elif type(old) in (tuple, list) and type(new) is type(old) and len(new) == len(old) and new is not old:
                slot = _Slot(fresh, key)
                for i, (o, n) in enumerate(zip(old, new)):
                    if isinstance(o, plain) and isinstance(n, plain) and n is not o and takes(o, n):
                        append((slot, i, o, n))
    # A new tensor installed in several places (LBFGS's state['t'] is its group's lr; ``shared``: how many) stays one
    # object: an old tensor takes it back only where it held every one of its places (one inside a container, or
    # none, would split it).
    news = [id(place[3]) for place in places]
    if shared or len(set(news)) != len(news):
        at: dict[int, list[tuple[Any, Any, torch.Tensor, torch.Tensor]]] = {}
        for place in places:
            at.setdefault(id(place[3]), []).append(place)
        split = {
            new
            for new, found in at.items()
            if len(found) < shared.get(new, 0) or len({id(place[2]) for place in found}) != 1
        }
        places = [place for place in places if id(place[3]) not in split]
    # NOTE: each old tensor once is the common case, found by one set over ids.
    olds = [id(place[2]) for place in places]
    if len(set(olds)) == len(olds):
        return [(old, new) for _, _, old, new in places], [[(fresh, key)] for fresh, key, _, _ in places]
    # An old tensor that sat in two places now given two different new ones keeps neither: each place keeps its own
    # (the checkpoint's values), as PyTorch installs them; one given one new tensor in both takes both back.
    by_old: dict[int, tuple[torch.Tensor, torch.Tensor, list[tuple[Any, Any]]]] = {}
    news_of: dict[int, set[int]] = {}
    for fresh, key, old, new in places:
        news_of.setdefault(id(old), set()).add(id(new))
        by_old.setdefault(id(old), (old, new, []))[2].append((fresh, key))
    kept = [entry for i, entry in by_old.items() if len(news_of[i]) == 1]
    return [(old, new) for old, new, _ in kept], [where for _, _, where in kept]


class _Slot:
    """Item ``i`` of the tuple or list ``holder[key]`` (a group's tensor betas) as a place the commit puts an old
    tensor back in (``slot.get(i)``, ``slot[i] = old``): a tuple is rebuilt around it."""

    __slots__ = ("holder", "key")

    def __init__(self, holder: dict[Any, Any], key: Any) -> None:
        self.holder, self.key = holder, key

    def get(self, i: int) -> Any:
        seq = self.holder.get(self.key)
        return seq[i] if isinstance(seq, (tuple, list)) and i < len(seq) else None

    def __setitem__(self, i: int, value: Any) -> None:
        seq = self.holder[self.key]
        if type(seq) is list:
            seq[i] = value
        else:
            self.holder[self.key] = (*seq[:i], value, *seq[i + 1 :])
