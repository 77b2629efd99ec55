"""Where each optimizer state entry belongs: where a freshly built optimizer of the same class and flags, over the
same params on the target device, would put it after a step (a move never changes a dtype: only *which device*).

For ``torch.optim`` classes the installed torch is observed by ``_probe`` (one step over a fake ``cuda:0`` param, no
GPU needed), else a static table of torch 2.4-2.13's rules answers. Non-scalar state follows its param; a group's own
tensor (tensor ``lr``, ``betas``) goes to the host if the step reads it there, else stays on the side it was given
on (torch never moves them). Third-party classes: :func:`register_policy`, else probed as torch's are (where the class
can be built from a param and the group's hyperparameters), else a safe default rule, which :func:`optimshift.check`
reports, with why.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, cast

import torch

from ._devices import HOST, HOSTS, resolve
from ._errors import add_note
from ._probe import (  # noqa: F401 (quiet_global_step_hooks: re-exported)
    HOST_READ,
    NEEDS_DEVICE,
    Observed,
    probe,
    quiet_global_step_hooks,
    torch_defined,
    unprobed,
)
from ._state import OPTIMIZER_WIDE, Path, group_device, label_in, param_positions

__all__ = [
    "Policy",
    "register_policy",
    "unregister_policy",
    "Decision",
    "decide",
    "HOST",
    "builtin_base",
    "separable",
    "step_of",
    "same_step",
    "stepping_base",
    "Placer",
    "why_guessed",
]


class Policy(Protocol):
    """Where one state entry of a third-party optimizer belongs.

    Called as ``policy(key, value, param, group, device)``:

    - ``key``: the top-level state key (``"step"``, ``"exp_avg"``, …) or, for a tensor kept in a param group,
      the group key (``"lr"``);
    - ``value``: the tensor itself (for containers, each tensor inside is asked about separately);
    - ``param``: the parameter the state belongs to, or ``None`` for a param-group entry and for an
      optimizer-wide one (``optimizer.state["k"]``, asked with the first group);
    - ``group``: the param group dict (read its flags, e.g. ``group.get("fused")``);
    - ``device``: where the param is going (or is, for ``move(opt)`` without a device).

    Return the device the tensor must live on (a ``torch.device`` or a string; anything else is refused), or
    ``None`` to fall back to the built-in rule; ``meta`` for an entry holding values whose param goes elsewhere is
    refused (the values would be lost). It must not mutate anything.
    """

    def __call__(
        self,
        key: str,
        value: torch.Tensor,
        param: torch.Tensor | None,
        group: Mapping[str, Any],
        device: torch.device,
    ) -> torch.device | None: ...


@dataclass(frozen=True)
class Decision:
    """Where one tensor belongs and how that was decided (``source``: registered, probe, table, default)."""

    device: torch.device
    source: str


_registry: dict[type, Policy] = {}
_separable: dict[type, bool] = {}
_lock = threading.Lock()
_generation = [0]  # bumped by every (un)registration: a plan cached before it is stale (see _plan.py)


def generation() -> int:
    """A counter that changes whenever a policy is registered or removed."""
    return _generation[0]


def register_policy(optimizer_class: type, policy: Policy, *, separable: bool = False) -> None:
    """Tell optimshift where the state of ``optimizer_class`` (and its subclasses) belongs.

    ``policy(key, value, param, group, device) -> torch.device | None``; see :class:`Policy` (a policy that
    always returns ``None`` keeps the built-in rules). ``separable=True`` declares that its ``step()`` updates
    each param from that param's grad and state alone, so that :func:`optimshift.stream` may step it a chunk of
    params at a time.
    """
    _check_class(optimizer_class, "register_policy")
    if not callable(policy):
        raise TypeError(f"register_policy: policy for {optimizer_class.__name__} must be callable, got {policy!r}")
    if not isinstance(separable, bool):
        raise TypeError(f"register_policy: separable for {optimizer_class.__name__} must be a bool, got {separable!r}")
    with _lock:
        _registry[optimizer_class] = policy
        _separable[optimizer_class] = separable
        _generation[0] += 1


def _check_class(optimizer_class: Any, what: str) -> None:
    """TypeError unless ``optimizer_class`` is an optimizer class (an instance was registered, or left registered)."""
    if not isinstance(optimizer_class, type) or not issubclass(optimizer_class, torch.optim.Optimizer):
        raise TypeError(f"{what} expects a torch.optim.Optimizer subclass, got {optimizer_class!r}")


def registered_policy(optimizer_class: type) -> Policy | None:
    """The policy registered for exactly ``optimizer_class`` (not a base class's), or None."""
    return _registry.get(optimizer_class)


def unregister_policy(optimizer_class: type) -> None:
    """Remove a policy registered with :func:`register_policy` (a no-op if there is none; TypeError for what is no
    optimizer class, such as an optimizer: its class's policy would stay, silently)."""
    _check_class(optimizer_class, "unregister_policy")
    with _lock:
        _registry.pop(optimizer_class, None)
        _separable.pop(optimizer_class, None)
        _generation[0] += 1


# torch.optim classes whose step is not a per-param update: LBFGS flattens every grad into one vector, keeps
# its history over all params at once and runs one line search over all of them.
_NOT_SEPARABLE = ("LBFGS",)


def separable(optimizer_class: type) -> tuple[bool, str]:
    """Whether ``optimizer_class.step()`` updates each param from its own grad and state alone (what stepping
    a chunk of params at a time needs), and why: ``"registered"`` (:func:`register_policy` said so, for the
    nearest registered class in the MRO), ``"torch.optim"``, ``"not separable"`` (LBFGS), ``"overrides step"``
    (a subclass of a torch.optim class with its own ``step``: it may read other params), ``"unknown"``."""
    for base in optimizer_class.__mro__:
        if base in _registry:
            return _separable.get(base, False), "registered"
    torch_base = builtin_base(optimizer_class)
    if torch_base is None:
        return False, "unknown"
    if torch_base.__name__ in _NOT_SEPARABLE:
        return False, "not separable"
    if not same_step(optimizer_class, torch_base):
        return False, "overrides step"
    return True, "torch.optim"


# NOTE: torch's hook wrapper is told by its code: its ``hooked`` mark is no proof, as ``functools.wraps`` copies it
# (and ``__wrapped__``) onto any function that wraps a hooked step.
_HOOK_WRAPPER = torch.optim.Optimizer.profile_hook_step(lambda *args, **kwargs: None).__code__


def step_of(cls: type) -> Callable[..., Any]:
    """The step function instances of ``cls`` run (its own or inherited), without the hook wrapper that
    ``torch.optim.Optimizer`` puts on the class of its first instance (``_patch_step_function``). Only that comes off:
    ``_use_grad_for_differentiable`` stays (calling the step needs it), and a step that wraps another is its own."""
    fn: Any = getattr(cls, "step")  # noqa: B009  (typed: a class, not an Optimizer)
    while getattr(fn, "__code__", None) is _HOOK_WRAPPER:
        fn = fn.__wrapped__
    return cast("Callable[..., Any]", fn)


def stepping_base(cls: type) -> type[torch.optim.Optimizer] | None:
    """The torch.optim class whose own step ``cls`` steps with (its nearest torch.optim base, where ``cls`` does
    not step otherwise); None for a class with a step of its own, or with no torch.optim base: the one answer to
    "which step does this class have" that placement, a load's checks, the dtype trials and ``check`` ask."""
    base = builtin_base(cls)
    return base if base is not None and same_step(cls, base) else None


def same_step(cls: type, base: type) -> bool:
    """Whether ``cls`` steps with ``base``'s step (a subclass that does not override it, or whose override is
    ``base``'s own function)."""
    return step_of(cls) is step_of(base)


# --- built-in rules -------------------------------------------------------------------------------------

# Fallback table (torch 2.4-2.13) used when the probe cannot run: for each class, the 0-dim scalar keys and
# the group flags that put them on the param's device ("always" = always there, () = never).
_ALWAYS = ("always",)
# NOTE: LBFGS's `t` (a tensor only with a tensor lr) is where its values put it: min(1, 1/|g|_1) * lr in the first
# iteration is a device tensor when the min picks the tensor and a new host tensor when it picks 1.0; later it is
# lr itself (the group's tensor, see plan._share). A fresh LBFGS may hold it on either side: it stays on its own.
_EITHER = ("either",)
_TABLE: dict[str, dict[str, tuple[str, ...]]] = {
    "Adam": {"step": ("fused", "capturable")},
    "AdamW": {"step": ("fused", "capturable")},
    "Adagrad": {"step": ("fused",)},
    "Adadelta": {"step": ("capturable",)},
    "Adamax": {"step": ("capturable",)},
    "RAdam": {"step": ("capturable",)},
    "RMSprop": {"step": ("capturable",)},
    "Rprop": {"step": ("capturable",)},
    "NAdam": {"step": ("capturable",), "mu_product": ("capturable",)},
    "ASGD": {"step": _ALWAYS, "eta": _ALWAYS, "mu": _ALWAYS},
    "Adafactor": {"step": ()},
    "LBFGS": {"t": _EITHER},
    # (a clone of the grad; a probe of fused=True cannot run: aten._fused_sgd_ has no fake kernel)
    "SGD": {"momentum_buffer": _ALWAYS},
}


def builtin_base(cls: type) -> type[torch.optim.Optimizer] | None:
    """The nearest class in ``cls``'s MRO that torch.optim defines (``None`` if there is none)."""
    for base in cls.__mro__:
        if base is torch.optim.Optimizer:
            return None
        if torch_defined(base):
            return cast("type[torch.optim.Optimizer]", base)  # (torch.optim's classes below Optimizer)
    return None


def _table_rule(base: type, group: Mapping[str, Any], key: str, value: torch.Tensor) -> bool | None:
    """Whether the table puts ``key`` on the param's device (``None``: it has no rule for it)."""
    flags = _TABLE.get(base.__name__, {}).get(key)
    if flags is None:
        return None
    if flags == _ALWAYS:
        return True
    if flags == _EITHER:
        return value.device.type != "cpu"
    return any(bool(group.get(flag)) for flag in flags)


_NO_DEFAULT_FOREACH = frozenset({"Adafactor", "Muon", "LBFGS", "SparseAdam"})
"""torch.optim classes whose ``foreach=None`` runs the single-tensor step (or which have no foreach one)."""


def default_foreach(params: Sequence[Any]) -> bool:
    """Whether torch's default (``_default_to_fused_or_foreach``) picks the foreach step for a group of ``params``:
    every one a plain Tensor or Parameter (or a DTensor) on an accelerator torch has foreach kernels for. A group
    with a param on the host, or of a Tensor subclass of its own, runs the single-tensor step."""
    from torch.optim.optimizer import _default_to_fused_or_foreach

    return bool(_default_to_fused_or_foreach(list(params), False, use_fused=False)[1])


def runs_foreach(name: str, foreach: bool | None, on_device: bool, hyper: Mapping[str, Any] | None = None) -> bool:
    """Whether a step of torch.optim class ``name`` runs its foreach implementation: ``foreach`` as given, else as
    torch picks it: ``on_device`` (:func:`default_foreach`'s answer for the group's params; for a saved group, whether
    they are on an accelerator), never under ``differentiable`` or a given ``fused`` (False too), nor for a class whose
    default is single-tensor (:data:`_NO_DEFAULT_FOREACH`: Adafactor, Muon, LBFGS, SparseAdam) or Adam/AdamW given a
    tensor ``lr`` without ``capturable`` (``hyper``: the group's hyperparameters, where known)."""
    if foreach is not None:
        return bool(foreach)
    hyper = hyper or {}
    if not on_device or hyper.get("differentiable") or hyper.get("fused") is not None or name in _NO_DEFAULT_FOREACH:
        return False
    return not (name in ("Adam", "AdamW") and isinstance(hyper.get("lr"), torch.Tensor) and not hyper.get("capturable"))


_LOW_PRECISION = (torch.bfloat16, torch.float16)  # (a host scalar torch keeps is never one of these)


def _may_refuse_on_host(cls: type, group: Mapping[str, Any], value: torch.Tensor, device: torch.device) -> bool:
    """Whether a step of ``cls`` may refuse scalar ``value`` on the host beside its param on ``device``: a foreach
    step groups a param's tensors by device and dtype, a float32/float64 host scalar excepted. It may run where
    torch picks it (:func:`runs_foreach`, for plain params on that device), and always for a step of its own."""
    from torch.utils._foreach_utils import _get_foreach_kernels_supported_devices

    if value.dtype not in _LOW_PRECISION or device.type in HOSTS:
        return False
    base = stepping_base(cls)
    if base is None:
        return True
    on_device = device.type in _get_foreach_kernels_supported_devices()
    return runs_foreach(base.__name__, group.get("foreach"), on_device, group)


def foreach_refuses_on_host(cls: type, group: Mapping[str, Any], value: torch.Tensor, device: torch.device) -> bool:
    """:func:`_may_refuse_on_host` for a class stepping with a torch.optim class's step (its foreach step does)."""
    return stepping_base(cls) is not None and _may_refuse_on_host(cls, group, value, device)


def decide(
    optimizer: torch.optim.Optimizer,
    group: Mapping[str, Any],
    param: torch.Tensor | None,
    key: str,
    value: torch.Tensor,
    device: torch.device,
    *,
    side: torch.device | None = None,
    values: bool = True,
    wide: Path | None = None,
) -> Decision:
    """Where ``value`` (state ``key`` of ``param``, or group entry ``key`` when ``param`` is None) belongs
    when the param is on ``device``. ``side``: for a group entry that optimshift took to the host, where it was
    given (a group tensor stays on its side: see ``_group_entry``). ``values=False``: asked about stand-ins whose
    values go nowhere (``inspect``'s), where a registered policy may answer meta. ``wide``: the path of an entry the
    optimizer keeps under a plain state key (``param`` None, ``group`` its first group)."""
    cls = type(optimizer)
    for base in cls.__mro__:
        policy = _registry.get(base)
        if policy is not None:
            try:
                answer = policy(key, value, param, group, device)
            except Exception as e:  # (its type kept, an interrupt untouched; nothing changed: operations plan first)
                add_note(
                    e,
                    f"{cls.__name__}: raised by the policy registered for {base.__name__}, asked where "
                    f"{_entry_label(optimizer, group, param, key)} goes; nothing was changed",
                )
                raise
            if answer is not None:
                try:
                    answer = _answered(answer, device, value)
                except (TypeError, ValueError) as e:  # (named here, where an answer is refused: the entry found then)
                    raise type(e)(
                        f"{cls.__name__}: the policy registered for {base.__name__}, asked where "
                        f"{_entry_label(optimizer, group, param, key)} goes: {e}; nothing was changed"
                    ) from None
                if values and answer.type == "meta" and device.type != "meta" and value.device.type != "meta":
                    # (the built-in rule puts state on meta only with its param: every value would be lost)
                    raise ValueError(
                        f"{cls.__name__}: the policy registered for {base.__name__} placed "
                        f"{_entry_label(optimizer, group, param, key)} on meta, for "
                        f"params bound for {device}: meta holds no values, so every one of them would be lost. Have "
                        f"the policy return the device it is given (or None for the default rule); nothing was changed"
                    )
                return Decision(answer, "registered")
            break
    if wide is not None:
        return _wide_entry(cls, group, wide, value, device)
    if param is None:
        return _group_entry(cls, group, key, value, device, value.device if side is None else side)
    # Tensors of several elements always live with their param (every torch.optim class, and the only sane
    # default); one of one element only where no probe or table keeps the entry as a scalar (a checkpoint's
    # step of shape (1,): on the host, as torch keeps it, each read is no sync).
    scalar = value.dim() == 0
    if not scalar and value.numel() != 1:
        return Decision(device, "rule")
    torch_base = builtin_base(cls)
    observed = probed_by(cls, group, param.dim())[1]
    probed = None if observed is None else observed.state
    # A low-precision scalar (torch's load casts NAdam's mu_product to bf16 params' dtype) follows its param where a
    # foreach step may refuse it on the host; the single-tensor step reads it there with no sync (on the device: one).
    hostable = not _may_refuse_on_host(cls, group, value, device)
    if probed is not None and key in probed:
        return Decision(device if probed[key] or not hostable else HOST, "probe")
    if torch_base is not None:
        tabled = _table_rule(torch_base, group, key, value)
        if tabled is not None:
            return Decision(device if tabled or not hostable else HOST, "table")
        if probed is not None:
            # The probe ran and this class keeps no such scalar after a step: follow the param, as
            # torch.optim does for every tensor it does not deliberately host.
            return Decision(device, "rule")
    if not scalar:
        return Decision(device, "rule")
    _warn_guessed(cls, group, param.dim(), key)
    hosted = key == "step" and not (group.get("fused") or group.get("capturable"))
    return Decision(HOST if hosted else device, "default")


def probed_by(cls: type, group: Mapping[str, Any], ndim: int) -> tuple[type, Observed | None]:
    """The class whose throwaway step says where ``cls``'s entries go, and what it observed: ``cls`` itself (a step of
    its own may keep scalars of its own, or read a group tensor on the host), but the base where ``cls`` steps with its
    torch.optim base's step, or cannot be built from the group's hyperparameters, or makes no state there (what it
    keeps of its own is then guessed)."""
    base = builtin_base(cls)
    if stepping_base(cls) is None:
        observed = probe(cls, group, ndim)
        if base is None or observed is not None and observed.state is not None:
            return cls, observed
    assert base is not None  # (a class with a torch base steps with it, or its own probe made no state)
    return base, probe(base, group, ndim)


def why_guessed(cls: type, group: Mapping[str, Any], ndim: int, key: str) -> str:
    """Why :func:`decide` used the default rule for 0-dim state ``key`` of a rank-``ndim`` param in ``group``
    (the probe could not build or run the class, or its step made no such entry)."""
    probed_cls, observed = probed_by(cls, group, ndim)
    failed = unprobed(probed_cls, group, ndim)
    if failed is not None:
        return failed
    if observed is None or observed.state is None:
        error = None if observed is None else observed.error
        return f"a probe step of {probed_cls.__name__} made no state" + (f" ({error})" if error else "")
    return f"a probe step of {probed_cls.__name__} made no 0-dim {key!r}"


_guessed: weakref.WeakSet[type] = weakref.WeakSet()  # (weakly: a class defined at run time may go)


def _warn_guessed(cls: type, group: Mapping[str, Any], ndim: int, key: str) -> None:
    """Say once per class, on the ``optimshift`` logger, that its placement was guessed, and why."""
    if cls in _guessed:
        return
    _guessed.add(cls)
    logging.getLogger("optimshift").warning(
        "no placement rule is known for %s: %s; a 0-dim 'step' stays on the host unless the group is fused or "
        "capturable, everything else follows its param; register one with optimshift.register_policy(%s, policy) "
        "if that is wrong",
        cls.__name__,
        why_guessed(cls, group, ndim, key),
        cls.__name__,
    )


def _answered(answer: Any, device: torch.device, value: torch.Tensor) -> torch.device:
    """A policy's answer as a checked device, its index made explicit: an accelerator of the param's type names
    the param's device, as ``'cuda'`` names the current one for a tensor (``'sim'`` for a param on ``sim:0`` is
    ``sim:0``, never a device that differs from it only by a missing index); any host device is the host. Anything
    but a ``torch.device`` or a string is refused (an int's accelerator type would be a guess)."""
    try:
        parsed = torch.device(answer) if isinstance(answer, str) else answer
    except RuntimeError:  # (resolve says why)
        parsed = answer
    if isinstance(parsed, torch.device) and parsed.index is None and parsed.type in (device.type, "meta"):
        return device if parsed.type == device.type else parsed
    if not isinstance(answer, (str, torch.device)):
        raise TypeError(f"it must return a torch.device, a string such as 'cuda:0' or None, got {answer!r}")
    return resolve(parsed, what="the device it returned,", tensors=(value,))


def _group_entry(
    cls: type, group: Mapping[str, Any], key: str, value: torch.Tensor, device: torch.device, side: torch.device
) -> Decision:
    """Where a tensor kept in a param group (a tensor ``lr``, tensor ``betas``) belongs; ``side``: where it was
    given (its device, unless optimshift took it to the host)."""
    if value.numel() != 1 or builtin_base(cls) is None and value.dim() != 0:
        # (D-Adaptation's running sums, made anew on the params' device by its step: with the params)
        return Decision(device, "rule")
    observed = _group_observed(cls, group)
    verdict = None if observed is None else observed.group.get(_group_path(group, key, value))
    if verdict == HOST_READ:
        return Decision(HOST, "probe")  # the step reads it on the host: on the device each read is a sync
    if verdict == NEEDS_DEVICE:
        return Decision(device, "probe")
    # NOTE: torch never moves a group's tensors: a fresh optimizer keeps them where they were given (on the
    # host in torch's own tests and docs; a CUDA-graph user may give a device lr on purpose). Where the step
    # works alike either way, the tensor stays on its side: on the host, or with the params on their device
    # (also after a move to the host and back, or a reload after the params moved: ``side`` remembers).
    return Decision(HOST if side.type == "cpu" else device, "rule" if observed is None else "probe")


def _group_observed(cls: type, group: Mapping[str, Any]) -> Observed | None:
    """What the probe that judges ``group``'s own tensors saw (over a param of its first param's rank)."""
    first = next((p for p in group.get("params", ()) if isinstance(p, torch.Tensor)), None)
    return probed_by(cls, group, 1 if first is None else first.dim())[1]


def group_read_cost(
    optimizer: torch.optim.Optimizer, group: Mapping[str, Any], key: str, value: torch.Tensor
) -> int | None:
    """Host syncs per step that group tensor ``value`` (under ``key``) costs on an accelerator, where the step
    reads it on the host: what the probe counted, for a step over the group's params a step reached (those with
    state; where none has any, those that take a grad), its once-a-step reads once per (device, dtype) of them, as
    torch's foreach step groups them (and rank class, where the probe saw it group so: Adafactor's); a 0-dim one's
    for a nonzero value, the branches its comparisons decide taken (None where the step does not read it there, or
    the count is not known)."""
    observed = _group_observed(type(optimizer), group)
    path = _group_path(group, key, value)
    if observed is None or observed.group.get(path) != HOST_READ or path not in observed.group_reads:
        return None
    once, per_param, by_rank = observed.group_reads[path]
    params = [p for p in group.get("params", ()) if isinstance(p, torch.Tensor)]
    # (a step reaches the params with a grad: those with state, else, before any step, those that take one)
    stepped = [p for p in params if optimizer.state.get(p)] or [p for p in params if p.requires_grad] or params
    return once * len({(p.device, p.dtype, by_rank and p.dim() > 1) for p in stepped}) + per_param * len(stepped)


def priced_nonzero(cls: type, group: Mapping[str, Any], key: str, value: torch.Tensor) -> bool:
    """Whether the step compares group tensor ``value`` with a number to decide a branch (``if weight_decay != 0``):
    then :func:`group_read_cost` is its cost for a nonzero value, which a probe stands it for (a 0 may cost less)."""
    observed = _group_observed(cls, group)
    return observed is not None and _group_path(group, key, value) in observed.by_value


def group_raises(cls: type, group: Mapping[str, Any], key: str, value: torch.Tensor) -> frozenset[str]:
    """Where (``"host"``, ``"device"``) a probe step raised with group tensor ``value`` (under ``key``), the step
    with it on the other side having run or failed otherwise: what ``check`` calls an error rather than a cost
    (for a tensor of 0s, where a branch it skips raised: a read of its value, which a probe's keys never make)."""
    observed = _group_observed(cls, group)
    if observed is None:
        return frozenset()
    path = _group_path(group, key, value)
    from torch._subclasses.fake_tensor import is_fake  # (a fake or meta tensor has no value to read)

    if path in observed.at_zero and not (value.is_meta or is_fake(value)) and not value.any():
        return observed.at_zero[path]
    return observed.raises.get(path, frozenset())


def _wide_entry(cls: type, group: Mapping[str, Any], path: Path, value: torch.Tensor, device: torch.device) -> Decision:
    """Where a tensor the optimizer keeps under a plain state key belongs: where a fresh one keeps it after a step
    (its probe: MADGRAD's host counter ``k``), else with the params (TRAC's ``s``, which the class it wraps never
    made), but a 0-dim one no probe saw stays where it is (on the host it mixes with device tensors as a scalar,
    and a counter read there costs no sync)."""
    if value.numel() == 1:
        params = [p for p in group.get("params", ()) if isinstance(p, torch.Tensor)]
        # (the class itself, which made the entry, though it steps with its torch.optim base's step: that keeps none)
        observed = probe(cls, group, params[0].dim() if params else 1)
        seen = None if observed is None else observed.wide.get(path)
        if seen is not None:
            return Decision(device if seen else HOST, "probe")
        if value.dim() == 0:
            return Decision(HOST if value.is_cpu else device, "rule")
    return Decision(device, "rule")


def _group_path(group: Mapping[str, Any], key: str, value: torch.Tensor) -> tuple[str, int | None]:
    """``(key, None)`` for ``group[key]`` itself, ``(key, i)`` for ``group[key][i]`` (found by identity)."""
    entry = group.get(key)
    if isinstance(entry, (list, tuple)):
        for i, v in enumerate(entry):
            if v is value:
                return (key, i)
    return (key, None)


def params_device(group: Mapping[str, Any], fallback: torch.Tensor) -> torch.device:
    """The device a group's own tensors are placed for, its params where they are: theirs, or the host where they
    span several (a step computing with a tensor on one beside a param on another raises; a host scalar serves all)."""
    devices = {p.device for p in group.get("params", ()) if isinstance(p, torch.Tensor)}
    return HOST if len(devices) > 1 else group_device(group, fallback)


_Held = tuple[dict[Any, tuple[torch.device, str]], dict[Any, tuple[torch.device, str]], torch.device]
"""A param's part of :class:`Placer`'s memo: its entries of several elements by key, its one-element ones by key,
rank, side and dtype; the device its param is bound for."""


class Placer:
    """The memoizing front of :func:`decide` for one operation (its plan's target function): ``placer(ident, param,
    group, key, tensor)`` is ``(device, source)`` for each entry, the param on ``device`` (``None``: where it is now).
    ``sides``: group tensors by id, with the side they were given on (the session's: those optimshift took to the host;
    a load's: every loaded one).

    NOTE: the memo key is what :func:`decide` reads of a param's entry without a registered policy (the group, for one
    operation; the key; the param's rank and device; for a one-element tensor, whether 0-dim, on the host, its dtype);
    a registered policy may read anything: then there is no memo. Group entries (few) are never memoized.
    """

    __slots__ = ("optimizer", "device", "sides", "memo", "values", "spans")

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        device: torch.device | None = None,
        sides: Mapping[int, tuple[torch.device, torch.Tensor]] | None = None,
        *,
        values: bool = True,
    ) -> None:
        self.optimizer, self.device, self.sides = optimizer, device, {} if sides is None else sides
        self.values = values  # (False: asked about stand-ins, see decide)
        self.memo: dict[tuple[int, int, torch.device], _Held] | None = None if has_registered_policy(optimizer) else {}
        self.spans: dict[tuple[int, torch.device], torch.device] = {}  # (params_at's, by group)

    def __call__(
        self, ident: Any, param: torch.Tensor | None, group: Mapping[str, Any], key: str, tensor: torch.Tensor
    ) -> tuple[torch.device, str]:
        if param is None:
            if ident[0] == OPTIMIZER_WIDE:
                return self.wide_entry(ident, group, key, tensor, self.device)
            return self.group_entry(ident, group, key, tensor, self.device)
        return self.entry(self.holder(param, group), param, group, key, tensor)

    def wide_entry(
        self, ident: Any, group: Mapping[str, Any], key: str, tensor: torch.Tensor, device: torch.device | None
    ) -> tuple[torch.device, str]:
        """Where an optimizer-wide entry goes with the params on ``device`` (``None``: where its first group's
        params are)."""
        return self.at(
            None, group, key, tensor, group_device(group, tensor) if device is None else device, wide=ident[2]
        )

    def group_entry(
        self, ident: Any, group: Mapping[str, Any], key: str, tensor: torch.Tensor, device: torch.device | None
    ) -> tuple[torch.device, str]:
        """Where the group's tensor ``key`` goes with the group's params on ``device`` (``None``: where they are),
        from its side in ``sides`` (:meth:`side`)."""
        side = self.side(tensor)
        return self.at(None, group, key, tensor, self.params_at(group, tensor) if device is None else device, side)

    def params_at(self, group: Mapping[str, Any], tensor: torch.Tensor) -> torch.device:
        """:func:`params_device` of ``group`` for its tensor ``tensor``, its params walked once per operation (not
        once per tensor it holds: a group of 10k params holding a tensor ``lr`` and ``betas``)."""
        key = (id(group), tensor.device)  # (the fallback, for a group without params, is the tensor's device)
        found = self.spans.get(key)
        if found is None:
            found = self.spans[key] = params_device(group, tensor)
        return found

    def side(self, tensor: torch.Tensor) -> torch.device | None:
        """The side ``sides`` holds for this very tensor, wherever it sits now (a group added meanwhile holding it,
        groups popped or inserted before it): the accelerator a move or an offload took it from (the session's), or
        a load's (``checkpoint._staging.Staging.sides``). None: none held (a tensor given on the host)."""
        side = self.sides.get(id(tensor)) if self.sides else None
        return None if side is None or side[1] is not tensor else side[0]

    def holder(self, param: torch.Tensor, group: Mapping[str, Any]) -> _Held | None:
        """The memo of ``param``'s entries (None: no memo), keyed by what all of them share (the group, the
        param's rank and device), for a caller that places a param's entries one after another
        (:func:`optimshift._plan.build_plan`): the shared part is hashed once per param, not once per entry."""
        memo = self.memo
        if memo is None:
            return None
        device = param.device if self.device is None else self.device
        shared = (id(group), param.dim(), device)
        held = memo.get(shared)
        if held is None:
            held = memo[shared] = ({}, {}, device)
        return held

    def entry(
        self, holder: _Held | None, param: torch.Tensor, group: Mapping[str, Any], key: str, tensor: torch.Tensor
    ) -> tuple[torch.device, str]:
        """Entry ``key`` of ``param``'s state, ``holder`` being :meth:`holder`'s answer for the param."""
        if holder is None:
            return self.at(param, group, key, tensor, param.device if self.device is None else self.device)
        # (decide reads a tensor's rank, side and dtype only where it has one element: a tensor of several is
        # placed by its key and its param alone)
        memo_key: Any
        if tensor.numel() == 1:
            memo, memo_key = holder[1], (key, tensor.dim() == 0, tensor.is_cpu, tensor.dtype)
        else:
            memo, memo_key = holder[0], key
        hit = memo.get(memo_key)
        if hit is None:
            hit = memo[memo_key] = self.at(param, group, key, tensor, holder[2])
        return hit

    def at(
        self,
        param: torch.Tensor | None,
        group: Mapping[str, Any],
        key: str,
        tensor: torch.Tensor,
        device: torch.device,
        side: torch.device | None = None,
        wide: Path | None = None,
    ) -> tuple[torch.device, str]:
        """Where ``tensor`` belongs with its param (or, for a group entry, the group's params) on ``device``."""
        decision = decide(self.optimizer, group, param, key, tensor, device, side=side, values=self.values, wide=wide)
        return decision.device, decision.source


def _entry_label(
    optimizer: torch.optim.Optimizer, group: Mapping[str, Any], param: torch.Tensor | None, key: str
) -> str:
    """The entry :func:`decide` was asked about, as errors name it (group and index, or the param's name)."""
    # (found by the param: a load's group is a new dict over the same params; inspect's stand-in has no groups)
    held = param if param is not None else next(iter(group.get("params", ())), None)
    where = param_positions(optimizer).get(id(held)) if hasattr(optimizer, "param_groups") else None
    if param is None:
        return ("a param group" if where is None else f"group {where[0]}") + f"[{key!r}]"
    return ("a param" if where is None else label_in(optimizer, *where)) + f", state[{key!r}]"


def has_registered_policy(optimizer: torch.optim.Optimizer) -> bool:
    """Whether a policy registered for this optimizer's class (or a base class) decides its entries."""
    return any(base in _registry for base in type(optimizer).__mro__)
