"""The GPU check of keep_addresses (a section of benchmarks/gpu_check.sh): what only a CUDA device can show.

1. raw: the driver (optimshift._vmm.CudaDriver, ctypes on libcuda.so.1) maps a reserved range; a CUDA graph is
   captured reading it; the memory is unmapped (the device's free memory rises), mapped again at the same address
   and refilled; the replay reads the right values.
2. compiled: a capturable Adam step compiled with mode="reduce-overhead" (cudagraph trees), 10 offload/reload
   cycles with keep_addresses=True: same objects, same data_ptr, bitwise state, the state's memory free while
   offloaded, and no cudagraph recording after the first cycle (cudagraph trees' recordings counted); then the
   control, without keep_addresses, which records again every cycle (so the count is shown to work).

Prints one line per check and exits 1 if any fails.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import torch

import optimshift
from optimshift import _vmm

failures: list[str] = []


def check(name: str, ok: bool, detail: str = "") -> None:
    print(f"keep-addresses {name}: {'ok' if ok else 'FAILED'}{f' ({detail})' if detail else ''}", flush=True)
    if not ok:
        failures.append(name)


def raw(device: torch.device) -> None:
    driver = _vmm.driver_for(device)
    why = _vmm.unsupported(device)
    check("driver", driver is not None and why is None, why or "")
    if driver is None or why is not None:
        return
    size = 4 * driver.granularity(device)
    address = driver.reserve(device, size)
    handle = driver.create(device, size)
    driver.map(device, address, size, handle)
    driver.set_access(device, address, size)
    buf = driver.wrap(device, address, size, None).view(torch.float32)
    values = torch.randn(buf.numel(), generator=torch.Generator().manual_seed(0))
    buf.copy_(values.to(device))
    out = torch.empty_like(buf)
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        out.copy_(buf * 2)  # (warm-up, as torch.cuda.graph asks)
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(buf * 2)
    torch.cuda.synchronize(device)
    del buf
    free_before = torch.cuda.mem_get_info(device)[0]
    driver.unmap(device, address, size)
    driver.release(device, handle)
    freed = torch.cuda.mem_get_info(device)[0] - free_before
    check("raw unmap frees", freed >= size, f"{freed} bytes freed of {size} mapped")
    handle = driver.create(device, size)
    driver.map(device, address, size, handle)
    driver.set_access(device, address, size)
    again = driver.wrap(device, address, size, None).view(torch.float32)
    check("raw remap at the same address", again.data_ptr() == address)
    again.copy_(values.to(device))
    out.zero_()
    graph.replay()
    torch.cuda.synchronize(device)
    check("raw replay after remap", torch.equal(out.cpu(), values * 2))
    del again, graph, out
    torch.cuda.synchronize(device)
    driver.unmap(device, address, size)
    driver.release(device, handle)
    driver.free_reserved(device, address, size)


def _recordings() -> Any:
    """Count cudagraph trees' recordings (CUDATreeManager.record_function, every new graph recorded)."""
    from torch._inductor import cudagraph_trees

    counted = [0]
    original = cudagraph_trees.CUDATreeManager.record_function

    def record_function(self: Any, *args: Any, **kwargs: Any) -> Any:
        counted[0] += 1
        return original(self, *args, **kwargs)

    cudagraph_trees.CUDATreeManager.record_function = record_function  # type: ignore[method-assign]
    return counted


def _where(opt: torch.optim.Optimizer) -> dict[Any, tuple[int, int]]:
    return {(i, k): (id(v), v.data_ptr()) for i, st in enumerate(opt.state.values()) for k, v in st.items()}


def compiled(device: torch.device, keep: bool, counted: list[int]) -> list[int]:
    """Per cycle, the recordings cudagraph trees made (cycle 0: the first offload/reload)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(4)]).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=torch.tensor(1e-3, device=device), capturable=True)
    grads = [torch.randn_like(p) for p in model.parameters()]

    @torch.compile(mode="reduce-overhead")  # type: ignore[misc]
    def step() -> None:
        opt.step()

    def train(n: int) -> None:
        for _ in range(n):
            for p, g in zip(model.parameters(), grads):
                p.grad = g
            step()

    train(4)  # warm-up and the first recording
    torch.cuda.synchronize(device)
    label = "keep_addresses" if keep else "control"
    per_cycle = []
    kept = None
    for cycle in range(10):
        before_values = {(i, k): v.clone() for i, st in enumerate(opt.state.values()) for k, v in st.items()}
        before = counted[0]
        state_bytes = sum(v.numel() * v.element_size() for st in opt.state.values() for v in st.values())
        torch.cuda.synchronize(device)
        free_on = torch.cuda.mem_get_info(device)[0]
        optimshift.offload(opt, keep_addresses=keep, empty_cache=True)
        torch.cuda.synchronize(device)
        freed = torch.cuda.mem_get_info(device)[0] - free_on
        optimshift.reload(opt)
        same = all(
            torch.equal(v, before_values[i, k]) for i, st in enumerate(opt.state.values()) for k, v in st.items()
        )
        if cycle == 0:
            kept = _where(opt)
        if keep:
            check(f"{label} cycle {cycle} objects and addresses", _where(opt) == kept)
            check(
                f"{label} cycle {cycle} memory freed while offloaded",
                freed >= 0.9 * state_bytes,
                f"{freed} of {state_bytes} bytes",
            )
        check(f"{label} cycle {cycle} bitwise", same)
        train(2)
        torch.cuda.synchronize(device)
        per_cycle.append(counted[0] - before)
    print(f"keep-addresses {label}: recordings per cycle {per_cycle}", flush=True)
    return per_cycle


def main() -> int:
    if not torch.cuda.is_available():
        print("keep-addresses: no CUDA device", flush=True)
        return 2
    device = torch.device("cuda", 0)
    start = time.perf_counter()
    raw(device)
    print(f"keep-addresses raw: {time.perf_counter() - start:.1f}s", flush=True)
    counted = _recordings()
    start = time.perf_counter()
    kept = compiled(device, True, counted)
    check("keep_addresses: no recording after the first cycle", sum(kept[1:]) == 0, f"per cycle {kept}")
    control = compiled(device, False, counted)
    check("control: a recording every cycle", all(n >= 1 for n in control), f"per cycle {control}")
    print(f"keep-addresses compiled: {time.perf_counter() - start:.1f}s", flush=True)
    print(f"keep-addresses: {'FAILED: ' + ', '.join(failures) if failures else 'all passed'}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
