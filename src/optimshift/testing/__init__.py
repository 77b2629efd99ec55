"""Testing helpers for optimshift and its users.

Importing this package sets nothing up; see :func:`simulated_accelerator`.
"""

from optimshift.testing.simulated import (
    SIM_DEVICE_TYPE,
    simulated_accelerator,
    simulated_memory_allocated,
)

__all__ = ["SIM_DEVICE_TYPE", "simulated_accelerator", "simulated_memory_allocated"]
