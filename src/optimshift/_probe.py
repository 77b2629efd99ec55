"""The probe: what a fresh ``torch.optim`` optimizer does on an accelerator, observed rather than assumed.

It builds the optimizer over one fake ``cuda:0`` param (``FakeTensorMode``: no GPU, no memory) with the live
group's hyperparameters, runs one step and reads

- where each 0-dim state tensor landed: on the param's device or on the host;
- for each tensor the group holds (a tensor ``lr``, tensor ``betas``): whether the step reads it on the host
  (``1 - beta2`` given to ``addcmul_`` as a number, ``alpha=-lr``), which costs a device-to-host sync per read
  when it sits on the device, and whether the step refuses it on the host. The step runs once with every such
  tensor on the host, as torch's own tests and docs give them, then once per tensor with only that one on the
  device; the device reads and the errors are compared.

Fake tensors have no values: a read during the step gets a stand-in of the right kind (0.5, 1, False) and is
counted when the tensor is on the device. The constructor sees the group's real values.

Results are cached per (class, every group entry but the params, param rank up to 2): anything in the group
can change what a step does (``weight_decay`` decides whether ``grad.add`` runs, a tensor's value whether a
branch is taken), so all of it is in the key, tensors by dtype, shape and value.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
import warnings
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["Observed", "probe", "probe_key", "group_tensor_paths", "quiet_global_step_hooks"]

HOST_READ, NEEDS_DEVICE = "host", "device"  # verdicts on a group tensor; absent: the step does not care

# NOTE: the probe's step must never build an autograd graph. An autograd node over a fake cuda tensor asks the
# (absent) CUDA backend for its device guard and the process dies with SIGABRT, which no ``except`` can catch
# (issue 13: differentiable=True turns grad mode on inside step(), and weight_decay/momentum then record
# edges). So the step runs under torch.inference_mode(), where the autograd dispatch keys are excluded and no
# node can be recorded whatever grad mode says, and nothing in it requires grad (the param, its grad, the
# group's tensors: all made by the probe).
_FAKE_DEVICE = torch.device("cuda", 0)
_CACHE_SIZE = 1024  # LR schedulers change `lr` every step: old entries are dropped, not kept forever
_KNOWN_FLAGS = ("fused", "capturable", "foreach", "differentiable")

GroupPath = tuple[Any, int | None]
"""A tensor a group holds: ``(key, None)`` for ``group[key]``, ``(key, i)`` for ``group[key][i]``."""
ProbeKey = tuple[type[torch.optim.Optimizer], tuple[tuple[str, Any], ...], tuple[bool, ...], int]
"""What :func:`probe_key` returns: the class, the group's entries, its implementation flags, the param rank."""


@dataclass(frozen=True)
class Observed:
    """What one probe saw. ``state``: {0-dim state key: on the param's device after a step}, ``None`` if the
    step created no state. ``group``:
    {(group key, index in a tuple or None): HOST_READ or NEEDS_DEVICE} for the group tensors the step reads on
    the host or refuses there (absent: it works alike wherever the tensor is)."""

    state: Mapping[str, bool] | None
    group: Mapping[GroupPath, str] = field(default_factory=dict)


@contextlib.contextmanager
def quiet_global_step_hooks() -> Iterator[None]:
    """Run a throwaway probe optimizer without firing the user's global step hooks
    (``register_optimizer_step_pre_hook``/``_post_hook``: counters, LR loggers, profilers)."""
    import torch.optim.optimizer as _optimizer

    saved = [
        (table, dict(table))
        for table in (
            getattr(_optimizer, "_global_optimizer_pre_hooks", {}),
            getattr(_optimizer, "_global_optimizer_post_hooks", {}),
        )
    ]
    for table, _ in saved:
        table.clear()
    try:
        yield
    finally:
        for table, content in saved:
            table.clear()
            table.update(content)


# --- the cache key -------------------------------------------------------------------------------------------


