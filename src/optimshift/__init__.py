"""optimshift: the missing ``optimizer.to(device)``.

Moves, offloads, reloads and checks optimizer state across devices. The rule: after any optimshift operation,
every state entry sits where a freshly built optimizer of the same class and flags, over the same params on
the target device, would put it after a step, with bitwise-unchanged values and dtypes.
"""

from . import _quiet_torch  # noqa: F401  (first: imports torch without its NumPy warning)
from ._offload import PendingTransfer
from ._stream import DEFAULT_CHUNK_BYTES, Streamed, is_streamed, stream, streamed, unstream
from ._version import __version__ as __version__
from .api import check, is_offloaded, move, offload, offloaded, placement, rebind, reload, wait
from .checkpoint import load, load_state_dict, save
from .policy import Policy, register_policy, unregister_policy
from .pool import HostPool, host_pool
from .report import Finding, PlacementRow, Report
from .syncs import SyncCount, count_syncs

__all__ = [
    "move",
    "offload",
    "reload",
    "offloaded",
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
