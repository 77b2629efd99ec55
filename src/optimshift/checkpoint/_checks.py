"""What a ``torch.optim`` class needs of the state it loads (its groups' hyperparameters, each param's entries),
read from the installed torch; each check raises through ``fail``, which names the optimizer and the file."""

from __future__ import annotations

import inspect
import numbers
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch

from .._errors import dtype_name, with_article
from .._probe import TRANSIENT, StateSpec, signature_defaults, step_needs, throwaway
from .._state import GROUP_SKIP, IMPLEMENTATION_FLAGS

__all__ = ["check_group", "check_entries", "keys_shown", "fresh_group", "torch_cast", "NOT_REAL"]

Fail = Callable[..., Exception]
"""``fail(message, exc=ValueError)``: the exception to raise, its message prefixed with the optimizer and file."""


def check_group(
    fail: Fail, cls: type[torch.optim.Optimizer], base: type[torch.optim.Optimizer], gi: int, group: Mapping[str, Any]
) -> None:
    """The hyperparameters torch.optim class ``base`` (that ``cls`` steps as) takes are in param group ``gi``
    and have the types it needs (PyTorch fails at step())."""
    fresh, filled = _group_keys(cls, base)
    absent = sorted(k for k in fresh if k not in group and k not in filled and step_needs(base, group, k))
    if absent:
        key = absent[0]
        raise fail(
            f"param group {gi} has no {keys_shown(absent)}, which {base.__name__}.step reads (a fresh "
            f"{base.__name__} group holds {keys_shown(fresh)}); the checkpoint is incomplete or was "
            f"edited. Set {'it' if len(absent) == 1 else 'each'} in the state dict before loading, e.g. to "
            f"the optimizer's own value: state_dict['param_groups'][{gi}][{key!r}] = "
            f"optimizer.param_groups[{gi}][{key!r}]; the optimizer is unchanged"
        )
    for key, default in _hyper_defaults(base).items():
        if key in group and key not in GROUP_SKIP:
            problem = _hyper_problem(key, default, group[key])
            if problem is not None:
                raise fail(f"param group {gi}, key {key!r}: {problem}", TypeError)


def check_entries(
    fail: Fail,
    where: Callable[[Any], str],
    base: type[torch.optim.Optimizer],
    p: torch.Tensor,
    saved: Mapping[Any, Any],
    spec: StateSpec,
) -> None:
    """Each entry a step of ``base`` creates is in ``saved`` (the checkpoint's state of param ``p``), with the
    kind, dtype and size it needs. ``where(key)``: the entry in words for an error (``where(None)``: the param)."""
    if not spec.keys <= saved.keys():
        missing = [k for k in spec.keys if k not in saved]
        raise fail(
            f"{where(None)}: its state has no {keys_shown(missing)}; {base.__name__}.step keeps {keys_shown(spec.keys)}"
        )
    strided, plain = torch.strided, torch.Tensor
    for key in spec.tensors:
        value = saved[key]
        if key in spec.scalars:
            if type(value) is plain:  # (the common case, decided inline: this runs once per entry)
                if value.numel() == 1 and value.layout == strided and value.dtype not in NOT_REAL:
                    continue
            elif _number_like(value) and (not isinstance(value, torch.Tensor) or value.layout == strided):
                continue  # a Python number is what older PyTorch saved; __setstate__ makes it a tensor
            raise fail(
                f"{where(key)}: expected a 0-dim tensor (or a number), got {_kind(value)}",
                TypeError if not isinstance(value, torch.Tensor) else ValueError,
            )
        if not isinstance(value, torch.Tensor):
            raise fail(f"{where(key)}: expected a tensor, got {_kind(value)}", TypeError)
        if value.layout != torch.strided:
            raise fail(
                f"{where(key)}: expected a dense tensor, got a {str(value.layout).replace('torch.', '')} one", TypeError
            )
        if key in spec.floating and not (value.is_floating_point() or value.is_complex()):
            raise fail(f"{where(key)}: expected a floating-point tensor, got {dtype_name(value.dtype)}", TypeError)
        if key in spec.bounded and key not in spec.shaped and value.numel() > p.numel():
            raise fail(
                f"{where(key)}: the checkpoint's tensor has {value.numel()} elements, more than its "
                f"param's {p.numel()} (shape {tuple(p.shape)}); this checkpoint was made for other "
                f"params"
            )


def keys_shown(keys: Any) -> str:
    return ", ".join(repr(k) for k in sorted(keys, key=str))


