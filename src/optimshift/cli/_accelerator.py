"""The accelerator the command-line tools run on."""

from __future__ import annotations

import torch

from .._devices import resolve


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
