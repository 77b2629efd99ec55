"""Hugging Face Accelerate: place optimizer state where a fresh optimizer would, in ``prepare`` and ``load_state``.

One line, once per process, before ``accelerator.prepare(...)``::

    import optimshift.integrations.accelerate as osa
    osa.patch()

Why: ``AcceleratedOptimizer`` (what ``prepare`` wraps every optimizer in) moves the whole state dict, ``step``
included, to the accelerator, and its ``load_state_dict`` (``load_state``) leaves ``step`` there or casts host
scalars onto the device: a non-fused Adam then syncs the host on every step. ``patch()`` replaces its
``__init__`` and ``load_state_dict`` (the one place Accelerate's placement can be reached): where it places state
(``device_placement=True``), each param's state follows that param as a fresh optimizer's would (``prepare`` has
placed the model by then), and loading is :func:`optimshift.load_state_dict`. Left to Accelerate: XLA,
``device_placement=False`` (DeepSpeed, Megatron-LM), and optimizers optimshift cannot place.
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
        from ..checkpoint._resume import can_load, load_as_torch_would, refused_for_wide_entries

        if (
            getattr(self, "device_placement", False)
            and not _on_xla(self.accelerator_state)
            and placeable(self.optimizer)
            and can_load(self.optimizer)  # (a class with its own load_state_dict, bitsandbytes': Accelerate's)
            and not refused_for_wide_entries(self.optimizer, state_dict)
        ):
            # optimshift's load: no cast of fp32 state to the params' dtype where the step takes it, strings and
            # namedtuples intact, linear time, and every entry placed for the params and the live flags.
            load_as_torch_would(self.optimizer, state_dict)
            return
        original(self, state_dict)

    return load_state_dict


def patch() -> None:
    """Make ``Accelerator.prepare`` and ``load_state`` place optimizer state with optimshift (see the module doc);
    again: a no-op. Raises ImportError without Accelerate, RuntimeError if it lacks the parameters it relies on."""
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


unpatch = _patch.undo  # (restores the framework's own functions; a no-op when not patched)
is_patched = _patch.applied
