"""Hugging Face Accelerate: place optimizer state where a fresh optimizer would, in ``prepare`` and ``load_state``.

One line, once per process, before ``accelerator.prepare(...)``::

    import optimshift.integrations.accelerate as osa
    osa.patch()

What it changes: ``AcceleratedOptimizer`` (what ``Accelerator.prepare`` wraps every optimizer in) runs
``move_to_device`` over the whole state dict, ``step`` included, then ``load_state_dict``: a non-fused Adam's
``step`` lands on the accelerator and costs host syncs on every step from then on. ``load_state`` goes through
the same ``load_state_dict``: with ``map_location="on_device"`` every ``step`` is loaded onto the accelerator
and stays there; with ``"cpu"`` PyTorch's own cast puts scalars such as NAdam's ``mu_product`` on the device.
``patch()`` replaces both steps of ``AcceleratedOptimizer``: when it places state (``device_placement=True``,
the default), each param's state follows that param (``prepare`` moves the model before it wraps the
optimizer), exactly as a fresh optimizer over those params would hold it, and ``load_state_dict`` is
:func:`optimshift.load_state_dict`: the loaded state is placed the same way, fp32 state is not cast to bf16
params, strings and namedtuples in state survive, and the live fused/capturable/foreach flags are kept.

Left to Accelerate, unchanged: TPU (XLA) placement, wrappers created with ``device_placement=False``
(DeepSpeed, Megatron-LM), and optimizers optimshift cannot place (sharded DTensor state, non-dict state).

Why a patch: Accelerate has no hook around optimizer placement; ``AcceleratedOptimizer``'s two methods are the one
place that covers ``prepare``, ``load_state`` and direct ``optimizer.load_state_dict`` calls. ``unpatch()`` restores
them.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

from .. import api
from ._common import Swap, follow_params, patch_of, placeable

__all__ = ["patch", "unpatch", "is_patched"]

_patch = patch_of(__name__)


def _on_xla(state: Any) -> bool:
    """Whether Accelerate's ``state`` (an ``AcceleratorState``) runs on XLA: its own transfer places the state there
    (``xm.send_cpu_data_to_device``)."""
    from accelerate.utils import DistributedType

    return bool(state.distributed_type == DistributedType.XLA)


def _make_init(original: Callable[..., None]) -> Callable[..., None]:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        optimizer = bound.arguments["optimizer"]
        from accelerate.state import AcceleratorState

        if not bound.arguments["device_placement"] or not placeable(optimizer) or _on_xla(AcceleratorState()):
            api.wait(optimizer)  # Accelerate's own move reads the state: a transfer in flight finishes first
            original(self, *args, **kwargs)
            return
        bound.arguments["device_placement"] = False  # skip Accelerate's move of the whole state dict
        original(*bound.args, **bound.kwargs)
        self.device_placement = True
        follow_params(optimizer)

    return __init__


def _make_load_state_dict(original: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(original)
    def load_state_dict(self: Any, state_dict: Any) -> None:
        from ..checkpoint._resume import can_load, load_as_torch_would

        if (
            getattr(self, "device_placement", False)
            and not _on_xla(self.accelerator_state)
            and placeable(self.optimizer)
            and can_load(self.optimizer)  # (a class with its own load_state_dict, bitsandbytes': Accelerate's)
        ):
            # optimshift's load: no cast of fp32 state to the params' dtype where the step takes it, strings and
            # namedtuples intact, linear time, and every entry placed for the params and the live flags.
            load_as_torch_would(self.optimizer, state_dict)
            return
        original(self, state_dict)

    return load_state_dict


def patch() -> None:
    """Make ``Accelerator.prepare`` and ``load_state`` place optimizer state with optimshift (see the module doc).

    Calling it again is a no-op; :func:`unpatch` undoes it. Raises ImportError without Accelerate.
    """
    _patch.apply(_plan_swaps)


def _plan_swaps() -> list[Swap]:
    try:
        from accelerate.optimizer import AcceleratedOptimizer
    except ImportError as e:
        raise ImportError(
            "optimshift.integrations.accelerate.patch() needs Accelerate: pip install 'optimshift[accelerate]'"
        ) from e
    makers = {"__init__": _make_init, "load_state_dict": _make_load_state_dict}
    originals = {name: AcceleratedOptimizer.__dict__[name] for name in makers}
    parameters = inspect.signature(originals["__init__"]).parameters
    if "optimizer" not in parameters or "device_placement" not in parameters:
        raise RuntimeError(
            "accelerate.optimizer.AcceleratedOptimizer.__init__ has no (optimizer, device_placement) "
            "parameters: optimshift cannot patch this Accelerate version"
        )
    return [Swap(AcceleratedOptimizer, name, originals[name], make(originals[name])) for name, make in makers.items()]


def unpatch() -> None:
    """Restore Accelerate's own ``AcceleratedOptimizer`` methods. A no-op when not patched."""
    _patch.undo()


def is_patched() -> bool:
    """Whether :func:`patch` is in effect."""
    return _patch.applied
