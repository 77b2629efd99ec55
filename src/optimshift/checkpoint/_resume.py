"""Loading optimizer state: a linear-time, transactional ``optimizer.load_state_dict`` that places every entry
where a fresh optimizer would keep it (staged in :mod:`._staging`, checked in :mod:`._checks`, installed here).

Unlike torch's (quadratic; casts floating state to the param's dtype, mangles strings and namedtuples, aliases the
caller's tensors, puts host scalars on the device, adopts the checkpoint's flags), it validates everything first,
builds the new state from copies, then installs it as PyTorch does (``__setstate__`` and the load hooks).
"""

from __future__ import annotations

import functools
import os
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from types import MappingProxyType
from typing import Any, TypeVar

import torch

from .. import _addresses, _engine, _mode
from .._copy import Batch
from .._devices import DeviceLike, resolve
from .._errors import with_article
from .._offload import exclusive, pending_of, prepare_discard
from .._plan import check_optimizer, optimizer_name
from .._state import IMPLEMENTATION_FLAGS, wrapping
from . import _files
from ._staging import CastNeeded, Staging, pair_places

__all__ = ["load_state_dict", "IMPLEMENTATION_FLAGS"]

Opt = TypeVar("Opt")

# Overrides of ``load_state_dict`` that only post-process what ``Optimizer.load_state_dict`` produced in ways
# this module already does (keeping non-floating dtypes and container types). Any other override may hold
# logic we cannot reproduce, so such optimizers are refused with a workaround rather than loaded wrongly.
_EQUIVALENT_OVERRIDES = frozenset({"pytorch_optimizer.base.optimizer.BaseOptimizer.load_state_dict"})

