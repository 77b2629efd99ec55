"""Counting device-to-host synchronizations: reading a device scalar (``.item()``, ``if t:``; ``fill_`` from one on
another device), copying a device tensor to the host, an op whose output size depends on device data (``nonzero``,
``x[mask]``), seen through a ``TorchDispatchMode`` on any backend. The streamed step's queued copies to the host are
counted apart (:func:`async_copies`). Not counted: waits outside the dispatcher (``torch.cuda.synchronize()``, event
waits), printing a device tensor; code under ``torch.compile`` counts as the ops its graph runs eagerly, and a
compiled function first called inside the block stays eager even after it (dynamo skips a frame run under a
dispatch mode): call it once outside first.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections import Counter
from collections.abc import Iterator
from types import TracebackType
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ._devices import HOSTS

__all__ = ["count_syncs", "SyncCount", "async_copies"]

_aten = torch.ops.aten
# Ops whose output size depends on device data: the host must wait for the device to know it.
_DATA_DEPENDENT = set(
    "nonzero masked_select _unique2 unique_dim unique_consecutive _unique equal bincount repeat_interleave".split()
)
# Indexing ops that take a boolean mask by its nonzero positions (an output or write of data-dependent size).
_MASK_INDEXED = {"index", "index_put", "index_put_", "_index_put_impl_"}


def _takes_nonzero(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether an indexing op takes a boolean mask's positions: not one value written through one mask on the
    tensor's device, which ATen does as ``masked_fill_`` (``x[mask] = 0``, torch's Rprop: no sync; so taken on any
    device, since the simulator's ``x[mask] = 0`` makes its value there: a device scalar given on purpose goes
    uncounted)."""
    indices = args[1] if isinstance(args[1], (list, tuple)) else ()
    masks = [i for i in indices if isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)]
    if not any(map(_is_device, masks)):  # (a mask on the host: its positions are read there)
        return False
    if name == "index":
        return True
    value = args[2] if len(args) > 2 else kwargs.get("values")
    accumulate = args[3] if len(args) > 3 else kwargs.get("accumulate", False)
    filled = (
        not accumulate
        and isinstance(value, torch.Tensor)
        and value.numel() == 1
        and len(masks) == 1
        and all(i is None or i is masks[0] for i in indices)
        and masks[0].device == args[0].device
    )
    return not filled


_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_THIS_FILE = os.path.abspath(__file__)
# torch's own wrappers between an op and the code that called it: never the interesting line.
_PLUMBING = tuple(
    os.path.join(_TORCH_DIR, *p.split("/"))
    for p in "_dynamo _compile.py utils/_python_dispatch utils/_stats.py _ops.py _subclasses _tensor.py".split()
)


_async = threading.local()


@contextlib.contextmanager
def async_copies(active: bool = True) -> Iterator[None]:
    """Device-to-host copies made inside, on this thread, are queued ones the host does not wait for (on CUDA:
    ``non_blocking`` into pinned memory on a side stream): :class:`SyncCount` counts them in ``async_copies``."""
    if not active:
        yield
        return
    _async.depth = getattr(_async, "depth", 0) + 1
    try:
        yield
    finally:
        _async.depth -= 1


