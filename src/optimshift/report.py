"""What :func:`optimshift.check` and :func:`optimshift.placement` return: findings and placement rows."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .policy import default_foreach, runs_foreach

__all__ = [
    "Finding",
    "Report",
    "PlacementRow",
    "format_table",
    "SYNC_COST",
    "DIFFERENTIABLE_SYNC_COST",
    "sync_cost",
    "runs_foreach",
    "default_foreach",
    "assumed",
    "default_rule_note",
]

# Host syncs per param per step that one 0-dim state tensor torch reads on the host costs kept on an accelerator,
# (single-tensor, foreach); measured on the simulated accelerator, re-measured by tests/test_check.py.
SYNC_COST: dict[tuple[str, str], tuple[int, int]] = {
    ("Adam", "step"): (1, 2),
    ("AdamW", "step"): (1, 2),
    ("Adagrad", "step"): (1, 1),
    ("Adadelta", "step"): (0, 0),
    ("Adamax", "step"): (1, 1),
    ("NAdam", "step"): (1, 3),
    ("NAdam", "mu_product"): (2, 2),
    ("RAdam", "step"): (1, 5),
    ("RMSprop", "step"): (0, 0),
    ("Rprop", "step"): (0, 0),
    ("Adafactor", "step"): (1, 3),
}

# The entries whose cost under ``differentiable=True`` differs from the single-tensor one (re-measured too).
DIFFERENTIABLE_SYNC_COST: dict[tuple[str, str], int] = {
    ("Adam", "step"): 0,
    ("AdamW", "step"): 0,
    ("NAdam", "mu_product"): 0,
}


def sync_cost(
    cls: type | None,
    name: str,
    key: str,
    foreach: bool | None,
    on_device: bool,
    group: Mapping[str, Any] | None = None,
    ndim: int = 1,
    *,
    hyper: Mapping[str, Any] | None = None,
    default: bool | None = None,
) -> int | None:
    """Host syncs per param per step of 0-dim state ``key`` kept on an accelerator, by the torch.optim class ``cls``
    steps with (else ``name``) and the implementation :func:`runs_foreach` picks (``default``: torch's pick for the
    group where known, else ``on_device``); a class with a step of its own: what its probe counted over ``group``
    and a param of rank ``ndim``. None where nothing was measured."""
    from ._probe import probe
    from .policy import stepping_base

    base = stepping_base(cls) if cls is not None else None  # (a subclass with a step of its own: None)
    # (by ``name`` only for a class not at hand, inspect's: a class of its own named "Adam" is not torch's)
    row = (base.__name__ if base else name if cls is None else "", key)
    costs = SYNC_COST.get(row)  # (single-tensor, foreach)
    if costs is None:
        if cls is None or group is None or not on_device or base is not None:
            return None
        observed = probe(cls, group, ndim)
        return None if observed is None else observed.reads.get(key)
    hyper = hyper if hyper is not None else group
    if hyper is not None and hyper.get("differentiable") and not foreach:
        return DIFFERENTIABLE_SYNC_COST.get(row, costs[0])
    picks = on_device if default is None else default
    return costs[1 if runs_foreach(row[0], foreach, picks, hyper) else 0]


@dataclass(frozen=True)
class PlacementRow:
    """One tensor held by an optimizer: which param and key, where it is, what it is, how big (a DTensor's: this
    rank's shard's ``device``, ``bytes`` and ``local_shape``, the global ``shape``, its mesh ``placements``)."""

    param: str
    key: str
    device: str
    dtype: str
    shape: tuple[int, ...]
    bytes: int
    local_shape: tuple[int, ...] | None = None
    placements: str | None = None


def assumed(name: str) -> str:
    """How a finding placed by the default rule begins (``check``'s and ``inspect``'s): a guess, not a fact."""
    return f"assumed by the default rule (no placement rule is known for {name}, see below): "


def default_rule_note(name: str, reasons: Iterable[str], *, register: bool = True) -> str:
    """The note after such findings: why no rule is known for ``name``, what the default does, and (``register``:
    ``name`` is a class) how to give one."""
    return (
        f"no placement rule is known for {name}: {'; '.join(reasons)}; used the default (a 0-dim 'step' stays on "
        f"the host unless the group is fused/capturable; everything else follows its param)."
        + (f" Register one with optimshift.register_policy({name}, policy) if that is wrong." if register else "")
    )


@dataclass(frozen=True)
class Finding:
    """One state entry not where a fresh optimizer would keep it, or a note: ``severity`` ``"error"`` (``step()``
    will fail), ``"warning"`` (it costs syncs or memory) or ``"info"``; ``syncs_per_step`` where known."""

    severity: str
    param: str
    key: str
    device: str
    dtype: str
    expected: str
    why: str
    group: int | None = None
    index: int | None = None
    syncs_per_step: int | None = None


@dataclass
class Report:
    """The result of :func:`optimshift.check`: ``ok`` unless an entry is misplaced; ``str()`` is a table."""

    optimizer: str
    findings: list[Finding] = field(default_factory=list)
    rows: list[PlacementRow] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not any(f.severity in ("error", "warning") for f in self.findings)

    @property
    def syncs_per_step(self) -> int:
        """Known host syncs per step that the misplaced entries cost in total."""
        return sum(f.syncs_per_step or 0 for f in self.findings)

    def __str__(self) -> str:
        head = f"optimshift check: {self.optimizer}, {len(self.rows)} state tensors"
        if not self.findings:
            return head + ": every entry is where a fresh optimizer would keep it."
        header = ["severity", "param", "key", "device", "dtype", "expected", "syncs/step", "why"]
        syncs = ["" if f.syncs_per_step is None else str(f.syncs_per_step) for f in self.findings]
        rows = [
            [f.severity, f.param, f.key, f.device, f.dtype, f.expected, n, f.why] for f, n in zip(self.findings, syncs)
        ]
        return f"{head}: {'OK' if self.ok else 'NOT OK'}\n{format_table(header, rows)}"

    __repr__ = __str__


def format_table(header: list[str], rows: list[list[str]]) -> str:
    """A plain aligned text table."""
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(header, widths)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    lines.extend("  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows)
    return "\n".join(lines)
