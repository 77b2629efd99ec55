"""Placement policies for third-party optimizer libraries, registered explicitly::

    import optimshift.integrations.third_party as tp
    tp.register()      # registers every policy below whose library is installed

Importing this module registers nothing and imports no optimizer library; ``register()`` imports each library
it has policies for, if installed. ``unregister()`` removes them again.

Checked against every optimizer in ``pytorch_optimizer``'s registry (``tests/integrations/test_third_party.py``):
the built-in rule (a param's 0-dim state where a probe step of the class puts it, where the probe can build the
class from a param; else a 0-dim ``step`` stays on the host unless the group is fused/capturable; every other
tensor follows its param; 0-dim tensors kept in a param group stay on the host) already matches a fresh
optimizer for every class that can be placed at all but two, whose entries no probe decides (a group's and an
optimizer-wide one):

- ``AliG`` writes ``group["step_size"] = loss / grad_norm``, a 0-dim tensor on the loss's device (the
  params' device) when the closure returns a tensor: it belongs with the group's params, not on the host.
- ``MADGRAD`` keeps an optimizer-wide step counter ``optimizer.state["k"]``, a 1-element int64 tensor it
  creates on the host and reads there: it stays on the host.

Optimizer-wide entries under plain keys (``EmoNavi``/``EmoFact``/``EmoLynx``'s ``state["ema"]``, ``SPAM``'s
``state["total_step"]``) are placed by the built-in rule: tensors go where the first group's params are.

Classes no policy can fix, because a policy only says *where* a tensor optimshift found belongs, and these
keep state where optimshift does not look (outside ``optimizer.state`` and ``param_groups``) or under keys it
rejects:

- ``Magma`` keeps per-param tensors in a private ``_state`` dict keyed by ``id(param)``; ``SaRA`` caches index
  tensors derived from ``state["mask"]`` in ``_mask_indices``: after a move they are left on the old device.
- ``AdaLOMO`` keeps its moments in attributes, not in ``optimizer.state`` (and, like ``LOMO``, updates params
  inside ``fused_backward`` hooks: ``step()`` raises).

Not checked on a CPU-only machine: ``DeMo`` and ``DistributedMuon`` (they need a torch.distributed process
group whose backend handles the device).
"""

from __future__ import annotations

import importlib
import threading
import warnings
from collections.abc import Mapping
from typing import Any

import torch

from ..policy import Policy, register_policy, registered_policy, unregister_policy

__all__ = ["register", "unregister", "POLICIES"]


def _alig(
    key: str, value: torch.Tensor, param: torch.Tensor | None, group: Mapping[str, Any], device: torch.device
) -> torch.device | None:
    """AliG: the group's ``step_size`` tensor is computed from the loss, on the params' device."""
    if param is None and key == "step_size":
        return device
    return None


def _madgrad(
    key: str, value: torch.Tensor, param: torch.Tensor | None, group: Mapping[str, Any], device: torch.device
) -> torch.device | None:
    """MADGRAD: the optimizer-wide counter ``state["k"]`` is created on the host and read there."""
    if param is None and key == "k":
        return torch.device("cpu")
    return None


# "module:Class" -> policy. Only classes whose state the built-in rule places wrongly (see the module doc).
POLICIES: Mapping[str, Policy] = {
    "pytorch_optimizer.optimizer.alig:AliG": _alig,
    "pytorch_optimizer.optimizer.madgrad:MADGRAD": _madgrad,
}

_lock = threading.Lock()
_registered: dict[type, Policy] = {}  # what register() installed, each class's policy


def _load(spec: str) -> type | None:
    module_name, _, class_name = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        return None  # that library is not installed: nothing to register
    cls = getattr(module, class_name, None)
    if not isinstance(cls, type) or not issubclass(cls, torch.optim.Optimizer):
        raise RuntimeError(f"optimshift.integrations.third_party: {spec} is not an optimizer class in this version")
    return cls


def register() -> list[type]:
    """Register every policy of :data:`POLICIES` whose library is installed; return the classes registered.

    Idempotent; a class the user registered a policy for keeps theirs (not returned). Warns (``UserWarning``) when
    none of the libraries is installed, since then nothing is registered. A library that is installed but no
    longer defines a listed class raises RuntimeError.
    """
    with _lock:
        classes = []
        for spec, policy in POLICIES.items():
            cls = _load(spec)
            if cls is None:
                continue
            if registered_policy(cls) is not None and _registered.get(cls) is not registered_policy(cls):
                continue  # (the user's own registration of it, even of this very policy: kept as they made it)
            register_policy(cls, policy)
            classes.append(cls)
            _registered[cls] = policy
    if not classes:
        libraries = sorted({spec.partition(":")[0].split(".")[0] for spec in POLICIES})
        warnings.warn(
            f"optimshift.integrations.third_party.register(): {', '.join(libraries)} is not installed, so no "
            f"policy was registered (pip install {' '.join(name.replace('_', '-') for name in libraries)})",
            UserWarning,
            stacklevel=2,
        )
    return classes


def unregister() -> None:
    """Remove the policies :func:`register` installed (one the user registered since is theirs: kept). A no-op if
    none are."""
    with _lock:
        while _registered:
            cls, policy = _registered.popitem()
            if registered_policy(cls) is policy:
                unregister_policy(cls)
