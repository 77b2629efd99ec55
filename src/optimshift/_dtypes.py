"""Which state dtypes a step accepts, observed rather than assumed; and what :func:`optimshift.check` says of them.

optimshift never changes a dtype: ``load_state_dict`` keeps the checkpoint's (unless ``cast="param"``), and a
move keeps what is there. That is right where the kernels accept it (SGD's float32 momentum for bfloat16
params) and wrong where they do not (Adam's ``lerp_`` wants ``exp_avg`` in the grad's dtype: float64 moments
for float32 params make the next ``step()`` raise). Which is which depends on the class, its flags and the
param dtype, so it is tried: :func:`optimshift._probe.rejected_dtypes` steps a fresh optimizer over a small host
param of that dtype until it holds the entries in question (its own state: the dtypes a fresh optimizer keeps;
LBFGS fills its history lists only once a step measures a positive curvature), then again with those entries in
the dtypes given, and again while a step changes the dtypes it found (LBFGS makes ``d`` anew in the grad's dtype
and keeps ``prev_flat_grad``'s: a float64 pair passes one step and fails the next). An entry is a tensor or a
container of tensors in one dtype (LBFGS's ``old_dirs``, ``old_stps``, ``ro``, ``al``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from ._probe import Rejection, entry_dtypes, rejected_dtypes
from ._state import group_tensors, label_in, leaves

if TYPE_CHECKING:
    from .report import Finding

__all__ = ["Rejection", "rejected_dtypes", "entry_dtypes", "dtype_findings", "dtype_name", "stepping_base"]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def stepping_base(optimizer: Any) -> type[torch.optim.Optimizer] | None:
    """The torch.optim class a host trial of dtypes steps for ``optimizer``: its base, where it steps with the
    base's step; None for a class with a step of its own (what it keeps is its own; the trial never builds a
    user's class: its ``__init__`` and step may log, draw random numbers or join a collective), as a load's
    checks (:mod:`optimshift.checkpoint._staging`) judge only such a class."""
    from .policy import stepping_base as of_class

    return of_class(type(optimizer))


def dtype_findings(optimizer: Any) -> list[Finding]:
    """:func:`optimshift.check`'s findings for state entries whose dtype the next step would refuse."""
    from .report import Finding

    base = stepping_base(optimizer)
    if base is None:
        return []
    name = type(optimizer).__name__
    findings: list[Finding] = []
    for gi, group in enumerate(optimizer.param_groups):
        own = {id(t) for _, t in group_tensors(group)}
        memo: dict[tuple[torch.dtype, int, tuple[tuple[str, str], ...]], list[Rejection]] = {}
        for pi, p in enumerate(group["params"]):
            state = optimizer.state.get(p)
            if not isinstance(p, torch.Tensor) or not isinstance(state, Mapping):
                continue
            dtypes = entry_dtypes(state, own)
            memo_key = (p.dtype, p.dim(), tuple(sorted((str(k), str(d)) for k, d in dtypes.items())))
            if memo_key not in memo:
                memo[memo_key] = rejected_dtypes(base, group, p, dtypes)
            label = label_in(optimizer, gi, pi)
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
