"""PyTorch Lightning: place optimizer state where a fresh optimizer would, in ``Trainer`` and ``Fabric``.

One line, once per process, before ``trainer.fit(...)`` or ``fabric.setup(...)``::

    import optimshift.integrations.lightning as osl
    osl.patch()

What it changes:

- ``Trainer``: Lightning's helper ``_optimizer_to_device`` (and its loop ``_optimizers_to_device``; strategy
  setup, checkpoint restore, teardown) skips ``step`` whatever the flags (a fused or capturable one stays on the
  GPU at teardown; a CPU-fused optimizer moved to a GPU keeps a host one its fused kernel rejects) and sends every
  other tensor to one root device. ``patch()`` replaces it wherever Lightning bound it: to an accelerator, each
  param's state follows that param; to the host, every tensor goes where a fresh host optimizer keeps it.
- ``Fabric``: ``setup``/``setup_optimizers`` never place the optimizer's state, ``load``/``load_raw`` leave it
  where torch's ``load_state_dict`` put it; after each, ``patch()`` places it by its params.
- ``fit(ckpt_path=...)`` (and Fabric's loads through the base strategy) load with
  :func:`optimshift.load_state_dict`; strategies with their own restore (DeepSpeed, FSDP, ModelParallel) keep it.

Optimizers optimshift cannot place are left to Lightning's code. Why a patch: the wrong moves happen inside
Lightning, between the hooks a callback sees; if a release renames its private helpers, ``patch()`` raises.

:class:`OffloadOptimizerDuringEval` is an ordinary callback: it moves optimizer state to host memory for the
validation, test and predict loops and puts it back, exactly where it was, before training resumes.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import inspect
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from .. import api
from ._common import (
    NAMES_ONLY,
    Swap,
    bound_swaps,
    follow_params,
    importable,
    patch_of,
    placeable,
    streamed,
    to_host,
)

if TYPE_CHECKING:
    from lightning.fabric.wrappers import _FabricOptimizer

__all__ = ["patch", "unpatch", "is_patched", "OffloadOptimizerDuringEval"]

# (top-level distribution module, its fabric package): the unified ``lightning`` package and the standalone
# ``pytorch_lightning`` + ``lightning_fabric`` pair ship separate copies of the same code.
_FLAVOURS = (("lightning", "lightning.fabric"), ("lightning_fabric", "lightning_fabric"))
_HELPERS = ("_optimizer_to_device", "_optimizers_to_device")
_LIGHTNING_PACKAGES = ("lightning", "pytorch_lightning", "lightning_fabric")  # whose modules are patched
_FABRIC_METHODS = ("setup", "setup_optimizers", "load", "load_raw")
_TRAINERS = {"lightning.fabric": "lightning.pytorch", "lightning_fabric": "pytorch_lightning"}  # fabric -> Trainer


_patch = patch_of(__name__, rebound=True)


def _is_host(device: Any) -> bool:
    if isinstance(device, (str, torch.device)):
        return torch.device(device).type == "cpu"
    return False  # an int names an accelerator index


def _make_optimizer_to_device(original: Callable[[Any, Any], None]) -> Callable[[Any, Any], None]:
    @functools.wraps(original, assigned=NAMES_ONLY)
    def _optimizer_to_device(optimizer: Any, device: Any) -> None:
        """optimshift's replacement for Lightning's helper (see optimshift.integrations.lightning)."""
        if not placeable(optimizer):
            api.wait(optimizer)  # Lightning's own loop reads the state: a transfer in flight finishes first
            original(optimizer, device)
        elif _is_host(device):
            to_host(optimizer)
        else:
            follow_params(optimizer)

    return _optimizer_to_device


def _make_optimizers_to_device(one: Callable[[Any, Any], None], original: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(original, assigned=NAMES_ONLY)
    def _optimizers_to_device(optimizers: Iterable[Any], device: Any) -> None:
        """optimshift's replacement for Lightning's helper: :func:`_optimizer_to_device` on each optimizer."""
        for optimizer in optimizers:
            one(optimizer, device)

    return _optimizers_to_device


def _fabric_place(optimizer: Any, fabric_optimizer: type[_FabricOptimizer]) -> None:
    if isinstance(optimizer, fabric_optimizer):
        optimizer = optimizer.optimizer
    if isinstance(optimizer, torch.optim.Optimizer) and placeable(optimizer):
        follow_params(optimizer)


def _wrap_fabric(
    original: Callable[..., Any],
    fabric_optimizer: type[_FabricOptimizer],
    argument: str | None,
    base_load: Callable[..., Any] | None = None,
) -> Callable[..., Any]:
    """``original`` (a ``Fabric`` method), then each optimizer it returned (``argument`` None) or loaded into (the
    one passed as ``argument``) placed by its params; loaded as ``fit(ckpt_path=...)`` does by ``base_load``."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        if argument is None:
            result = original(self, *args, **kwargs)
            placed: Iterable[Any] = result if isinstance(result, tuple) else (result,)
        else:
            target = signature.bind(self, *args, **kwargs).arguments.get(argument)
            placed = list(target.values()) if isinstance(target, dict) else [target]
            ours = type(self.strategy).load_checkpoint is base_load  # (FSDP's, DeepSpeed's own restore: theirs)
            with _loading_as_torch_would(placed if ours else (), fabric_optimizer):
                result = original(self, *args, **kwargs)
        for item in placed:
            _fabric_place(item, fabric_optimizer)
        return result

    return wrapper