# Wrappers whose load_state_dict hands the state dict on to the optimizer they wrap, unchanged (Accelerate's: on
# XLA it also moves it to the device, which the load's placement does).
_DELEGATING_OVERRIDES = frozenset({"accelerate.optimizer.AcceleratedOptimizer.load_state_dict"})


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

    Everything is validated, and every copy made, before the optimizer changes (live tensors that fit take their values
    in place within the commit): an error names the group, param index and key and leaves the optimizer untouched.
    Checked: the class, the group count, the params per group, that every key of ``state`` is a saved param id (text
    keys such as ``"0"``, left by a JSON round trip, are refused, not taken for optimizer-wide entries; a torch.optim
    class keeps no optimizer-wide entries, other classes may), no container nested more than 64 levels, no tensor that
    is an expanded view far larger than its storage. For torch.optim classes, also what their step needs (probed): every
    entry a step creates is there and is a dense tensor, per-param buffers have the param's shape and a floating dtype,
    scalars such as ``step`` have one element, and hyperparameters have the right type (``lr`` a number or one-element
    tensor, ``betas`` a pair) and are there. A group may lack only keys the class's ``__setstate__`` fills for older
    checkpoints (SGD's ``nesterov``) and keys its step never reads or reads with a default (SparseAdam's ``maximize``);
    both are read from the installed torch. Registered load_state_dict pre/post hooks and the class's ``__setstate__``
    run as in PyTorch.
    """
    return _load(optimizer, state_dict, device, flags, copy, cast, as_torch=False)


def _load(
    optimizer: Opt, state_dict: Mapping[str, Any], device: Any, flags: str, copy: bool, cast: Any, *, as_torch: bool
) -> Opt:
    """:func:`load_state_dict` (its options as it takes them); ``as_torch``: where keeping a saved dtype would leave
    state the step refuses (:class:`CastNeeded`), PyTorch's cast instead, decided after the pre-hooks ran once."""
    receiver = check_optimizer(_receiver(optimizer))
    name = optimizer_name(receiver)
    if flags not in ("live", "checkpoint"):
        raise ValueError(f"{name}: load_state_dict: flags must be 'live' or 'checkpoint', got {flags!r}")
    if cast not in (None, "param"):
        raise ValueError(f"{name}: load_state_dict: cast must be None or 'param', got {cast!r}")
    if not isinstance(copy, bool):
        raise TypeError(f"{name}: load_state_dict: copy must be a bool, got {copy!r}")
    params = [p for g in receiver.param_groups for p in g["params"]]
    target = None if device is None else resolve(device, what=f"{name}: load_state_dict: device", tensors=params)
    mode = _mode.mode_of(receiver)
    if mode is not None:  # streamed: the state loads into host memory, where it lives between steps
        if target is not None and target.type != "cpu":
            raise streamed_elsewhere(f"{name}: load_state_dict", target)
        mode.wait()
        target = torch.device("cpu")

    label = f"{name}: load_state_dict"
    saved = None  # (a file's: where each storage was saved)
    if isinstance(state_dict, (str, bytes, os.PathLike)):
        source = _files.file_path(state_dict, label)
        state_dict, saved = _read(source, label)
        label = f"{label}: {source}"
    sd, recorded = _extract(state_dict, label)
    if recorded is not None:
        _check_class(optimizer, receiver, recorded, label)

    # A transfer still in flight writes the live state that the load reads and replaces: order after it first.
    pending_of(receiver).order_before_use()
    # As PyTorch: a shallow copy goes through the pre-hooks, which may return a replacement.
    sd = dict(sd)
    for hook in list(getattr(receiver, "_optimizer_load_state_dict_pre_hooks", {}).values()):
        result = hook(receiver, sd)
        if result is not None:
            sd = result

    staging = functools.partial(
        Staging,
        receiver,
        name,
        sd,
        flags=flags,
        copy=copy,
        device=target,
        what=label,
        streamed=mode is not None,
        saved=saved,
    )
    staged = staging(cast=cast)
    # (one operation at a time on this optimizer, as move/offload/reload; tens of thousands of small objects:
    # collections would cost more than the copies)
    with _engine.operation(), exclusive(receiver), _engine.no_gc():
        # The loaded state supersedes any offload record: offloaded grads are copied back first, before the state
        # is staged (a grad that cannot go back, or an OOM there, leaves everything as it was), handed back only
        # once the state is installed.
        finish = [prepare_discard(obj) for obj in dict.fromkeys((receiver, optimizer))]
        try:
            new_state, new_groups = staged.build()
        except CastNeeded:
            if not as_torch or cast is not None:
                raise
            staged = staging(cast="param")
            new_state, new_groups = staged.build()
        _install(
            receiver,
            name,
            new_state,
            new_groups,
            made=staged.made_ids if staged.made_any() else None,
            shared=staged.shared_uses(),
            in_place=staged.in_place,
        )
        if mode is not None:
            mode.after_load()
        for done in finish:  # (in the operation: a Ctrl-C held by the commit waits for these too)
            done()
        # State kept at fixed addresses (keep_addresses) that the load did not write in place left its slots, as
        # after a move: their memory is released (the copies an adoption left holding it go first), once the
        # work queued on the device (the last step, the load's own copies there) no longer uses it.
        del staged, new_state, new_groups
        _addresses.release(receiver, name, queued=True)
    for hook in list(getattr(receiver, "_optimizer_load_state_dict_post_hooks", {}).values()):
        hook(receiver)
    return optimizer


def _read(source: str, label: str) -> tuple[Any, Mapping[int, str]]:
    """:func:`optimshift.load` of ``source``, with where each storage was saved (:func:`_files.load_located`); an
    error reading it (it names the file) names the optimizer too, its type and attributes kept."""
    try:
        return _files.load_located(source)
    except (OSError, _files.CheckpointError) as e:
        if isinstance(e, OSError) and e.strerror is not None:  # (the system's own: str() shows its strerror)
            e.strerror = f"{label}: {e.strerror}"
            e.args = (e.errno, e.strerror, *e.args[2:])  # (what a pickle keeps; BlockingIOError's third arg too)
        else:
            e.args = (f"{label}: {e}",)
        raise


def streamed_elsewhere(label: str, device: torch.device) -> ValueError:
    """The refusal of a load onto ``device`` of a streamed optimizer's state, which lives in host memory."""
    return ValueError(
        f"{label}: it is streamed (optimshift.stream), so its state loads into host memory; device={device} would "
        f"put it elsewhere. Call optimshift.unstream() first."
    )


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


