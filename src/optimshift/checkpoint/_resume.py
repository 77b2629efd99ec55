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
import threading
import warnings
from collections import defaultdict
from typing import Any, Mapping, Optional, TypeVar

import torch

from .. import _mode
from .. import engine
from .._copy import copy_tensor
from .._offload import prepare_discard
from .. import policy as _policy
from .._devices import DeviceLike, resolve
from .._state import _ATOMS, Setter, format_path, leaves, rebuild
from ..plan import optimizer_name

__all__ = ["load_state_dict", "IMPLEMENTATION_FLAGS"]

Opt = TypeVar("Opt")

IMPLEMENTATION_FLAGS = ("fused", "capturable", "foreach", "differentiable")
"""Group entries that choose *how* a step is computed, not *what* it computes: ``flags="live"`` keeps them."""

_FLAG_MODES = ("live", "checkpoint")
_CAST_MODES = (None, "param")

# Overrides of ``load_state_dict`` that only post-process what ``Optimizer.load_state_dict`` produced in ways
# this module already does (keeping non-floating dtypes and container types). Any other override may hold
# logic we cannot reproduce, so such optimizers are refused with a workaround rather than loaded wrongly.
_EQUIVALENT_OVERRIDES = frozenset({
    "pytorch_optimizer.base.optimizer.BaseOptimizer.load_state_dict",
})