def _key_of(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        described = ("tensor", str(value.dtype), tuple(value.shape), value.requires_grad)
        if value.numel() > 16:
            return described
        try:
            return described + (tuple(value.detach().to("cpu").reshape(-1).tolist()),)
        except Exception:  # a tensor without values (fake, meta): its kind alone
            return described
    if isinstance(value, (list, tuple)):
        return (type(value).__name__,) + tuple(_key_of(v) for v in value)
    if isinstance(value, Mapping):
        return ("dict",) + tuple(sorted((str(k), _key_of(v)) for k, v in value.items()))
    if value is None or isinstance(value, (bool, int, float, complex, str)):
        return (type(value).__name__, value)  # type too: 1 and True, 0 and 0.0 are distinct keys
    return (type(value).__qualname__, repr(value))


def probe_key(cls: type[torch.optim.Optimizer], group: Mapping[str, Any], ndim: int) -> ProbeKey:
    """Everything that can change what the probe observes: the class, every group entry but the params (the
    known implementation flags also as booleans: ``fused=1`` runs as ``fused=True``), the param rank (0, 1, 2+)."""
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():  # read the values themselves, not through a mode the caller is in
        items = tuple(sorted((str(k), _key_of(v)) for k, v in group.items() if k not in ("params", "param_names")))
    flags = tuple(bool(group.get(flag)) for flag in _KNOWN_FLAGS)
    return (cls, items, flags, min(ndim, 2))


# --- running it ------------------------------------------------------------------------------------------------


def group_tensor_paths(group: Mapping[str, Any]) -> list[GroupPath]:
    """The one-element tensors a group holds as hyperparameters: ``(key, None)`` for ``group[key]`` itself,
    ``(key, i)`` for ``group[key][i]`` (tensor ``betas``)."""
    paths: list[GroupPath] = []
    for key, value in group.items():
        if key in ("params", "param_names"):
            continue
        if isinstance(value, torch.Tensor):
            if value.numel() == 1:
                paths.append((key, None))
        elif isinstance(value, (list, tuple)):
            paths.extend((key, i) for i, v in enumerate(value) if isinstance(v, torch.Tensor) and v.numel() == 1)
    return paths


def _stand_in(t: torch.Tensor, want: type = float) -> Any:
    """What a host read of a fake tensor (which has no value) returns: a value of the right kind."""
    if want is bool or t.dtype == torch.bool:
        return False
    if want is int or not (t.dtype.is_floating_point or t.dtype.is_complex):
        return 1
    return 0.5


_READS = {
    torch.Tensor.item: float,
    torch.Tensor.__float__: float,
    torch.Tensor.__bool__: bool,
    torch.Tensor.__int__: int,
    torch.Tensor.__index__: int,
}


class _Reads(TorchFunctionMode):
    """Counts host reads of device tensors during the probe's step and answers them with stand-ins, so that the
    step goes on past them (fake tensors have no values, and reading a fake cuda tensor raises).

    A read is ``t.item()``, ``float(t)``, ``bool(t)`` (``if t > 0``), or a 0-dim tensor given where an op wants
    a Python number (``addcmul_(..., value=1 - beta2)``, ``add_(..., alpha=-lr)``): that conversion happens in
    C++ and fails on a fake tensor, so a failed call is retried with its 0-dim tensor arguments as numbers."""

    def __init__(self) -> None:
        super().__init__()
        self.on_device = 0

    def _count(self, t: torch.Tensor) -> None:
        if t.device.type != "cpu":
            self.on_device += 1

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        want = _READS.get(func)
        if want is not None and args and isinstance(args[0], torch.Tensor) and args[0].numel() == 1:
            self._count(args[0])
            return _stand_in(args[0], want)
        from torch._subclasses.fake_tensor import DataDependentOutputException

        try:
            return func(*args, **kwargs)
        except DataDependentOutputException as first:  # a fake tensor was read as a number
            scalars = [i for i, a in enumerate(args) if _is_scalar(a) and not _takes_tensor(func, i)]
            named = [k for k, v in kwargs.items() if _is_scalar(v) and not _takes_tensor(func, k)]
            if not scalars and not named:
                raise
            args2 = tuple(_stand_in(a) if i in scalars else a for i, a in enumerate(args))
            kwargs2 = {k: (_stand_in(v) if k in named else v) for k, v in kwargs.items()}
            try:
                result = func(*args2, **kwargs2)
            except Exception:
                raise first from None
            for i in scalars:
                self._count(args[i])
            for k in named:
                self._count(kwargs[k])
            return result


def _takes_tensor(func: Any, where: Any) -> bool:
    """Whether some overload of ``func`` (an aten op, as ``torch.x`` or ``Tensor.x``) takes a tensor at
    position or keyword ``where``: given a 0-dim tensor there, it is used as one; elsewhere it is read as a
    number (``addcmul_``'s ``value``, ``_foreach_pow``'s scalar base)."""
    packet = getattr(torch.ops.aten, getattr(func, "__name__", ""), None)
    if packet is None:
        return False
    for name in packet.overloads():
        arguments = getattr(packet, name)._schema.arguments
        if isinstance(where, int):
            arg = arguments[where] if where < len(arguments) and not arguments[where].kwarg_only else None
        else:
            arg = next((a for a in arguments if a.name == where), None)
        if arg is not None and str(arg.type).rstrip("?") == "Tensor":
            return True
    return False


def _is_scalar(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() == 0


@dataclass
class _Run:
    state: dict[str, bool] | None
    reads: int
    error: str | None


def _as_python(value: Any) -> Any:
    """A tensor hyperparameter as the Python number the constructor validates (``0.0 <= lr``)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            return value
        try:
            return value.reshape(-1)[0].item()
        except Exception:  # a tensor without values (fake, meta)
            return _stand_in(value)
    if isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value):
        return type(value)(_as_python(v) for v in value)
    return value


def _run(
    cls: type[torch.optim.Optimizer],
    group: Mapping[str, Any],
    ndim: int,
    paths: list[GroupPath],
    on_device: GroupPath | None,
) -> _Run:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import _disable_current_modes

    accepted = inspect.signature(cls.__init__).parameters
    kwargs = {k: _as_python(v) for k, v in group.items() if k in accepted and k not in ("params", "param_names")}
    shape = (2,) * ndim
    with _disable_current_modes(), warnings.catch_warnings(), quiet_global_step_hooks(), torch.inference_mode():
        warnings.simplefilter("ignore")
        with FakeTensorMode(allow_non_fake_inputs=True):
            param = torch.nn.Parameter(torch.zeros(shape, device=_FAKE_DEVICE), requires_grad=False)
            param.grad = torch.zeros(shape, device=_FAKE_DEVICE)
            opt = cls([param], **kwargs)
            live = opt.param_groups[0]
            for key, index in paths:  # the group's own tensors, on the host (one of them on the device)
                like = group[key] if index is None else group[key][index]
                t = torch.zeros(
                    like.shape, dtype=like.dtype, device=_FAKE_DEVICE if (key, index) == on_device else "cpu"
                )
                if index is None:
                    live[key] = t
                else:
                    entry = list(live.get(key, group[key]))
                    entry[index] = t
                    live[key] = type(group[key])(entry)
            error = None
            with _Reads() as reads:
                try:
                    # (torch's stubs type the closure's loss as a float; torch.optim returns the tensor)
                    opt.step(lambda: torch.zeros((), device=_FAKE_DEVICE))  # type: ignore[arg-type, return-value]
                except Exception as e:
                    # Fake tensors cannot launch every kernel (a CPU-only build has no fused CUDA kernels), but
                    # the state was created before that point, which is all that is read of it.
                    error = f"{type(e).__name__}: {str(e)[:200]}"
            state = opt.state.get(param, {})
            found = {
                key: value.device.type != "cpu"
                for key, value in state.items()
                if isinstance(value, torch.Tensor) and value.dim() == 0
            }
    return _Run(found if state else None, reads.on_device, error)


def _observe(cls: type[torch.optim.Optimizer], group: Mapping[str, Any], ndim: int) -> Observed:
    paths = group_tensor_paths(group)
    baseline = _run(cls, group, ndim, paths, None)
    verdicts: dict[GroupPath, str] = {}
    for path in paths:
        alone = _run(cls, group, ndim, paths, path)
        if alone.reads > baseline.reads or (alone.error is not None and alone.error != baseline.error):
            verdicts[path] = HOST_READ  # on the device it costs syncs, or the step goes wrong there
        elif baseline.error is not None and alone.error is None:
            verdicts[path] = NEEDS_DEVICE  # the step refuses it on the host
    return Observed(baseline.state, verdicts)


_cache: OrderedDict[ProbeKey, Observed | None] = OrderedDict()
_lock = threading.Lock()


def probe(cls: type[torch.optim.Optimizer], group: Mapping[str, Any], ndim: int) -> Observed | None:
    """What one step of a fresh ``cls`` over a fake ``cuda:0`` param of rank ``ndim`` with ``group``'s
    hyperparameters does (see the module docstring); ``None`` when the probe cannot run (the caller falls back
    to its table for state, and keeps group tensors where they are)."""
    key = probe_key(cls, group, ndim)
    with _lock:
        if key in _cache:
            _cache.move_to_end(key)
            return _cache[key]
    try:
        result = _observe(cls, group, min(ndim, 2))
    except Exception:  # the optimizer cannot be built this way: use the static table
        result = None
    with _lock:
        _cache[key] = result
        while len(_cache) > _CACHE_SIZE:
            _cache.popitem(last=False)
    return result


def clear_cache() -> None:
    with _lock:
        _cache.clear()
