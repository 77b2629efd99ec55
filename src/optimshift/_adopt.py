"""Giving a tensor object another tensor's contents while it stays the same Python object.

A ``torch.compile``d step guards on the identity of every state tensor: replacing them recompiles it (and, past
``recompile_limit``, runs it eagerly for good). So the old object *adopts* its copy, by the first mechanism the pair
allows: ``"data"`` (``set_data``: same TensorImpl kind, plain class; not for a view where a swap works, as it keeps
the ``_base`` and its storage alive), ``"swap"`` (``_swap_tensor_impl``/``swap_tensors``: any devices, but no weak
reference to either and no other C++ holder), else ``"replace"`` (also for a ``Parameter`` kept in state, a
module's, and an inference tensor). :func:`mechanism` is pure, so every tensor is decided before any changes, and
:func:`adopt` cannot fail.
"""

from __future__ import annotations

import copyreg
import weakref
from collections import Counter
from collections.abc import Sequence
from typing import Any, Literal

import torch

__all__ = ["Mechanism", "mechanism", "decide_all", "still_valid", "adopt", "kept", "keeps_object_across_host"]

Mechanism = Literal["data", "swap", "replace"]

# NOTE: exact classes only. ``Parameter``/``Buffer`` keep no device in Python; any other subclass might
# (FakeTensor's ``fake_device``, a wrapper subclass's inner tensor), so it is swapped as a whole instead.
_PARAM = torch.nn.Parameter
_PLAIN = (torch.Tensor, torch.nn.Parameter) + ((torch.nn.Buffer,) if hasattr(torch.nn, "Buffer") else ())


def mechanism(old: torch.Tensor, new: torch.Tensor) -> Mechanism:
    """How ``old`` can take ``new``'s contents and stay the same object (see the module docstring)."""
    return decide_all([(old, new)])[0]


def decide_all(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], *, fresh: bool = False) -> list[Mechanism]:
    """:func:`mechanism` for each pair. ``fresh``: each ``new`` of a plain class is a copy just made of its ``old``,
    which requires no grad (``_copy.Batch.fresh``: no inference tensor, no other holder): not asked again."""
    out: list[Mechanism] = []
    append = out.append
    views: Counter[int] | None = None  # id(base) -> how often the olds that view it hold it (counted when needed)
    plain = torch.Tensor
    getweakrefcount = weakref.getweakrefcount
    use_count: Any = torch.Tensor._use_count  # type: ignore[attr-defined]  # (missing from torch's stubs)
    compatible = torch._has_compatible_shallow_copy_type  # (one C call: cheaper than a memo keyed by devices)
    for old, new in pairs:
        if fresh and type(old) is plain and type(new) is plain and not old.is_inference():
            # NOTE: the answers below for a fresh ``new`` (four C calls each saved, a third of a move's decisions);
            # anything else is decided by the general case.
            if compatible(old, new):
                append("swap" if old._is_view() and _swappable(old, new) else "data")
                continue
            if not (getweakrefcount(old) or getweakrefcount(new)) and use_count(old) == 1:
                append("swap")
                continue
        kind = (type(old), type(new))
        data = kind[0] in _PLAIN and kind[1] in _PLAIN and compatible(old, new)
        # (type() first: Parameter's isinstance goes through a Python-level metaclass check)
        if old.is_inference() or new.is_inference() or (kind[0] is not plain and isinstance(old, _PARAM)):
            # set_data breaks an inference tensor (no version counter to move); a Parameter in state is a
            # module's (a frozen param kept as state): changing it in place would move the model with the state
            append("replace")
        elif data:
            # NOTE: set_data keeps a view's ``_base`` (a dropped flat buffer an offload would never free); a swap
            # gives it the copy's TensorImpl, which views nothing.
            append("swap" if old._is_view() and type(old) is plain and _swappable(old, new) else "data")
        elif (
            kind[0] is plain
            and kind[1] is plain
            and not (getweakrefcount(old) or getweakrefcount(new))
            and use_count(old) == 1
            and use_count(new) == 1
            and not (old.requires_grad or new.requires_grad)
        ) or _swappable(old, new):  # (_swappable's checks for two plain tensors, inlined: once per tensor)
            append("swap")
        else:
            if views is None and type(old) is torch.Tensor:
                viewing = [(o.dtype, b) for o, _ in pairs if (b := o._base) is not None]  # (one _base each)
                views = Counter([id(b) for _, b in viewing])
                # (a view across complex and real, view_as_real(c) or c.real, holds its base twice: torch gives it
                # a forward view info of its own beside the backward one, which others share)
                views.update([id(b) for d, b in viewing if d is not b.dtype and d.is_complex != b.dtype.is_complex])
            # NOTE: a flat buffer kept in state with views of it (state[p]["view"] = flat[i:j]): each view holds
            # the base's TensorImpl. When those views are all among the tensors adopting copies here, nothing
            # that stays with the optimizer holds it, and a plain tensor is swapped without torch's use-count
            # check (_swap_tensor_impl): the old views keep the old base, now on the copy's object.
            held = views.get(id(old), 0) if views is not None and type(old) is torch.Tensor else 0
            append("swap" if held and _swappable(old, new, held) else "replace")
    return out


