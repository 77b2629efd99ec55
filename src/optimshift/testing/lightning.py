"""Lightning on the simulated accelerator: run a ``LightningModule`` or ``Fabric`` code on ``sim:0`` in CPU-only CI.

One line for a ``Trainer``, one for ``Fabric``::

    import optimshift.testing.lightning as ostl

    trainer = L.Trainer(strategy=ostl.strategy(), max_steps=10)   # model, optimizer and batches on sim:0
    fabric = L.Fabric(strategy=ostl.fabric_strategy())

Your code then meets a device that is not the host, as on a GPU: a ``step`` left on the wrong device, a host
tensor in a fused kernel or a forgotten ``.to(device)`` fail, and host syncs can be counted with
:func:`optimshift.count_syncs` (see :func:`optimshift.testing.simulated_accelerator` for what the simulator
enforces and its limits).

Why a strategy and not ``Trainer(accelerator=...)``: for one device, Lightning takes the root device from the
strategy, and for an accelerator it does not know it builds a CPU strategy. :class:`SimAccelerator` is the
accelerator inside the strategy (``Trainer(accelerator=SimAccelerator(), strategy=...)`` is what the one-liner
spells out).

Importing this module imports Lightning (the ``lightning`` package); importing :mod:`optimshift` or
:mod:`optimshift.testing` does not.
"""

from __future__ import annotations

from typing import Any

import torch

try:
    from lightning.fabric.strategies.single_device import SingleDeviceStrategy as _FabricSingleDevice
    from lightning.pytorch.accelerators import Accelerator as _Accelerator
    from lightning.pytorch.strategies import SingleDeviceStrategy as _TrainerSingleDevice
except ImportError as e:  # pragma: no cover - exercised only without Lightning
    raise ImportError("optimshift.testing.lightning needs Lightning: pip install 'optimshift[lightning]'") from e

from .simulated import SIM_DEVICE_TYPE, simulated_accelerator, simulated_memory_allocated

__all__ = ["SimAccelerator", "strategy", "fabric_strategy"]

DeviceLike = int | str | torch.device


def _sim_device(device: DeviceLike) -> torch.device:
    """``sim:N`` for an index, ``"sim:N"`` or ``torch.device("sim", N)``; sets the simulator up."""
    if isinstance(device, int) and not isinstance(device, bool):
        return simulated_accelerator(device)
    resolved = torch.device(device) if isinstance(device, str) and device.startswith(SIM_DEVICE_TYPE) else device
    if not isinstance(resolved, torch.device) or resolved.type != SIM_DEVICE_TYPE:
        raise ValueError(f"expected a simulated device (an index, 'sim:0', 'sim:1'), got {device!r}")
    return simulated_accelerator(resolved.index or 0)


class SimAccelerator(_Accelerator):
    """Lightning's accelerator for the simulated device, for the ``Trainer`` and ``Fabric`` alike.

    Building one sets the simulator up (once per process, with the side effects
    :func:`optimshift.testing.simulated_accelerator` lists). ``devices=N`` means ``sim:0`` … ``sim:N-1``.
    """

    def __init__(self) -> None:
        super().__init__()
        simulated_accelerator()

    def setup_device(self, device: torch.device) -> None:
        _sim_device(device)

    def teardown(self) -> None:
        pass

    def get_device_stats(self, device: Any) -> dict[str, Any]:
        return {"allocated_bytes": simulated_memory_allocated(_sim_device(device).index or 0)}

    @staticmethod
    def parse_devices(devices: Any) -> list[int]:
        if devices == "auto" or devices in (-1, "-1"):  # (Lightning's convention: -1 is every device)
            devices = SimAccelerator.auto_device_count()
        elif isinstance(devices, str):  # Lightning's convention: "2" is a count, "0,1" a list of indices
            devices = [int(d) for d in devices.split(",") if d.strip()] if "," in devices else int(devices)
        if isinstance(devices, int):
            return list(range(devices))
        return [int(d) for d in devices]

    @staticmethod
    def get_parallel_devices(devices: Any) -> list[torch.device]:
        return [simulated_accelerator(int(i)) for i in devices]

    @staticmethod
    def auto_device_count() -> int:
        simulated_accelerator()
        return int(torch.get_device_module(SIM_DEVICE_TYPE).device_count())

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def name() -> str:
        return SIM_DEVICE_TYPE

    @classmethod
    def register_accelerators(cls, accelerator_registry: Any) -> None:
        accelerator_registry.register(SIM_DEVICE_TYPE, cls, description="optimshift's simulated accelerator")


def strategy(device: DeviceLike = 0, strategy_cls: type | None = None) -> Any:
    """A ``Trainer`` strategy that runs on the simulated device: ``L.Trainer(strategy=strategy())``.

    ``device``: ``0``/``1``, ``"sim:1"`` or ``torch.device("sim", 1)``; ``strategy_cls``: a subclass of
    Lightning's ``SingleDeviceStrategy`` to build instead (one that places a model over two devices, say).
    """
    cls = strategy_cls or _TrainerSingleDevice
    return cls(device=_sim_device(device), accelerator=SimAccelerator())


def fabric_strategy(device: DeviceLike = 0) -> Any:
    """A ``Fabric`` strategy that runs on the simulated device: ``L.Fabric(strategy=fabric_strategy())``."""
    return _FabricSingleDevice(device=_sim_device(device), accelerator=SimAccelerator())
