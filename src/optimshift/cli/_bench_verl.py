"""``optimshift bench --case verl``: verl's optimizer offload/load as shipped against the patched ones.

On one optimizer (AdamW, foreach: verl's default optimizer, over transformer-shaped params on the device),
``verl.utils.fsdp_utils.offload_fsdp_optimizer``/``load_fsdp_optimizer`` as verl ships them, then as
:mod:`optimshift.integrations.verl` replaces them, each called the way verl's engine calls them: time per
offload+load cycle, host syncs of the step after a cycle, new host allocations per cycle once warmed up, and
the share of state tensors that are the same objects after a cycle.
"""

from __future__ import annotations

import gc
import importlib
import os
import statistics
import sys
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

import torch

from ..api import move, offload, reload
from ..pool import host_pool
from ..syncs import count_syncs
from ._accelerator import shipped_vs_patched

__all__ = ["run_verl_case", "render_verl"]


_SIMULATOR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "testing") + os.sep


def _simulator_bookkeeping() -> bool:
    """Whether the op runs inside the simulated accelerator's own code (its race detector keeps a host copy of
    the memory a queued copy uses): not an allocation of the code measured."""
    frame: FrameType | None = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_filename.startswith(_SIMULATOR):
            return True
        frame = frame.f_back
    return False


class _HostAllocations:
    """Counts ops whose output is a host tensor with storage of its own (not a view or an in-place result of an
    input): the host buffers a cycle allocates (the simulated accelerator's own bookkeeping left out)."""

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_leaves

        outer = self
        self.count = 0

        class Mode(TorchDispatchMode):  # type: ignore[no-untyped-call]  # torch: __init_subclass__ is unannotated
            def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
                out = func(*args, **(kwargs or {}))
                inputs = {
                    t.untyped_storage().data_ptr()
                    for t in tree_leaves((args, kwargs))
                    if isinstance(t, torch.Tensor) and t.device.type == "cpu"
                }
                for t in tree_leaves(out):
                    if isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.untyped_storage().nbytes() > 0:
                        if t.untyped_storage().data_ptr() not in inputs and not _simulator_bookkeeping():
                            outer.count += 1
                return out

        self.mode = Mode()  # type: ignore[no-untyped-call]  # torch: TorchDispatchMode.__init__ is unannotated


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "sim":
        torch.get_device_module(device).synchronize(device.index or 0)


def _state_tensors(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]


def _set_grads(opt: torch.optim.Optimizer) -> None:
    for group in opt.param_groups:
        for p in group["params"]:
            p.grad = torch.full_like(p, 1e-3)


def _method(
    opt: torch.optim.Optimizer,
    offload: Callable[[Any], None],
    load: Callable[[Any, Any], None],
    device: torch.device,
    device_id: Any,
    reps: int,
) -> dict[str, Any]:
    def cycle() -> None:
        offload(opt)
        _sync(device)
        load(opt, device_id)
        _sync(device)

    cycle()  # warm-up: pools, streams, caches
    objects = _state_tensors(opt)  # (the objects themselves: a replaced one's id may be reused by its successor)
    before = host_pool.stats().allocations
    counter = _HostAllocations()
    with counter.mode:
        cycle()
    kept = sum(a is b for a, b in zip(objects, _state_tensors(opt))) / max(len(objects), 1)
    del objects
    times = []
    for _ in range(reps):
        gc.collect()
        start = time.perf_counter()
        cycle()
        times.append(time.perf_counter() - start)
    _set_grads(opt)
    with count_syncs() as syncs:
        opt.step()
    _sync(device)
    return {
        "cycle_s": statistics.median(times),
        "syncs_per_step_after": syncs.total,
        "host_allocations_per_cycle": counter.count,
        "pool_allocations_per_cycle": host_pool.stats().allocations - before,
        "objects_kept": kept,
    }


