"""``optimshift bench --case rl-loop``: the offload/reload loop of an RL pipeline, as it runs every iteration.

N cycles of: a ``torch.compile``d AdamW step (foreach), ``offload(non_blocking=True)``, a device allocation the
size of the state standing in for generation, ``reload(non_blocking=True)``, and the next step, with a scheduler
stepping ``lr`` every step. Per cycle, once warmed up:

- the offload+reload overhead against the least work: a bare per-tensor identity-keeping loop over the same
  tensors (``swap_tensors``/``set_data`` of ``v.to(host)`` and back), timed in the same process;
- host syncs per step (goal 0), recompiles of the compiled step (goal 0), new host allocations of the pool
  (goal 0), the device memory freed while offloaded (goal: all the state's bytes), and how many state tensors
  kept their object across the cycle (all, where set_data or a swap applies), and their address
  (``--keep-addresses``: all after the first cycle, where the device keeps addresses).
"""

from __future__ import annotations

import gc
import statistics
import time
from typing import Any, Literal

import torch

from .. import _addresses
from .._adopt import decide_all
from ..api import offload, reload
from ..pool import host_pool
from ..syncs import count_syncs
from ._accelerator import SIMULATED_TIMES, simulated

__all__ = ["run_rl_loop_case", "render_rl_loop"]


def _device_bytes(device: torch.device, opt: torch.optim.Optimizer) -> int | None:
    if device.type == "cuda":  # (state kept at fixed addresses is mapped outside the caching allocator)
        torch.cuda.synchronize(device)
        return int(torch.cuda.memory_allocated(device)) + _addresses.mapped_bytes(opt)
    try:
        from ..testing import simulated_memory_allocated

        return simulated_memory_allocated(device.index or 0)
    except Exception:  # noqa: BLE001 - not measurable on this device
        return None


