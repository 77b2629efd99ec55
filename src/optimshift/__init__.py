"""optimshift: the missing ``optimizer.to(device)``.

Moves, offloads, reloads and checks optimizer state across devices. The rule: after any optimshift operation,
every state entry sits where a freshly built optimizer of the same class and flags, over the same params on
the target device, would put it after a step, with bitwise-unchanged values and dtypes.
"""

import typing as _typing

from . import _quiet_torch  # noqa: F401  (first: imports torch without its NumPy warning)
from ._offload import PendingTransfer
from ._streaming import DEFAULT_CHUNK_BYTES, Streamed, is_streamed, stream, streamed, unstream
from ._version import __version__ as __version__
from .api import check, is_offloaded, keep_addresses, move, offload, offloaded, placement, rebind, reload, wait
from .checkpoint import CheckpointError, UnsafeCheckpointError, load, load_state_dict, save
from .policy import Policy, register_policy, unregister_policy
from .pool import HostPool, host_pool
from .report import Finding, PlacementRow, Report
from .syncs import SyncCount, count_syncs

if _typing.TYPE_CHECKING:  # what the lazy attributes below are, for type checkers
    from . import distributed as distributed
    from . import integrations as integrations
    from . import testing as testing

# NOTE: subpackages that are attributes of the package but imported on first use (PEP 562), so that
# `import optimshift` imports neither torch.distributed.checkpoint nor any framework:
# `optimshift.distributed.save(...)` and `optimshift.testing.simulated_accelerator()` work as written.
_SUBPACKAGES = ("distributed", "integrations", "testing")

__all__ = [
    "move",
    "offload",
    "reload",
    "offloaded",
    "keep_addresses",
    "is_offloaded",
    "wait",
    "stream",
    "unstream",
    "streamed",
    "is_streamed",
    "Streamed",
    "DEFAULT_CHUNK_BYTES",
    "check",
    "placement",
    "rebind",
    "load_state_dict",
    "save",
    "load",
    "CheckpointError",
    "UnsafeCheckpointError",
    "count_syncs",
    "register_policy",
    "unregister_policy",
    "Policy",
    "Report",
    "Finding",
    "PlacementRow",
    "SyncCount",
    "PendingTransfer",
    "host_pool",
    "HostPool",
]


def __getattr__(name: str) -> _typing.Any:
    if name in _SUBPACKAGES:
        import importlib

        return importlib.import_module(f"{__name__}.{name}")  # also sets it as an attribute of the package
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_SUBPACKAGES))
