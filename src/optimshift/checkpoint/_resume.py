"""Loading optimizer state: a linear-time, transactional ``optimizer.load_state_dict`` that places every entry
where a fresh optimizer would keep it.

``torch.optim.Optimizer.load_state_dict`` is right about Adam's ``step`` but scans the param groups once per
tensor (quadratic), casts floating state to the param's dtype, mangles strings and namedtuples, aliases the
caller's tensors, puts host scalars such as NAdam's ``mu_product`` on the device and adopts the checkpoint's
``fused``/``capturable`` flags. :func:`load_state_dict` validates everything first, builds the new state from
copies, then installs it the way PyTorch does (``__setstate__`` and the load hooks).
"""

from __future__ import annotations

import copy as _copy
import inspect
import numbers
import os
import warnings
from collections import defaultdict
from collections.abc import Mapping, MutableMapping
from collections.abc import Set as AbstractSet
from typing import Any, TypeVar

import torch

from .. import _mode, engine
from .. import policy as _policy
from .._copy import copy_tensor
from .._devices import DeviceLike, resolve
from .._dtypes import Rejection, dtype_name, entry_dtypes, rejected_dtypes
from .._errors import add_note
from .._offload import exclusive, prepare_discard, wait_pending
from .._probe import NO_SPEC, StateSpec, expected_state, step_needs
from .._state import (
    _ATOMS,
    IMPLEMENTATION_FLAGS,
    MAX_DEPTH,
    Path,
    Setter,
    format_path,
    leaves,
    param_label,
    param_name,
    rebuild,
    too_deep,
    unwrap,
)
from ..plan import OPTIMIZER_WIDE, Plan, build_plan, optimizer_name, policy_target
from . import _files

__all__ = ["load_state_dict", "IMPLEMENTATION_FLAGS"]

Opt = TypeVar("Opt")


_FLAG_MODES = ("live", "checkpoint")
_CAST_MODES = (None, "param")

# Overrides of ``load_state_dict`` that only post-process what ``Optimizer.load_state_dict`` produced in ways
# this module already does (keeping non-floating dtypes and container types). Any other override may hold
# logic we cannot reproduce, so such optimizers are refused with a workaround rather than loaded wrongly.
_EQUIVALENT_OVERRIDES = frozenset(
    {
        "pytorch_optimizer.base.optimizer.BaseOptimizer.load_state_dict",
    }
)


def load_state_dict(
    optimizer: Opt,
    state_dict: Mapping[str, Any],
    *,
    device: DeviceLike | None = None,
    flags: str = "live",
    copy: bool = True,
    cast: str | None = None,
) -> Opt:
    """Drop-in for ``optimizer.load_state_dict(state_dict)`` that puts each entry where a fresh optimizer would.

    Entries follow their param (``device=None``) or sit where a fresh optimizer on ``device`` keeps them;
    values and dtypes are kept as saved (``cast="param"``: PyTorch's cast to the param's dtype). Linear time.

    - ``flags="live"``: hyperparameters come from the checkpoint, ``fused``/``capturable``/``foreach``/
      ``differentiable`` stay as the live optimizer has them; ``"checkpoint"``: PyTorch's choice (all saved).
    - ``copy=True``: the optimizer never shares a tensor with ``state_dict``.
    - ``state_dict`` may also be a whole checkpoint holding exactly one optimizer state (a Lightning ``.ckpt``,
      ``{"optimizer": ...}``, an :func:`optimshift.save` file); a recorded optimizer class is checked. A path
      is read with :func:`optimshift.load` (errors then name the file too).

    Everything is validated and copied before the optimizer changes: an error names the group, param index and
    key and leaves the optimizer untouched. Checked: the class, the group count, the params per group, that
    every key of ``state`` is a saved param id (text keys such as ``"0"``, left by a JSON round trip, are
    refused, not taken for optimizer-wide entries; a torch.optim class keeps no optimizer-wide entries, other
    classes may), no container nested more than 64 levels, no tensor that is an expanded view far larger than
    its storage. For torch.optim classes, also what their step needs (probed): every entry a step creates is
    there and is a dense tensor, per-param buffers have the param's shape and a floating dtype, scalars such as
    ``step`` have one element, and hyperparameters have the right type (``lr`` a number or one-element
    tensor, ``betas`` a pair) and are there. A group may lack only keys the class fills itself for older
    checkpoints: its ``__setstate__`` defaults (torch 2.13: the flags ``foreach``, ``fused``, ``capturable``,
    ``differentiable`` it has; ``maximize`` but for Adafactor's; Adam's and AdamW's ``amsgrad``; Adam's,
    AdamW's, NAdam's and RAdam's ``decoupled_weight_decay``; SGD's ``nesterov``; RMSprop's ``momentum`` and
    ``centered``; none of LBFGS's or Muon's) and keys its step never reads or reads with a default (Adagrad's
    ``initial_accumulator_value``, SparseAdam's ``maximize``); both are read from the installed torch.
    Registered load_state_dict pre/post hooks and the class's ``__setstate__`` run as in PyTorch.
    """
    receiver = _receiver(optimizer)
    name = optimizer_name(receiver)
    if flags not in _FLAG_MODES:
        raise ValueError(f"{name}: load_state_dict: flags must be 'live' or 'checkpoint', got {flags!r}")
    if cast not in _CAST_MODES:
        raise ValueError(f"{name}: load_state_dict: cast must be None or 'param', got {cast!r}")
    if not isinstance(copy, bool):
        raise TypeError(f"{name}: load_state_dict: copy must be a bool, got {copy!r}")
    params = [p for g in receiver.param_groups for p in g["params"]]
    target = None if device is None else resolve(device, what="device", tensors=params)
    mode = _mode.mode_of(receiver)
    if mode is not None:  # streamed: the state loads into host memory, where it lives between steps
        if target is not None and target.type != "cpu":
            raise ValueError(
                f"{name}: load_state_dict: it is streamed (optimshift.stream), so its state loads into "
                f"host memory; device={target} would put it elsewhere. Call optimshift.unstream() first."
            )
        mode.settle()
        target = torch.device("cpu")

    source = None
    if isinstance(state_dict, (str, os.PathLike)):
        source = os.fspath(state_dict)
        state_dict = _files.load(source)
    label = f"{name}: load_state_dict: {source}" if source else f"{name}: load_state_dict"
    sd, recorded = _extract(state_dict, label)
    if recorded is not None:
        _check_class(receiver, recorded, label)

    # A transfer still in flight writes the live state that the load reads and replaces: order after it first.
    wait_pending(receiver)
    # As PyTorch: a shallow copy goes through the pre-hooks, which may return a replacement.
    sd = dict(sd)
    for hook in list(getattr(receiver, "_optimizer_load_state_dict_pre_hooks", {}).values()):
        result = hook(receiver, sd)
        if result is not None:
            sd = result

    staged = _Staging(receiver, name, sd, flags=flags, cast=cast, copy=copy, device=target, source=source)
    # (one operation at a time on this optimizer, as move/offload/reload; tens of thousands of small objects:
    # collections would cost more than the copies)
    with exclusive(receiver), engine.no_gc():
        new_state, new_groups = staged.build()
        # The loaded state supersedes any offload record: offloaded grads are copied back first (an OOM there
        # leaves everything as it was), handed back only once the state is installed.
        finish = [prepare_discard(obj) for obj in dict.fromkeys((receiver, optimizer))]
        _install(receiver, name, new_state, new_groups, made=staged.made_ids(), shared=staged.shared_ids())
        if mode is not None:
            mode.after_load()
    for done in finish:
        done()
    for hook in list(getattr(receiver, "_optimizer_load_state_dict_post_hooks", {}).values()):
        hook(receiver)
    return optimizer


