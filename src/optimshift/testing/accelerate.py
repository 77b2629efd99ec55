"""Accelerate (and the Transformers ``Trainer``, built on it) on the simulated accelerator, in CPU-only CI.

The recipe, in one block::

    from optimshift.testing.accelerate import on_device

    with on_device() as device:                       # sim:0; every Accelerator made inside runs there
        accelerator = accelerate.Accelerator()        # or TrainingArguments(...) / Trainer(...)
        model, optimizer = accelerator.prepare(model, optimizer)
        ...
        accelerator.save_state(folder, safe_serialization=False)

What it does: Accelerate picks its device from the ``ACCELERATE_TORCH_DEVICE`` environment variable when no
GPU is present, and keeps its state process-wide (``AcceleratorState``): :func:`on_device` sets the simulator
up, sets the variable, and resets that state on the way in and out (and restores the variable), so that each
block starts from a fresh Accelerate. The Transformers ``Trainer`` follows: ``TrainingArguments.device`` is
then ``sim:0``.

``save_state(..., safe_serialization=False)``: safetensors refuses tensors on a device it does not know, so the
models in an Accelerate folder must be written with ``torch.save`` there. (The Trainer's ``save_pretrained``
copies weights to the host first and needs nothing.)

Importing this module imports nothing of Accelerate; :func:`on_device` does.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

from .simulated import SIM_DEVICE_TYPE, simulated_accelerator

__all__ = ["on_device"]

_VARIABLE = "ACCELERATE_TORCH_DEVICE"


def _reset() -> None:
    # NOTE: Accelerate's own test suites reset its process-wide state this way; there is no public call.
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


@contextlib.contextmanager
def on_device(device: int | str | torch.device = 0) -> Iterator[torch.device]:
    """Within the block, every new ``accelerate.Accelerator`` (and Transformers ``Trainer``) runs on ``device``.

    ``device``: an index of the simulated accelerator (``0``, ``1``), ``"sim:1"``, or any other device
    (``"cpu"``). Yields it as a ``torch.device``. Blocks may follow each other (save in one, load in the next);
    an Accelerator made in a block should not be used after it.
    """
    if isinstance(device, int) and not isinstance(device, bool):
        resolved = simulated_accelerator(device)
    else:
        resolved = torch.device(device)
        if resolved.type == SIM_DEVICE_TYPE:
            resolved = simulated_accelerator(resolved.index or 0)
    try:
        import accelerate  # noqa: F401
    except ImportError as e:
        raise ImportError("optimshift.testing.accelerate needs Accelerate: pip install 'optimshift[accelerate]'") from e
    saved = os.environ.get(_VARIABLE)
    _reset()
    os.environ[_VARIABLE] = str(resolved)
    try:
        yield resolved
    finally:
        if saved is None:
            os.environ.pop(_VARIABLE, None)
        else:
            os.environ[_VARIABLE] = saved
        _reset()
