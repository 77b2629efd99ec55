"""DeepSpeed: ZeRO-1/2 ``offload_states``/``reload_states`` by the rule, on optimshift's host pool.

One line, in every process that builds a DeepSpeed engine (``patch()``/``unpatch()`` do it by hand; importing
:mod:`optimshift` alone never imports DeepSpeed)::

    import optimshift.integrations.deepspeed   # patches at once when deepspeed is importable

In ``deepspeed.runtime.zero.stage_1_and_2`` (what ``engine.offload_states()``/``reload_states()`` call): the
optimizer state goes through :func:`optimshift.offload`/:func:`optimshift.reload` of the inner torch optimizer (a
``non_blocking=True`` reload is left in flight: the step waits for it on the device); for the fp32 master
partitions and bf16/fp16 flat params (``pin_memory=True``) DeepSpeed is handed pool buffers as its
``hp_params_pin_buffers``/``lp_params_pin_buffers``, which its own code fills as always and which go back to the
pool at the reload. ``lp_grads``, ``pin_memory=False``, ZeRO-Offload, ZeRO-3 and an inner optimizer optimshift cannot
place stay DeepSpeed's (one log line each; a streamed one's state stays on the host); functions that differ from
the ones this patch knows are left unpatched with a warning (:func:`unknown_functions`).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import inspect
import logging
import threading
from collections.abc import Callable, Iterable
from typing import Any

import torch

from .. import _session, api
from .._device_streams import host_pinning
from .._engine import _current_stream_event, uninterrupted
from .._plan import check_optimizer
from .._state import leaves, rebuild
from ..pool import host_pool
from ._common import NAMES_ONLY, Swap, bound_swaps, held, importable, patch_of, placeable, reload_to, streamed, warn

__all__ = ["patch", "unpatch", "is_patched", "patched_functions", "unknown_functions"]

_FUNCTIONS = "deepspeed.runtime.zero.offload_states"
_STAGE_1_AND_2 = "deepspeed.runtime.zero.stage_1_and_2"
_STAGE_3 = "deepspeed.runtime.zero.stage3"
_NAMES_ONLY = (*NAMES_ONLY, "__doc__")

_log = logging.getLogger("optimshift")
_patch = patch_of(__name__, rebound=True)
_within = threading.local()  # .left: inside a ZeRO optimizer's call left to DeepSpeed (its line is logged)

# What this patch relies on in each DeepSpeed function: its parameters, and the names its code reads (the
# buffer attributes it hands over, the functions it calls). A DeepSpeed whose function differs is left alone.
_HANDED_OVER = frozenset(
    {"hp_params_pin_buffers", "lp_params_pin_buffers", "single_partition_of_fp32_groups", "bit16_groups_flat"}
)
_KNOWN: dict[str, tuple[tuple[str, ...], frozenset[str]]] = {
    "offload_optimizer_states": (("optimizer", "device", "pin_memory", "non_blocking"), frozenset({"state"})),
    "reload_optimizer_states": (("optimizer", "device", "non_blocking"), frozenset({"state"})),
    "DeepSpeedZeroOptimizer.offload_states": (
        ("self", "include", "device", "pin_memory", "non_blocking"),
        _HANDED_OVER | {"offloaded_states", "offload_optimizer_states"},
    ),
    "DeepSpeedZeroOptimizer.reload_states": (
        ("self", "non_blocking"),
        _HANDED_OVER | {"offloaded_states", "reload_optimizer_states"},
    ),
    "DeepSpeedZeroOptimizer.state_dict": (("self",), frozenset({"single_partition_of_fp32_groups"})),
}
# The buffers DeepSpeed's offload_states creates when they are missing, and the tensors they mirror.
_BUFFERS = {"hp_params": ("hp_params_pin_buffers", "single_partition_of_fp32_groups"),
            "lp_params": ("lp_params_pin_buffers", "bit16_groups_flat")}  # fmt: skip


# --- what optimshift keeps on a DeepSpeed optimizer -----------------------------------------------------------


def _held(zero: Any) -> dict[str, list[torch.Tensor]]:
    """The pool buffers a ZeRO-1/2 optimizer's offloaded partitions live in, per kind (kept in its session); empty
    for one that cannot have a session, to which none is handed (DeepSpeed pins its own)."""
    session = _session.get(zero)
    return {} if session is None else session.pooled


_logged: set[tuple[str, str]] = set()  # (class name, reason): each logged once per process; no object held


def _leave_alone(owner: Any, why: str) -> None:
    """One INFO line per kind of optimizer left to DeepSpeed, with the reason (none within a left-alone call)."""
    if getattr(_within, "left", False):
        return
    key = (type(owner).__name__, why)
    if key not in _logged:
        _logged.add(key)
        _log.info("optimshift.integrations.deepspeed: %s left as DeepSpeed made it: %s", key[0], why)


def _why_not_inner(optimizer: Any) -> str | None:
    """Why optimshift does not place this (inner, torch) optimizer's state, or None when it does ("left": inside a
    ZeRO optimizer's call left to DeepSpeed, whose line is logged)."""
    if getattr(_within, "left", False):
        return "left"
    if held(optimizer):
        return None  # (whatever its state now: optimshift's error where it cannot place it)
    if type(optimizer).__name__ == "DeepSpeedCPUAdam":
        return "a DeepSpeedCPUAdam keeps its state on the host (ZeRO-Offload)"
    try:
        check_optimizer(optimizer)
    except TypeError:
        return "its optimizer is not a torch optimizer optimshift can place"
    if not placeable(optimizer):
        return "its optimizer's state is not one dict of tensors per param"
    return None