# --- which optimizer receives the state -------------------------------------------------------------------


def _override_name(cls: type) -> str | None:
    """The qualified name of the nearest ``load_state_dict`` defined below ``torch.optim.Optimizer``."""
    for base in cls.__mro__:
        if base is torch.optim.Optimizer:
            return None
        fn = base.__dict__.get("load_state_dict")
        if fn is not None:
            fn = getattr(fn, "__func__", fn)
            return f"{getattr(fn, '__module__', base.__module__)}.{getattr(fn, '__qualname__', base.__qualname__)}"
    return None


def can_load(optimizer: Any) -> bool:
    """Whether :func:`load_state_dict` can load into ``optimizer`` (an optimizer, or a wrapper delegating to
    one, whose class does not override ``load_state_dict`` with logic of its own)."""
    try:
        _receiver(optimizer)
    except TypeError:
        return False
    return True


def _receiver(optimizer: Any) -> torch.optim.Optimizer:
    """The ``torch.optim.Optimizer`` whose state is loaded: ``optimizer`` itself, or the optimizer that a
    delegating wrapper (Accelerate's ``AcceleratedOptimizer``, Lightning's ``LightningOptimizer``) wraps."""
    optimizer = unwrap(optimizer)
    if isinstance(optimizer, torch.optim.Optimizer):
        override = _override_name(type(optimizer))
        if override is None or override in _EQUIVALENT_OVERRIDES:
            return optimizer
    name = type(optimizer).__name__
    if isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"{name}: load_state_dict: {name} overrides load_state_dict ({_override_name(type(optimizer))}); "
            f"optimshift.load_state_dict reproduces torch.optim.Optimizer.load_state_dict and would skip that "
            f"logic. Call optimizer.load_state_dict(state_dict), then optimshift.move(optimizer) to place the state."
        )
    raise TypeError(
        f"load_state_dict: optimizer must be a torch.optim.Optimizer (or a wrapper delegating to one), got {name}"
    )


def _check_class(optimizer: Any, recorded: Mapping[str, Any], label: str) -> None:
    qualname = recorded.get("class")
    module = recorded.get("module", "")
    if not isinstance(qualname, str):
        return
    cls = type(optimizer)
    if cls.__qualname__ == qualname:
        return
    saved = f"{module}.{qualname}" if module else qualname
    raise ValueError(
        f"{label}: the checkpoint was saved from a {saved}, not a {cls.__module__}.{cls.__qualname__}; "
        f"its state would be misread. Load it into a {qualname}, or pass only its 'state' and 'param_groups' "
        f"entries to skip this check."
    )


def _extract(state_dict: Any, label: str) -> tuple[Any, Mapping[str, Any] | None]:
    """The optimizer state dict inside ``state_dict`` (itself, or the only one a checkpoint holds) and the
    class optimshift recorded for it."""
    from ._files import META_KEY, find_optimizer_states, is_optimizer_state_dict

    if not isinstance(state_dict, Mapping):
        raise TypeError(f"{label}: state_dict must be a dict (or a path), got {type(state_dict).__name__}")
    if is_optimizer_state_dict(state_dict):
        meta = state_dict.get(META_KEY)
        return state_dict, meta if isinstance(meta, Mapping) else None
    found = find_optimizer_states(state_dict)
    if len(found) == 1:
        meta = found[0].state_dict.get(META_KEY)
        return found[0].state_dict, meta if isinstance(meta, Mapping) else None
    if len(found) > 1:
        where = ", ".join(f.where for f in found)
        raise ValueError(
            f"{label}: this checkpoint holds {len(found)} optimizer states ({where}); pass the one "
            f"for this optimizer, e.g. checkpoint{found[0].where}"
        )
    return state_dict, None  # not recognised: the pre-hooks may still turn it into a state dict