def run_verl_case(
    device: torch.device, *, quick: bool = False, shapes: list[tuple[int, ...]] | None = None
) -> dict[str, Any]:
    """Both ways on the same optimizer (verl's shipped functions first, then ``move`` puts the state back where
    a fresh optimizer keeps it, then the patched ones). Needs verl installed (``optimshift[verl]``).
    ``shapes``: the params' shapes (default: a transformer's, scaled to the device)."""
    from ..integrations import verl as osv
    from ._shapes import transformer_shapes

    was_patched = osv.is_patched()
    osv.unpatch()
    with osv._quiet_verl_import():
        fsdp_utils = importlib.import_module("verl.utils.fsdp_utils")
        version = str(getattr(importlib.import_module("verl"), "__version__", "?"))
    shipped = (fsdp_utils.offload_fsdp_optimizer, fsdp_utils.load_fsdp_optimizer)
    osv.patch()
    patched = (fsdp_utils.offload_fsdp_optimizer, fsdp_utils.load_fsdp_optimizer)
    try:
        if shapes is None:
            if device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(device)
                n_params = int(min(2e8, free / 8 / 8))
            else:
                n_params = 500_000 if quick else 2_000_000  # every simulated op runs through Python: scale down
            shapes = transformer_shapes(n_params)
        reps = 3 if quick else 5
        params = [torch.nn.Parameter(torch.zeros(s, device=device)) for s in shapes]
        opt = torch.optim.AdamW(params, foreach=True)
        _set_grads(opt)
        opt.step()
        tensors = len(_state_tensors(opt))
        state_bytes = sum(
            v.numel() * v.element_size()
            for st in opt.state.values()
            for v in st.values()
            if isinstance(v, torch.Tensor) and v.device.type != "cpu"
        )
        device_id = device.type  # what verl's FSDP engine passes: get_device_name()
        methods: dict[str, dict[str, Any]] = {}
        methods["verl (shipped)"] = _method(opt, shipped[0], shipped[1], device, device_id, reps)
        move(opt)  # the state back where a fresh optimizer keeps it (the shipped load left every step on the device)
        methods["optimshift (patched)"] = _method(opt, patched[0], patched[1], device, device_id, reps)
        # for reference: the same optimshift calls, blocking (on the simulator, its race-checked streams make the
        # patched functions' non-blocking copies slow; a GPU's copy engines make them overlap)
        methods["optimshift.offload/reload, blocking"] = _method(
            opt, lambda o: offload(o), lambda o, d: reload(o), device, device_id, reps
        )
        theirs, ours = methods["verl (shipped)"], methods["optimshift (patched)"]
        return {
            "case": "verl",
            "device": str(device),
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "simulated accelerator",
            "torch": torch.__version__,
            "verl": version,
            "optimizer": "AdamW(foreach=True)",
            "params": len(params),
            "tensors": tensors,
            "state_bytes": state_bytes,
            "device_id": device_id,
            "methods": methods,
            "cycle_speedup": theirs["cycle_s"] / ours["cycle_s"],
        }
    finally:
        if not was_patched:
            osv.unpatch()


def render_verl(result: dict[str, Any]) -> str:
    lines = [
        f"optimshift bench --case verl on {result['device']} ({result['device_name']}), torch {result['torch']}, "
        f"verl {result['verl']}",
        f"{result['optimizer']} over {result['params']} params: {result['tensors']} state tensors, "
        f"{result['state_bytes'] / 1e6:.1f} MB of device state; offload_fsdp_optimizer(opt), "
        f"load_fsdp_optimizer(opt, {result['device_id']!r})",
    ]
    lines += shipped_vs_patched(result, "functions", "verl (shipped)")
    if not result["device"].startswith("cuda"):
        lines.append(
            "(not a GPU: every simulated op runs through Python on host copies, and the patched functions' "
            "non-blocking copies run on the simulator's race-checked streams, so the cycle times measure the "
            "simulator, not a GPU's transfers; the syncs, allocations and objects are what a GPU sees)"
        )
    return "\n".join(lines)
