"""Turning what users pass as a device into a checked ``torch.device``."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

DeviceLike = torch.device | str | int

HOSTS = ("cpu", "meta")
"""Device types no accelerator queue serves: nothing to synchronize, no streams."""

HOST = torch.device("cpu")
"""The host, as :func:`resolve` makes it (``"cpu:0"`` too): where a fresh optimizer keeps host state."""


def device_module(device_type: str) -> Any:
    """torch's module for a device type (``torch.cuda``, a registered backend's), or None."""
    try:
        return torch.get_device_module(device_type)
    except Exception:
        return getattr(torch, device_type, None)


def _fake_mode_active(tensors: Iterable[torch.Tensor] = ()) -> bool:
    """True under ``FakeTensorMode`` or when the optimizer's tensors are fake (no real device is needed)."""
    from torch._subclasses.fake_tensor import FakeTensor

    if any(isinstance(t, FakeTensor) for t in tensors):
        return True
    return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None


def resolve(device: DeviceLike, *, what: str = "device", tensors: Iterable[torch.Tensor] = ()) -> torch.device:
    """A ``torch.device`` with an explicit index for accelerators; ValueError/TypeError if unusable here."""
    if isinstance(device, bool) or not isinstance(device, (torch.device, str, int)):
        raise TypeError(f"{what} must be a torch.device, a string such as 'cuda:0' or an int, got {device!r}")
    if isinstance(device, int):
        if device < 0:
            raise ValueError(f"{what} index must be >= 0, got {device}")
        acc = current_accelerator()
        if acc is None:
            raise ValueError(f"{what}={device}: an int names an accelerator index, but no accelerator is available")
        device = torch.device(acc, device)
    else:
        try:
            device = torch.device(device)
        except RuntimeError as e:
            raise ValueError(f"{what} {device!r} is not a device PyTorch knows: {e}") from None
    if device.type == "meta":
        raise ValueError(
            f"{what} meta holds no data: optimizer state moved there would lose every value. Keep it on 'cpu' "
            f"(or offload it) and move it once the params have real storage"
        )
    if device.type == "cpu":
        return torch.device("cpu")
    if _fake_mode_active(tensors):
        return device if device.index is not None else torch.device(device.type, 0)
    module = device_module(device.type)
    if module is None or not hasattr(module, "device_count"):
        raise ValueError(f"{what} {device} is not available: torch has no '{device.type}' backend in this process")
    available = bool(getattr(module, "is_available", lambda: True)())
    count = int(module.device_count()) if available else 0
    if count == 0:
        raise ValueError(f"{what} {device} is not available: this machine has no {device.type} device")
    index = device.index
    if index is None:
        index = int(module.current_device()) if hasattr(module, "current_device") else 0
    if index >= count:
        raise ValueError(
            f"{what} {device} is not available: this machine has {count} {device.type} device"
            f"{'s' if count != 1 else ''} (indices 0..{count - 1})"
        )
    return torch.device(device.type, index)


def current_accelerator() -> str | None:
    """This process's accelerator type (``torch.accelerator``'s; CUDA on a torch without it), or None."""
    try:
        dev = torch.accelerator.current_accelerator()
    except Exception:  # (a torch without torch.accelerator: before 2.6)
        dev = None
    if dev is not None:
        return dev.type
    return "cuda" if torch.cuda.is_available() else None