# --- building the new state ---------------------------------------------------------------------------------

_Site = tuple[int, int | None, Any, Path]  # (group, param index or None for a group entry, key, path inside)
_Ticket = tuple[int, torch.device, torch.dtype]  # (id(source), device, dtype): one copy each
_Wanted = torch.Tensor | _Ticket  # a tensor that fits as it is, or the ticket of its copy


class _Staging:
    """Validates a state dict against the live optimizer and builds its new state and groups from copies.

    Nothing here touches the optimizer: :meth:`build` returns objects that only :func:`_install` assigns.
    """

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
        source: str | None = None,
    ) -> None:
        self.opt, self.name, self.sd, self.source = optimizer, name, sd, source
        self.flags, self.cast, self.copy, self.device = flags, cast, copy, device
        self.wide: list[Any] = []  # optimizer-wide state keys (set by _validate_structure)
        self.base = _policy.builtin_base(type(optimizer))
        # What a torch.optim class's step creates is known (probed): checked in full when the class steps as
        # torch.optim's does; a subclass with its own step may keep other state (only shapes are checked).
        self.strict = self.base is not None and _same_step(type(optimizer), self.base)
        # (id(source), device, dtype) -> (source, where it is used): one copy each, made by _resolve().
        self._wanted: dict[_Ticket, tuple[torch.Tensor, _Site]] = {}
        self._made: dict[_Ticket, torch.Tensor] = {}
        self._uses: dict[_Ticket, int] = {}  # how many places (planned transfers) each copy is installed in
        self._dtype_checks: dict[tuple[int, torch.dtype, int, tuple[tuple[str, str], ...]], list[Rejection]] = {}

    def fail(self, message: str, exc: type[Exception] = ValueError) -> Exception:
        where = f"{self.source}: " if self.source else ""
        return exc(f"{self.name}: load_state_dict: {where}{message}")

    # -- structure ------------------------------------------------------------------------------------------

    def _validate_structure(self) -> tuple[list[Mapping[str, Any]], Mapping[Any, Any]]:
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
        seen_live: dict[int, tuple[int, int]] = {}
        seen_ids: dict[Any, tuple[int, int]] = {}
        for gi, (g, lg) in enumerate(zip(groups, live)):
            saved_params = g.get("params")
            if not isinstance(saved_params, (list, tuple)):
                raise self.fail(f"param group {gi} of the checkpoint has no 'params' list", TypeError)
            if len(saved_params) != len(lg["params"]):
                raise self.fail(
                    f"param group {gi} has {len(saved_params)} params in the checkpoint and "
                    f"{len(lg['params'])} in the optimizer"
                )
            for pi, (sid, p) in enumerate(zip(saved_params, lg["params"])):
                if id(p) in seen_live:
                    g0, i0 = seen_live[id(p)]
                    raise self.fail(
                        f"the optimizer lists one param twice (group {g0}, param {i0} and group {gi}, param {pi})"
                    )
                seen_live[id(p)] = (gi, pi)
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
        id_types = {type(sid) for sid in seen_ids}
        texts = _files.stringified_ids([k for k in states if k not in seen_ids], seen_ids)
        if texts:
            raise self.fail(
                f"state_dict['state'] is keyed by text ({', '.join(repr(k) for k in texts[:3])}"
                f"{', …' if len(texts) > 3 else ''}) while the param groups list the ids "
                f"{_ids_shown(seen_ids)}: it went through JSON or another round trip that turns keys into text, "
                f"and PyTorch would silently drop every param's state. Turn the keys back first: "
                f"sd['state'] = {{int(k): v for k, v in sd['state'].items()}}"
            )
        # Keys of another kind than the params' ids are optimizer-wide entries (MADGRAD's "k"): PyTorch keeps them.
        self.wide = [k for k in states if k not in seen_ids and type(k) not in id_types] if id_types else []
        if self.wide and self.base is not None and type(self.opt) is self.base:
            raise self.fail(
                f"state_dict['state'] has entries {self.wide[:5]!r} that are no param's id, but "
                f"{self.base.__module__}.{self.base.__qualname__} keeps all of its state per param (only other "
                f"optimizer classes keep optimizer-wide entries); the param groups list the ids "
                f"{_ids_shown(seen_ids)}"
            )
        stray = [k for k in states if k not in seen_ids and k not in self.wide] if len(states) > 0 else []
        if stray:
            raise self.fail(
                f"state_dict['state'] has entries for param ids {stray[:5]!r} that no param group lists; "
                f"they could not be matched to a param"
            )
        return list(groups), states

    # -- placement ------------------------------------------------------------------------------------------

    def _cast_dtype(
        self, group: Mapping[str, Any], param: torch.Tensor | None, inner_key: Any, tensor: torch.Tensor
    ) -> torch.dtype:
        """``cast="param"``: PyTorch's rule (``step`` to float32 when fused/capturable, other tensors to a
        floating param's dtype); otherwise the saved dtype."""
        if self.cast != "param" or param is None:
            return tensor.dtype
        if inner_key == "step":
            return torch.float32 if (group.get("fused") or group.get("capturable")) else tensor.dtype
        return param.dtype if param.is_floating_point() else tensor.dtype

    def _param_label(self, gi: int, pi: int) -> str:
        names = self.opt.param_groups[gi].get("param_names") or self.sd["param_groups"][gi].get("param_names")
        return param_label(gi, pi, param_name(pi, names))

    def _site(self, site: _Site) -> str:
        """``(group, param index or None, key, path)`` as words, for errors."""
        gi, pi, key, path = site
        if pi is None:
            return f"param group {gi}, key {key!r}{format_path(path)}"
        return f"{self._param_label(gi, pi)}, state key {key!r}{format_path(path)}"

    def _want(
        self, tensor: torch.Tensor, device: torch.device, dtype: torch.dtype, always_copy: bool, site: _Site
    ) -> _Wanted:
        """Ask for ``tensor`` on ``device`` in ``dtype``: returns the tensor itself when it already fits and
        copying was not asked for, else a ticket that :meth:`_got` turns into its copy once :meth:`_resolve`
        has made every copy. One copy per distinct (source, device, dtype), so tensors shared in the
        checkpoint stay shared. Sources stay alive (the state dict holds them) while their ids are keys."""
        why = _files.overexpanded(tensor)
        if why is not None:
            raise self.fail(
                f"{self._site(site)}: {why}; copying it would allocate every element (a corrupt or hostile checkpoint)"
            )
        if not always_copy and tensor.dtype == dtype and tensor.device == device:
            return tensor
        ticket: _Ticket = (id(tensor), device, dtype)
        if ticket not in self._wanted:
            if tensor.is_meta and device.type != "meta":
                raise self.fail(f"{self._site(site)}: a meta tensor has no values to load")
            self._wanted[ticket] = (tensor, site)
        return ticket

    def made_ids(self) -> set[int]:
        """The ids of the copies this staging made (never the caller's own tensors)."""
        return {id(t) for t in self._made.values()}

    def shared_ids(self) -> set[int]:
        """The ids of the copies installed in more than one place (a tensor the checkpoint shares: LBFGS's
        ``state['t']`` is its group's ``lr``), which must stay one object."""
        return {id(self._made[ticket]) for ticket, n in self._uses.items() if n > 1}

    def _plan(self, groups: list[dict[str, Any]], state: Mapping[Any, Any]) -> Plan:
        """The plan of the state about to be installed: where :func:`optimshift.plan.policy_target` puts each
        tensor for the live optimizer's class, with the loaded groups' hyperparameters and the live flags."""
        # (remembered=False: where a move took the old group tensors from says nothing of the loaded ones)
        target = policy_target(self.opt, self.device, remembered=False)
        try:
            return build_plan(self.opt, target, groups=groups, state=state)
        except ValueError as e:  # a tensor the checkpoint shares between entries that belong on two devices
            raise self.fail(str(e).removeprefix(f"{self.name}: ")) from None

    def _got(self, wanted: _Wanted) -> torch.Tensor:
        return wanted if isinstance(wanted, torch.Tensor) else self._made[wanted]

    def _resolve(self) -> None:
        """Make every copy asked for. Host<->device moves go to the engine as one batch (grouped by device
        pair and dtype: one staging copy per chunk instead of one transfer per tensor, then one
        synchronize); copies in place (``copy=True``) and casts are made tensor by tensor."""
        moving: list[tuple[_Ticket, torch.Tensor, torch.device]] = []
        batched: set[int] = set()
        for ticket, (t, site) in self._wanted.items():
            _, device, dtype = ticket
            if t.dtype == dtype and t.device != device and id(t) not in batched:
                batched.add(id(t))
                moving.append((ticket, t, device))
            else:
                self._made[ticket] = self._copy_one(t, device, dtype, site)
        if moving:
            try:
                batch = engine.copy_items([(t, d) for _, t, d in moving])
            except Exception as e:  # an OOM: nothing was installed yet
                add_note(
                    e,
                    f"{self.name}: load_state_dict: while copying {len(moving)} tensors to "
                    f"{', '.join(sorted({str(d) for _, _, d in moving}))}; the optimizer is unchanged",
                )
                raise
            for (ticket, _, _), new in zip(moving, batch.copies):
                assert new is not None  # (copy_items returns once every copy is made)
                self._made[ticket] = new

    def _copy_one(self, tensor: torch.Tensor, device: torch.device, dtype: torch.dtype, site: _Site) -> torch.Tensor:
        try:
            if tensor.requires_grad or type(tensor) is not torch.Tensor:  # Parameters, subclasses: the general copy
                new = copy_tensor(tensor, device)
                return new if new.dtype == dtype else new.to(dtype)
            if tensor.dtype == dtype and tensor.device == device:
                return tensor.clone()  # same place: keeps the strides, and is the cheapest copy
            return tensor.to(device, dtype, False, True)  # a cast (cast="param"): a plain blocking copy
        except Exception as e:  # an OOM on the 900th tensor: say which one; nothing was installed yet
            add_note(
                e,
                f"{self.name}: load_state_dict: while copying {self._site(site)} to {device}; "
                f"the optimizer is unchanged",
            )
            raise

    # -- the whole state --------------------------------------------------------------------------------------

    def build(self) -> tuple[defaultdict[Any, Any], list[dict[str, Any]]]:
        saved_groups, states = self._validate_structure()
        live_groups = self.opt.param_groups
        new_groups = [self._new_group(gi, lg, sg) for gi, (lg, sg) in enumerate(zip(live_groups, saved_groups))]
        spec_cache: dict[tuple[int, int], StateSpec] = {}
        new_state: defaultdict[Any, Any] = defaultdict(dict)
        pending: list[tuple[dict[Any, Any], torch.Tensor, int, int]] = []  # (new state dict, param, group, index)
        if self.strict:
            for gi, ng in enumerate(new_groups):
                self._check_group(gi, ng)
        for gi, (lg, sg, ng) in enumerate(zip(live_groups, saved_groups, new_groups)):
            for pi, (sid, p) in enumerate(zip(sg["params"], lg["params"])):
                saved = states.get(sid)
                ndim, pshape = p.dim(), p.shape
                spec = spec_cache.get((gi, ndim))
                if spec is None:
                    spec = spec_cache[(gi, ndim)] = self._spec(ng, ndim)
                if saved is None:
                    if self.strict and spec.eager:
                        assert self.base is not None  # (strict: a torch.optim class)
                        raise self.fail(
                            f"{self._param_label(gi, pi)}: the checkpoint has no state for it, but "
                            f"{self.base.__name__} creates every param's state when it is built "
                            f"({_keys_shown(spec.keys)}); this state dict is incomplete"
                        )
                    continue
                if type(saved) is not dict and not isinstance(saved, Mapping):
                    raise self.fail(
                        f"{self._param_label(gi, pi)}: its state is a {type(saved).__name__}, expected a dict",
                        TypeError,
                    )
                if self.strict and (saved or spec.eager):  # {}: a param that never stepped, for a lazy class
                    self._check_entries(gi, pi, p, saved, spec)
                new: dict[Any, Any] = {}
                for key, value in saved.items():
                    if isinstance(value, torch.Tensor):
                        if key in spec.shaped and value.shape != pshape:
                            raise self.fail(
                                f"{self._site((gi, pi, key, ()))}: the checkpoint's tensor has shape "
                                f"{tuple(value.shape)}, the param has shape {tuple(p.shape)}; this checkpoint was "
                                f"made for other params (or another model)"
                            )
                        new[key] = value  # a placeholder (keeps the key order), replaced by its placed copy
                    elif isinstance(value, _ATOMS):
                        new[key] = value
                    else:
                        new[key] = self._copy_container(value, (gi, pi, key, ()))
                new_state[p] = new
                pending.append((new, p, gi, pi))

        for key in self.wide:  # optimizer-wide entries (placed as the plan places them: with the first group's)
            value = states[key]
            if not isinstance(value, (torch.Tensor, *_ATOMS)):
                self._check_depth(value, (0, None, key, ()), wide=True)
                value = _copy.deepcopy(value, {id(t): t for _, t in leaves(value)})
            new_state[key] = value

        # Where each tensor goes: the planner's, over the state and groups about to be installed (policy_target,
        # and plan._share: a state entry holding its group's own tensor, as LBFGS's state['t'] is its tensor lr,
        # goes where the group entry goes, one tensor). Then in which dtype; then every copy is made, before the
        # optimizer changes, so an error (an OOM) leaves it as it was; then the new dicts and containers are
        # filled in.
        plan = self._plan(new_groups, new_state)
        owned = {id(tr[2]) for tr in plan.transfers if tr[0][1] is None and tr[0][0] != OPTIMIZER_WIDE}
        if self.cast is None:  # (containers too: LBFGS's old_dirs/old_stps; a group's own tensor is the group's)
            for new, p, gi, pi in pending:
                self._check_dtypes(new_groups[gi], p, gi, pi, entry_dtypes(new, owned))
        holders: dict[tuple[int, int | None], MutableMapping[Any, Any]] = {(gi, pi): new for new, _, gi, pi in pending}
        holders.update({(gi, None): group for gi, group in enumerate(new_groups)})
        holders[(OPTIMIZER_WIDE, None)] = new_state
        # (group, param index, key) -> None: holder[key] is wanted; {id: wanted}: the tensors in its container
        fills: dict[tuple[int, int | None, Any], dict[int, _Wanted] | None] = {}
        for tr in plan.transfers:
            (tgi, tpi, path), tensor, param, device = tr[0], tr[2], tr[3], tr[4]
            key = path[0][1]
            slot = (tgi, tpi, key)
            nested = fills.get(slot)
            if nested is not None and id(tensor) in nested:
                continue  # one tensor twice in a container: one copy
            ggi = 0 if tgi == OPTIMIZER_WIDE else tgi
            site: _Site = (ggi, tpi, key, path[1:])
            if tpi is not None and id(tensor) in owned:
                # NOTE: it holds its group's own tensor: it gets the group entry's copy (same device, dtype and a
                # copy whatever `copy` says, as the group's), so the two stay one tensor, as in PyTorch.
                wanted = self._want(tensor, device, tensor.dtype, True, site)
            else:
                inner = path[-1][1] if path[-1][0] == "key" else None  # PyTorch casts by the innermost dict key
                dtype = self._cast_dtype(new_groups[ggi], param, inner, tensor)
                # PyTorch deep-copies the groups, so their tensors are copied whatever ``copy`` says.
                always = self.copy or (tpi is None and tgi != OPTIMIZER_WIDE)
                wanted = self._want(tensor, device, dtype, always, site)
            if not isinstance(wanted, torch.Tensor):
                self._uses[wanted] = self._uses.get(wanted, 0) + 1
            if len(path) == 1:
                holders[(tgi, tpi)][key] = wanted  # (its placeholder was the checkpoint's tensor)
                fills[slot] = None
            elif nested is None:
                fills[slot] = {id(tensor): wanted}
            else:
                nested[id(tensor)] = wanted
        self._resolve()
        for (tgi, tpi, key), nested in fills.items():
            holder = holders[(tgi, tpi)]
            holder[key] = self._got(holder[key]) if nested is None else self._fill_nested(holder[key], nested)
        return new_state, new_groups

    def _fill_nested(self, value: Any, wanted: Mapping[int, _Wanted]) -> Any:
        """``value`` with each tensor replaced by its copy. Only our own copies of the checkpoint's
        containers are mutated."""
        replace = {ident: self._got(w) for ident, w in wanted.items()}
        if isinstance(value, torch.Tensor):
            return replace.get(id(value), value)
        setters: list[Setter] = []
        result = rebuild(value, replace, setters, {})
        for apply in setters:
            apply()
        return result

    def _new_group(self, gi: int, live: Mapping[str, Any], saved: Mapping[str, Any]) -> dict[str, Any]:
        """The group as PyTorch builds it (a deep copy of the saved one, with the live params and, when the
        checkpoint has none, the live param names), with the live implementation flags for ``flags="live"``.
        Tensors inside are left for the plan to place (:meth:`build`)."""
        out: dict[str, Any] = {}
        for key, value in saved.items():
            if key == "params":
                continue
            if isinstance(value, torch.Tensor) or isinstance(value, _ATOMS):
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
        self, group: Mapping[str, Any], p: torch.Tensor, gi: int, pi: int, dtypes: Mapping[str, torch.dtype]
    ) -> None:
        """Keeping the checkpoint's dtypes (``cast=None``) must leave an optimizer that can step: fail now,
        before anything is copied, if a step refuses one of them (float64 moments for float32 params in Adam;
        SGD takes float32 momentum for bfloat16 params, so that one is kept)."""
        if self.base is None or not dtypes:
            return
        memo_key = (gi, p.dtype, p.dim(), tuple(sorted((str(k), str(d)) for k, d in dtypes.items())))
        rejected = self._dtype_checks.get(memo_key)
        if rejected is None:
            rejected = self._dtype_checks[memo_key] = rejected_dtypes(self.base, group, p, dtypes)
        if rejected:
            r, n = rejected[0], dtype_name
            others = "".join(f" (and {x.key!r}, {n(x.dtype)})" for x in rejected[1:])
            raise self.fail(
                f"{self._site((gi, pi, r.key, ()))}: the checkpoint holds it as {n(r.dtype)}{others}, and a step of "
                f"{self.name} over {n(p.dtype)} params rejects that ({r.error.splitlines()[0]}); a fresh "
                f"{self.name} keeps it as {n(r.fresh)}. Load with cast='param' to cast the state to the params' "
                f"dtype as PyTorch does; the optimizer is unchanged"
            )

    def _spec(self, group: Mapping[str, Any], ndim: int) -> StateSpec:
        """What this optimizer class keeps per param (probed), for the checks."""
        if self.base is None:
            return NO_SPEC
        return expected_state(self.base, group, ndim)

    # -- validation -------------------------------------------------------------------------------------------

    def _check_group(self, gi: int, group: Mapping[str, Any]) -> None:
        """The hyperparameters a torch.optim class takes are there and have the types it needs (PyTorch fails
        at step())."""
        assert self.base is not None  # (called when strict: a torch.optim class)
        fresh, filled = _group_keys(type(self.opt), self.base)
        absent = sorted(k for k in fresh if k not in group and k not in filled and step_needs(self.base, group, k))
        if absent:
            key = absent[0]
            raise self.fail(
                f"param group {gi} has no {_keys_shown(absent)}, which {self.base.__name__}.step reads (a fresh "
                f"{self.base.__name__} group holds {_keys_shown(fresh)}); the checkpoint is incomplete or was "
                f"edited. Set {'it' if len(absent) == 1 else 'each'} in the state dict before loading, e.g. to "
                f"the optimizer's own value: state_dict['param_groups'][{gi}][{key!r}] = "
                f"optimizer.param_groups[{gi}][{key!r}]; the optimizer is unchanged"
            )
        for key, default in _hyper_defaults(self.base).items():
            if key in group and key not in ("params", "param_names"):
                problem = _hyper_problem(key, default, group[key])
                if problem is not None:
                    raise self.fail(f"param group {gi}, key {key!r}: {problem}", TypeError)

    def _check_entries(self, gi: int, pi: int, p: torch.Tensor, saved: Mapping[Any, Any], spec: StateSpec) -> None:
        """Each entry a step of this torch.optim class creates is there, with the kind, dtype and size it needs."""
        missing = [k for k in spec.keys if k not in saved]
        if missing:
            assert self.base is not None  # (called when strict: a torch.optim class)
            raise self.fail(
                f"{self._param_label(gi, pi)}: its state has no {_keys_shown(missing)}; "
                f"{self.base.__name__}.step keeps {_keys_shown(spec.keys)}"
            )
        for key in spec.tensors:
            value = saved[key]
            site = self._site((gi, pi, key, ()))
            if key in spec.scalars:
                if _number_like(value) and (not isinstance(value, torch.Tensor) or value.layout == torch.strided):
                    continue  # a Python number is what older PyTorch saved; __setstate__ makes it a tensor
                raise self.fail(
                    f"{site}: expected a 0-dim tensor (or a number), got {_kind(value)}",
                    TypeError if not isinstance(value, torch.Tensor) else ValueError,
                )
            if not isinstance(value, torch.Tensor):
                raise self.fail(f"{site}: expected a tensor, got {_kind(value)}", TypeError)
            if value.layout != torch.strided:
                raise self.fail(
                    f"{site}: expected a dense tensor, got a {str(value.layout).replace('torch.', '')} one", TypeError
                )
            if key in spec.floating and not (value.is_floating_point() or value.is_complex()):
                raise self.fail(
                    f"{site}: expected a floating-point tensor, got {str(value.dtype).replace('torch.', '')}", TypeError
                )
            if key in spec.bounded and key not in spec.shaped and value.numel() > p.numel():
                raise self.fail(
                    f"{site}: the checkpoint's tensor has {value.numel()} elements, more than its "
                    f"param's {p.numel()} (shape {tuple(p.shape)}); this checkpoint was made for other "
                    f"params"
                )

    def _copy_container(self, value: Any, site: _Site) -> Any:
        """Our own copy of a checkpoint's container (the tensors inside stay the checkpoint's, to be placed
        one by one), after the depth check; an uncopyable object is a clear error."""
        self._check_depth(value, site)
        memo: dict[int, Any] = {id(t): t for _, t in leaves(value)}
        try:
            return _copy.deepcopy(value, memo)
        except Exception as e:
            where = self._site(site) if site[1] is not None else f"param group {site[0]}, key {site[2]!r}"
            raise self.fail(
                f"{where}: cannot copy its {type(value).__name__} ({type(e).__name__}: {e})", TypeError
            ) from e

    def _check_depth(self, value: Any, site: _Site, wide: bool = False) -> None:
        if too_deep(value):
            where = f"optimizer-wide entry {site[2]!r}" if wide else self._site(site)
            raise self.fail(
                f"{where}: nested more than {MAX_DEPTH} levels deep; no optimizer keeps state like "
                f"this (a corrupt or hostile checkpoint)"
            )


