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
