"""``optimshift bench --case deepspeed``: DeepSpeed's ZeRO-1/2 optimizer-state offload/reload, shipped vs patched.

On one torch ``AdamW`` (foreach; the client optimizer the Hugging Face Trainer hands DeepSpeed) over
transformer-shaped params on the device, the functions ``DeepSpeedZeroOptimizer.offload_states`` and
``reload_states`` call for the optimizer state (``offload_optimizer_states``/``reload_optimizer_states``, through
the names ``deepspeed.runtime.zero.stage_1_and_2`` imported, with its arguments), as DeepSpeed ships them and as
:mod:`optimshift.integrations.deepspeed` replaces them: time per cycle, host syncs of the step after a cycle, new
host allocations per cycle once warmed up, objects kept. Then the fp32 master partitions' host buffers: a fresh
``pin_empty_like`` per cycle (DeepSpeed's reload deletes them) against a pool buffer reused.
"""

from __future__ import annotations

import gc
import importlib
import statistics
import time
from typing import Any

import torch

from ..api import move
from ..pool import host_pool
from ..report import format_table
from ._accelerator import shipped_vs_patched
from ._bench_verl import _HostAllocations, _method, _set_grads, _state_tensors, _sync

__all__ = ["run_deepspeed_case", "render_deepspeed"]


def _partition_buffers(device: torch.device, numel: int, reps: int) -> dict[str, dict[str, Any]]:
    """One fp32 partition of ``numel`` on the device, offloaded and reloaded as ZeRO-1/2 does with ``hp_params``
    (copy into a host buffer, swap ``.data``; back with ``.to(device)``): a new ``pin_empty_like`` buffer every
    cycle (shipped) against a pool buffer reused (patched)."""
    from deepspeed.accelerator import get_accelerator

    from ..integrations.deepspeed import _pooled_like

    partition = torch.zeros(numel, device=device)
    pinned = device.type == "cuda"
    out: dict[str, dict[str, Any]] = {}

    def shipped() -> None:
        buf = get_accelerator().pin_empty_like(partition, device="cpu")
        buf.copy_(partition)
        partition.data = buf
        partition.data = partition.data.to(device)

    def patched() -> None:
        raw, buf = _pooled_like(partition, pinned=pinned)
        buf.copy_(partition)
        partition.data = buf
        partition.data = partition.data.to(device)
        del buf
        host_pool.release(raw)

    if device.type not in ("cuda", "cpu"):
        return out  # (torch refuses .data between the host and a Python-defined backend)
    for name, cycle in (("DeepSpeed (shipped)", shipped), ("optimshift pool (patched)", patched)):
        cycle()
        _sync(device)
        before = host_pool.stats().allocations
        counter = _HostAllocations()
        with counter.mode:
            cycle()
        times = []
        for _ in range(reps):
            gc.collect()
            start = time.perf_counter()
            cycle()
            _sync(device)
            times.append(time.perf_counter() - start)
        out[name] = {
            "cycle_s": statistics.median(times),
            "host_allocations_per_cycle": counter.count,
            "pool_allocations_per_cycle": host_pool.stats().allocations - before,
        }
    return out


def run_deepspeed_case(
    device: torch.device, *, quick: bool = False, shapes: list[tuple[int, ...]] | None = None
) -> dict[str, Any]:
    """Both ways on the same optimizer (DeepSpeed's functions first, then ``move`` puts the state back where a
    fresh optimizer keeps it, then the patched ones). Needs deepspeed (``optimshift[deepspeed]``)."""
    from ..integrations import deepspeed as osd
    from ._shapes import transformer_shapes

    was_patched = osd.is_patched()
    osd.unpatch()
    zero12 = importlib.import_module("deepspeed.runtime.zero.stage_1_and_2")
    version = str(getattr(importlib.import_module("deepspeed"), "__version__", "?"))
    shipped = (zero12.offload_optimizer_states, zero12.reload_optimizer_states)
    osd.patch()
    patched = (zero12.offload_optimizer_states, zero12.reload_optimizer_states)
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
        numel = sum(p.numel() for p in params)
        state_bytes = sum(
            v.numel() * v.element_size()
            for st in opt.state.values()
            for v in st.values()
            if isinstance(v, torch.Tensor) and v.device.type != "cpu"
        )
        target = str(device)  # what reload_states passes: get_accelerator().current_device_name()

        def as_zero_calls(functions: tuple[Any, Any]) -> tuple[Any, Any]:
            off, on = functions
            return (
                lambda o: off(o, "cpu", pin_memory=True, non_blocking=False),
                lambda o, d: on(o, d, non_blocking=False),
            )

        methods: dict[str, dict[str, Any]] = {}
        methods["DeepSpeed (shipped)"] = _method(opt, *as_zero_calls(shipped), device, target, reps)
        move(opt)  # the state back where a fresh optimizer keeps it (the shipped reload left every step on the device)
        methods["optimshift (patched)"] = _method(opt, *as_zero_calls(patched), device, target, reps)
        theirs, ours = methods["DeepSpeed (shipped)"], methods["optimshift (patched)"]
        return {
            "case": "deepspeed",
            "device": str(device),
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "simulated accelerator",
            "torch": torch.__version__,
            "deepspeed": version,
            "optimizer": "AdamW(foreach=True)",
            "params": len(params),
            "tensors": tensors,
            "state_bytes": state_bytes,
            "methods": methods,
            "cycle_speedup": theirs["cycle_s"] / ours["cycle_s"],
            "partition_numel": numel,
            "partition": _partition_buffers(device, numel, reps),
        }
    finally:
        if not was_patched:
            osd.unpatch()


def render_deepspeed(result: dict[str, Any]) -> str:
    lines = [
        f"optimshift bench --case deepspeed on {result['device']} ({result['device_name']}), torch {result['torch']}, "
        f"deepspeed {result['deepspeed']}",
        f"{result['optimizer']} over {result['params']} params: {result['tensors']} state tensors, "
        f"{result['state_bytes'] / 1e6:.1f} MB of device state; ZeRO-1/2's offload_optimizer_states(opt, 'cpu', "
        f"pin_memory=True), reload_optimizer_states(opt, {result['device']!r})",
    ]
    lines += shipped_vs_patched(result, "optim_states", "DeepSpeed (shipped)")
    partition = result["partition"]
    if partition:
        rows = [
            [name, f"{m['cycle_s'] * 1e3:.1f}", str(m["host_allocations_per_cycle"])] for name, m in partition.items()
        ]
        lines.append(
            f"hp_params: one fp32 partition of {result['partition_numel']:,} elements offloaded and reloaded as "
            "ZeRO-1/2 does (copy into a host buffer, .data swap; .to(device) back):"
        )
        lines.append(format_table(["host buffer", "cycle ms", "host allocations/cycle"], rows))
    else:
        lines.append(
            "hp_params: not measured on this device (torch refuses DeepSpeed's .data swap between the host and a "
            "Python-defined backend); tests/integrations/test_deepspeed.py checks the pool buffers on the real engine"
        )
    if not result["device"].startswith("cuda"):
        lines.append(
            "(not a GPU: every simulated op runs through Python on host copies, so the cycle times measure the "
            "simulator, not a GPU's transfers; the syncs, allocations and objects are what a GPU sees)"
        )
    return "\n".join(lines)
