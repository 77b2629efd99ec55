"""What the framework integrations share: which optimizers optimshift places, and the two moves they make."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from .. import _mode, api

__all__ = ["placeable", "follow_params", "to_host", "streamed"]


def _is_dtensor(value: Any) -> bool:
    # Checked by name so that this never imports torch.distributed.
    cls = type(value)
    return cls.__name__ == "DTensor" and cls.__module__.startswith("torch.distributed")


def placeable(optimizer: Any) -> bool:
    """Whether optimshift can place this optimizer's state: a torch optimizer (or an object with
    ``param_groups`` and ``state``) whose state is one dict of ordinary tensors per param of its groups.

    False for custom optimizers whose state is not a dict per param, for optimizer-wide entries keyed by
    anything but a param, and for sharded (DTensor) state; the integrations then leave the framework's own
    code in charge, as it was before.
    """
    groups = getattr(optimizer, "param_groups", None)
    state = getattr(optimizer, "state", None)
    if not isinstance(groups, list) or not isinstance(state, Mapping):
        return False
    held = {id(p) for group in groups if isinstance(group, Mapping) for p in group.get("params", ())}
    for key, entry in state.items():
        if id(key) not in held or not isinstance(entry, Mapping):
            return False
        if any(_is_dtensor(v) for v in entry.values()):
            return False
    return True


def streamed(optimizer: Any) -> bool:
    """Whether ``optimizer`` (or the optimizer a wrapper holds) is streamed: its state stays where
    :func:`optimshift.stream` keeps it, whatever a framework asks."""
    return any(_mode.mode_of(o) is not None for o in (optimizer, getattr(optimizer, "optimizer", None))
               if o is not None)


def follow_params(optimizer: Any) -> None:
    """Place every state tensor where a fresh optimizer over the params, where they are now, would keep it
    (a streamed optimizer's state is left on the host: its step streams it)."""
    if not streamed(optimizer):
        api.move(optimizer)


def to_host(optimizer: Any) -> None:
    """Place every state tensor where a fresh optimizer with its params on the host would keep it (a streamed
    optimizer's state is on the host already)."""
    if not streamed(optimizer):
        api.move(optimizer, torch.device("cpu"))
