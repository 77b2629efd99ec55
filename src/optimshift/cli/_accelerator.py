"""The accelerator the command-line tools run on."""

from __future__ import annotations

from typing import Any

import torch

from .._devices import resolve
from ..report import format_table


def demo_accelerator(name: str | None = None) -> torch.device:
    """The accelerator a command-line tool runs on: ``name`` if given (``sim`` sets the simulated one up),
    else ``cuda:0`` when present, else the simulated accelerator."""
    if name is None:
        if torch.cuda.is_available():
            return torch.device("cuda", 0)
        name = "sim"
    if name.split(":")[0] == "sim":
        from ..testing import simulated_accelerator

        simulated_accelerator()
    return resolve(name)


# What every bench case says of the times it measured on the simulated accelerator.
SIMULATED_TIMES = (
    "times on the simulated accelerator measure the simulator (every op runs in Python on host copies), not a device"
)


def simulated(device: str | torch.device) -> bool:
    """Whether ``device`` is the simulated accelerator, whose times measure the simulator, not a device."""
    from ..testing.simulated import SIM_DEVICE_TYPE

    return str(device).split(":", 1)[0] == SIM_DEVICE_TYPE


def shipped_vs_patched(result: dict[str, Any], first_column: str, shipped: str) -> list[str]:
    """A framework case's table of each method's cycle and counts, and the line comparing the framework's shipped
    functions with optimshift's patched ones (``bench --case verl``, ``--case deepspeed``)."""
    rows = [
        [
            name,
            f"{m['cycle_s'] * 1e3:.1f}",
            str(m["syncs_per_step_after"]),
            str(m["host_allocations_per_cycle"]),
            f"{m['objects_kept'] * 100:.0f}%",
        ]
        for name, m in result["methods"].items()
    ]
    theirs, ours = result["methods"][shipped], result["methods"]["optimshift (patched)"]
    speed = result["cycle_speedup"]
    return [
        format_table([first_column, "cycle ms", "syncs/step after", "host allocations/cycle", "objects kept"], rows),
        f"patched vs shipped: a cycle {speed:.2f}x {'faster' if speed >= 1 else 'slower'} "
        f"({ours['cycle_s'] * 1e3:.1f} ms vs {theirs['cycle_s'] * 1e3:.1f} ms); host syncs per step "
        f"{theirs['syncs_per_step_after']} -> {ours['syncs_per_step_after']}; host allocations per cycle "
        f"{theirs['host_allocations_per_cycle']} -> {ours['host_allocations_per_cycle']}",
    ]
