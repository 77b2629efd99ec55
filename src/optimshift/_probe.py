"""What the installed torch does, observed rather than assumed: the one module that runs throwaway steps (a
throwaway optimizer of the class, built with a group's hyperparameters; never the caller's). :func:`probe` steps
over a fake ``cuda:0`` param (``FakeTensorMode``), each group tensor (tensor ``lr``, ``betas``) on the device in a
step of its own: its device reads and errors say whether the step reads it on the host or refuses it there.

NOTE: one cache serves every probe, keyed by :func:`probe_key` (a float by its class against 0 and 1, never its
value: an LR scheduler runs no probe again), so the throwaway never sees the group's floats: it is built with
torch's default where that is of the same class, else a fixed number of the class (:func:`_built_with`); a value
that is not plain is never handed over (it shares nothing mutable with the user's groups). A third-party class's
step runs only as a torch class's: on fake tensors, under ``inference_mode``, its exceptions caught (not
:data:`TRANSIENT`), its host reads bounded (:data:`MAX_READS`); its global RNG draws are not put back (another
thread's draws meanwhile would be drawn again).
"""

from __future__ import annotations

import contextlib
import enum
import inspect
import math
import numbers
import operator
import threading
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable, Container, Hashable, Iterable, Iterator, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import torch
from torch.overrides import TorchFunctionMode

from ._state import GROUP_SKIP, IMPLEMENTATION_FLAGS, Path, Setter, group_tensors, holds_tensor, leaves, rebuild

__all__ = [
    "Observed",
    "StateSpec",
    "Rejection",
    "probe",
    "unprobed",
    "torch_defined",
    "probe_key",
    "group_kinds",
    "expected_state",
    "rejected_dtypes",
    "step_needs",
    "entry_dtypes",
    "group_tensor_paths",
    "quiet_global_step_hooks",
    "throwaway",
    "clear_cache",
    "TRANSIENT",
]

HOST_READ, NEEDS_DEVICE = "host", "device"  # verdicts on a group tensor; absent: the step does not care

# NOTE: the probe's step must never build an autograd graph: a node over a fake cuda tensor asks the absent CUDA
# backend for its device guard and the process dies with SIGABRT (differentiable=True turns grad mode on inside
# step()). So it runs under torch.inference_mode(), and nothing in it requires grad.
_FAKE_DEVICE = torch.device("cuda", 0)
CACHE_SIZE = 1024
MAX_READS = 10_000
"""At most this many host reads in one probe step: past it the step is stopped (an error the probe catches)."""

GroupPath = tuple[Any, int | None]
"""A tensor a group holds: ``(key, None)`` for ``group[key]``, ``(key, i)`` for ``group[key][i]``."""
ProbeKey = tuple["weakref.ref[type]", tuple[tuple[str, Any], ...], tuple[bool, ...], int]
"""The class (weakly: its entries are only ever found through it), the group's entries by kind, flags, rank."""


@contextlib.contextmanager
def throwaway(*, host: bool = True) -> Iterator[None]:
    """Where a throwaway optimizer is built and stepped (the probes', the load's checks'): outside the caller's
    tensor modes (a FakeTensorMode), its warnings silenced, the user's global step hooks not fired, its tensors
    made on the host (``host``)."""
    from torch.utils._python_dispatch import _disable_current_modes

    place = torch.device("cpu") if host else contextlib.nullcontext()
    with _disable_current_modes(), warnings.catch_warnings(), place, quiet_global_step_hooks():
        warnings.simplefilter("ignore")
        yield


@contextlib.contextmanager
def quiet_global_step_hooks() -> Iterator[None]:
    """Run a throwaway probe optimizer without firing the user's global step hooks
    (``register_optimizer_step_pre_hook``/``_post_hook``: counters, LR loggers, profilers)."""
    import torch.optim.optimizer as _optimizer

    tables: list[dict[int, Any]] = [_optimizer._global_optimizer_pre_hooks, _optimizer._global_optimizer_post_hooks]
    saved = [(table, dict(table)) for table in tables]
    for table, _ in saved:
        table.clear()
    try:
        yield
    finally:
        for table, content in saved:
            table.clear()
            table.update(content)


# --- the cache key -------------------------------------------------------------------------------------------


def _is_float(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, (numbers.Integral, torch.Tensor))


def _float_class(x: float) -> str:
    """Where ``x`` lies against 0 and 1: all that torch.optim's constructors and steps compare a float with."""
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    if x < 0:
        return "< 0"
    if x == 0:
        return "0"
    if x < 1:
        return "(0, 1)"
    return "1" if x == 1 else "> 1"


_REPRESENTATIVE = {"< 0": -0.5, "0": 0.0, "(0, 1)": 0.5, "1": 1.0, "> 1": 2.0}