def load_state_dict(
    optimizer: Opt,
    state_dict: Mapping[str, Any],
    *,
    device: Optional[DeviceLike] = None,
    flags: str = "live",
    copy: bool = True,
    cast: Optional[str] = None,
) -> Opt:
    """Drop-in for ``optimizer.load_state_dict(state_dict)`` that puts each entry where a fresh optimizer would.

    Entries follow their param (``device=None``) or sit where a fresh optimizer on ``device`` keeps them;
    values and dtypes are kept as saved (``cast="param"``: PyTorch's cast to the param's dtype). Linear time.

    - ``flags="live"``: hyperparameters come from the checkpoint, ``fused``/``capturable``/``foreach``/
      ``differentiable`` stay as the live optimizer has them; ``"checkpoint"``: PyTorch's choice (all saved).
    - ``copy=True``: the optimizer never shares a tensor with ``state_dict``.
    - ``state_dict`` may also be a whole checkpoint holding exactly one optimizer state (a Lightning ``.ckpt``,
      ``{"optimizer": ...}``, an :func:`optimshift.save` file); a recorded optimizer class is checked.

    Everything is validated (class, group count, params per group, state shapes) and copied before the
    optimizer changes: an error names the group, param index and key and leaves the optimizer untouched.
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
            raise ValueError(f"{name}: load_state_dict: it is streamed (optimshift.stream), so its state loads into "
                             f"host memory; device={target} would put it elsewhere. Call optimshift.unstream() first.")
        mode.settle()
        target = torch.device("cpu")

    sd, recorded = _extract(state_dict, name)
    if recorded is not None:
        _check_class(receiver, recorded, name)

    # As PyTorch: a shallow copy goes through the pre-hooks, which may return a replacement.
    sd = dict(sd)
    for hook in list(getattr(receiver, "_optimizer_load_state_dict_pre_hooks", {}).values()):
        result = hook(receiver, sd)
        if result is not None:
            sd = result

    staged = _Staging(receiver, name, sd, flags=flags, cast=cast, copy=copy, device=target)
    with engine.no_gc():  # tens of thousands of small objects: collections would cost more than the copies
        new_state, new_groups = staged.build()
        # The loaded state supersedes any offload record: offloaded grads are copied back first (an OOM there
        # leaves everything as it was), handed back only once the state is installed.
        finish = [prepare_discard(obj) for obj in dict.fromkeys((receiver, optimizer))]
        _install(receiver, name, new_state, new_groups, made=staged.made_ids())
        if mode is not None:
            mode.after_load()
    for done in finish:
        done()
    for hook in list(getattr(receiver, "_optimizer_load_state_dict_post_hooks", {}).values()):
        hook(receiver)
    return optimizer


# --- which optimizer receives the state -------------------------------------------------------------------


def _override_name(cls: type) -> Optional[str]:
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
    for _ in range(8):
        # A wrapper delegating groups and state first: Lightning's LightningOptimizer is also an instance of the
        # optimizer class it wraps (a dynamic subclass), but the optimizer that steps is the one inside.
        inner = getattr(optimizer, "optimizer", None)
        if (
            isinstance(inner, torch.optim.Optimizer)
            and inner is not optimizer
            and getattr(optimizer, "param_groups", None) is inner.param_groups
            and getattr(optimizer, "state", None) is inner.state
        ):
            optimizer = inner
            continue
        if isinstance(optimizer, torch.optim.Optimizer):
            override = _override_name(type(optimizer))
            if override is None or override in _EQUIVALENT_OVERRIDES:
                return optimizer
        break
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


def _check_class(optimizer: Any, recorded: Mapping[str, Any], name: str) -> None:
    qualname = recorded.get("class")
    module = recorded.get("module", "")
    if not isinstance(qualname, str):
        return
    cls = type(optimizer)
    if cls.__qualname__ == qualname:
        return
    saved = f"{module}.{qualname}" if module else qualname
    raise ValueError(
        f"{name}: load_state_dict: the checkpoint was saved from a {saved}, not a {cls.__module__}.{cls.__qualname__}; "
        f"its state would be misread. Load it into a {qualname}, or pass only its 'state' and 'param_groups' "
        f"entries to skip this check."
    )


def _extract(state_dict: Any, name: str) -> tuple[Any, Optional[Mapping[str, Any]]]:
    """The optimizer state dict inside ``state_dict`` (itself, or the only one a checkpoint holds) and the
    class optimshift recorded for it."""
    from ._files import META_KEY, find_optimizer_states, is_optimizer_state_dict

    if not isinstance(state_dict, Mapping):
        raise TypeError(f"{name}: load_state_dict: state_dict must be a dict, got {type(state_dict).__name__}")
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
            f"{name}: load_state_dict: this checkpoint holds {len(found)} optimizer states ({where}); pass the one "
            f"for this optimizer, e.g. checkpoint{found[0].where}"
        )
    return state_dict, None  # not recognised: the pre-hooks may still turn it into a state dict


# --- building the new state ---------------------------------------------------------------------------------


def _label(gi: int, pi: int, names: Any) -> str:
    label = f"group {gi}, param {pi}"
    if isinstance(names, (list, tuple)) and pi < len(names):
        label += f" ({names[pi]})"
    return label


class _Staging:
    """Validates a state dict against the live optimizer and builds its new state and groups from copies.

    Nothing here touches the optimizer: :meth:`build` returns objects that only :func:`_install` assigns.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, name: str, sd: Any, *, flags: str, cast: Optional[str],
                 copy: bool, device: Optional[torch.device]) -> None:
        self.opt, self.name, self.sd = optimizer, name, sd
        self.flags, self.cast, self.copy, self.device = flags, cast, copy, device
        self.registered = _policy.has_registered_policy(optimizer)
        self.wide: list[Any] = []  # optimizer-wide state keys (set by _validate_structure)
        self.base = _policy._builtin_base(type(optimizer))
        self._decisions: dict[tuple, torch.device] = {}
        # (id(source), device, dtype) -> (source, where it is used): one copy each, made by _resolve().
        self._wanted: dict[tuple, tuple[torch.Tensor, tuple]] = {}
        self._made: dict[tuple, torch.Tensor] = {}

    def fail(self, message: str, exc: type = ValueError) -> BaseException:
        return exc(f"{self.name}: load_state_dict: {message}")

    # -- structure ------------------------------------------------------------------------------------------

    def _validate_structure(self) -> tuple[list, Mapping]:
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
                    raise self.fail(f"the optimizer lists one param twice (group {g0}, param {i0} and "
                                    f"group {gi}, param {pi})")
                seen_live[id(p)] = (gi, pi)
                try:
                    prior = seen_ids.get(sid)
                except TypeError:
                    raise self.fail(f"group {gi}, param {pi}: the checkpoint's param id {sid!r} is not hashable",
                                    TypeError) from None
                if prior is not None:
                    raise self.fail(
                        f"the checkpoint lists param id {sid!r} twice (group {prior[0]}, param {prior[1]} and "
                        f"group {gi}, param {pi})"
                    )
                seen_ids[sid] = (gi, pi)
        id_types = {type(sid) for sid in seen_ids}
        # Keys of another kind than the params' ids are optimizer-wide entries (MADGRAD's "k"): PyTorch keeps them.
        self.wide = [k for k in states if k not in seen_ids and type(k) not in id_types] if id_types else []
        stray = [k for k in states if k not in seen_ids and k not in self.wide] if len(states) > 0 else []
        if stray:
            raise self.fail(
                f"state_dict['state'] has entries for param ids {stray[:5]!r} that no param group lists; "
                f"they could not be matched to a param"
            )
        return list(groups), states

    # -- placement ------------------------------------------------------------------------------------------

    def _place(self, group: Mapping[str, Any], param: Optional[torch.Tensor], key: Any, tensor: torch.Tensor,
               gi: int, where: torch.device, pdim: int) -> torch.device:
        """policy.decide for this entry, with the param (or, for a group entry, the group) on ``where``.

        For built-in rules the answer depends only on the group, the key, the param's rank and device and
        whether the tensor is a scalar, so it is memoized on those: this is what keeps a load linear with a
        small constant. A registered policy sees each value, so it is asked for each one."""
        if self.registered:
            return _policy.decide(self.opt, group, param, str(key), tensor, where).device
        memo_key = (gi, key, pdim, tensor.dim() == 0, where)
        found = self._decisions.get(memo_key)
        if found is None:
            found = _policy.decide(self.opt, group, param, str(key), tensor, where).device
            self._decisions[memo_key] = found
        return found

    def _cast_dtype(self, group: Mapping[str, Any], param: Optional[torch.Tensor], inner_key: Any,
                    tensor: torch.Tensor) -> torch.dtype:
        """``cast="param"``: PyTorch's rule (``step`` to float32 when fused/capturable, other tensors to a
        floating param's dtype); otherwise the saved dtype."""
        if self.cast != "param" or param is None:
            return tensor.dtype
        if inner_key == "step":
            return torch.float32 if (group.get("fused") or group.get("capturable")) else tensor.dtype
        return param.dtype if param.is_floating_point() else tensor.dtype

    def _param_label(self, gi: int, pi: int) -> str:
        names = self.opt.param_groups[gi].get("param_names") or self.sd["param_groups"][gi].get("param_names")
        return _label(gi, pi, names)

    def _site(self, site: tuple) -> str:
        """``(group, param index or None, key, path)`` as words, for errors."""
        gi, pi, key, path = site
        if pi is None:
            return f"param group {gi}, key {key!r}{format_path(path)}"
        return f"{self._param_label(gi, pi)}, state key {key!r}{format_path(path)}"

    def _want(self, tensor: torch.Tensor, device: torch.device, dtype: torch.dtype, always_copy: bool,
              site: tuple) -> Any:
        """Ask for ``tensor`` on ``device`` in ``dtype``: returns the tensor itself when it already fits and
        copying was not asked for, else a ticket that :meth:`_got` turns into its copy once :meth:`_resolve`
        has made every copy. One copy per distinct (source, device, dtype), so tensors shared in the
        checkpoint stay shared. Sources stay alive (the state dict holds them) while their ids are keys."""
        if not always_copy and tensor.dtype == dtype and tensor.device == device:
            return tensor
        ticket = (id(tensor), device, dtype)
        if ticket not in self._wanted:
            if tensor.is_meta and device.type != "meta":
                raise self.fail(f"{self._site(site)}: a meta tensor has no values to load")
            self._wanted[ticket] = (tensor, site)
        return ticket

    def made_ids(self) -> set[int]:
        """The ids of the copies this staging made (never the caller's own tensors)."""
        return {id(t) for t in self._made.values()}

    def _got(self, wanted: Any) -> torch.Tensor:
        return wanted if isinstance(wanted, torch.Tensor) else self._made[wanted]

    def _resolve(self) -> None:
        """Make every copy asked for. Host<->device moves go to the engine as one batch (grouped by device
        pair and dtype: one staging copy per chunk instead of one transfer per tensor, then one
        synchronize); copies in place (``copy=True``) and casts are made tensor by tensor."""
        moving: list[tuple[tuple, torch.Tensor, torch.device]] = []
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
                if hasattr(e, "add_note"):
                    e.add_note(f"{self.name}: load_state_dict: while copying {len(moving)} tensors to "
                               f"{', '.join(sorted({str(d) for _, _, d in moving}))}; the optimizer is unchanged")
                raise
            for (ticket, _, _), new in zip(moving, batch.copies):
                self._made[ticket] = new

    def _copy_one(self, tensor: torch.Tensor, device: torch.device, dtype: torch.dtype, site: tuple) -> torch.Tensor:
        try:
            if tensor.requires_grad or type(tensor) is not torch.Tensor:  # Parameters, subclasses: the general copy
                new = copy_tensor(tensor, device)
                return new if new.dtype == dtype else new.to(dtype)
            if tensor.dtype == dtype and tensor.device == device:
                return tensor.clone()  # same place: keeps the strides, and is the cheapest copy
            return tensor.to(device, dtype, False, True)  # a cast (cast="param"): a plain blocking copy
        except Exception as e:  # an OOM on the 900th tensor: say which one; nothing was installed yet
            if hasattr(e, "add_note"):
                e.add_note(f"{self.name}: load_state_dict: while copying {self._site(site)} to {device}; "
                           f"the optimizer is unchanged")
            raise

    # -- the whole state --------------------------------------------------------------------------------------

    def build(self) -> tuple[defaultdict, list[dict[str, Any]]]:
        saved_groups, states = self._validate_structure()
        live_groups = self.opt.param_groups
        new_groups = [self._new_group(gi, lg, sg) for gi, (lg, sg) in enumerate(zip(live_groups, saved_groups))]
        shaped_cache: dict[tuple[int, int], frozenset] = {}
        new_state: defaultdict = defaultdict(dict)
        # Per param with state: (its new state dict, param, group, index, [(key, tensor)], [(key, container)]).
        pending: list[tuple[dict, torch.Tensor, int, int, list, list]] = []
        for gi, (lg, sg, ng) in enumerate(zip(live_groups, saved_groups, new_groups)):
            for pi, (sid, p) in enumerate(zip(sg["params"], lg["params"])):
                saved = states.get(sid)
                if saved is None:
                    continue
                if type(saved) is not dict and not isinstance(saved, Mapping):
                    raise self.fail(f"{self._param_label(gi, pi)}: its state is a {type(saved).__name__}, "
                                    f"expected a dict", TypeError)
                ndim, pshape = p.dim(), p.shape
                shaped = shaped_cache.get((gi, ndim))
                if shaped is None:
                    shaped = shaped_cache[(gi, ndim)] = self._shaped_keys(ng, ndim)
                new: dict = {}
                tensors: list = []
                containers: list = []
                for key, value in saved.items():
                    if isinstance(value, torch.Tensor):
                        if key in shaped and value.shape != pshape:
                            raise self.fail(
                                f"{self._site((gi, pi, key, ()))}: the checkpoint's tensor has shape "
                                f"{tuple(value.shape)}, the param has shape {tuple(p.shape)}; this checkpoint was "
                                f"made for other params (or another model)"
                            )
                        tensors.append((key, value))
                        new[key] = value  # a placeholder (keeps the key order), replaced by its placed copy
                    elif isinstance(value, _ATOMS):
                        new[key] = value
                    else:
                        memo: dict[int, Any] = {id(t): t for _, t in leaves(value)}
                        try:
                            new[key] = _copy.deepcopy(value, memo)
                        except Exception as e:
                            raise self.fail(f"{self._site((gi, pi, key, ()))}: cannot copy its "
                                            f"{type(value).__name__} ({type(e).__name__}: {e})", TypeError) from e
                        containers.append(key)
                new_state[p] = new
                pending.append((new, p, gi, pi, tensors, containers))

        # Where each tensor goes (and in which dtype); then every copy is made, before the optimizer changes,
        # so an error (an OOM) leaves it as it was; then the new dicts and containers are filled in.
        fixed, always = self.device, self.copy
        fills: list[tuple[Any, Any, Any]] = []  # (holder, key, wanted) or (holder, key, (container, [(id, wanted)]))
        for new, p, gi, pi, tensors, containers in pending:
            group = new_groups[gi]
            where = fixed if fixed is not None else p.device
            pdim = p.dim()
            for key, value in tensors:
                device = self._place(group, p, key, value, gi, where, pdim)
                dtype = value.dtype if self.cast is None else self._cast_dtype(group, p, key, value)
                new[key] = self._want(value, device, dtype, always, (gi, pi, key, ()))
                fills.append((new, key, None))
            for key in containers:
                fills.append((new, key, self._want_nested(new[key], group, p, key, gi, pi, where, pdim, always)))
        for gi, group in enumerate(new_groups):
            for key in list(group):
                if key in ("params", "param_names"):
                    continue
                value = group[key]
                if isinstance(value, torch.Tensor) or not isinstance(value, _ATOMS):
                    # PyTorch deep-copies the groups, so their tensors are copied whatever ``copy`` says.
                    gwhere = fixed if fixed is not None else _group_device(group, value)
                    fills.append((group, key, self._want_nested(value, group, None, key, gi, None, gwhere, -1, True)))
        for key in self.wide:  # optimizer-wide entries: placed like the plan places them (the first group's)
            value = states[key]
            if isinstance(value, _ATOMS) and not isinstance(value, torch.Tensor):
                new_state[key] = value
                continue
            if not isinstance(value, torch.Tensor):
                memo = {id(t): t for _, t in leaves(value)}
                value = _copy.deepcopy(value, memo)
            new_state[key] = value
            gwhere = fixed if fixed is not None else _group_device(new_groups[0], value)
            fills.append((new_state, key, self._want_nested(value, new_groups[0], None, key, 0, None, gwhere, -1,
                                                            always)))
        self._resolve()
        for holder, key, nested in fills:
            holder[key] = self._got(holder[key]) if nested is None else self._fill_nested(holder[key], nested)
        return new_state, new_groups

    def _want_nested(self, value: Any, group: Mapping[str, Any], param: Optional[torch.Tensor], key: Any, gi: int,
                     pi: Optional[int], where: Any, pdim: int, always_copy: bool) -> list[tuple[int, Any]]:
        """Ask for each tensor inside ``value`` (our copy of the checkpoint's container, or a group's tensor)
        where it belongs: ``[(id(tensor), wanted)]`` for :meth:`_fill_nested`."""
        wanted: dict[int, Any] = {}
        for path, t in leaves(value, (("key", key),)):
            if id(t) in wanted:
                continue
            inner = path[-1][1] if path[-1][0] == "key" else None  # PyTorch casts by the innermost dict key
            device = self._place(group, param, key, t, gi, where if where is not None else t.device, pdim)
            dtype = self._cast_dtype(group, param, inner, t)
            wanted[id(t)] = self._want(t, device, dtype, always_copy, (gi, pi, key, path[1:]))
        return list(wanted.items())

    def _fill_nested(self, value: Any, wanted: list[tuple[int, Any]]) -> Any:
        """``value`` with each tensor replaced by its copy. Only our own copies of the checkpoint's
        containers are mutated."""
        replace = {ident: self._got(w) for ident, w in wanted}
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
        Tensors inside are left for :meth:`_want_nested` to place."""
        out: dict[str, Any] = {}
        for key, value in saved.items():
            if key == "params":
                continue
            if isinstance(value, torch.Tensor) or isinstance(value, _ATOMS):
                out[key] = value
            else:
                memo: dict[int, Any] = {id(t): t for _, t in leaves(value)}
                try:
                    out[key] = _copy.deepcopy(value, memo)
                except Exception as e:
                    raise self.fail(f"param group {gi}, key {key!r}: cannot copy its {type(value).__name__} "
                                    f"({type(e).__name__}: {e})", TypeError) from e
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

    def _shaped_keys(self, group: Mapping[str, Any], ndim: int) -> frozenset:
        """State keys that this optimizer class keeps in its param's shape (probed), for the shape check."""
        if self.base is None:
            return frozenset()
        return _shaped_keys(self.base, group, ndim)