@contextlib.contextmanager
def _loading_as_torch_would(items: Iterable[Any], fabric_optimizer: type[_FabricOptimizer]) -> Iterator[None]:
    """While Fabric's strategy loads a checkpoint, each optimizer among ``items`` optimshift can load has
    :func:`load_as_torch_would` as its ``load_state_dict`` (torch's casts saved state to the params' dtype), but for
    a state dict :func:`refused_for_wide_entries`."""
    from ..checkpoint._resume import can_load, load_as_torch_would, refused_for_wide_entries

    optimizers = [item.optimizer if isinstance(item, fabric_optimizer) else item for item in items]
    mine = [
        o
        for o in optimizers
        if isinstance(o, torch.optim.Optimizer) and "load_state_dict" not in vars(o) and placeable(o) and can_load(o)
    ]

    def load(optimizer: torch.optim.Optimizer, state_dict: Any) -> None:
        if refused_for_wide_entries(optimizer, state_dict):
            type(optimizer).load_state_dict(optimizer, state_dict)
        else:
            load_as_torch_would(optimizer, state_dict)

    for optimizer in mine:
        optimizer.load_state_dict = functools.partial(load, optimizer)  # type: ignore[method-assign]
    try:
        yield
    finally:
        for optimizer in mine:
            vars(optimizer).pop("load_state_dict", None)


def _plan_swaps() -> list[Swap]:
    packages = [fabric for top, fabric in _FLAVOURS if importable(top)]
    if not packages:
        raise ImportError(
            "optimshift.integrations.lightning.patch() needs Lightning: pip install 'optimshift[lightning]' "
            "(the `lightning` package, or `pytorch_lightning` with `lightning_fabric`)"
        )
    swaps: list[Swap] = []
    for package in packages:
        source = importlib.import_module(f"{package}.utilities.optimizer")
        helpers: list[Any] = [vars(source).get(name) for name in _HELPERS]
        for name, helper in zip(_HELPERS, helpers):
            if not callable(helper):
                raise RuntimeError(
                    f"{package}.utilities.optimizer has no {name}(): this Lightning version moves optimizer state "
                    f"differently and optimshift.integrations.lightning does not know how to patch it"
                )
        first, each = helpers
        one = _make_optimizer_to_device(first)
        pairs = [(first, one), (each, _make_optimizers_to_device(one, each))]
        swaps += bound_swaps(pairs, [source], _LIGHTNING_PACKAGES)  # (every Lightning module holding a helper)
        fabric_cls = importlib.import_module(f"{package}.fabric").Fabric
        fabric_optimizer = importlib.import_module(f"{package}.wrappers")._FabricOptimizer
        base_strategy = importlib.import_module(f"{package}.strategies.strategy").Strategy
        for name in _FABRIC_METHODS:
            original = fabric_cls.__dict__.get(name)
            if not callable(original):
                raise RuntimeError(
                    f"{package}.fabric.Fabric has no {name}(): optimshift cannot patch this Lightning version"
                )
            argument = {"load": "state", "load_raw": "obj"}.get(name)
            wrapped = _wrap_fabric(original, fabric_optimizer, argument, base_strategy.load_checkpoint)
            swaps.append(Swap(fabric_cls, name, original, wrapped))
        trainer = _TRAINERS.get(package)
        if trainer is not None and importlib.util.find_spec(trainer.split(".")[0]) is not None:
            strategy_cls = importlib.import_module(f"{trainer}.strategies.strategy").Strategy
            original = strategy_cls.__dict__.get("load_optimizer_state_dict")
            if not callable(original):
                raise RuntimeError(
                    f"{trainer}.strategies.strategy.Strategy has no load_optimizer_state_dict(): "
                    f"optimshift cannot patch this Lightning version"
                )
            replacement = _make_load_optimizer_state_dict(original)
            swaps.append(Swap(strategy_cls, "load_optimizer_state_dict", original, replacement))
    return swaps