def _key_of(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        device = value.device
        return ("tensor", device.type, device.index, str(value.dtype), tuple(value.shape), value.requires_grad)
    if isinstance(value, (bool, str, complex)) or value is None:
        return (type(value).__name__, value)  # type too: 1 and True are distinct keys
    if isinstance(value, numbers.Integral):
        return (type(value).__name__, int(value))  # (LBFGS's max_iter=1 keeps no tensor H_diag: by value)
    if _is_float(value):
        return (type(value).__name__, _float_class(float(value)))  # its class, never its value
    if isinstance(value, (list, tuple)):
        return (type(value).__name__,) + tuple(_key_of(v) for v in value)
    if isinstance(value, Mapping):
        # (a key that is a tensor, a param: by its kind, as a value is; its str() would print its values, a host
        # sync per param on a device, and change with every step)
        items = [(str(_key_of(k)) if isinstance(k, torch.Tensor) else str(k), _key_of(v)) for k, v in value.items()]
        return ("dict",) + tuple(sorted(items, key=repr))  # (by repr: keys of one kind tie, and values may not order)
    return (type(value).__qualname__, repr(value))


def probe_key(cls: type[torch.optim.Optimizer], group: Mapping[str, Any], ndim: int) -> ProbeKey:
    """What can change what a throwaway step observes: the class, the group's entries by kind, the implementation
    flags as booleans (``fused=1`` runs as ``fused=True``), the param rank (0, 1, 2+)."""
    flags = tuple(bool(group.get(flag)) for flag in IMPLEMENTATION_FLAGS)
    return (weakref.ref(cls), group_kinds(group), flags, min(ndim, 2))


def group_kinds(group: Mapping[str, Any]) -> tuple[tuple[str, Any], ...]:
    """Every entry of ``group`` but its params, by kind (a float by its class, never its value): what a probed
    placement depends on, and so what a cached plan keys on."""
    return tuple(sorted((str(k), _key_of(v)) for k, v in group.items() if k not in GROUP_SKIP))


# --- what the throwaway optimizer is built with ------------------------------------------------------------


_signatures: weakref.WeakKeyDictionary[type, Mapping[str, Any]] = weakref.WeakKeyDictionary()  # (one per class)


def signature_defaults(cls: type[torch.optim.Optimizer]) -> Mapping[str, Any]:
    """``cls.__init__``'s parameters but ``self``/``params`` with their defaults (``Parameter.empty`` if none), its
    bases' too where it passes ``**kwargs`` on. Raises ``TypeError``/``ValueError`` where it has no signature."""
    found = _signatures.get(cls)
    if found is None:
        found = {}
        for klass in cls.__mro__:
            init = klass.__dict__.get("__init__")
            if init is None:
                continue
            params = inspect.signature(init).parameters
            passed_on = False
            for name, p in params.items():
                if p.kind is inspect.Parameter.VAR_KEYWORD:
                    passed_on = True
                elif name not in ("self", "params") and p.kind is not inspect.Parameter.VAR_POSITIONAL:
                    found.setdefault(name, p.default)
            if not passed_on or klass is torch.optim.Optimizer:
                break
        _signatures[cls] = found
    return found


_DROP = object()


def _stand_in(t: torch.Tensor, want: type = float) -> Any:
    """What a host read of a fake tensor (which has no value) returns: a value of the right kind."""
    if want is bool or t.dtype == torch.bool:
        return False
    if want is int or not (t.dtype.is_floating_point or t.dtype.is_complex):
        return 1
    return 0.5


def _built_with(value: Any, default: Any) -> Any:
    """What the throwaway optimizer is given for a group entry ``value`` whose default is ``default``: a number
    that depends only on ``value``'s key (see the module NOTE); ``_DROP`` for a tensor that is not one number."""
    number = _is_float(default) or (isinstance(default, numbers.Integral) and not isinstance(default, bool))
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            return _DROP
        if number and (value.dtype.is_floating_point or value.dtype.is_complex):
            return float(default)
        return _stand_in(value)
    if _is_float(value):
        kind = _float_class(float(value))
        if number and _float_class(float(default)) == kind:
            return float(default)
        return _REPRESENTATIVE.get(kind, float(value))  # (infinite, NaN: the value is its class)
    if isinstance(value, (list, tuple)):
        defaults = (
            default if isinstance(default, (list, tuple)) and len(default) == len(value) else (None,) * len(value)
        )
        items = [_built_with(v, d) for v, d in zip(value, defaults)]
        if any(item is _DROP for item in items):
            return _DROP
        return tuple(items) if isinstance(value, tuple) else items
    if value is None or isinstance(value, (numbers.Number, str, bytes, enum.Enum, torch.dtype, torch.device)):
        return value  # (immutable: given as it is)
    return _DROP  # (a dict, a callable, an object: the constructor's default, never the user's object)


def built_kwargs(
    cls: type[torch.optim.Optimizer], group: Mapping[str, Any], skip: tuple[str, ...] = ()
) -> dict[str, Any]:
    """A throwaway ``cls``'s keywords: the entries of ``group`` its ``__init__`` takes (but ``skip``), built."""
    accepted = signature_defaults(cls)
    out: dict[str, Any] = {}
    for key, value in group.items():
        if key in GROUP_SKIP or key in skip or key not in accepted:
            continue
        built = _built_with(value, accepted[key])
        if built is not _DROP:
            out[key] = built
    return out


# --- the one cache -------------------------------------------------------------------------------------------

_T = TypeVar("_T")
_cache: OrderedDict[Hashable, Any] = OrderedDict()
_lock = threading.Lock()
_MISSING = object()

TRANSIENT: tuple[type[BaseException], ...] = (MemoryError, torch.cuda.OutOfMemoryError, RecursionError)
"""Errors that say nothing of the class (out of memory, the stack too deep: where the probe was asked, or in the
class, cannot be told): never its answer, never cached. Any other error is the class's: the same inputs raise it
again; an interrupt (no ``Exception``) always propagates."""


def _cached(key: Hashable, compute: Callable[[], _T], unknown: Callable[[Exception], _T]) -> _T:
    """``compute()``, once per ``key`` among the :data:`CACHE_SIZE` most recent, else ``unknown(error)`` for an error
    of the class. A RecursionError is answered so too, but not kept; the other transient errors propagate."""
    with _lock:
        found = _cache.get(key, _MISSING)
        if found is not _MISSING:
            _cache.move_to_end(key)
            return found  # type: ignore[no-any-return]
    try:
        result = compute()
    except RecursionError as e:
        return unknown(e)
    except TRANSIENT:
        raise
    except Exception as e:
        result = unknown(e)
    with _lock:
        _cache[key] = result
        while len(_cache) > CACHE_SIZE:
            _cache.popitem(last=False)
    return result


def clear_cache() -> None:
    with _lock:
        _cache.clear()


def _failure(call: Callable[[], object]) -> Exception | None:
    """The class's error ``call()`` raised, None if none (a :data:`TRANSIENT` one propagates)."""
    try:
        call()
    except TRANSIENT:
        raise
    except Exception as e:
        return e
    return None


# --- placement: one step over a fake cuda:0 param --------------------------------------------------------------


@dataclass(frozen=True)
class Observed:
    """What one probe saw. ``state``: {0-dim state key: on the param's device} (None: no state); ``group``:
    {GroupPath: HOST_READ or NEEDS_DEVICE} (absent: either works); ``error``: what the step raised (with group
    tensors: or the next one, which computes with what the first made state from: SGD's momentum); ``reads``: {host
    0-dim key: device reads it costs a later step on the device}; ``wide``: {path under a plain state key: on the
    device}; ``group_reads``: {GroupPath: ``(a, b, by_rank)``}: ``a + b * n`` device reads more over ``n`` params
    (``a`` once per rank class, 1-D or 2-D and up, where ``by_rank``), a 0-dim one's for a nonzero value
    (:class:`_Reads`); ``by_value``: those whose comparison with a number decided a branch; ``raises``: {GroupPath:
    where (``"host"``, ``"device"``) a step with it there raised, that of the other did not; both: on either, where
    with a number in its place it did not}; ``at_zero``: ``raises`` for a tensor of 0s where a step raised only in a
    branch a 0 skips (AdamW's ``if weight_decay != 0``: a ``(1,)`` 0 runs; a 0-dim one stands for a nonzero value)."""

    state: Mapping[str, bool] | None
    group: Mapping[GroupPath, str] = field(default_factory=dict)
    error: str | None = None
    reads: Mapping[str, int] = field(default_factory=dict)
    wide: Mapping[Path, bool] = field(default_factory=dict)
    group_reads: Mapping[GroupPath, tuple[int, int, bool]] = field(default_factory=dict)
    raises: Mapping[GroupPath, frozenset[str]] = field(default_factory=dict)
    at_zero: Mapping[GroupPath, frozenset[str]] = field(default_factory=dict)
    by_value: frozenset[GroupPath] = frozenset()


def group_tensor_paths(group: Mapping[str, Any]) -> list[GroupPath]:
    """The one-element tensors a group holds as hyperparameters (see :data:`GroupPath`)."""
    paths: list[GroupPath] = []
    for path, t in group_tensors(group):
        if t.numel() != 1:
            continue
        if len(path) == 1:
            paths.append((path[0][1], None))
        elif len(path) == 2 and path[1][0] == "index":
            paths.append((path[0][1], path[1][1]))
    return paths


_READS = {
    torch.Tensor.item: float,
    torch.Tensor.__float__: float,
    torch.Tensor.__bool__: bool,
    torch.Tensor.__int__: int,
    torch.Tensor.__index__: int,
}
_LIFTS = (torch.tensor, torch.as_tensor, torch.asarray)  # (a tensor from Python data: see _Reads)
_COMPARISONS: dict[Any, Callable[[Any, Any], Any]] = {  # (a truth read of one: see _Reads)
    func: op
    for op, funcs in (
        (operator.eq, (torch.Tensor.__eq__, torch.Tensor.eq, torch.eq)),
        (operator.ne, (torch.Tensor.__ne__, torch.Tensor.ne, torch.ne)),
        (operator.lt, (torch.Tensor.__lt__, torch.Tensor.lt, torch.lt)),
        (operator.le, (torch.Tensor.__le__, torch.Tensor.le, torch.le)),
        (operator.gt, (torch.Tensor.__gt__, torch.Tensor.gt, torch.gt)),
        (operator.ge, (torch.Tensor.__ge__, torch.Tensor.ge, torch.ge)),
    )
    for func in funcs
}


class _Reads(TorchFunctionMode):
    """Counts host reads during the probe's step, answered with stand-ins (a truth value: ``truth``); a 0-dim tensor
    where an op wants a number (``alpha=-lr``) is read in C++, which fails on a fake tensor: the call is retried with
    it as a number. A 0-dim group tensor (``scalars``) stands for its stand-in, a nonzero value: a truth read of it,
    or of its comparison with a number (``if weight_decay != 0``), is answered as that value answers it, so the step
    takes the branch a nonzero value takes and its reads there are counted."""

    def __init__(self, truth: bool = False) -> None:
        super().__init__()
        self.on_device = 0
        self.reads = 0
        self.truth = truth
        # {id: (the tensor, the value it stands for, the scalar it compared or None)}: the scalars, their comparisons
        self.values: dict[int, tuple[torch.Tensor, Any, torch.Tensor | None]] = {}
        self.decided: list[torch.Tensor] = []  # (the scalars whose comparison a truth read was answered for)

    def stand_for(self, scalars: Iterable[torch.Tensor]) -> None:
        """Answer reads of each of ``scalars`` (0-dim), and of its comparisons with a number, as its stand-in."""
        self.values.update((id(t), (t, _stand_in(t), None)) for t in scalars)

    def _count(self, t: torch.Tensor) -> None:
        self.reads += 1
        if self.reads > MAX_READS:
            raise RuntimeError(f"optimshift probe: more than {MAX_READS} host reads in one step; stopped")
        if t.device.type != "cpu":
            self.on_device += 1

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        want = _READS.get(func)
        if want is not None and args and isinstance(args[0], torch.Tensor) and args[0].numel() == 1:
            self._count(args[0])
            held = self.values.get(id(args[0]))
            truth = want is bool or args[0].dtype == torch.bool
            if truth and held is not None and held[0] is args[0]:
                if held[2] is not None:
                    self.decided.append(held[2])
                return bool(held[1])
            return self.truth if truth else _stand_in(args[0], want)
        op = _COMPARISONS.get(func)
        held = self.values.get(id(args[0])) if op is not None and len(args) == 2 and not kwargs else None
        if op and held is not None and held[0] is args[0] and held[2] is None and isinstance(args[1], numbers.Number):
            result = func(*args)
            self.values[id(result)] = (result, op(held[1], args[1]), args[0])
            return result
        from torch._subclasses.fake_tensor import DataDependentOutputException

        device = kwargs.get("device")
        if func in _LIFTS and args and not isinstance(args[0], torch.Tensor) and device is not None:
            # (Python data lifted onto the fake device: a constant, which FakeTensorMode makes on the real device under
            # inference mode or once a backend is registered, and a CPU-only build cannot: ASGD's eta. Only its shape
            # and dtype are read)
            if torch.device(device).type != "cpu":
                host = func(*args, **{**kwargs, "device": "cpu"})
                return torch.empty(host.shape, dtype=host.dtype, device=device)
        if func is torch.Tensor.__setitem__ and _masked_fill(*args):
            if isinstance(args[2], torch.Tensor) and args[2].device.type != "cpu":  # (a sync: see _masked_fill)
                self._count(args[2])
            return None
        if func is torch.Tensor.copy_:  # (its binding asks for the device's guard, which a CPU-only build lacks)
            func = _aten_copy_
        elif getattr(func, "__name__", "").startswith("_foreach_") and func is not torch._foreach_copy_:
            _same_device(args, kwargs)
        try:
            return func(*args, **kwargs)
        except DataDependentOutputException as first:  # a fake tensor was read as a number
            scalars = [i for i, a in enumerate(args) if _is_scalar(a) and not _takes_tensor(func, i)]
            named = [k for k, v in kwargs.items() if _is_scalar(v) and not _takes_tensor(func, k)]
            # (none: a kernel taking a 0-dim tensor that only its fake twin reads: taken as a number, and no read of a
            # real step's; but an ``.item()``, where the binding picked an overload taking a number, is one:
            # ``_foreach_add_(.., eps)``'s, RAdam's capturable foreach ``_foreach_add_(.., rho_inf)``)
            taken = not scalars and not named and first.func is not torch.ops.aten._local_scalar_dense.default
            if not scalars and not named:
                scalars = [i for i, a in enumerate(args) if _is_scalar(a)]
                named = [k for k, v in kwargs.items() if _is_scalar(v)]
                if not scalars and not named:
                    raise
            args2 = tuple(_stand_in(a) if i in scalars else a for i, a in enumerate(args))
            kwargs2 = {k: (_stand_in(v) if k in named else v) for k, v in kwargs.items()}
            try:
                result = func(*args2, **kwargs2)
            except TRANSIENT:  # (says nothing of the class: never its answer)
                raise
            except Exception as retried:
                # (past its arguments, taken as numbers, it failed in a kernel fake tensors cannot run: fused
                # Adam's on a CPU-only build; they were read all the same. A TypeError: not numbers there)
                if not isinstance(retried, TypeError) and not taken:
                    self._count_each(args, scalars, kwargs, named)
                raise first from None
            if not taken:
                self._count_each(args, scalars, kwargs, named)
            return result

    def _count_each(self, args: tuple[Any, ...], scalars: list[int], kwargs: dict[str, Any], named: list[str]) -> None:
        for t in [args[i] for i in scalars] + [kwargs[k] for k in named]:
            self._count(t)


def _same_device(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Raise as a device does for a foreach op whose tensor lists hold a host tensor that is not 0-dim beside device
    tensors (its per-tensor fallback refuses it, as every other op but the copy, which ``_foreach_copy_`` skips;
    fake tensors' foreach kernels do not check)."""
    devices = {
        str(t.device)
        for arg in (*args, *kwargs.values())
        if isinstance(arg, (list, tuple))
        for t in arg
        if isinstance(t, torch.Tensor) and (t.device.type != "cpu" or t.dim() != 0)
    }
    if len(devices) > 1:
        found = " and ".join(sorted(devices, reverse=True))
        raise RuntimeError(f"Expected all tensors to be on the same device, but found at least two devices, {found}!")


def _masked_fill(self: Any, index: Any = None, value: Any = None, *_: Any) -> bool:
    """``self[mask] = value`` (one value, from either side as a real kernel takes it) run as a fill, which fake tensors
    can run and not their ``index_put_``: non-capturable Rprop's ``sign[sign.gt(0)] = etaplus``. False: not one.
    (ATen's ``masked_fill_`` takes a host value only: a device one goes to ``index_put_``, whose ``nonzero`` syncs.)"""
    mask = index if isinstance(index, torch.Tensor) and index.dtype == torch.bool else None
    one = isinstance(value, numbers.Number) or isinstance(value, torch.Tensor) and value.numel() == 1
    if not isinstance(self, torch.Tensor) or mask is None or mask.shape != self.shape or not one:
        return False
    _aten_copy_(self, torch.where(mask, value.reshape(()) if isinstance(value, torch.Tensor) else value, self))
    return True


def _aten_copy_(self: torch.Tensor, other: torch.Tensor, non_blocking: bool = False) -> Any:
    return torch.ops.aten.copy_.default(self, other, non_blocking)  # (aten's ``src`` is the binding's ``other``)


def _takes_tensor(func: Any, where: Any) -> bool:
    """Whether some overload of the aten op ``func`` takes a tensor at position or keyword ``where`` (elsewhere a
    0-dim tensor is read as a number: ``addcmul_``'s ``value``, ``_foreach_pow``'s scalar base)."""
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


class _Unbuilt(Exception):
    """The throwaway optimizer could not be built (its message: why)."""


def _error(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e)[:200]}"


def _fake_step(opt: torch.optim.Optimizer, reads: _Reads) -> None:
    """One step of ``opt`` (its exceptions propagate), its host reads counted in ``reads``, its groups' 0-dim tensors
    standing for nonzero values."""
    reads.stand_for(t for group in opt.param_groups for _, t in group_tensors(group) if t.dim() == 0)
    with reads:
        # (torch's stubs type the closure's loss as a float; torch.optim returns the tensor)
        opt.step(lambda: torch.zeros((), device=_FAKE_DEVICE))  # type: ignore[arg-type, return-value]


_foreach_lock = threading.Lock()
_foreach_holders = 0  # probe steps running with the fake param counted as torch's default foreach takes it
_foreach_added = False  # whether FakeTensor was added to torch's list by the probe (and so is taken out by it)


@contextlib.contextmanager
def _fake_param_takes_default_foreach() -> Iterator[None]:
    """While a probe step runs, ``FakeTensor`` counts as a plain tensor for torch's default implementation, so
    ``foreach=None`` runs the foreach step a real accelerator param runs (Adagrad's reads a device ``lr`` there)."""
    global _foreach_holders, _foreach_added
    import torch.optim.optimizer as _optimizer
    from torch._subclasses.fake_tensor import FakeTensor

    types = _optimizer._foreach_supported_types
    # (counted and added inside the try that undoes them, the mark set before the append: a Ctrl-C landing
    # anywhere leaves neither the count too high nor FakeTensor in torch's list)
    counted = False
    try:
        with _foreach_lock:
            if _foreach_holders == 0 and FakeTensor not in types:
                _foreach_added = True
                types.append(FakeTensor)
            _foreach_holders += 1
            counted = True
        yield
    finally:
        with _foreach_lock:
            if counted:
                _foreach_holders -= 1
            if _foreach_holders == 0 and _foreach_added:
                _foreach_added = False
                if FakeTensor in types:
                    types.remove(FakeTensor)


def _run(
    cls: type[torch.optim.Optimizer],
    group: Mapping[str, Any],
    ndim: int,
    paths: list[GroupPath],
    on_device: Container[GroupPath],
    costs: bool = False,
    others: tuple[int, ...] = (),
    truth: bool = False,
) -> tuple[Observed, int, int | None]:
    """One probe step over a param of rank ``ndim`` and one more of each rank in ``others``, ``on_device`` the group
    tensors on the device: what it saw of the first (no group verdicts yet), its device reads and a later step's
    (None: failed or no group tensors); ``costs``: also what each host scalar costs on the device (:func:`_costs`);
    ``truth``: what a truth read gets."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    kwargs = built_kwargs(cls, group)
    with throwaway(host=False), torch.inference_mode(), _fake_param_takes_default_foreach():
        with FakeTensorMode(allow_non_fake_inputs=True):
            params = [
                torch.nn.Parameter(torch.zeros((2,) * rank, device=_FAKE_DEVICE), requires_grad=False)
                for rank in (ndim, *others)
            ]
            for param in params:
                param.grad = torch.zeros(param.shape, device=_FAKE_DEVICE)
            param = params[0]
            try:
                opt = cls(params, **kwargs)
            except TRANSIENT:  # (says nothing of the class: never its answer)
                raise
            except Exception as e:
                raise _Unbuilt(_error(e)) from None
            live = opt.param_groups[0]
            for flag in IMPLEMENTATION_FLAGS if not torch_defined(cls) else ():
                if bool(live.get(flag)) != bool(group.get(flag)):  # (a flag its constructor does not take)
                    raise _Unbuilt(f"built, it has {flag}={live.get(flag)!r}, the group {group.get(flag)!r}")
            placed: list[tuple[torch.Tensor, GroupPath]] = []
            for key, index in paths:  # the group's own tensors, on the host (one of them on the device)
                like = group[key] if index is None else group[key][index]
                t = torch.zeros(
                    like.shape, dtype=like.dtype, device=_FAKE_DEVICE if (key, index) in on_device else "cpu"
                )
                if index is None:
                    live[key] = t
                else:
                    entry = list(live.get(key, group[key]))
                    entry[index] = t
                    live[key] = type(group[key])(entry)
                placed.append((t, (key, index)))
            reads = _Reads(truth)
            # (fake tensors cannot launch every kernel, a CPU-only build's fused CUDA ones, but the state was
            # created before that point, which is all that is read of it)
            failed = _failure(lambda: _fake_step(opt, reads))
            error = None if failed is None else _error(failed)
            state = opt.state.get(param, {})
            found = {
                key: value.device.type != "cpu"
                for key, value in state.items()
                if isinstance(value, torch.Tensor) and value.dim() == 0
            }
            measured = _costs(opt, state, found) if costs and error is None else {}
            # (a second step's error is the step's too: SGD's first computes with its momentum there)
            later, error = _later_step(opt, truth) if paths and error is None else (None, error)
            wide = {
                path: t.device.type != "cpu"
                for key, value in opt.state.items()
                if not isinstance(key, torch.Tensor)
                for path, t in leaves(value, (("key", key),))
                if t.numel() == 1
            }
            by_value = frozenset(path for t, path in placed if any(s is t for s in reads.decided))
    observed = Observed(found if state else None, {}, error, measured, wide, by_value=by_value)
    return observed, reads.on_device, later


def _later_step(opt: torch.optim.Optimizer, truth: bool = False) -> tuple[int | None, str | None]:
    """The device reads of one more step of ``opt`` (the first may read what it creates state from: Rprop's
    ``lr``), or None and its error."""
    reads = _Reads(truth)
    failed = _failure(lambda: _fake_step(opt, reads))
    return (reads.on_device, None) if failed is None else (None, _error(failed))


def _costs(opt: torch.optim.Optimizer, state: dict[Any, Any], found: Mapping[str, bool]) -> dict[str, int]:
    """{host scalar key: the device reads one more step makes with it on the (fake) device than without}; a key
    whose step fails is left out. NOTE: every read returns the same stand-in, so the steps compare alike."""
    baseline = _later_step(opt)[0]
    if baseline is None:
        return {}
    out: dict[str, int] = {}
    for key in [k for k, on_device in found.items() if not on_device]:
        held = state[key]
        state[key] = torch.zeros((), dtype=held.dtype, device=_FAKE_DEVICE)
        try:
            reads = _later_step(opt)[0]
        finally:
            state[key] = torch.zeros((), dtype=held.dtype)
        if reads is not None:
            out[key] = max(reads - baseline, 0)
    return out


def torch_defined(cls: type) -> bool:
    """Whether torch.optim defines ``cls`` itself (its sync costs are measured on a device: ``report``)."""
    return cls.__module__.split(".")[:2] == ["torch", "optim"] and getattr(torch.optim, cls.__name__, None) is cls


_NO_BACKEND = ("PyTorch is not linked with support for", "Torch not compiled with CUDA enabled")
"""How a CPU-only build refuses the fake device: a kernel launched on it (fused Adam's), a ``torch.cuda`` call for
it (a step's own, on a group tensor's device): no refusal of the class."""


_MIXED = "Expected all tensors to be on the same device"
"""How a step refuses a host tensor that is not 0-dim beside device ones (torch's words, and :func:`_same_device`'s)."""


def _needs_device(host: Observed, device: Observed) -> bool:
    """Whether the step refused the tensor on the host and took it on the device; a refusal to mix it with device
    tensors, also where a CPU-only build could not finish the device step (LBFGS's one-element ``tolerance_grad``)."""
    mixed = _MIXED in (host.error or "") and any(m in (device.error or "") for m in _NO_BACKEND)
    return host.error is not None and (device.error is None or mixed)


def _observe(cls: type[torch.optim.Optimizer], group: Mapping[str, Any], ndim: int) -> Observed:
    paths = group_tensor_paths(group)
    baseline, reads, later = _run(cls, group, ndim, paths, (), costs=not torch_defined(cls))
    verdicts: dict[GroupPath, str] = {}
    costs: dict[GroupPath, tuple[int, int, bool]] = {}
    raises: dict[GroupPath, frozenset[str]] = {}
    two: dict[tuple[tuple[GroupPath, ...], int], int | None] = {}  # (later_over_two's, each run once)

    def later_over_two(on: tuple[GroupPath, ...], rank: int) -> int | None:
        """A later step's device reads over two params, the second of rank ``rank``, ``on`` on the device (None:
        failed, or a class built over one param only: its cost is not known, its verdict stands)."""
        if (on, rank) not in two:
            two[on, rank] = None
            with contextlib.suppress(_Unbuilt):
                two[on, rank] = _run(cls, group, ndim, paths, on, others=(rank,))[2]
        return two[on, rank]

    truthy: list[Observed] = []  # (the host step with every truth read true: run once, when needed)

    def needs_device_if_taken(path: GroupPath) -> bool:
        """Whether a branch the false stand-in skipped refuses a one-element tensor that is not 0-dim on the host
        (computing with it beside the params: AdamW's ``if weight_decay != 0``) and takes it on the device."""
        key, index = path
        if (group[key] if index is None else group[key][index]).dim() == 0:
            return False
        if not truthy:
            truthy.append(_run(cls, group, ndim, paths, (), truth=True)[0])
        return _MIXED in (truthy[0].error or "") and _needs_device(
            truthy[0], _run(cls, group, ndim, paths, (path,), truth=True)[0]
        )

    everywhere: list[Observed] = []  # (the step with every group tensor on the device: run once, when needed)

    def needs_device_beside(path: GroupPath, alone: Observed) -> bool:
        """Whether the host step refused it with the others on the device, which the step takes all on the device,
        where on the device alone it is still refused beside another one (Adamax's capturable ``(1,)`` betas)."""
        if alone.error is None or alone.error != baseline.error or _MIXED not in alone.error:
            return False
        if not everywhere:
            everywhere.append(_run(cls, group, ndim, paths, paths)[0])
        others = [other for other in paths if other != path]
        return everywhere[0].error is None and _needs_device(_run(cls, group, ndim, paths, others)[0], everywhere[0])

    at_zero: dict[GroupPath, frozenset[str]] = {}  # (raises for a 0, where it was seen with truth reads true only)

    def needs_device(path: GroupPath, alone: Observed) -> bool:
        if _needs_device(baseline, alone) or needs_device_beside(path, alone):
            return True
        if needs_device_if_taken(path):
            at_zero[path] = frozenset()  # (a 0 skips the branch that refuses it)
            return True
        return False

    alones = {path: _run(cls, group, ndim, paths, (path,)) for path in paths}
    needed = tuple(path for path, (alone, _, _) in alones.items() if needs_device(path, alone))
    reference = baseline
    if needed and baseline.error is not None:  # (the host step stopped at them, before the others' reads)
        reference, reads, later = _run(cls, group, ndim, paths, needed)
    base = needed if reference is not baseline else ()  # (on the device in the reference step)
    truthy_reference: list[Observed] = []  # (the reference step with every truth read true: run once, when needed)

    def raises_either(
        path: GroupPath, host: Observed, device: Observed, among: list[GroupPath] = paths, truth: bool = False
    ) -> bool:
        """Whether the step raises with it on the host (``host``) and on the device (``device``), and not so with a
        number in its place (a ``(1,)`` eps a foreach op takes only 0-dim, a fused kernel's ``(1,)`` one); where
        another of ``among`` raises first, asked with it the only tensor (Adamax's ``(1,)`` betas)."""
        unseen = (*_NO_BACKEND, "DataDependent")  # (where a fake step stops: a missing backend, a number read in C++)
        failed = [e for e in (host.error, device.error) if e is not None and not any(m in e for m in unseen)]
        if len(failed) < 2:
            return False
        on = base if among is paths else ()
        if _run(cls, group, ndim, [p for p in among if p != path], on, truth=truth)[0].error not in failed:
            return True
        if among != [path]:
            host, device = (_run(cls, group, ndim, [path], where, truth=truth)[0] for where in ((), (path,)))
            return raises_either(path, host, device, [path], truth)
        return False

    def raises_if_taken(path: GroupPath) -> bool:
        """:func:`raises_either` with every truth read true: where a branch the false stand-in skipped computes with
        it (AdamW's foreach ``if weight_decay != 0``), and where a 0-dim one raised with them false, whether it does
        either way (fused SGD's ``momentum == 0`` and ``!= 0`` both read false disagree: an IndexError no real step
        makes)."""
        if not truthy_reference:
            same = truthy and not base  # (the host step with truth reads true, run already)
            truthy_reference.append(truthy[0] if same else _run(cls, group, ndim, paths, base, truth=True)[0])
        host = truthy_reference[0]
        device = None if host.error is None else _run(cls, group, ndim, paths, (*base, path), truth=True)[0]
        return device is not None and raises_either(path, host, device, truth=True)

    for path in paths:
        if path in needed:
            verdicts[path] = NEEDS_DEVICE  # the step refuses it on the host
            raises[path] = frozenset({"host"})
            continue
        on_device = (*base, path)
        alone, alone_reads, alone_later = (
            alones[path] if reference is baseline else _run(cls, group, ndim, paths, on_device)
        )
        read_later = later is not None and alone_later is not None and alone_later > later  # (SGD's dampening)
        if alone_reads > reads or read_later or (alone.error is not None and alone.error != reference.error):
            verdicts[path] = HOST_READ  # on the device it costs syncs, or the step goes wrong there
            failed = alone.error if alone.error != reference.error else None
            if failed is not None and not any(m in failed for m in _NO_BACKEND):
                # (where the step with it on the device raised: on the host too, where that one failed)
                raises[path] = frozenset({"device"} | ({"host"} if reference.error is not None else set()))
            without = on_device[:-1]
            if later is not None and alone_later is not None and later_over_two(without, ndim) is not None:
                two_alone = later_over_two(on_device, ndim)
                if two_alone is not None:
                    more = two_alone - (later_over_two(without, ndim) or 0)
                    one, per_param = alone_later - later, more - (alone_later - later)
                    # (a second param of the other rank class, 1-D against 2-D and up: a step grouping by it,
                    # Adafactor's foreach, makes its once-a-step reads once per class)
                    other = 1 if ndim > 1 else 2
                    mixed = [later_over_two(on, other) for on in (without, on_device)]
                    by_rank = mixed[0] is not None and mixed[1] is not None and mixed[1] - mixed[0] > more
                    costs[path] = (one - per_param, per_param, by_rank)
        either = raises_either(path, reference, alone)
        one_dim = (group[path[0]] if path[1] is None else group[path[0]][path[1]]).dim() != 0
        # (a raise with truth reads false: a one-dim tensor's is a branch its nonzero values may take, ``if wd == 0``'s
        # else; a 0-dim one's counts where it holds with them true too, as fused SGD's contradicting reads do not)
        if either and one_dim or (either or one_dim) and raises_if_taken(path):
            if not either:  # (a 0 skips the branch: what holds without it)
                at_zero[path] = raises.get(path, frozenset())
            raises[path] = frozenset({"host", "device"})  # (its kind, not its side: the verdict is the reads')
    return replace(baseline, group=verdicts, group_reads=costs, raises=raises, at_zero=at_zero)


def _placement(cls: type[torch.optim.Optimizer], group: Mapping[str, Any], ndim: int) -> Observed | str:
    """The cached probe: what it observed, or why it could not run."""

    def could_not(e: Exception) -> Observed | str:
        if isinstance(e, _Unbuilt):
            return f"the probe could not build {cls.__name__} from a param and its group's hyperparameters ({e})"
        return f"the probe could not run {cls.__name__} ({_error(e)})"

    return _cached(("placement", probe_key(cls, group, ndim)), lambda: _observe(cls, group, min(ndim, 2)), could_not)


def probe(cls: type[torch.optim.Optimizer], group: Mapping[str, Any], ndim: int) -> Observed | None:
    """What one step of a fresh ``cls`` over a fake ``cuda:0`` param of rank ``ndim`` with ``group``'s
    hyperparameters does; ``None`` when the probe cannot run (:func:`unprobed` says why)."""
    found = _placement(cls, group, ndim)
    return found if isinstance(found, Observed) else None


def unprobed(cls: type[torch.optim.Optimizer], group: Mapping[str, Any], ndim: int) -> str | None:
    """Why :func:`probe` cannot run for ``cls`` with ``group`` (the constructor's error), ``None`` where it runs."""
    found = _placement(cls, group, ndim)
    return found if isinstance(found, str) else None


# --- what a step keeps per param: one step over two small host params -------------------------------------------


@dataclass(frozen=True)
class StateSpec:
    """What one step leaves in a param's state (two small host params): its keys, those of tensors of the param's
    shape, 0-dim, any tensor, non-scalar floating, never larger than the param (Adafactor's ``row_var``);
    ``eager``: a param without state cannot step (Adagrad up to torch 2.11)."""

    keys: frozenset[str] = frozenset()
    shaped: frozenset[str] = frozenset()
    scalars: frozenset[str] = frozenset()
    tensors: frozenset[str] = frozenset()
    floating: frozenset[str] = frozenset()
    bounded: frozenset[str] = frozenset()
    eager: bool = False


NO_SPEC = StateSpec()


def _host_kwargs(
    cls: type[torch.optim.Optimizer], group: Mapping[str, Any], skip: tuple[str, ...] = ()
) -> dict[str, Any]:
    """A host trial's keywords: the flags at their defaults, but ``foreach=False`` (the same ops, one at a time)."""
    kwargs = built_kwargs(cls, group, skip + IMPLEMENTATION_FLAGS)
    if "foreach" in signature_defaults(cls) and "foreach" not in skip:
        kwargs["foreach"] = False
    return kwargs


def expected_state(cls: type[torch.optim.Optimizer], group: Mapping[str, Any], ndim: int) -> StateSpec:
    """The state one step of ``cls`` leaves on two small host params of rank ``ndim`` (1 or 2), empty when it cannot
    run. NOTE: rank 0 is probed as 1: there every entry is 0-dim, its buffers indistinguishable from ``step``."""
    ndim = max(ndim, 1)
    shapes: list[tuple[int, ...]] = [(2, 3), (3, 2)] if ndim >= 2 else [(5,), (7,)]
    key = ("spec", probe_key(cls, group, ndim))
    return _cached(key, lambda: _spec(cls, _host_kwargs(cls, group), shapes), lambda _: NO_SPEC)


def _host_params(shapes: list[tuple[int, ...]]) -> list[torch.nn.Parameter]:
    params = [torch.nn.Parameter(torch.full(s, 0.5, dtype=torch.float32)) for s in shapes]
    for p in params:
        p.grad = torch.full(p.shape, 0.25)
    return params


def _spec(cls: type[torch.optim.Optimizer], kwargs: dict[str, Any], shapes: list[tuple[int, ...]]) -> StateSpec:
    with throwaway():
        params = _host_params(shapes)
        opt = cls(params, **kwargs)
        eager = all(opt.state.get(p) for p in params) and not _steps_without_state(cls, kwargs, shapes)
        # (the state was created before whatever failed; it is all we read. torch's stubs type the loss as a float)
        _failure(lambda: opt.step(lambda: torch.tensor(1.0)))  # type: ignore[arg-type, return-value]
        states = [opt.state.get(p, {}) for p in params]
        if not all(states):
            return NO_SPEC

        def common(test: Callable[[Any, torch.Tensor], bool]) -> frozenset[str]:
            return frozenset.intersection(
                *(frozenset(k for k, v in st.items() if test(v, p)) for st, p in zip(states, params))
            )

        return StateSpec(
            keys=frozenset.intersection(*(frozenset(st) for st in states)),
            shaped=common(lambda v, p: isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape == p.shape),
            scalars=common(lambda v, p: isinstance(v, torch.Tensor) and v.dim() == 0),
            tensors=common(lambda v, p: isinstance(v, torch.Tensor)),
            floating=common(lambda v, p: isinstance(v, torch.Tensor) and v.dim() > 0 and v.is_floating_point()),
            bounded=common(lambda v, p: isinstance(v, torch.Tensor) and v.dim() > 0 and v.numel() <= p.numel()),
            eager=eager,
        )


def _steps_without_state(
    cls: type[torch.optim.Optimizer], kwargs: dict[str, Any], shapes: list[tuple[int, ...]]
) -> bool:
    """Whether a param whose state is missing still steps (the class creates it there: a lazy class)."""
    params = _host_params(shapes)
    opt = cls(params, **kwargs)
    opt.state.pop(params[0], None)
    stepped = _failure(lambda: opt.step(lambda: torch.tensor(1.0))) is None  # type: ignore[arg-type, return-value]
    return stepped and bool(opt.state.get(params[0]))


# --- which state dtypes a step refuses: a host trial -------------------------------------------------------------
#
# NOTE: the host trial stands for the device: the same ops, and fused kernels with host twins with the same checks
# (capturable cannot step on a host: off). A device kernel stricter than its twin (a CUDA fused kernel's `step`
# dtype) is not seen; where the trial cannot run on the host, nothing is rejected.


@dataclass(frozen=True)
class Rejection:
    """A state entry whose dtype a step refuses: ``key``, its ``dtype``, the one a fresh optimizer keeps
    (``fresh``) and the step's error (``error``). For a container, the dtype of the tensors in it."""

    key: str
    dtype: torch.dtype
    fresh: torch.dtype
    error: str


def entry_dtypes(entries: Mapping[Any, Any], skip: AbstractSet[int] = frozenset()) -> dict[Any, torch.dtype]:
    """{key: dtype} of each state entry that is a tensor, or holds tensors of one dtype (LBFGS's history lists);
    tensors whose id is in ``skip`` (a group's own, as LBFGS's ``t``) are left out."""
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


class _Trial:
    """One fresh optimizer over a host param; ``step()`` steps it, ``recast`` changes some entries' dtypes."""

    def __init__(
        self, cls: type[torch.optim.Optimizer], group: Mapping[str, Any], dtype: torch.dtype, ndim: int
    ) -> None:
        kwargs = built_kwargs(cls, group)
        if "capturable" in kwargs:
            kwargs["capturable"] = False  # it cannot step on a host; the dtype rules are the same
        self.param = torch.full(((3, 2) if ndim >= 2 else (3,)) if ndim else (), 0.5, dtype=dtype)
        self.opt = cls([self.param], **kwargs)
        self.steps = 0

    def step(self) -> None:
        # NOTE: a quadratic loss whose minimum moves every step: LBFGS fills its history and walks it in the next
        # step, so the dtypes of old_dirs/old_stps are tried (a constant grad left the history empty).
        self.steps += 1
        target = float(self.steps)

        def closure() -> torch.Tensor:  # LBFGS: a loss and a grad, without autograd
            self.param.grad = self.param - target
            return ((self.param - target) ** 2).sum() / 2

        self.param.grad = self.param - target
        self.opt.step(closure)  # type: ignore[arg-type]  # torch's stubs type the closure's loss as a float

    def held_dtypes(self) -> dict[Any, frozenset[torch.dtype]]:
        """{key: the dtypes of its tensors} for every entry holding one (a container's may be mixed)."""
        state = self.opt.state.get(self.param, {}).items()
        return {key: found for key, value in state if (found := frozenset(t.dtype for _, t in leaves(value)))}

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


FILL_STEPS = 4  # at most this many more steps for a trial to fill the entries in question (:func:`_filled`)
AFTER_STEPS = 3  # at most this many steps after the recast, while each changes the dtypes (:func:`_refusal`)


def _filled(
    cls: type[torch.optim.Optimizer], group: Mapping[str, Any], dtype: torch.dtype, ndim: int, keys: AbstractSet[Any]
) -> _Trial:
    """A fresh trial, stepped once, then again while one of ``keys`` it holds has no tensor in it (LBFGS keeps
    ``old_dirs`` empty until a step sees a positive curvature: an empty entry cannot be tried)."""
    trial = _Trial(cls, group, dtype, ndim)
    trial.step()
    for _ in range(FILL_STEPS):
        state = trial.opt.state.get(trial.param, {})
        if not any(key in state and not holds_tensor(state[key]) for key in keys):
            break
        trial.step()
    return trial


def _refusal(trial: _Trial, dtypes: Mapping[str, torch.dtype]) -> str | None:
    """The error of a step of ``trial`` with ``dtypes`` recast, ``None`` if the steps take them; it steps again
    while the dtypes change (LBFGS's ``d`` made anew in the param's dtype meets a float64 ``prev_flat_grad``)."""
    trial.recast(dtypes)

    def steps() -> None:
        held = trial.held_dtypes()
        for _ in range(AFTER_STEPS):
            trial.step()
            before, held = held, trial.held_dtypes()
            if held == before:
                return

    error = _failure(steps)
    return None if error is None else f"{type(error).__name__}: {error}"


def _try(
    cls: type[torch.optim.Optimizer],
    group: Mapping[str, Any],
    dtype: torch.dtype,
    ndim: int,
    dtypes: Mapping[str, torch.dtype],
) -> tuple[Rejection, ...]:
    """The rejections, ``()`` if a step takes these dtypes; raises if the trial cannot run."""
    with throwaway(), torch.no_grad():
        keys = frozenset(dtypes)
        trial = _filled(cls, group, dtype, ndim, keys)  # (an error: the cache answers None)
        fresh = entry_dtypes(trial.opt.state.get(trial.param, {}))
        changed = {k: d for k, d in dtypes.items() if k in fresh and fresh[k] != d}
        if not changed:
            return ()
        together = _refusal(trial, changed)
        if together is None:
            return ()
        rejected: list[Rejection] = []
        for key, wanted in changed.items():  # which of them, each alone (from the same state: a trial is repeatable)
            error = _refusal(_filled(cls, group, dtype, ndim, keys), {key: wanted})
            if error is not None:
                rejected.append(Rejection(key, wanted, fresh[key], error))
        return tuple(rejected) or tuple(Rejection(k, d, fresh[k], together) for k, d in changed.items())


def rejected_dtypes(
    cls: type[torch.optim.Optimizer], group: Mapping[str, Any], param: torch.Tensor, dtypes: Mapping[str, torch.dtype]
) -> list[Rejection]:
    """The entries of ``dtypes`` (as :func:`entry_dtypes` gives) that a step of ``cls`` with ``group`` over a param
    like ``param`` (dtype, rank) refuses; not those a fresh optimizer lacks or the host trial cannot tell. An integer
    or bool param has no trial (a complex one has: complex64 moments under a complex128 param fail Adam's step)."""
    if not (param.is_floating_point() or param.is_complex()):
        return []
    asked = tuple(sorted((str(k), str(d)) for k, d in dtypes.items()))
    key = ("dtypes", probe_key(cls, group, param.dim()), param.dtype, asked)
    found = _cached(key, lambda: _try(cls, group, param.dtype, min(param.dim(), 2), dtypes), lambda _: None)
    return list(found or ())


# --- whether a step reads a group key -------------------------------------------------------------------------


def step_needs(cls: type[torch.optim.Optimizer], group: Mapping[str, Any], key: str) -> bool:
    """Whether two steps of ``cls`` over a small host param, ``key`` deleted from ``group`` and ``__setstate__`` run
    as a load runs it, raise ``KeyError(key)`` (Rprop reads ``lr`` only in the first; a key read with a default,
    SparseAdam's ``maximize``, unsaved before PyTorch 1.13, is not needed). Where no trial step runs, the key is
    needed: a fresh group holds it and nothing fills it."""
    without = {k: v for k, v in group.items() if k != key}

    def needs() -> bool:
        kwargs = _host_kwargs(cls, without, (key,))
        # (a class that takes only sparse grads refuses dense ones: SparseAdam)
        tried = [_steps_without(cls, kwargs, key, sparse) for sparse in (False, True)]
        return next((t for t in tried if t is not None), True)

    return _cached(("needs", probe_key(cls, without, 2), key), needs, lambda _: True)


def _steps_without(cls: type[torch.optim.Optimizer], kwargs: dict[str, Any], key: str, sparse: bool) -> bool | None:
    """True if two steps without ``key`` raise ``KeyError(key)``, False if they run, None if they fail otherwise."""
    with throwaway():
        param = torch.nn.Parameter(torch.full((2, 3), 0.5))  # 2-D: Muon takes only those

        def closure() -> torch.Tensor:
            grad = torch.full((2, 3), 0.25)
            param.grad = grad.to_sparse() if sparse else grad
            return torch.tensor(1.0)

        try:
            opt = cls([param], **kwargs)
            opt.param_groups[0].pop(key, None)
            opt.__setstate__({"state": opt.state, "param_groups": opt.param_groups})
            with torch.no_grad():
                for _ in range(2):
                    closure()
                    opt.step(closure)  # type: ignore[arg-type]  # (torch's stubs type the loss as a float)
        except KeyError as e:
            return True if e.args == (key,) else None
        except TRANSIENT:  # (says nothing of the class: never its answer)
            raise
        except Exception:
            return None
    return False
