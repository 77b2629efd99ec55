"""Which state dtypes a step accepts, observed rather than assumed.

optimshift never changes a dtype: ``load_state_dict`` keeps the checkpoint's (unless ``cast="param"``), and a
move keeps what is there. That is right where the kernels accept it (SGD's float32 momentum for bfloat16
params) and wrong where they do not (Adam's ``lerp_`` wants ``exp_avg`` in the grad's dtype: float64 moments
for float32 params make the next ``step()`` raise). Which is which depends on the class, its flags and the
param dtype, so it is tried: a fresh optimizer over a small host param of that dtype steps once (its own
state: the dtypes a fresh optimizer keeps), then steps again with the entries in question in the dtypes
given. Where the trial cannot run on the host (a kernel this build lacks), nothing is rejected. An entry is a
tensor or a container of tensors in one dtype (LBFGS's ``old_dirs``, ``old_stps``, ``ro``, ``al``).

The host trial stands for the device: the single-tensor and foreach paths run the same ops there (a foreach
fast path that cannot take mixed dtypes falls back to the per-tensor ops), and the fused kernels have host
twins with the same list checks; capturable cannot step on a host, so the trial runs without it. A device
kernel stricter than its host twin (a CUDA fused kernel's `step` dtype) is not seen here.
"""

from __future__ import annotations

import inspect
import threading
import warnings
from collections import OrderedDict
from collections.abc import Mapping
from collections.abc import Set as AbstractSet
from typing import TYPE_CHECKING, Any

import torch

from ._probe import ProbeKey, probe_key, quiet_global_step_hooks
from ._state import Setter, leaves, rebuild

if TYPE_CHECKING:
    from .report import Finding

__all__ = ["Rejection", "rejected_dtypes", "entry_dtypes", "dtype_findings", "dtype_name"]

_CACHE_SIZE = 512


class Rejection:
    """A state entry whose dtype a step refuses: ``key``, its ``dtype``, the one a fresh optimizer keeps
    (``fresh``) and the step's error (``error``). For a container, the dtype of the tensors in it."""

    __slots__ = ("key", "dtype", "fresh", "error")

    def __init__(self, key: str, dtype: torch.dtype, fresh: torch.dtype, error: str) -> None:
        self.key, self.dtype, self.fresh, self.error = key, dtype, fresh, error

    def __repr__(self) -> str:
        return f"Rejection({self.key!r}, {self.dtype}, fresh {self.fresh}: {self.error})"


def entry_dtypes(entries: Mapping[Any, Any], skip: AbstractSet[int] = frozenset()) -> dict[Any, torch.dtype]:
    """{key: dtype} for each entry of a param's state that is a tensor, or a container whose tensors share one
    dtype (LBFGS's history lists); tensors whose id is in ``skip`` (a group's own, as LBFGS's ``t``) are left out."""
    out: dict[Any, torch.dtype] = {}
    for key, value in entries.items():
        if isinstance(value, torch.Tensor):
            if id(value) not in skip:
                out[key] = value.dtype
            continue
        found = {t.dtype for _, t in leaves(value) if id(t) not in skip}
        if len(found) == 1:
            out[key] = found.pop()
    return out


def _shape(ndim: int) -> tuple[int, ...]:
    return ((3, 2) if ndim >= 2 else (3,)) if ndim else ()


def _plain(value: Any) -> Any:
    """A hyperparameter as the constructor takes it on the host (tensors as numbers: capturable is off)."""
    if isinstance(value, torch.Tensor):
        return value.reshape(-1)[0].item() if value.numel() == 1 else value.detach().to("cpu")
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value)
    return value


class _Trial:
    """One fresh optimizer over a host param; ``step(changes)`` steps it with some entries recast."""

    def __init__(
        self, cls: type[torch.optim.Optimizer], group: Mapping[str, Any], dtype: torch.dtype, ndim: int
    ) -> None:
        accepted = inspect.signature(cls.__init__).parameters
        kwargs = {k: _plain(v) for k, v in group.items() if k in accepted and k not in ("params", "param_names")}
        if "capturable" in kwargs:
            kwargs["capturable"] = False  # it cannot step on a host; the dtype rules are the same
        self.param = torch.full(_shape(ndim), 0.5, dtype=dtype)
        self.opt = cls([self.param], **kwargs)
        self.steps = 0

    def step(self) -> None:
        # NOTE: the loss is a quadratic whose minimum moves every step: LBFGS then fills its history in one step
        # and walks it in the next, so the dtypes of old_dirs/old_stps are tried (a constant grad, whose
        # differences are zero, left the history empty and every dtype of it accepted).
        self.steps += 1
        target = float(self.steps)

        def closure() -> torch.Tensor:  # LBFGS: a loss and a grad, without autograd
            self.param.grad = self.param - target
            return ((self.param - target) ** 2).sum() / 2

        self.param.grad = self.param - target
        self.opt.step(closure)  # type: ignore[arg-type]  # torch's stubs type the closure's loss as a float

    def fresh_dtypes(self) -> dict[str, torch.dtype]:
        return entry_dtypes(self.opt.state.get(self.param, {}))

    def recast(self, dtypes: Mapping[str, torch.dtype]) -> None:
        state = self.opt.state[self.param]
        for key, dtype in dtypes.items():
            value = state[key]
            if isinstance(value, torch.Tensor):
                state[key] = value.to(dtype)
                continue
            setters: list[Setter] = []  # a container (LBFGS's history): each tensor in it
            state[key] = rebuild(value, {id(t): t.to(dtype) for _, t in leaves(value)}, setters, {})
            for apply in setters:
                apply()


