"""verl: its optimizer offload and reload, done by the rule, in every Ray worker, with one line.

One line, for a whole verl run (verl imports the modules named there in the driver and in every worker)::

    VERL_USE_EXTERNAL_MODULES=optimshift.integrations.verl python -m verl.trainer.main_ppo ...

or ``import optimshift.integrations.verl`` in one process (it patches at once when verl is importable).

``patch()`` replaces verl's ``offload_fsdp_optimizer``/``load_fsdp_optimizer`` (``verl.utils.fsdp_utils``: every
tensor replaced by ``.to()``, ``step`` included) in every verl module holding them, and the veomni and automodel
engines' own, with :func:`optimshift.offload`/:func:`optimshift.reload` (the persistent host pool, the same objects,
``step`` where a fresh optimizer keeps it; a ``device_id`` naming another device: where a fresh optimizer there
keeps it). No state yet, a streamed optimizer, or no optimizer: left as verl does it. A verl function that looks
like an optimizer offload but is none of these is warned about (:func:`unknown_functions`; not Megatron's).
``OPTIMSHIFT_VERL_KEEP_ADDRESSES=1`` (off by default until a GPU has run it with verl): offloads keep device
addresses where the device can, so a CUDA-graphed step survives every offload/reload.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import logging
import os
import re
import sys
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .. import api
from .._plan import check_optimizer, states_by_id
from ._common import (
    NAMES_ONLY,
    Swap,
    bound_swaps,
    hand_over,
    held,
    importable,
    module_items,
    own,
    patch_of,
    reload_to,
    streamed,
    warn,
)

__all__ = ["patch", "unpatch", "is_patched", "patched_functions", "unknown_functions"]

_FSDP_UTILS = "verl.utils.fsdp_utils"
# Modules that define offload/load functions of their own, the functions, and whether they walk a
# multi-optimizer's ``optimizers_dict``. The last item: a package the module's engine needs (importing the
# module without it fails in verl's engine package, and then no engine of it can run in this process).
_SOURCES: tuple[tuple[str, tuple[str, str], bool, str | None], ...] = (
    (_FSDP_UTILS, ("offload_fsdp_optimizer", "load_fsdp_optimizer"), False, None),
    ("verl.workers.engine.veomni.utils", ("offload_veomni_optimizer", "load_veomni_optimizer"), True, "veomni"),
    (
        "verl.workers.engine.automodel.utils",
        ("offload_automodel_optimizer", "load_automodel_optimizer"),
        False,
        "nemo_automodel",
    ),
)
# verl functions that look like an optimizer offload or load and are deliberately left alone.
_LEFT_ALONE = {
    "offload_megatron_optimizer": "Megatron's optimizer buffers; step is not moved",
    "load_megatron_optimizer": "Megatron's optimizer buffers; step is not moved",
}
_LOOKALIKE = re.compile(r"^_?(offload|load)_\w*optimizers?$")

_patch = patch_of(__name__, rebound=True)


# --- keeping verl's start-up noise out of our output --------------------------------------------------------


class _DropPlatformNotice(logging.Filter):
    # verl's platform detection on a machine without its accelerators (a CPU-only Ray driver, CI).
    _NOTICES = ("No supported accelerator detected", "Platform '%s' (%s) is registered but not available")

    def filter(self, record: logging.LogRecord) -> bool:
        return not (isinstance(record.msg, str) and record.msg.startswith(self._NOTICES))


@contextlib.contextmanager
def _quiet_verl_import() -> Iterator[None]:
    """Import verl modules without its CPU-only platform notices and "<engine> engine is not available" warnings
    (they say nothing about optimshift); only those, only inside the block."""
    logger = logging.getLogger("verl.plugin.platform.platform_manager")
    notice = _DropPlatformNotice()
    logger.addFilter(notice)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r".* engine is not available", category=UserWarning)
            yield
    finally:
        logger.removeFilter(notice)


# --- the replacements ---------------------------------------------------------------------------------------


def _optimizers(optimizer: Any, multi: bool) -> list[Any]:
    """What verl's function walks: a veomni multi-optimizer's sub-optimizers, else the optimizer itself."""
    if multi and getattr(optimizer, "_is_multi_optimizer", False):
        return list(optimizer.optimizers_dict.values())
    return [optimizer]


def _is_optimizer(optimizer: Any) -> bool:
    """Whether optimshift moves this optimizer's state (DTensor state too: FSDP2's), else verl's code does (after a
    transfer in flight); one it :func:`held` is always its own (its error where its state is one it cannot place)."""
    if held(optimizer):
        return True
    try:
        states_by_id(check_optimizer(optimizer))  # (state for a param in no group: verl's code walks only groups)
    except (TypeError, ValueError):
        hand_over(optimizer)
        return False
    return True


def _offload(optimizer: Any) -> None:
    if not optimizer.state or streamed(optimizer):
        return  # no state yet (verl's contract); a streamed optimizer's state lives on the host already
    # NOTE: non-blocking: what verl runs next on the memory freed is device work, ordered after the copies
    # (record_stream); host reads (its checkpoints) wait for them through optimshift's in-flight guards.
    api.offload(optimizer, non_blocking=True, keep_addresses="auto" if keep_addresses() else False)


def keep_addresses() -> bool:
    """Whether the patched offloads keep device addresses: ``OPTIMSHIFT_VERL_KEEP_ADDRESSES`` 1, true, yes or on."""
    return os.environ.get("OPTIMSHIFT_VERL_KEEP_ADDRESSES", "").strip().lower() in ("1", "true", "yes", "on")


def _load(optimizer: Any, device_id: Any) -> None:
    if not optimizer.state or streamed(optimizer):
        return
    # NOTE: non-blocking. verl's next use of the state is optimizer.step(), after the forward and backward
    # passes the copies overlap with; the step pre-hook makes the step wait for them on the device.
    reload_to(optimizer, device_id, what="verl's device_id", non_blocking=True)


def _make(original: Callable[..., None], multi: bool, ours: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(original, assigned=NAMES_ONLY)
    @torch.no_grad()
    def replacement(optimizer: Any, *args: Any, **kwargs: Any) -> None:
        """optimshift's replacement for verl's optimizer offload or load (see optimshift.integrations.verl)."""
        for opt in _optimizers(optimizer, multi):
            (ours if _is_optimizer(opt) else original)(opt, *args, **kwargs)  # (else: verl's own code)

    return replacement


# --- finding and swapping -----------------------------------------------------------------------------------


def _sources() -> list[tuple[Any, tuple[str, str], bool]]:
    """The modules that define the functions: verl's fsdp_utils, and each engine's that is loaded or can be."""
    try:
        with _quiet_verl_import():
            found = [(importlib.import_module(_FSDP_UTILS), _SOURCES[0][1], _SOURCES[0][2])]
    except ImportError as e:
        raise ImportError(
            f"optimshift.integrations.verl.patch() needs verl: pip install 'optimshift[verl]' ({e})"
        ) from e
    for name, functions, multi, needs in _SOURCES[1:]:
        module = sys.modules.get(name)
        if module is None and needs is not None and importlib.util.find_spec(needs) is not None:
            try:
                with _quiet_verl_import():
                    module = importlib.import_module(name)
            except ImportError:
                module = None  # this engine cannot run here: nothing calls its functions
        if module is not None:
            found.append((module, functions, multi))
    return found


def _plan_swaps() -> list[Swap]:
    pairs = []
    sources = _sources()
    for module, (offload_name, load_name), multi in sources:
        for name, ours in ((offload_name, _offload), (load_name, _load)):
            missing = (
                f"{module.__name__} has no {name}(): this verl version moves optimizer state differently and "
                f"optimshift.integrations.verl does not know how to patch it"
            )
            original = own(module, name, missing)
            pairs.append((original, _make(original, multi, ours)))
    return bound_swaps(pairs, [m for m, _, _ in sources], ("verl",))  # (and every other verl module holding one)


def unknown_functions() -> list[str]:
    """verl functions loaded now that look like an optimizer offload or load (``offload_*_optimizer``,
    ``load_*_optimizer``) but are neither patched nor known to need no patch: ``module.name`` of each."""
    swapped = {id(f) for s in _patch.swaps for f in (s.original, s.replacement)}
    found = []
    for module in [m for n, m in list(sys.modules.items()) if n.split(".")[0] == "verl"]:  # (None: no items)
        for name, value in module_items(module):
            if not callable(value) or not _LOOKALIKE.match(name) or name in _LEFT_ALONE:
                continue
            if id(value) in swapped or getattr(value, "__module__", None) != module.__name__:
                continue  # (a verl function is reported where it is defined)
            found.append(f"{module.__name__}.{name}")
    return sorted(found)


patched_functions = _patch.names  # (``module.name`` of every function replaced)


def patch() -> None:
    """Make verl offload and reload optimizer state with optimshift (see the module doc); again: a no-op. Raises
    ImportError without verl, RuntimeError if it lacks the functions; warns about look-alikes not patched."""
    _patch.apply(_plan_swaps)
    unknown = unknown_functions()
    if unknown:
        warn(
            f"optimshift.integrations.verl: {', '.join(unknown)} look like optimizer offload/load functions that "
            f"optimshift does not patch: their state moves are verl's own"
        )


unpatch = _patch.undo  # (restores the framework's own functions; a no-op when not patched)
is_patched = _patch.applied


# Importing this module is the way in (VERL_USE_EXTERNAL_MODULES): patch at once when verl is there.
if importable("verl"):
    patch()