def _why_not_zero(zero: Any) -> str | None:
    """Why a ZeRO-1/2 optimizer's offload is left to DeepSpeed, or None."""
    if getattr(zero, "cpu_offload", False):
        return "ZeRO-Offload (offload_optimizer on the host): its state and fp32 partitions live on the host"
    return _why_not_inner(getattr(zero, "optimizer", None))


# --- the replacements: optimizer state ------------------------------------------------------------------------


def _make_offload_optimizer_states(original: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(original, assigned=NAMES_ONLY)
    @torch.no_grad()
    def offload_optimizer_states(
        optimizer: Any, device: Any, pin_memory: bool = False, non_blocking: bool = False
    ) -> None:
        """optimshift's replacement (see optimshift.integrations.deepspeed): every state tensor to the host pool."""
        why = _why_not_inner(optimizer)
        if why is not None or str(device) != "cpu":
            if why is not None:
                _leave_alone(optimizer, why)  # (silent within a left-alone ZeRO call)
            original(optimizer, device, pin_memory=pin_memory, non_blocking=non_blocking)
            return
        if optimizer.state and not streamed(optimizer):  # (a streamed optimizer's state lives on the host)
            api.offload(optimizer, pin_memory=pin_memory, non_blocking=non_blocking)  # type: ignore[call-overload]

    return offload_optimizer_states


def _reload(optimizer: Any, device: Any, non_blocking: bool) -> None:
    if optimizer.state and not streamed(optimizer):  # (a streamed optimizer's state stays on the host)
        reload_to(optimizer, device, what="DeepSpeed's device", non_blocking=non_blocking)


def _make_reload_optimizer_states(original: Callable[..., list[Any]]) -> Callable[..., list[Any]]:
    @functools.wraps(original, assigned=NAMES_ONLY)
    @torch.no_grad()
    def reload_optimizer_states(optimizer: Any, device: Any, non_blocking: bool = False) -> list[Any]:
        """optimshift's replacement (see optimshift.integrations.deepspeed): every state tensor back where it was."""
        why = _why_not_inner(optimizer)
        if why is not None:
            _leave_alone(optimizer, why)
            return original(optimizer, device, non_blocking=non_blocking)
        _reload(optimizer, device, non_blocking)
        return []  # no host buffer to keep alive: the pool holds them until the copies are done

    return reload_optimizer_states


# --- the replacements: the ZeRO-1/2 optimizer's methods -------------------------------------------------------


def _pooled_like(tensor: torch.Tensor, pinned: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A pool buffer and a host tensor shaped like ``tensor`` at its start (DeepSpeed's ``pin_empty_like``)."""
    nbytes = tensor.numel() * tensor.element_size()
    raw = host_pool.acquire(nbytes, pinned=pinned)
    return raw, raw[:nbytes].view(tensor.dtype).view(tensor.shape)


def _hand_over(zero: Any, kind: str, held: dict[str, list[torch.Tensor]]) -> None:
    """Give DeepSpeed's offload pool buffers for one kind of partition (where they are missing it pins new ones)."""
    attribute, sources = _BUFFERS[kind]
    if hasattr(zero, attribute) or kind in held:
        return
    tensors = list(getattr(zero, sources))
    if not all(isinstance(t, torch.Tensor) and t.is_contiguous() for t in tensors):
        return  # DeepSpeed's own buffers
    pin_type = host_pinning()
    raws, views = [], []
    try:
        for t in tensors:
            raw, view = _pooled_like(t, pinned=pin_type is not None and t.device.type == pin_type)
            raws.append(raw)
            views.append(view)
    except BaseException:
        for raw in raws:
            host_pool.release(raw)
        raise
    held[kind] = raws
    setattr(zero, attribute, views)


def _own_on_host(zero: Any, held: dict[str, list[torch.Tensor]], target: str) -> None:
    """Where DeepSpeed reloads onto the host (its CPU accelerator: ``.to("cpu")`` moves nothing), copy each
    partition out of its pool buffer first, so that the buffer can go back to the pool."""
    if torch.device(target).type != "cpu":
        return
    for kind, raws in held.items():
        pooled = {raw.untyped_storage().data_ptr() for raw in raws}
        for t in getattr(zero, _BUFFERS[kind][1]):
            if t.device.type == "cpu" and t.untyped_storage().data_ptr() in pooled:
                t.data = t.data.clone()


def _give_back(zero: Any, held: dict[str, list[torch.Tensor]], event: Any | None = None) -> None:
    """Return the pool buffers of every kind DeepSpeed reloaded (its reload waited for the copies reading them;
    ``event``: one that failed may not have, and they are reused after it)."""
    offloaded = {getattr(s, "name", str(s)) for s in getattr(zero, "offloaded_states", ())}
    for kind in [k for k in held if k not in offloaded]:
        attribute = _BUFFERS[kind][0]
        if hasattr(zero, attribute):
            continue  # still DeepSpeed's to use
        for raw in held.pop(kind):
            host_pool.release(raw, event)


def _left_to_deepspeed(original: Callable[..., None], zero: Any, **kwargs: Any) -> None:
    """DeepSpeed's own method, its optimizer-state functions included (as shipped, for this call)."""
    _within.left = True  # (per thread: the functions below it see it)
    try:
        original(zero, **kwargs)
    finally:
        _within.left = False


def _make_offload_states(original: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(original, assigned=_NAMES_ONLY)
    def offload_states(
        self: Any, include: Any = None, device: Any = None, pin_memory: bool = True, non_blocking: bool = False
    ) -> None:
        args: dict[str, Any] = {"include": include, "pin_memory": pin_memory, "non_blocking": non_blocking}
        if device is not None:
            args["device"] = device
        why = _why_not_zero(self)
        if why is not None:
            _leave_alone(self, why)
            return _left_to_deepspeed(original, self, **args)
        held = _held(self)
        if pin_memory and _session.of(self) is not None:
            offloaded = {getattr(s, "name", str(s)) for s in getattr(self, "offloaded_states", ())}
            wanted = None if include is None else {getattr(s, "name", str(s)) for s in include}
            for kind in _BUFFERS:
                if kind not in offloaded and (wanted is None or kind in wanted):
                    _hand_over(self, kind, held)
        return original(self, **args)

    return offload_states


def _make_reload_states(original: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(original, assigned=_NAMES_ONLY)
    def reload_states(self: Any, non_blocking: bool = False) -> None:
        why = _why_not_zero(self)
        if why is not None:
            _leave_alone(self, why)
            return _left_to_deepspeed(original, self, non_blocking=non_blocking)
        states: set[Any] = getattr(self, "offloaded_states", set())
        optim = next((s for s in states if getattr(s, "name", None) == "optim_states"), None)
        later = non_blocking and optim is not None
        from deepspeed.accelerator import get_accelerator

        target = get_accelerator().current_device_name()  # where DeepSpeed's reload puts everything
        _own_on_host(self, _held(self), target)  # (first: one that fails leaves DeepSpeed's record as it was)
        if later:
            # DeepSpeed synchronizes the device at the end of a non-blocking reload (its host buffers go then);
            # the optimizer state is reloaded after that, left in flight: the step waits for it on the device.
            states.discard(optim)
        failed = True
        try:
            original(self, non_blocking=non_blocking)
            failed = False
        finally:
            # (a Ctrl-C is held until the buffers went back: one landing before the event was recorded gave them back
            # with none, reused under DeepSpeed's copies; one landing before this section gives nothing back)
            with uninterrupted(to_the_end=False):
                if failed and later:
                    states.add(optim)  # still offloaded: DeepSpeed's record says so again
                # (failed before its closing synchronize: its copies may still read the buffers)
                queued = _current_stream_event([torch.device(target)]) if failed and non_blocking else None
                _give_back(self, _held(self), queued)
        if later:
            try:
                _reload(self.optimizer, target, non_blocking=True)
            except BaseException:
                states.add(optim)  # (still offloaded, as optimshift's record says: a retry reloads it)
                raise

    return reload_states


def _make_state_dict(original: Callable[..., dict[str, Any]]) -> Callable[..., dict[str, Any]]:
    @functools.wraps(original, assigned=_NAMES_ONLY)
    def state_dict(self: Any) -> dict[str, Any]:
        inner = getattr(self, "optimizer", None)
        if inner is not None and _why_not_inner(inner) is None:
            api.wait(inner)  # DeepSpeed reads the inner state directly (elastic checkpoints)
        held = _held(self)
        if held:
            from deepspeed.accelerator import get_accelerator

            # DeepSpeed's non-blocking offload may still be copying into the buffers: the host reads them below
            get_accelerator().synchronize()
        result = original(self)
        if not held:
            return result
        # Partitions offloaded into pool buffers: each saved tensor gets its own bytes (torch.save writes a
        # view's whole storage: a pool buffer holds more than the tensor).
        pooled = host_pool.in_use_storages()
        inside = [t for _, t in leaves(result) if t.untyped_storage().data_ptr() in pooled]
        if not inside:
            return result
        setters: list[Callable[[], None]] = []
        new = rebuild(result, {id(t): t.clone() for t in inside}, setters, {})
        for setter in setters:  # the containers are the ones state_dict() just built
            setter()
        return new  # type: ignore[no-any-return]

    return state_dict


def _make_left_alone(original: Callable[..., None], why: str) -> Callable[..., None]:
    @functools.wraps(original, assigned=_NAMES_ONLY)
    def offload_states(self: Any, *args: Any, **kwargs: Any) -> None:
        _leave_alone(self, why)
        return original(self, *args, **kwargs)

    return offload_states


# --- finding and swapping -------------------------------------------------------------------------------------


def _differs(name: str, function: Any) -> str | None:
    """How ``function`` (None: missing) differs from the DeepSpeed function this patch knows by ``name``, or None."""
    if function is None:
        return "missing"
    parameters, reads = _KNOWN[name]
    code = getattr(function, "__code__", None)
    if code is None:
        return "not a Python function"
    try:
        found = tuple(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        return "no signature"
    if found != parameters:
        return f"parameters {found}, not {parameters}"
    missing = sorted(reads - set(code.co_names))
    return f"no longer reads {', '.join(missing)}" if missing else None


_unknown: list[str] = []


def _differing(module: str, owner: Any, prefix: str, names: Iterable[str]) -> list[str]:
    """``module.prefix+name (how)`` of each of ``owner``'s ``names`` that differs from the one this patch knows."""
    found = [(name, _differs(prefix + name, owner.__dict__.get(name))) for name in names]
    return [f"{module}.{prefix}{name} ({why})" for name, why in found if why is not None]


def _plan_swaps() -> list[Swap]:
    try:
        functions = importlib.import_module(_FUNCTIONS)
        stage12 = importlib.import_module(_STAGE_1_AND_2)
    except ImportError as e:
        raise ImportError(
            f"optimshift.integrations.deepspeed.patch() needs deepspeed: pip install 'optimshift[deepspeed]' ({e})"
        ) from e
    stage3 = None
    with contextlib.suppress(ImportError):
        stage3 = importlib.import_module(_STAGE_3)
    swaps: list[Swap] = []
    makers: dict[str, Callable[[Any], Any]] = {
        "offload_optimizer_states": _make_offload_optimizer_states,
        "reload_optimizer_states": _make_reload_optimizer_states,
    }
    unknown = _differing(_FUNCTIONS, functions, "", makers)
    if not unknown:  # (in every DeepSpeed module holding them by name: stage_1_and_2 imports both)
        pairs = [(functions.__dict__[name], make(functions.__dict__[name])) for name, make in makers.items()]
        swaps += bound_swaps(pairs, [functions], ("deepspeed",))
    zero = stage12.DeepSpeedZeroOptimizer
    methods: dict[str, Callable[[Any], Any]] = {
        "offload_states": _make_offload_states,
        "reload_states": _make_reload_states,
        "state_dict": _make_state_dict,
    }
    differing = _differing(_STAGE_1_AND_2, zero, "DeepSpeedZeroOptimizer.", methods)
    unknown += differing
    if not differing:
        for name, make in methods.items():
            original = zero.__dict__[name]
            swaps.append(Swap(zero, name, original, make(original)))
    if stage3 is not None:
        cls = getattr(stage3, "DeepSpeedZeroOptimizer_Stage3", None)
        original = cls.__dict__.get("offload_states") if cls is not None else None
        if callable(original):
            why = "ZeRO-3's offload_adam_states keeps a persistent host buffer and leaves step alone"
            swaps.append(Swap(cls, "offload_states", original, _make_left_alone(original, why)))
    _unknown[:] = unknown
    return swaps


def unknown_functions() -> list[str]:
    """The DeepSpeed functions the last :func:`patch` left alone: they differ from the ones it knows."""
    return list(_unknown)


patched_functions = _patch.names  # (``module.name`` of every function replaced)


def patch() -> None:
    """Make DeepSpeed's ZeRO-1/2 ``offload_states``/``reload_states`` go through optimshift (see the module doc);
    again: a no-op. Raises ImportError without deepspeed; warns about (and leaves) functions it does not know."""
    if _patch.applied():
        return
    _patch.apply(_plan_swaps)
    if _unknown:
        warn(
            f"optimshift.integrations.deepspeed: this deepspeed's {'; '.join(_unknown)} differ from the functions "
            f"optimshift knows; left as DeepSpeed made them"
        )


unpatch = _patch.undo  # (restores the framework's own functions; a no-op when not patched)
is_patched = _patch.applied


# Importing this module is the way in: patch at once when deepspeed is there.
if importable("deepspeed"):
    patch()