def _is_device(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type not in HOSTS


def _to_host(device: Any) -> bool:
    return device is not None and torch.device(device).type == "cpu"


class SyncCount(TorchDispatchMode):  # type: ignore[no-untyped-call]  # (TorchDispatchMode.__init_subclass__ is unannotated in torch)
    """The counts of a :func:`count_syncs` block: ``total``, ``by_op``, ``by_device``; with ``trace=True``
    also ``by_site`` (your line that caused each sync) and ``by_origin`` (the innermost Python line, often
    inside torch, that read the device). ``async_copies``: device-to-host tensor copies queued on a copy
    stream (see :func:`async_copies`), which are not syncs and are not in ``total``."""

    def __init__(self, trace: bool = False) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # unannotated in torch
        self.trace = trace
        self.by_op: Counter[str] = Counter()
        self.by_device: Counter[str] = Counter()
        self.by_site: Counter[str] = Counter()
        self.by_origin: Counter[str] = Counter()
        self.async_copies = 0

    @property
    def total(self) -> int:
        return sum(self.by_op.values())

    def __repr__(self) -> str:
        return f"SyncCount(total={self.total}, by_op={dict(self.by_op)}, by_device={dict(self.by_device)})"

    def _record(self, kind: str, device: torch.device) -> None:
        self.by_op[kind] += 1
        self.by_device[str(device)] += 1
        if self.trace:
            user, origin = _sites()
            self.by_site[user] += 1
            self.by_origin[origin] += 1

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        first: Any = args[0] if args else None
        if name == "_local_scalar_dense" and _is_device(first):
            self._record("item", first.device)
        elif name == "_to_copy" and _is_device(first) and _to_host(kwargs.get("device")):
            self._record("copy_to_host", first.device)
        elif name in ("copy_", "_foreach_copy_") and len(args) >= 2:
            pairs = zip(first or (), args[1] or ()) if name == "_foreach_copy_" else [(first, args[1])]
            for dst, src in pairs:
                if _is_device(src) and isinstance(dst, torch.Tensor) and dst.device.type == "cpu":
                    if getattr(_async, "depth", 0):
                        self.async_copies += 1
                    else:
                        self._record("copy_to_host", src.device)
        elif (
            name == "fill_"
            and len(args) >= 2
            and _is_device(args[1])
            and isinstance(first, torch.Tensor)
            and first.device != args[1].device
        ):
            # (ATen reads a value on another device with .item() inside the op: an LR scheduler filling a host
            # tensor lr from the device base_lrs it cloned; only the outer op reaches a dispatch mode)
            self._record("item", args[1].device)
        elif name in _DATA_DEPENDENT and _is_device(first):
            self._record(name, first.device)
        elif name in _MASK_INDEXED and _is_device(first) and len(args) >= 2 and _takes_nonzero(name, args, kwargs):
            self._record(name, first.device)  # (x[mask], x[mask] = v: a nonzero of the mask inside)
        return func(*args, **kwargs)


def _format(frame: Any) -> str:
    filename = os.path.abspath(frame.f_code.co_filename)
    if filename.startswith(_TORCH_DIR):
        shown = "torch/" + filename[len(_TORCH_DIR) :]
    else:
        try:
            shown = os.path.relpath(filename)
        except ValueError:
            shown = filename
        if shown.startswith(".." + os.sep + ".."):
            shown = filename
    return f"{shown}:{frame.f_lineno} ({frame.f_code.co_name})"


def _sites() -> tuple[str, str]:
    """(the innermost frame outside torch and this module: the user's line; the innermost Python frame,
    often inside torch: the exact line that read the device, e.g. in ``torch/optim/adam.py``)."""
    frame = sys._getframe(3)
    origin = None
    while frame is not None:
        filename = os.path.abspath(frame.f_code.co_filename)
        if filename != _THIS_FILE and not filename.startswith(_PLUMBING):
            if origin is None:
                origin = _format(frame)
            if not filename.startswith(_TORCH_DIR):
                return _format(frame), origin
        frame = frame.f_back  # type: ignore[assignment]
    return "<torch internals>", origin or "<torch internals>"


class count_syncs:
    """Context manager counting host syncs of the code inside it.

    >>> with count_syncs(trace=True) as syncs:
    ...     optimizer.step()
    >>> syncs.total, syncs.by_op, syncs.by_site.most_common(1)
    """

    def __init__(self, *, trace: bool = False) -> None:
        self._count = SyncCount(trace=trace)
        self._active = False

    def __enter__(self) -> SyncCount:
        if self._active:
            # (its mode twice on torch's stack counts every sync of the inner block twice)
            raise RuntimeError(
                "count_syncs: this block is already counting (the same count_syncs object entered again inside "
                "it); nest a new count_syncs() instead"
            )
        self._count.__enter__()  # type: ignore[no-untyped-call]  # unannotated in torch
        self._active = True
        return self._count

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._active = False
        self._count.__exit__(exc_type, exc, tb)  # type: ignore[no-untyped-call]  # unannotated in torch