def _same_step(cls: type, base: type) -> bool:
    """Whether ``cls`` steps with ``base``'s ``step``. NOTE: ``Optimizer.__init__`` wraps ``type(self).step`` in a
    profiling hook the first time a class is built, so a subclass may hold its own wrapper of the same function:
    compare what the wrappers wrap."""
    try:
        return inspect.unwrap(getattr(cls, "step")) is inspect.unwrap(getattr(base, "step"))  # noqa: B009
    except (AttributeError, ValueError):
        return False


def _keys_shown(keys: Any) -> str:
    return ", ".join(repr(k) for k in sorted(keys, key=str))


def _ids_shown(ids: Mapping[Any, Any]) -> str:
    shown = list(ids)[:4]
    return ", ".join(repr(i) for i in shown) + (", …" if len(ids) > len(shown) else "")


# --- which hyperparameters a torch.optim class takes -------------------------------------------------------

_defaults_cache: dict[type[torch.optim.Optimizer], dict[str, Any]] = {}


def _hyper_defaults(cls: type[torch.optim.Optimizer]) -> dict[str, Any]:
    """``cls.__init__``'s keyword defaults (``lr``, ``betas``, ``maximize``…), read from its signature."""
    found = _defaults_cache.get(cls)
    if found is None:
        try:
            params = inspect.signature(cls.__init__).parameters.values()
            found = {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}
        except (TypeError, ValueError):
            found = {}
        _defaults_cache[cls] = found
    return found


