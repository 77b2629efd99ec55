"""Testing helpers for optimshift and its users: test training code on a simulated accelerator, on a CPU.

- :func:`simulated_accelerator`: sets up ``sim:0`` and ``sim:1``, an accelerator with real values.
- :mod:`optimshift.testing.lightning`: ``L.Trainer(strategy=optimshift.testing.lightning.strategy())`` and
  ``L.Fabric(strategy=optimshift.testing.lightning.fabric_strategy())`` run on it.
- :mod:`optimshift.testing.accelerate`: ``with on_device(): ...`` makes every Accelerate ``Accelerator`` (and
  Transformers ``Trainer``) created inside run on it.

Importing this package sets nothing up and imports neither Lightning nor Accelerate.
"""

from optimshift.testing.simulated import (
    SIM_DEVICE_TYPE,
    simulated_accelerator,
    simulated_memory_allocated,
)

__all__ = ["SIM_DEVICE_TYPE", "simulated_accelerator", "simulated_memory_allocated"]