def _bare_cycle(opt: torch.optim.Optimizer, device: torch.device) -> None:
    """The least an identity-keeping offload+reload does: each tensor to the host and back, keeping its object
    (set_data where torch allows it, else swap_tensors), one at a time."""
    for host in (torch.device("cpu"), device):
        for st in opt.state.values():
            for k, v in st.items():
                if k != "step" and isinstance(v, torch.Tensor):
                    new = v.to(host)
                    if decide_all([(v, new)])[0] == "data":
                        v.data = new
                    else:
                        torch.utils.swap_tensors(v, new)  # type: ignore[no-untyped-call]
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_rl_loop_case(
    device: torch.device, *, quick: bool = False, keep_addresses: bool | Literal["auto"] = False
) -> dict[str, Any]:
    """The loop; ``keep_addresses``: as ``offload``'s (state back at the same addresses each cycle)."""
    cycles = 4 if quick else 10
    layers = 4 if quick else 16
    width = 64 if quick else 256
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(layers))).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.99)
    compiles = [0]

    def counting_backend(gm: Any, example_inputs: Any) -> Any:
        compiles[0] += 1
        return gm.forward

    step = torch.compile(opt.step, backend=counting_backend)
    x = torch.randn(8, width, device=device)

    def train_step() -> None:
        opt.zero_grad(set_to_none=False)
        model(x).square().mean().backward()
        step()
        sched.step()

    train_step()  # state exists from here on (and the first compile)
    state_bytes = sum(
        v.numel() * v.element_size() for st in opt.state.values() for v in st.values() if v.device == device
    )
    rows: list[dict[str, Any]] = []
    for cycle in range(cycles):
        allocations = host_pool.stats().allocations
        compiled = compiles[0]
        objects = [id(v) for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
        addresses = [v.data_ptr() for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
        gc.collect()
        before = _device_bytes(device, opt)
        t0 = time.perf_counter()
        offload(opt, non_blocking=True, keep_addresses=keep_addresses).wait()
        t1 = time.perf_counter()
        gc.collect()
        freed = None if before is None else before - (_device_bytes(device, opt) or 0)
        generation = torch.empty(max(state_bytes // 4, 1), device=device)  # stands in for rollouts
        del generation
        t2 = time.perf_counter()
        reload(opt, non_blocking=True).wait()  # (waited for here to time it; the step would wait on the device)
        t3 = time.perf_counter()
        now = [id(v) for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
        kept = sum(a == b for a, b in zip(objects, now))
        ptrs = [v.data_ptr() for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
        same_addresses = sum(a == b for a, b in zip(addresses, ptrs))
        with count_syncs() as syncs:
            train_step()
        rows.append(
            {
                "cycle": cycle,
                "optimshift_s": (t1 - t0) + (t3 - t2),
                "syncs_per_step": syncs.total,
                "recompiles": compiles[0] - compiled,
                "new_host_allocations": host_pool.stats().allocations - allocations,
                "freed_bytes": freed,
                "objects_kept": kept,
                "addresses_kept": same_addresses,
            }
        )
    # the least work, on the same optimizer (its state where it is now), timed after the loop
    bare = []
    for _ in range(max(3, cycles // 2)):
        t0 = time.perf_counter()
        _bare_cycle(opt, device)
        bare.append(time.perf_counter() - t0)
    warm = rows[1:] or rows
    tensors = sum(1 for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor))
    os_s = statistics.median(r["optimshift_s"] for r in warm)
    bare_s = statistics.median(bare)
    return {
        "device": str(device),
        "torch": torch.__version__,
        "cycles": cycles,
        "state_tensors": tensors,
        "keep_addresses": keep_addresses,
        "state_bytes": state_bytes,
        "rows": rows,
        "optimshift_ms": os_s * 1e3,
        "bare_ms": bare_s * 1e3,
        "overhead_vs_bare": os_s / bare_s if bare_s else None,
        "goals": {
            "syncs per step 0": all(r["syncs_per_step"] == 0 for r in warm),
            "recompiles 0": all(r["recompiles"] == 0 for r in warm),
            "new host allocations 0 after the first cycle": all(r["new_host_allocations"] == 0 for r in warm),
            "all state bytes freed while offloaded": all(
                r["freed_bytes"] is not None and r["freed_bytes"] >= state_bytes for r in warm
            ),
            **(
                {"addresses kept after the first cycle": all(r["addresses_kept"] == tensors for r in warm)}
                if keep_addresses
                else {}
            ),
        },
    }


def render_rl_loop(result: dict[str, Any]) -> str:
    lines = [
        f"rl-loop on {result['device']} (torch {result['torch']}): {result['cycles']} cycles, "
        f"{result['state_tensors']} state tensors, {result['state_bytes'] / 2**20:.1f} MiB of device state",
        "cycle  offload+reload ms  syncs/step  recompiles  new host allocs  freed MiB  objects kept  addresses kept",
    ]
    for r in result["rows"]:
        freed = "-" if r["freed_bytes"] is None else f"{r['freed_bytes'] / 2**20:.1f}"
        lines.append(
            f"{r['cycle']:>5}  {r['optimshift_s'] * 1e3:>17.2f}  {r['syncs_per_step']:>10}  {r['recompiles']:>10}  "
            f"{r['new_host_allocations']:>15}  {freed:>9}  {r['objects_kept']:>5}/{result['state_tensors']}  "
            f"{r['addresses_kept']:>7}/{result['state_tensors']}"
        )
    if not result.get("keep_addresses"):
        lines.append(
            "(addresses kept: without --keep-addresses only where the caching allocator happened to hand the same "
            "memory back; a step captured in a CUDA graph needs every one)"
        )
    lines.append(
        f"offload+reload (non-blocking, waited for) {result['optimshift_ms']:.2f} ms against a bare per-tensor "
        f"identity-keeping loop {result['bare_ms']:.2f} ms: {result['overhead_vs_bare']:.2f}x"
    )
    if simulated(result["device"]):
        lines.append(
            f"({SIMULATED_TIMES}: the ms and the ratio compare Python overheads over the simulator, not transfers; "
            f"the counts are the device's. Run it on a GPU for times)"
        )
    lines.append("goals: " + "; ".join(f"{k}: {'met' if v else 'NOT met'}" for k, v in result["goals"].items()))
    if any(r["objects_kept"] < result["state_tensors"] for r in result["rows"]):
        lines.append(
            "note: a cycle replaced state tensors (a weak reference, as a compiled step's, blocks the swap, and "
            "set_data does not apply between the host and this device; CUDA takes set_data): the step's graph may "
            "keep the old ones, so that cycle frees less device memory and may recompile"
        )
    return "\n".join(lines)