_group_keys_cache: dict[tuple[type, type], tuple[frozenset[str], frozenset[str]]] = {}


def _group_keys(
    cls: type[torch.optim.Optimizer], base: type[torch.optim.Optimizer]
) -> tuple[frozenset[str], frozenset[str]]:
    """(the keys a fresh ``base`` group holds, those of them ``cls.__setstate__`` fills in a group that lacks
    them), read from the installed torch: a fresh optimizer's ``defaults``, and ``__setstate__`` (what a load
    runs, as PyTorch's does) on a bare group. NOTE: PyTorch's classes ``setdefault`` each key their older
    releases did not save (``foreach``, ``maximize``, ``fused``...), so those checkpoints still load."""
    found = _group_keys_cache.get((cls, base))
    if found is not None:
        return found
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes(), warnings.catch_warnings(), torch.device("cpu"):
        warnings.simplefilter("ignore")
        try:
            fresh_opt: Any = base([torch.nn.Parameter(torch.zeros(2, 3))])  # type: ignore[call-arg]  # (its own __init__)
            defaults = dict(fresh_opt.defaults)  # (a 2-D param: Muon takes only those)
        except Exception:
            defaults = dict(_hyper_defaults(base))
        fresh = frozenset(defaults)
        filled: frozenset[str] = frozenset()
        group: dict[str, Any] = {"params": []}
        for _ in range(len(fresh) + 1):  # a __setstate__ that reads a key it does not fill is given that key
            bare, given = cls.__new__(cls), set(group)
            try:
                bare.__setstate__({"defaults": dict(defaults), "state": {}, "param_groups": [dict(group)]})
            except KeyError as e:
                missing = e.args[0] if len(e.args) == 1 and isinstance(e.args[0], str) else ""
                if missing not in defaults or missing in group:
                    break
                group[missing] = defaults[missing]
                continue
            except Exception:
                break
            filled = frozenset(k for k in bare.param_groups[0] if k in fresh and k not in given)
            break
    found = _group_keys_cache[(cls, base)] = (fresh, filled)
    return found