def _make_load_optimizer_state_dict(original: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(original, assigned=NAMES_ONLY)
    def load_optimizer_state_dict(self: Any, checkpoint: Any) -> None:
        """optimshift's restore for ``fit(ckpt_path=...)`` where every optimizer can be; else Lightning's."""
        from ..checkpoint._resume import can_load, load_as_torch_would, refused_for_wide_entries

        pairs = list(zip(self.optimizers, checkpoint["optimizer_states"]))
        if not all(placeable(o) and can_load(o) and not refused_for_wide_entries(o, s) for o, s in pairs):
            original(self, checkpoint)
            return
        for optimizer, opt_state in pairs:
            load_as_torch_would(optimizer, opt_state)

    return load_optimizer_state_dict


def patch() -> None:
    """Make every installed Lightning flavour's ``Trainer`` and ``Fabric`` place optimizer state with optimshift;
    again: a no-op. Raises ImportError without Lightning, RuntimeError if it lacks the helpers it replaces."""
    _patch.apply(_plan_swaps)  # everything is found and checked before anything is replaced


unpatch = _patch.undo  # (restores the framework's own functions; a no-op when not patched)
is_patched = _patch.applied


def _callback_base() -> type:
    for module in ("lightning.pytorch", "pytorch_lightning"):
        try:
            callback: type = importlib.import_module(module).Callback
            return callback
        except ImportError:
            continue
    raise ImportError("optimshift.integrations.lightning needs Lightning: pip install 'optimshift[lightning]'")


class OffloadOptimizerDuringEval(_callback_base()):  # type: ignore[misc]  # a base chosen at run time
    """Keep optimizer state in host memory while the validation, test and predict loops run.

    Frees accelerator memory for evaluation: at the start of each loop every optimizer of the trainer is
    :func:`optimshift.offload`-ed (pinned host memory where it helps, unless ``pin_memory=False``; with
    ``include=("grads",)`` the params' gradients too); at its end :func:`optimshift.reload` puts each tensor back
    exactly where it was, before training resumes. If the run fails meanwhile, the state stays on the host,
    where Lightning's teardown wants it.
    """

    def __init__(self, *, pin_memory: bool | None = None, include: Iterable[str] = ()) -> None:
        super().__init__()
        if pin_memory is not None and not isinstance(pin_memory, bool):
            raise TypeError(f"OffloadOptimizerDuringEval: pin_memory must be a bool or None, got {pin_memory!r}")
        self.pin_memory = pin_memory
        self.include = (include,) if isinstance(include, str) else tuple(include)  # (as offload takes it)
        self._offloaded: list[Any] = []

    def _offload(self, trainer: Any) -> None:
        for optimizer in trainer.optimizers:
            if placeable(optimizer) and not api.is_offloaded(optimizer) and not streamed(optimizer):
                api.offload(optimizer, pin_memory=self.pin_memory, include=self.include)
                self._offloaded.append(optimizer)

    def _reload(self) -> None:
        while self._offloaded:
            api.reload(self._offloaded.pop())

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        self._offload(trainer)

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        self._reload()

    on_test_start = on_predict_start = on_validation_start
    on_test_end = on_predict_end = on_validation_end

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        # Everything is already on the host: this copies nothing and only forgets the offload record.
        while self._offloaded:
            to_host(self._offloaded.pop())