def _try(
    cls: type[torch.optim.Optimizer],
    group: Mapping[str, Any],
    dtype: torch.dtype,
    ndim: int,
    dtypes: Mapping[str, torch.dtype],
) -> list[Rejection] | None:
    """The rejections, ``[]`` if a step takes these dtypes, ``None`` if the trial cannot run."""
    from torch.utils._python_dispatch import _disable_current_modes

    with (
        _disable_current_modes(),
        warnings.catch_warnings(),
        torch.device("cpu"),
        quiet_global_step_hooks(),
        torch.no_grad(),
    ):
        warnings.simplefilter("ignore")
        try:
            trial = _Trial(cls, group, dtype, ndim)
            trial.step()
        except Exception:
            return None
        fresh = trial.fresh_dtypes()
        changed = {k: d for k, d in dtypes.items() if k in fresh and fresh[k] != d}
        if not changed:
            return []
        trial.recast(changed)
        try:
            trial.step()
            return []
        except Exception as e:
            together = f"{type(e).__name__}: {e}"
        rejected: list[Rejection] = []
        for key, wanted in changed.items():  # which of them, each alone
            alone = _Trial(cls, group, dtype, ndim)
            alone.step()
            alone.recast({key: wanted})
            try:
                alone.step()
            except Exception as e:
                rejected.append(Rejection(key, wanted, fresh[key], f"{type(e).__name__}: {e}"))
        return rejected or [Rejection(k, d, fresh[k], together) for k, d in changed.items()]


_Key = tuple[ProbeKey, torch.dtype, tuple[tuple[str, str], ...]]
_cache: OrderedDict[_Key, list[Rejection] | None] = OrderedDict()
_lock = threading.Lock()


def rejected_dtypes(
    cls: type[torch.optim.Optimizer], group: Mapping[str, Any], param: torch.Tensor, dtypes: Mapping[str, torch.dtype]
) -> list[Rejection]:
    """The entries of ``dtypes`` ({state key: dtype}, as :func:`entry_dtypes` gives) that a step of ``cls``
    with ``group``'s flags and hyperparameters over a param like ``param`` (its dtype and rank) refuses.
    Entries a fresh optimizer does not keep, and anything the host trial cannot tell, are not rejected."""
    if not param.is_floating_point():
        return []
    key: _Key = (probe_key(cls, group, param.dim()), param.dtype, tuple(sorted((k, str(d)) for k, d in dtypes.items())))
    with _lock:
        if key in _cache:
            _cache.move_to_end(key)
            found = _cache[key]
            return list(found or ())
    try:
        found = _try(cls, group, param.dtype, min(param.dim(), 2), dtypes)
    except Exception:
        found = None
    with _lock:
        _cache[key] = found
        while len(_cache) > _CACHE_SIZE:
            _cache.popitem(last=False)
    return list(found or ())


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def dtype_findings(optimizer: Any) -> list[Finding]:
    """:func:`optimshift.check`'s findings for state entries whose dtype the next step would refuse."""
    from .plan import Site
    from .policy import builtin_base
    from .report import Finding

    base = builtin_base(type(optimizer))
    if base is None:
        return []
    name = type(optimizer).__name__
    findings: list[Finding] = []
    for gi, group in enumerate(optimizer.param_groups):
        own = {
            id(t)
            for k, v in group.items()
            if k not in ("params", "param_names")
            for t in (v if isinstance(v, (list, tuple)) else (v,))
            if isinstance(t, torch.Tensor)
        }
        names = group.get("param_names")
        memo: dict[tuple[torch.dtype, int, tuple[tuple[str, str], ...]], list[Rejection]] = {}
        for pi, p in enumerate(group["params"]):
            state = optimizer.state.get(p)
            if not isinstance(p, torch.Tensor) or not isinstance(state, Mapping):
                continue
            dtypes = entry_dtypes(state, own)
            memo_key = (p.dtype, p.dim(), tuple(sorted((str(k), str(d)) for k, d in dtypes.items())))
            if memo_key not in memo:
                memo[memo_key] = rejected_dtypes(base, group, p, dtypes)
            label = Site(
                gi, pi, "", (), str(names[pi]) if isinstance(names, (list, tuple)) and pi < len(names) else None
            ).param_label
            for r in memo[memo_key]:
                t = next(t for _, t in leaves(state[r.key]) if id(t) not in own)
                findings.append(
                    Finding(
                        "error",
                        label,
                        str(r.key),
                        str(t.device),
                        dtype_name(r.dtype),
                        dtype_name(r.fresh),
                        f"step() rejects {dtype_name(r.dtype)} here with {dtype_name(p.dtype)} params "
                        f"({r.error.splitlines()[0]}); a fresh {name} keeps it as {dtype_name(r.fresh)}: cast it, or "
                        f"load the checkpoint with optimshift.load_state_dict(..., cast='param')",
                        gi,
                        pi,
                    )
                )
    return findings