def _number_like(value: Any) -> bool:
    """A real number, or a one-element real tensor (PyTorch takes a tensor ``lr``)."""
    if isinstance(value, torch.Tensor):
        return value.numel() == 1 and not value.is_complex() and value.dtype != torch.bool
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _hyper_problem(key: str, default: Any, value: Any) -> str | None:
    """What is wrong with ``value`` for a hyperparameter whose default is ``default`` (None if nothing)."""
    if key in IMPLEMENTATION_FLAGS or isinstance(default, bool):
        if value is None or isinstance(value, bool) or (type(value) is int and value in (0, 1)):
            return None
        return f"expected True or False, got {_kind(value)}"
    if isinstance(default, numbers.Real):
        return None if _number_like(value) else f"expected a number (or a one-element tensor), got {_kind(value)}"
    if isinstance(default, tuple):
        if not isinstance(value, (tuple, list)) or len(value) != len(default):
            return (
                f"expected a pair of numbers like {default!r}, got {_kind(value)}"
                if len(default) == 2
                else f"expected {len(default)} numbers like {default!r}, got {_kind(value)}"
            )
        for i, (d, v) in enumerate(zip(default, value)):
            if not (_number_like(v) or (d is None and v is None)):
                return f"item {i} must be a number, got {_kind(v)}"
        return None
    if isinstance(default, str) and not isinstance(value, str):
        return f"expected a string, got {_kind(value)}"
    return None