def _group_device(group: Mapping[str, Any], fallback: torch.Tensor) -> torch.device:
    for p in group.get("params", ()):
        if isinstance(p, torch.Tensor):
            return p.device
    return fallback.device


# --- which state keys have the param's shape ----------------------------------------------------------------

_shape_cache: dict[tuple, frozenset] = {}
_shape_lock = threading.Lock()


def _plain(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return False
    if isinstance(value, (list, tuple)):
        return all(_plain(v) for v in value)
    return isinstance(value, (int, float, bool, str, type(None)))


def _shaped_keys(cls: type, group: Mapping[str, Any], ndim: int) -> frozenset:
    """Run ``cls`` for one step on two small host params of rank ``ndim`` (1, or 2 for anything higher) and
    return the state keys whose tensors had their param's shape in both. Empty when the probe cannot run
    (then nothing is checked) or for 0-dim params."""
    if ndim == 0:
        return frozenset()
    try:
        accepted = inspect.signature(cls.__init__).parameters
    except (TypeError, ValueError):
        return frozenset()
    kwargs = {k: v for k, v in group.items()
              if k in accepted and k not in ("params", "param_names") + IMPLEMENTATION_FLAGS and _plain(v)}
    if "foreach" in accepted:
        kwargs["foreach"] = False
    shapes = [(2, 3), (3, 2)] if ndim >= 2 else [(5,), (7,)]
    cache_key = (cls, repr(sorted(kwargs.items())), len(shapes[0]))
    with _shape_lock:
        hit = _shape_cache.get(cache_key)
    if hit is not None:
        return hit
    result: frozenset = frozenset()
    try:
        result = _probe_shapes(cls, kwargs, shapes)
    except Exception:
        result = frozenset()
    with _shape_lock:
        _shape_cache[cache_key] = result
    return result


def _probe_shapes(cls: type, kwargs: dict, shapes: list) -> frozenset:
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes(), warnings.catch_warnings(), torch.device("cpu"), _policy.quiet_global_step_hooks():
        warnings.simplefilter("ignore")
        params = [torch.nn.Parameter(torch.full(s, 0.5, dtype=torch.float32)) for s in shapes]
        for p in params:
            p.grad = torch.full(p.shape, 0.25)
        opt = cls(params, **kwargs)
        try:
            opt.step(lambda: torch.tensor(1.0))
        except Exception:
            pass  # the state was created before whatever failed; it is all we read
        keys: Optional[set] = None
        for p in params:
            state = opt.state.get(p)
            if not state:
                return frozenset()
            here = {k for k, v in state.items() if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape == p.shape}
            keys = here if keys is None else keys & here
    return frozenset(keys or ())


# --- installing ----------------------------------------------------------------------------------------------


def _install(optimizer: torch.optim.Optimizer, name: str, state: defaultdict, groups: list, *,
             made: set[int] = frozenset()) -> None:  # type: ignore[assignment]
    """Hand the new state to the optimizer as PyTorch does (``__setstate__``, which runs the class's fix-ups,
    e.g. Adam turning a float ``step`` into a tensor). If a fix-up raises, the optimizer is put back.

    Then every tensor the optimizer already held at the same place (param and key, or group and key) adopts
    the loaded copy's contents and stays the same object (see :mod:`optimshift._adopt`), so a resume into an
    optimizer with state does not recompile a compiled ``step()``. Only copies made here are adopted: with
    ``copy=False`` the caller's own tensors are installed as they are.
    """
    before = dict(optimizer.__dict__)
    live = [(holder, {k: v for k, v in holder.items() if isinstance(v, torch.Tensor)}, fresh)
            for holder, fresh in _same_places(optimizer, state, groups)]
    try:
        optimizer.__setstate__({"state": state, "param_groups": groups})
    except Exception as e:
        optimizer.__dict__.clear()
        optimizer.__dict__.update(before)
        raise ValueError(
            f"{name}: load_state_dict: {type(optimizer).__name__}.__setstate__ rejected the loaded state "
            f"({type(e).__name__}: {e}); the optimizer is unchanged"
        ) from e
    places: list[tuple[dict, Any, torch.Tensor, torch.Tensor]] = []  # (new holder, key, old tensor, copy)
    uses: dict[int, int] = {}
    for _, old_tensors, fresh in live:
        for key, old in old_tensors.items():
            new = fresh.get(key)
            if isinstance(new, torch.Tensor) and id(new) in made and new is not old:
                places.append((fresh, key, old, new))
                uses[id(new)] = uses.get(id(new), 0) + 1
    # A copy installed in two places stays one shared object (adopting it twice would split the sharing).
    places = [place for place in places if uses[id(place[3])] == 1]
    cannot, apply = engine.adopt_all([(old, new) for _, _, old, new in places])
    stay_new = {id(old) for old, _ in cannot}  # no mechanism for this pair: the copy stays installed
    apply()
    for fresh, key, old, _ in places:
        if id(old) not in stay_new:
            fresh[key] = old


def _same_places(optimizer: torch.optim.Optimizer, state: Mapping[Any, Any], groups: list) -> list[tuple[dict, dict]]:
    """(live holder, new holder) for each param's state dict and each param group present in both."""
    pairs = []
    for p, fresh in state.items():
        if isinstance(p, torch.Tensor) and isinstance(fresh, dict):
            old = optimizer.state.get(p)
            if isinstance(old, dict) and old:
                pairs.append((old, fresh))
    for old_group, new_group in zip(optimizer.param_groups, groups):
        pairs.append((old_group, new_group))
    return pairs