def _swappable(old: torch.Tensor, new: torch.Tensor, views: int = 0) -> bool:
    """What ``torch.utils.swap_tensors`` checks, asked beforehand (it raises half-way otherwise); ``views``:
    how many other holders of ``old`` are views of it that adopt copies too (see decide_all)."""
    if weakref.getweakrefcount(old) or weakref.getweakrefcount(new):
        return False
    if type(old) is not type(new) and set(copyreg._slotnames(type(old))) != set(copyreg._slotnames(type(new))):  # type: ignore[attr-defined]
        return False
    # Another C++ holder of either tensor (a view's base, an autograd node) would end up on the other object.
    use_count: Any = torch.Tensor._use_count  # type: ignore[attr-defined]
    return use_count(old) == 1 + views and use_count(new) == 1 and _grads_allow(old, new)


def _grads_allow(old: torch.Tensor, new: torch.Tensor) -> bool:
    """Whether autograd lets ``old`` take ``new``'s TensorImpl: neither requires grad, or both are grad-less,
    hook-less leaves (a grad or hook lives in the TensorImpl and would go with it to the other object)."""
    if not (old.requires_grad or new.requires_grad):
        return True
    return all(
        t.requires_grad
        and t.is_leaf
        and t.grad is None
        and t._backward_hooks is None
        and t._post_accumulate_grad_hooks is None
        for t in (old, new)
    )


def still_valid(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], hows: list[Mechanism]) -> bool:
    """Whether decisions made for an earlier commit of the same plan hold for these pairs: cheaper than
    :func:`decide_all` (what depends on classes, devices and inference-ness was checked with the plan; what a
    swap needs is asked again). A decision to replace is never reused (the tensor may be swappable now)."""
    if len(pairs) != len(hows):
        return False
    getweakrefcount = weakref.getweakrefcount
    use_count: Any = torch.Tensor._use_count  # type: ignore[attr-defined]
    for (old, new), how in zip(pairs, hows):
        if type(old) is not type(new) or how == "replace":
            return False
        if how == "swap" and (
            getweakrefcount(old)
            or getweakrefcount(new)
            or use_count(old) != 1
            or use_count(new) != 1
            or old.requires_grad
            or new.requires_grad
        ):
            return False
    return True


_HOST_PROBE = torch.empty(0)


def keeps_object_across_host(t: torch.Tensor) -> bool:
    """Whether ``t`` can move to or from the host and stay the same object: ``set_data`` applies (its TensorImpl
    is of the host's kind: CPU, CUDA), or nothing blocks a swap (no weak reference to it)."""
    if type(t) in _PLAIN and torch._has_compatible_shallow_copy_type(t, _HOST_PROBE):
        return True
    return not weakref.getweakrefcount(t)


def kept(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """``old`` holding ``new``'s contents where a mechanism allows it, else ``new``: one tensor adopting outside a
    commit (a param's grad going to or from the host)."""
    how = mechanism(old, new)
    if how == "replace":
        return new
    adopt([(old, new)], [how])
    return old


def adopt(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], hows: Sequence[Mechanism]) -> None:
    """The one adoption loop: each ``old`` takes its ``new``'s contents by its decision (a ``"replace"`` is the
    caller's: it puts ``new`` in ``old``'s place). Cannot fail once decided. A ``new`` must not be used
    afterwards (after a swap it holds its ``old``'s former contents)."""
    plain, swap_impl = torch.Tensor, torch._C._swap_tensor_impl
    for (old, new), how in zip(pairs, hows):
        if how == "data":
            old.data = new  # (inline: this loop runs once per tensor)
        elif how == "swap":
            if type(old) is plain and type(new) is plain:
                # (the C++ tensors only: swap_tensors would also hand the object's Python attributes to the copy)
                swap_impl(old, new)
            else:
                torch.utils.swap_tensors(old, new)  # type: ignore[no-untyped-call]  # unannotated in torch