def _kind(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)} ({str(value.dtype).replace('torch.', '')})"
    if isinstance(value, (str, bytes)):
        return f"{type(value).__name__} {value[:40]!r}"
    if value is None:
        return "None"
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)}"
    return f"a {type(value).__name__}"


# --- installing ----------------------------------------------------------------------------------------------


def _install(
    optimizer: torch.optim.Optimizer,
    name: str,
    state: defaultdict[Any, Any],
    groups: list[dict[str, Any]],
    *,
    made: AbstractSet[int] = frozenset(),
    shared: AbstractSet[int] = frozenset(),
) -> None:
    """Hand the new state to the optimizer as PyTorch does (``__setstate__``, which runs the class's fix-ups,
    e.g. Adam turning a float ``step`` into a tensor). If a fix-up raises, the optimizer is put back.

    Then every tensor the optimizer already held at the same place (param and key, or group and key) adopts
    the loaded copy's contents and stays the same object (see :mod:`optimshift._adopt`), so a resume into an
    optimizer with state does not recompile a compiled ``step()``. Only copies made here are adopted (``made``),
    and only those installed in one place (``shared``: the others): with ``copy=False`` the caller's own tensors
    are installed as they are.
    """
    before = dict(optimizer.__dict__)
    live = [
        (holder, {k: v for k, v in holder.items() if isinstance(v, torch.Tensor)}, fresh)
        for holder, fresh in _same_places(optimizer, state, groups)
    ]
    try:
        optimizer.__setstate__({"state": state, "param_groups": groups})
    except Exception as e:
        optimizer.__dict__.clear()
        optimizer.__dict__.update(before)
        raise ValueError(
            f"{name}: load_state_dict: {type(optimizer).__name__}.__setstate__ rejected the loaded state "
            f"({type(e).__name__}: {e}); the optimizer is unchanged"
        ) from e
    places: list[tuple[dict[Any, Any], Any, torch.Tensor, torch.Tensor]] = []  # (new holder, key, old tensor, copy)
    for _, old_tensors, fresh in live:
        for key, old in old_tensors.items():
            new = fresh.get(key)
            if isinstance(new, torch.Tensor) and id(new) in made and new is not old:
                places.append((fresh, key, old, new))
    # A copy installed in two places (LBFGS's state['t'] is its group's lr), at the top level or inside a
    # container, stays one shared object: adopting it into one old tensor would split the sharing.
    places = [place for place in places if id(place[3]) not in shared]
    # An old tensor that sat in two places now given two different copies keeps neither: each place gets its
    # own copy (the checkpoint's values), as PyTorch installs them.
    by_old: dict[int, set[int]] = {}
    for _, _, old, new in places:
        by_old.setdefault(id(old), set()).add(id(new))
    places = [place for place in places if len(by_old[id(place[2])]) == 1]
    cannot, apply = engine.adopt_all([(old, new) for _, _, old, new in places], protect=engine.outside_owned(optimizer))
    stay_new = {id(old) for old, _ in cannot}  # no mechanism for this pair: the copy stays installed
    apply()
    for fresh, key, old, _ in places:
        if id(old) not in stay_new:
            fresh[key] = old


def _same_places(
    optimizer: torch.optim.Optimizer, state: Mapping[Any, Any], groups: list[dict[str, Any]]
) -> list[tuple[dict[Any, Any], dict[Any, Any]]]:
    """(live holder, new holder) for each param's state dict and each param group present in both."""
    pairs: list[tuple[dict[Any, Any], dict[Any, Any]]] = []
    for p, fresh in state.items():
        if isinstance(p, torch.Tensor) and isinstance(fresh, dict):
            old = optimizer.state.get(p)
            if isinstance(old, dict) and old:
                pairs.append((old, fresh))
    for old_group, new_group in zip(optimizer.param_groups, groups):
        pairs.append((old_group, new_group))
    return pairs