# --- which hyperparameters a torch.optim class takes -------------------------------------------------------


def _hyper_defaults(cls: type[torch.optim.Optimizer]) -> dict[str, Any]:
    """``cls.__init__``'s keyword defaults (``lr``, ``betas``, ``maximize``…), read from its signature."""
    return {k: d for k, d in signature_defaults(cls).items() if d is not inspect.Parameter.empty}


_fresh_groups: weakref.WeakKeyDictionary[type, dict[str, Any] | None] = weakref.WeakKeyDictionary()


def fresh_group(cls: type[torch.optim.Optimizer]) -> dict[str, Any] | None:
    """What a fresh ``cls`` group holds besides its params, read from the installed torch (None where ``cls`` cannot
    be built from params alone); cached. NOTE: built through a subclass whose ``add_param_group`` only records the
    group: torch's imports torch._dynamo (about 1.5 s). The param is 2-D: Muon takes only those."""
    if cls not in _fresh_groups:

        class _Recorder(cls):  # type: ignore[misc, valid-type]  # a base chosen at run time
            def add_param_group(self, param_group: dict[str, Any]) -> None:
                self.param_groups.append({**self.defaults, **param_group})

        try:
            with throwaway():
                opt = _Recorder([torch.nn.Parameter(torch.zeros(2, 3))])  # pyright: ignore[reportCallIssue]  # (the run-time base takes params alone)
            _fresh_groups[cls] = {k: v for k, v in opt.param_groups[0].items() if k not in GROUP_SKIP}
        except TRANSIENT:  # (says nothing of the class: never its answer, never kept)
            raise
        except Exception:
            _fresh_groups[cls] = None
    return _fresh_groups[cls]


def torch_cast(
    key: Any, group: Mapping[str, Any], param: tuple[torch.dtype, torch.device], value: tuple[torch.dtype, torch.device]
) -> tuple[torch.dtype, torch.device]:
    """The (dtype, device) PyTorch's ``Optimizer.load_state_dict`` gives a saved state tensor (``value``'s) of a
    param (``param``'s): ``_process_value_according_to_param_policy``, which ``cast='param'`` applies."""
    if key == "step":
        if group.get("fused") or group.get("capturable"):
            return torch.float32, param[1]
        return value
    return (param[0] if param[0].is_floating_point else value[0]), param[1]


# (by class, weakly: a class defined at run time goes with its last instance; then by its torch base)
_group_keys_cache: weakref.WeakKeyDictionary[type, dict[type, tuple[frozenset[str], frozenset[str]]]] = (
    weakref.WeakKeyDictionary()
)


def _group_keys(
    cls: type[torch.optim.Optimizer], base: type[torch.optim.Optimizer]
) -> tuple[frozenset[str], frozenset[str]]:
    """(the keys a fresh ``base`` group holds, those ``cls.__setstate__`` fills in a group lacking them). NOTE:
    PyTorch's classes ``setdefault`` each key older releases did not save (``foreach``...): those still load."""
    found = _group_keys_cache.get(cls, {}).get(base)
    if found is not None:
        return found
    with throwaway():
        recorded = fresh_group(base)
        defaults = dict(_hyper_defaults(base) if recorded is None else recorded)
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
            except TRANSIENT:  # (says nothing of the class: never its answer, never kept)
                raise
            except Exception:
                break
            filled = frozenset(k for k in bare.param_groups[0] if k in fresh and k not in given)
            break
    found = _group_keys_cache.setdefault(cls, {})[base] = (fresh, filled)
    return found


NOT_REAL = frozenset({torch.bool, torch.complex32, torch.complex64, torch.complex128})


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
            count = "a pair of" if len(default) == 2 else len(default)
            return f"expected {count} numbers like {default!r}, got {_kind(value)}"
        for i, (d, v) in enumerate(zip(default, value)):
            if not (_number_like(v) or (d is None and v is None)):
                return f"item {i} must be a number, got {_kind(v)}"
        return None
    if isinstance(default, str) and not isinstance(value, str):
        return f"expected a string, got {_kind(value)}"
    return None


def _kind(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)} ({dtype_name(value.dtype)})"
    if isinstance(value, (str, bytes)):
        return f"{type(value).__name__} {value[:40]!r}"
    if value is None:
        return "None"
    if isinstance(value, (tuple, list)):
        return f"{with_article(type(value).__name__)} of {len(value)}"
    return with_article(type(value).__name__)