def load_as_torch_would(optimizer: Any, state_dict: Mapping[str, Any]) -> None:
    """A framework's resume through :func:`load_state_dict`, where the framework called torch's: the
    checkpoint's dtypes kept, or, where the step would refuse one (an fp32 checkpoint resumed with bf16 params),
    PyTorch's cast to the params' dtype, as the resume does unpatched (the framework passes no ``cast``)."""
    _load(optimizer, state_dict, None, "live", True, None, as_torch=True)  # (load_state_dict's defaults)


def can_load(optimizer: Any) -> bool:
    """Whether :func:`load_state_dict` can load into ``optimizer`` (an optimizer, or a wrapper delegating to
    one, whose class does not override ``load_state_dict`` with logic of its own)."""
    try:
        _receiver(optimizer)
    except TypeError:
        return False
    return True


def refused_for_wide_entries(optimizer: Any, state_dict: Any) -> bool:
    """Whether :func:`load_state_dict` refuses ``state_dict`` only for its optimizer-wide entries (a hand-added one
    in a torch.optim class's state), which torch's load keeps: a framework's resume of it stays the framework's own."""
    receiver = _receiver(optimizer)

    def wide(sd: Any) -> list[Any] | None:  # the entries the load's validator calls optimizer-wide; None: valid
        staging = Staging(receiver, "", sd, flags="live", cast=None, copy=True, device=None, what="")
        try:
            staging.validate_structure()
        except (TypeError, ValueError):
            return staging.wide
        return None

    found = wide(state_dict)
    if not found:
        return False
    states = state_dict["state"]
    return wide({**state_dict, "state": {k: v for k, v in states.items() if k not in found}}) is None


def _receiver(optimizer: Any) -> torch.optim.Optimizer:
    """The ``torch.optim.Optimizer`` whose state is loaded: ``optimizer`` itself, or the optimizer that a
    delegating wrapper (Accelerate's ``AcceleratedOptimizer``, Lightning's ``LightningOptimizer``) wraps."""
    *wrappers, optimizer = wrapping(optimizer)
    for wrapper in wrappers:  # (a wrapper's own load, TRAC's: what it adds would be skipped)
        override = _override_name(type(wrapper)) if isinstance(wrapper, torch.optim.Optimizer) else None
        if override is not None and override not in _EQUIVALENT_OVERRIDES | _DELEGATING_OVERRIDES:
            raise _skipped(wrapper, f"wraps {type(optimizer).__name__} and overrides", override)
    if isinstance(optimizer, torch.optim.Optimizer):
        override = _override_name(type(optimizer))
        if override is None or override in _EQUIVALENT_OVERRIDES:
            return optimizer
        raise _skipped(optimizer, "overrides", override)
    raise TypeError(
        f"load_state_dict: optimizer must be a torch.optim.Optimizer (or a wrapper delegating to one), got "
        f"{type(optimizer).__name__}"
    )


def _skipped(obj: Any, does: str, override: str) -> TypeError:
    """The refusal of an ``obj`` whose class ``does`` ("overrides") ``load_state_dict`` with logic of its own."""
    name = type(obj).__name__
    return TypeError(
        f"{name}: load_state_dict: {name} {does} load_state_dict ({override}); optimshift.load_state_dict reproduces "
        f"torch.optim.Optimizer.load_state_dict and would skip that logic. Call optimizer.load_state_dict(state_dict), "
        f"then optimshift.move(optimizer) to place the state."
    )


def _check_class(given: Any, optimizer: Any, recorded: Mapping[str, Any], label: str) -> None:
    """The class the file recorded is the receiving ``optimizer``'s, or a wrapper's it was ``given`` through (a
    file saved from a wrapper an older optimshift did not unwrap)."""
    qualname = recorded.get("class")
    module = recorded.get("module", "")
    if not isinstance(qualname, str):
        return
    cls = type(optimizer)
    if any(type(layer).__qualname__ == qualname for layer in wrapping(given)):
        return
    saved = f"{module}.{qualname}" if module else qualname
    raise ValueError(
        f"{label}: the checkpoint was saved from {with_article(saved)}, not "
        f"{with_article(f'{cls.__module__}.{cls.__qualname__}')}; its state would be misread. Load it into "
        f"{with_article(qualname)}, or pass only its 'state' and 'param_groups' entries to skip this check."
    )


