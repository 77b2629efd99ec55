"""Optimizers in a mode that keeps their state on the host between steps (streamed), which every operation that
places state asks first; a module of its own so that ``api`` and ``checkpoint`` ask without importing streaming."""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Any, Protocol

import torch

from . import _session
from ._devices import HOST, HOSTS
from ._plan import Ident, TargetFn, optimizer_name


class Mode(Protocol):
    """What an operation needs to know about an optimizer in a mode."""

    def wait(self) -> None:
        """Block the host until copies still writing its host state are complete."""

    def after_load(self) -> None:
        """Its state was replaced by a load (now plain host tensors): lay it out again. Must not raise."""


def mode_of(optimizer: Any) -> Mode | None:
    session = _session.of(optimizer)  # (not weakly referenceable: never in a mode)
    ref = None if session is None else session.mode
    return None if ref is None else ref()


def enter(optimizer: Any, mode: Mode) -> None:
    """``optimizer`` is in ``mode``, held weakly (the optimizer keeps it alive; a strong reference would keep its
    tensors one collection longer)."""
    session = _session.get(optimizer)
    if session is None:
        raise TypeError(f"{type(optimizer).__name__} cannot be weakly referenced: it cannot enter a mode")
    session.mode = weakref.ref(mode)


def leave(optimizer: Any) -> None:
    session = _session.of(optimizer)
    if session is not None:
        session.mode = None


def refuse(optimizer: Any, operation: str) -> None:
    """ValueError if ``optimizer`` is streamed: ``operation`` would place state its streamed step reads."""
    if mode_of(optimizer) is not None:
        name = optimizer_name(optimizer)
        raise ValueError(
            f"{name} is streamed (optimshift.stream): its state lives on the host and streams through the device "
            f"at every step(); {operation} would take it from there. Call optimshift.unstream(optimizer) first."
        )


def hosted(target: TargetFn) -> TargetFn:
    """``target`` for a streamed optimizer: every per-param entry that belongs on an accelerator is expected on
    the host (where it lives between steps); param-group entries stay where ``target`` says."""

    def where(
        ident: Ident, param: torch.Tensor | None, group: Mapping[str, Any], key: str, tensor: torch.Tensor
    ) -> tuple[torch.device, str]:
        device, source = target(ident, param, group, key, tensor)
        if param is not None and device.type not in HOSTS:
            return HOST, "streamed"
        return device, source

    return where
