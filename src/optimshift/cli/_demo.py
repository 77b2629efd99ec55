"""``optimshift demo``: the resume bug of Lightning #19955 end to end, in under a minute on a CPU.

Train a small model with Adam on the host, save a checkpoint, restore it on the host and move model and
optimizer to the accelerator (a real GPU when present, else the simulated one) three ways, and print where
``step`` lives, host syncs per step, whether the step ran, and the largest param difference against training
that never stopped.
"""

from __future__ import annotations

import argparse
import io
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from ..api import move
from ..report import format_table
from ..syncs import count_syncs
from ._accelerator import demo_accelerator, simulated
from ._common import failure

STEPS_BEFORE, STEPS_AFTER = 3, 5

DESCRIPTION = """\
Shows the optimizer resume bug reported as Lightning issue #19955, and its fix, in under a minute on a CPU.

A small model is trained with Adam on the host and checkpointed. The checkpoint is restored on the host, then
model and optimizer are moved to the accelerator (a GPU when there is one, else a simulated accelerator that
runs on the CPU) in three ways: every tensor moved, Lightning's current rule (everything but the step
counter), and optimshift.move. For each, the table says where Adam's step counter ends up, how many
device-to-host syncs each training step costs, whether the step runs at all, and how far the parameters drift
from a run that never stopped.
"""


@dataclass
class Row:
    method: str
    optimizer: str
    step_device: str
    syncs_per_step: float | None
    step_ran: str
    max_param_diff: float | None


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4)
    )


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)


def _train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int, device: torch.device) -> None:
    x, y = (t.to(device) for t in _batch(step))
    opt.zero_grad(set_to_none=True)
    torch.nn.functional.mse_loss(model(x), y).backward()  # type: ignore[no-untyped-call]  # unannotated in torch
    opt.step()


def _naive_move(opt: torch.optim.Optimizer, device: torch.device) -> None:
    """What Lightning did before #20019 (and verl, NeMo-RL, Composer, Accelerate do): every tensor moves."""
    for state in opt.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                state[key] = value.to(device)


def _lightning_move(opt: torch.optim.Optimizer, device: torch.device) -> str:
    """Lightning's current rule: move everything except ``step`` (the real function when lightning is installed)."""
    try:
        from lightning.fabric.utilities.optimizer import _optimizer_to_device

        _optimizer_to_device(opt, device)
        return "lightning._optimizer_to_device"
    except ImportError:
        for state in opt.state.values():
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and key != "step":
                    state[key] = value.to(device)
        return "Lightning's rule (skip 'step'), replicated"


def _resume(
    checkpoint: bytes,
    device: torch.device,
    fused: bool,
    how: Callable[[torch.optim.Optimizer], Any],
    reference: list[torch.Tensor],
    method: str,
) -> Row:
    saved = torch.load(io.BytesIO(checkpoint), weights_only=True)
    model = _model(1)  # different init: everything must come from the checkpoint
    model.load_state_dict(saved["model"])
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, fused=fused)
    opt.load_state_dict(saved["optimizer"])  # restored on the host, as a CPU-side checkpoint load does
    model.to(device)  # then the model goes to the accelerator, and the optimizer state must follow
    how(opt)
    step = next(iter(opt.state.values()))["step"]
    label = f"Adam{' fused' if fused else ''}"
    try:
        with count_syncs() as syncs:
            for s in range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER):
                _train_step(model, opt, s, device)
    except RuntimeError as e:
        reason = str(e).split("\n")[0]
        short = "a host tensor in the fused kernel" if "fused" in reason else reason[:50]
        return Row(method, label, str(step.device), None, f"no: {short}", None)
    diff = max((p.detach().cpu() - r).abs().max().item() for p, r in zip(model.parameters(), reference))
    return Row(method, label, str(step.device), syncs.total / STEPS_AFTER, "yes", diff)


def run_demo(device: torch.device | None = None) -> list[Row]:
    """Run the scenario; returns the table rows."""
    device = demo_accelerator() if device is None else device
    rows = []
    for fused in (False, True):
        host = torch.device("cpu")
        model = _model(0)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2, fused=fused)
        for s in range(STEPS_BEFORE):
            _train_step(model, opt, s, host)
        buffer = io.BytesIO()
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, buffer)
        checkpoint = buffer.getvalue()
        for s in range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER):  # the run that never stopped
            _train_step(model, opt, s, host)
        reference = [p.detach().clone() for p in model.parameters()]
        if not fused:
            rows.append(
                _resume(
                    checkpoint,
                    device,
                    fused,
                    lambda o: _naive_move(o, device),
                    reference,
                    "naive: every tensor to the device",
                )
            )
        else:
            lightning_name: list[Any] = []

            def lightning_move(o: Any, names: list[Any] = lightning_name) -> None:
                names.append(_lightning_move(o, device))

            rows.append(
                _resume(
                    checkpoint,
                    device,
                    fused,
                    lightning_move,
                    reference,
                    "Lightning today: all but 'step'",
                )
            )
        rows.append(_resume(checkpoint, device, fused, lambda o: move(o), reference, "optimshift.move(opt)"))
    return rows


def render(rows: list[Row], device: torch.device) -> str:
    table = format_table(
        ["resume method", "optimizer", "'step' lives on", "host syncs/step", "step ran", "max |param diff|"],
        [
            [
                r.method,
                r.optimizer,
                r.step_device,
                "-" if r.syncs_per_step is None else f"{r.syncs_per_step:g}",
                r.step_ran,
                "-" if r.max_param_diff is None else f"{r.max_param_diff:.3g}",
            ]
            for r in rows
        ],
    )
    note = (
        (
            "(simulated accelerator: real values computed on the host; a real GPU shows small param differences "
            "from its different kernels)"
        )
        if simulated(device)
        else ""
    )
    return (
        f"Adam trained {STEPS_BEFORE} steps on the host, checkpointed, resumed on {device} for {STEPS_AFTER} "
        f"steps; compared with training that never stopped.\n\n{table}\n{note}"
    ).rstrip()


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="reproduce the Lightning #19955 resume bug and its fix (under a minute, CPU-only is fine)",
        description=DESCRIPTION,
    )
    parser.add_argument(
        "--device",
        default=None,
        help="accelerator to resume on (default: cuda:0 if present, else the simulated accelerator)",
    )
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    parser.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    try:
        device = demo_accelerator(args.device)
    except (ValueError, TypeError) as e:  # (a device this machine lacks, a name torch does not know)
        return failure("demo", f"--device {args.device}: {e}", as_json=args.json, error=e)
    rows = run_demo(device)
    if args.json:
        print(json.dumps([asdict(r) for r in rows], indent=2))
    else:
        print(render(rows, device))
    return 0