def _extract(state_dict: Any, label: str) -> tuple[Any, Mapping[str, Any] | None]:
    """The optimizer state dict inside ``state_dict`` (itself, or the only one a checkpoint holds) and the
    class optimshift recorded for it."""
    if not isinstance(state_dict, Mapping) or not _files.is_optimizer_state_dict(state_dict):
        # (a checkpoint that is a list or tuple is searched too, as inspect searches it)
        found = _files.find_optimizer_states(state_dict) if isinstance(state_dict, (Mapping, list, tuple)) else []
        if not found and not isinstance(state_dict, Mapping):
            raise TypeError(f"{label}: state_dict must be a dict (or a path), got {type(state_dict).__name__}")
        if not found:
            return state_dict, None  # not recognised: the pre-hooks may still turn it into a state dict
        if len(found) > 1:
            where = ", ".join(f.where for f in found)
            raise ValueError(
                f"{label}: this checkpoint holds {len(found)} optimizer states ({where}); pass the one "
                f"for this optimizer, e.g. checkpoint{found[0].where}"
            )
        state_dict = found[0].state_dict
    meta = state_dict.get(_files.META_KEY)
    return state_dict, meta if isinstance(meta, Mapping) else None


# --- installing ----------------------------------------------------------------------------------------------


def _install(
    optimizer: torch.optim.Optimizer,
    name: str,
    state: defaultdict[Any, Any],
    groups: list[dict[str, Any]],
    *,
    made: Callable[[], AbstractSet[int]] | None = None,
    shared: Mapping[int, int] = MappingProxyType({}),
    in_place: Mapping[torch.device, tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]]] = MappingProxyType({}),
) -> None:
    """Hand the new state to the optimizer as PyTorch does (``__setstate__``) in the engine's commit (put back if it
    raises); each live tensor at the same place adopts the copy made here (``made()``: their ids; None: none was
    made; never the caller's own, which ``copy=False`` installs as they are) and stays the same object, so a
    compiled ``step()`` does not recompile (:func:`pair_places`, ``shared``).
    ``in_place``: by device, (live tensors, checkpoint tensors) the live ones take the values of in the commit."""
    before = dict(optimizer.__dict__)
    # (only copies made here are adopted, their ids asked once a live tensor is found at such a place: a fresh
    # optimizer's groups hold none; none is made when every entry was installed as it is or taken in place)
    ids = functools.cache(made) if made is not None else None
    pairs, places = (
        pair_places(_same_places(optimizer, state, groups), lambda _, new: id(new) in ids(), shared)
        if ids is not None
        else ([], [])
    )

    def set_state() -> None:
        try:
            optimizer.__setstate__({"state": state, "param_groups": groups})
        except BaseException as e:  # (an interrupt too: the optimizer is put back, and the interrupt goes on)
            optimizer.__dict__.clear()
            optimizer.__dict__.update(before)
            if not isinstance(e, Exception):
                raise
            raise ValueError(
                f"{name}: load_state_dict: {type(optimizer).__name__}.__setstate__ rejected the loaded state "
                f"({type(e).__name__}: {e}); the optimizer is unchanged"
            ) from e

    copies = _engine.Copies([], pairs, Batch([]), in_place=in_place)
    _engine.commit(optimizer, copies, rewrite=set_state, installed=places)


def _same_places(
    optimizer: torch.optim.Optimizer, state: Mapping[Any, Any], groups: list[dict[str, Any]]
) -> list[tuple[dict[Any, Any], dict[Any, Any]]]:
    """(live holder, new holder) for each param's state dict and each param group present in both."""
    pairs: list[tuple[dict[Any, Any], dict[Any, Any]]] = []
    live = optimizer.state
    for p, fresh in state.items() if live else ():  # (a fresh optimizer: no state to pair)
        if isinstance(p, torch.Tensor) and isinstance(fresh, dict):
            old = live.get(p)
            if isinstance(old, dict) and old:
                pairs.append((old, fresh))
    pairs.extend(zip(optimizer.param_groups, groups))
    return pairs
