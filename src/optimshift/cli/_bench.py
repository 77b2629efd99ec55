"""``optimshift bench`` (also ``python -m optimshift.bench``): how fast and how correct offload/reload/move are.

Measures on whatever is present (CUDA if there, else the simulated accelerator, plus the meta device for pure
Python overhead), every figure against baselines run in the same process, because these machines are noisy:

- offload and reload throughput (GB/s) for AdamW state shaped like a transformer (scaled to the memory at
  hand) and for 50,000 small tensors, against one flat copy of the same bytes (the physical limit), a naive
  per-tensor ``.to()`` loop (verl, NeMo-RL), and Lightning's ``_optimizer_to_device`` when installed;
- host syncs per step after each method, and step time after a move relative to a fresh optimizer;
- new host-pool (pinned on CUDA) allocations per offload/reload cycle after warm-up;
- the per-tensor overhead of ``move`` against a bare ``.to()`` loop, on the meta device;
- a streamed step (:func:`optimshift.stream`) of fused AdamW against the same step with all state on the
  device, the flat pinned copy bandwidth of the same bytes both ways, a CPU step of the same optimizer (torch's
  fused CPU AdamW, and torchao's ``CPUOffloadOptimizer`` when it is installed), the extra device memory during
  the streamed step, and host syncs per step; with the issue's goals checked on the figures of this run.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from .._plan import policy_target
from .._streaming import DEFAULT_CHUNK_BYTES, stream, unstream
from ..api import _move_key, _one_at_a_time, _transfer, move, offload, reload
from ..pool import host_pool
from ..report import format_table
from ..syncs import count_syncs
from ._accelerator import SIMULATED_TIMES, demo_accelerator, simulated
from ._common import failure
from ._help import HelpFormatter, run_command
from ._shapes import transformer_shapes

_transformer_shapes = transformer_shapes  # (the name tests use)

DESCRIPTION = """\
Measures how fast and how correct offload, reload and move are, on a GPU when there is one, else on a
simulated accelerator (plus the meta device, for pure Python overhead). Every figure is compared with
baselines run in the same process, because shared machines are noisy:

- offload and reload throughput (GB/s) for AdamW state shaped like a transformer (scaled to the memory at
  hand) and for many small tensors, against one flat copy of the same bytes (the physical limit), a
  per-tensor .to() loop (what most training frameworks do), and Lightning's own helper when it is installed;
- host syncs per training step after each method, and step time after a move compared with a fresh
  optimizer;
- new host-memory allocations per offload/reload cycle once warmed up;
- the per-tensor cost of move against a bare .to() loop.

--case verl measures verl's optimizer offload/load as shipped against optimshift's replacements instead
(needs verl: pip install "optimshift[verl]"); --case deepspeed does the same for DeepSpeed ZeRO-1/2's
offload_states/reload_states (needs deepspeed: pip install "optimshift[deepspeed]").
"""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn: Callable[[], Any], device: torch.device, reps: int) -> float:
    """Median seconds of ``reps`` runs (``fn`` is run once before, as a warm-up)."""
    fn()
    _sync(device)
    times = []
    for _ in range(reps):
        gc.collect()
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _optimizer(shapes: list[tuple[int, ...]], device: torch.device, **kwargs: Any) -> torch.optim.Optimizer:
    params = [torch.nn.Parameter(torch.zeros(s, device=device)) for s in shapes]
    opt = torch.optim.AdamW(params, **kwargs)
    for p in params:
        p.grad = torch.zeros_like(p)
    opt.step()
    for p in params:
        p.grad = None
    return opt


def _state_bytes(opt: torch.optim.Optimizer) -> int:
    return sum(
        v.numel() * v.element_size()
        for st in opt.state.values()
        for v in st.values()
        if isinstance(v, torch.Tensor) and v.device.type != "cpu"
    )


def _naive(opt: torch.optim.Optimizer, device: torch.device) -> None:
    for st in opt.state.values():
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                st[k] = v.to(device)


def _lightning() -> Callable[[torch.optim.Optimizer, torch.device], None] | None:
    try:
        from lightning.fabric.utilities.optimizer import _optimizer_to_device
    except Exception:
        return None
    return _optimizer_to_device


def _throughput_case(name: str, shapes: list[tuple[int, ...]], device: torch.device, reps: int) -> dict[str, Any]:
    host = torch.device("cpu")
    opt = _optimizer(shapes, device)
    nbytes = _state_bytes(opt)
    tensors = sum(1 for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor))
    result: dict[str, Any] = {"case": name, "tensors": tensors, "bytes": nbytes, "methods": {}}

    pin = device.type == "cuda"
    flat_dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    flat_host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
    methods: dict[str, tuple[Callable[[], Any], Callable[[], Any]]] = {
        "flat copy (limit)": (
            lambda: flat_host.copy_(flat_dev, non_blocking=pin),
            lambda: flat_dev.copy_(flat_host, non_blocking=pin),
        ),
        "naive .to() loop": (lambda: _naive(opt, host), lambda: _naive(opt, device)),
    }
    lightning = _lightning()
    if lightning is not None:
        methods["lightning _optimizer_to_device"] = (lambda: lightning(opt, host), lambda: lightning(opt, device))
    methods["optimshift offload/reload"] = (lambda: offload(opt), lambda: reload(opt))

    for method, (down, up) in methods.items():

        def cycle(down: Callable[[], Any] = down, up: Callable[[], Any] = up) -> None:
            down()
            _sync(device)
            up()

        cycle()  # warm-up: pools, streams, caches
        downs, ups = [], []
        for _ in range(reps):
            gc.collect()
            _sync(device)
            t0 = time.perf_counter()
            down()
            _sync(device)
            t1 = time.perf_counter()
            up()
            _sync(device)
            t2 = time.perf_counter()
            downs.append(t1 - t0)
            ups.append(t2 - t1)
        with count_syncs() as syncs:  # one optimizer step after this method's reload
            for p in (p for g in opt.param_groups for p in g["params"]):
                p.grad = torch.zeros_like(p)
            opt.step()
            for p in (p for g in opt.param_groups for p in g["params"]):
                p.grad = None
        move(opt)  # back to the correct placement for the next method
        result["methods"][method] = {
            "offload_s": statistics.median(downs),
            "reload_s": statistics.median(ups),
            "offload_GBps": nbytes / statistics.median(downs) / 1e9,
            "reload_GBps": nbytes / statistics.median(ups) / 1e9,
            "syncs_per_step_after": syncs.total,
        }
    flat = result["methods"]["flat copy (limit)"]
    naive = result["methods"]["naive .to() loop"]
    ours = result["methods"]["optimshift offload/reload"]
    result["ratios"] = {
        "offload_vs_flat": ours["offload_GBps"] / flat["offload_GBps"],
        "reload_vs_flat": ours["reload_GBps"] / flat["reload_GBps"],
        "offload_vs_naive": naive["offload_s"] / ours["offload_s"],
        "reload_vs_naive": naive["reload_s"] / ours["reload_s"],
    }
    return result


def _pool_case(device: torch.device, shapes: list[tuple[int, ...]], cycles: int) -> dict[str, Any]:
    opt = _optimizer(shapes, device)
    offload(opt)
    reload(opt)  # warm-up
    before = host_pool.stats()
    for _ in range(cycles):
        offload(opt)
        reload(opt)
    after = host_pool.stats()
    return {
        "cycles": cycles,
        "new_allocations_per_cycle": (after.allocations - before.allocations) / cycles,
        "pinned": device.type == "cuda",
        "idle_bytes": after.idle_bytes,
    }


def _step_time_case(device: torch.device, shapes: list[tuple[int, ...]], reps: int) -> dict[str, Any]:
    """Step time of an optimizer moved host -> device by optimshift, and by the naive loop, vs a fresh one."""

    def stepper(opt: torch.optim.Optimizer) -> Callable[[], None]:
        params = [p for g in opt.param_groups for p in g["params"]]
        for p in params:
            p.grad = torch.zeros_like(p)
        return opt.step

    fresh = _optimizer(shapes, device)
    moved = _params_to(_optimizer(shapes, torch.device("cpu")), device)
    naive = _params_to(_optimizer(shapes, torch.device("cpu")), device)
    move(moved)
    _naive(naive, device)
    t_fresh = _time(stepper(fresh), device, reps)
    t_moved = _time(stepper(moved), device, reps)
    t_naive = _time(stepper(naive), device, reps)
    with count_syncs() as s_fresh:
        fresh.step()
    with count_syncs() as s_moved:
        moved.step()
    with count_syncs() as s_naive:
        naive.step()
    return {
        "fresh_step_s": t_fresh,
        "moved_vs_fresh": t_moved / t_fresh,
        "naive_vs_fresh": t_naive / t_fresh,
        "syncs_per_step": {"fresh": s_fresh.total, "optimshift.move": s_moved.total, "naive": s_naive.total},
    }


def _params_to(opt: torch.optim.Optimizer, device: torch.device) -> torch.optim.Optimizer:
    """What ``model.to(device)`` does to an optimizer whose params it replaced: new params, state not moved."""
    for group in opt.param_groups:
        for i, p in enumerate(group["params"]):
            q = torch.nn.Parameter(p.detach().to(device))
            group["params"][i] = q
            if p in opt.state:
                opt.state[q] = opt.state.pop(p)
    return opt


def _overhead_case(n_tensors: int, reps: int) -> dict[str, Any]:
    """Per-tensor Python overhead of ``move`` vs a bare ``.to()`` loop over the same tensors, host -> meta."""
    n_params = n_tensors // 2
    meta = torch.device("meta")

    def fresh() -> torch.optim.Optimizer:
        opt = _optimizer([(8,)] * n_params, torch.device("cpu"), foreach=False)
        return opt

    def bare(opt: torch.optim.Optimizer) -> None:  # what a loop that knows the rule does: skip the host `step`
        for st in opt.state.values():
            for k, v in st.items():
                if k != "step":
                    st[k] = v.to(meta)

    @_one_at_a_time  # move()'s path and wrapper (move itself refuses meta)
    def move_to_meta(opt: torch.optim.Optimizer) -> None:
        # (move()'s cache key too: a first call leaves its marker; nothing returned: freed before the collector runs)
        _transfer(opt, policy_target(opt, meta), what="move", cache_key=_move_key(opt, meta))

    t_bare, t_move = [], []
    for _ in range(reps):  # alternate, fresh optimizers each time: the same conditions for both
        a, b = fresh(), fresh()
        gc.collect()
        t0 = time.perf_counter()
        bare(a)
        t1 = time.perf_counter()
        move_to_meta(b)
        t2 = time.perf_counter()
        t_bare.append(t1 - t0)
        t_move.append(t2 - t1)
        del a, b
    moved = 2 * n_params
    return {
        "tensors": moved,
        "bare_us_per_tensor": statistics.median(t_bare) / moved * 1e6,
        "move_us_per_tensor": statistics.median(t_move) / moved * 1e6,
        "move_vs_bare": statistics.median(t_move) / statistics.median(t_bare),
    }


class _PeakSim:
    """The simulated device's allocated bytes after every op (it has no peak counter of its own)."""

    def __init__(self, device: torch.device) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        from ..testing import simulated_memory_allocated

        index = device.index or 0
        outer = self

        class Mode(TorchDispatchMode):  # type: ignore[no-untyped-call]  # torch: __init_subclass__ is unannotated
            def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
                out = func(*args, **(kwargs or {}))
                outer.peak = max(outer.peak, simulated_memory_allocated(index))
                return out

        self.mode = Mode()  # type: ignore[no-untyped-call]  # torch: TorchDispatchMode.__init__ is unannotated
        self.peak = 0
        self.now: Callable[[], int] = lambda: simulated_memory_allocated(index)


def _extra_memory(fn: Callable[[], Any], device: torch.device) -> int | None:
    """Peak device bytes allocated while ``fn`` runs, beyond what was allocated before (None: not measurable)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - base
    if device.type == "sim":
        peak = _PeakSim(device)
        base = peak.now()
        with peak.mode:
            fn()
        return max(peak.peak - base, 0)
    return None


def _cpu_steps(shapes: list[tuple[int, ...]], device: torch.device, reps: int) -> dict[str, float | None]:
    """Seconds per step of AdamW over the same shapes stepped on the CPU: torch's fused CPU AdamW (params on the
    host), and torchao's CPUOffloadOptimizer (params on ``device``, state and step on the host) if installed."""
    host = torch.device("cpu")
    out: dict[str, float | None] = {}
    params = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
    for p in params:
        p.grad = torch.full_like(p, 1e-3)
    try:
        cpu = torch.optim.AdamW(params, fused=True)
        cpu.step()
    except Exception:  # a torch without the fused CPU kernel
        cpu = torch.optim.AdamW(params, foreach=False)
    out["torch CPU AdamW"] = _time(cpu.step, host, reps)
    del cpu, params
    gc.collect()
    out["torchao CPUOffloadOptimizer"] = None
    if device.type == "cuda":
        try:
            from torchao.optim import CPUOffloadOptimizer  # type: ignore[import-not-found]
        except Exception:
            return out
        dparams = [torch.nn.Parameter(torch.zeros(s, device=device)) for s in shapes]
        for p in dparams:
            p.grad = torch.full_like(p, 1e-3)
        ao = CPUOffloadOptimizer(dparams, torch.optim.AdamW, fused=True)
        out["torchao CPUOffloadOptimizer"] = _time(ao.step, device, reps)
    return out


def _flat_copies(nbytes: int, device: torch.device, reps: int) -> tuple[float, float]:
    """Seconds for one flat copy of ``nbytes`` host -> device and device -> host (pinned on CUDA): the link."""
    pin = device.type == "cuda"
    flat_dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    flat_host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
    return (
        _time(lambda: flat_dev.copy_(flat_host, non_blocking=pin), device, reps),
        _time(lambda: flat_host.copy_(flat_dev, non_blocking=pin), device, reps),
    )


def _stream_case(device: torch.device, shapes: list[tuple[int, ...]], reps: int) -> dict[str, Any]:
    """Fused AdamW: all state on the device vs streamed vs a CPU step, with the link's flat pinned bandwidth."""
    params = [torch.nn.Parameter(torch.zeros(s, device=device)) for s in shapes]
    for p in params:
        p.grad = torch.full_like(p, 1e-3)
    opt = torch.optim.AdamW(params, fused=True)
    opt.step()
    state_bytes = _state_bytes(opt)
    largest = max(p.numel() for p in params) * 4 * 2
    t_device = _time(opt.step, device, reps)
    with count_syncs() as s_device:
        opt.step()

    t_h2d, t_d2h = _flat_copies(state_bytes, device, reps)

    handle = stream(opt, chunk_bytes=DEFAULT_CHUNK_BYTES)
    opt.step()  # warm-up: windows, streams
    t_stream = _time(opt.step, device, reps)
    with count_syncs() as s_stream:
        opt.step()
    handle.wait()  # the last step's write-backs done: their windows are gone before the baseline is read
    extra = _extra_memory(opt.step, device)
    chunks = handle.chunks
    unstream(opt)
    del opt, params, handle
    gc.collect()
    host_pool.release_idle()
    if device.type == "cuda":
        torch.cuda.empty_cache()

    cpu = _cpu_steps(shapes, device, max(2, reps - 1))
    link_s = t_h2d + t_d2h  # the state once down and once up at the flat copy's speed
    budget_s = 1.2 * link_s + t_device
    bound = 2 * DEFAULT_CHUNK_BYTES + (largest if largest > DEFAULT_CHUNK_BYTES else 0)
    cpu_s = cpu["torch CPU AdamW"]
    return {
        "state_bytes": state_bytes,
        "chunk_bytes": DEFAULT_CHUNK_BYTES,
        "chunks": chunks,
        "device_step_s": t_device,
        "streamed_step_s": t_stream,
        "flat_h2d_GBps": state_bytes / t_h2d / 1e9,
        "flat_d2h_GBps": state_bytes / t_d2h / 1e9,
        "link_s": link_s,
        "cpu_step_s": cpu,
        "extra_device_bytes_streamed_step": extra,
        "extra_device_bytes_bound": bound,
        "syncs_per_step": {"all on device": s_device.total, "streamed": s_stream.total},
        "goals": {
            "streamed <= 1.2 x link + device step": t_stream <= budget_s,
            "streamed >= 3x faster than torch CPU AdamW": cpu_s is not None and cpu_s >= 3 * t_stream,
            "extra device memory <= 2 chunks (+ a larger param's state)": extra is not None and extra <= bound,
            "host syncs per step equal": s_device.total == s_stream.total,
        },
        "streamed_vs_budget": t_stream / budget_s,
        "cpu_vs_streamed": (cpu_s / t_stream) if cpu_s else None,
        "note": None
        if device.type == "cuda"
        else (
            "not a GPU: copies here are synchronous host copies and nothing overlaps, so the time goals are not "
            "measured by this run"
        ),
    }


def run_bench(device: torch.device | None = None, *, quick: bool = False) -> dict[str, Any]:
    device = demo_accelerator() if device is None else device
    reps = 3 if not quick else 2
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        # AdamW over a 1B-param-shaped model: 8 bytes of state per param; keep it within a quarter of free memory
        n_params = int(min(1e9, free / 4 / 8))
    else:
        n_params = 2_000_000 if quick else 8_000_000  # every simulated op runs through Python: scale down
    large = transformer_shapes(n_params)
    small_tensors = 10_000 if quick else 50_000
    small: list[tuple[int, ...]] = [(16,)] * (small_tensors // 2)
    out: dict[str, Any] = {
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "simulated accelerator",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "params_large": sum(torch.Size(s).numel() for s in large),
        "throughput": [
            _throughput_case("AdamW, transformer-shaped", large, device, reps),
            _throughput_case(f"AdamW, {small_tensors} small tensors", small, device, reps),
        ],
        "pool": _pool_case(device, large, 10 if not quick else 3),
        "step_after_move": _step_time_case(device, large if device.type == "cuda" else large[:24], reps + 2),
        "overhead_meta": _overhead_case(small_tensors, reps),
    }
    del large
    gc.collect()
    out["streamed"] = _stream_case(device, transformer_shapes(n_params), reps)
    return out


def _speedup(ratio: float) -> str:
    """A time ratio (baseline / ours) in words: "2.00x faster", or "1.25x slower" when below 1."""
    if ratio >= 1:
        return f"{ratio:.2f}x faster"
    return f"{1 / ratio:.2f}x slower" if ratio > 0 else "not measured"


# Goals of the streamed case that compare times (the others compare counts: memory, host syncs).
_TIME_GOALS = ("streamed <= 1.2 x link + device step", "streamed >= 3x faster than torch CPU AdamW")


def _on_simulator(result: dict[str, Any]) -> bool:
    """Whether ``result`` was measured on the simulated accelerator, whose every op runs in Python on host copies:
    its times measure the simulator, not a device, so only its counts are shown."""
    return simulated(result["device"])


def render(result: dict[str, Any]) -> str:
    on_sim = _on_simulator(result)
    lines = [f"optimshift bench on {result['device']} ({result['device_name']}), torch {result['torch']}"]
    if on_sim:
        lines.append(
            f"{SIMULATED_TIMES}: only counts are shown (host syncs, allocations, device memory) and no time is "
            "compared; run it on a GPU for times (the per-tensor overhead on the meta device is real host time)"
        )
    for case in result["throughput"]:
        lines.append(f"\n{case['case']}: {case['tensors']} tensors, {case['bytes'] / 1e6:.1f} MB of device state")
        if on_sim:
            rows = [[m, str(r["syncs_per_step_after"])] for m, r in case["methods"].items()]
            lines.append(format_table(["method", "syncs/step after"], rows))
            continue
        rows = [
            [
                m,
                f"{r['offload_GBps']:.2f}",
                f"{r['reload_GBps']:.2f}",
                f"{r['offload_s'] * 1e3:.1f}",
                f"{r['reload_s'] * 1e3:.1f}",
                str(r["syncs_per_step_after"]),
            ]
            for m, r in case["methods"].items()
        ]
        lines.append(
            format_table(["method", "offload GB/s", "reload GB/s", "offload ms", "reload ms", "syncs/step after"], rows)
        )
        r = case["ratios"]
        lines.append(
            f"optimshift vs flat copy: offload {r['offload_vs_flat']:.2f}x, reload {r['reload_vs_flat']:.2f}x;"
            f" vs naive loop: offload {_speedup(r['offload_vs_naive'])}, reload "
            f"{_speedup(r['reload_vs_naive'])}"
        )
    p = result["pool"]
    lines.append(
        f"\nhost pool ({'pinned' if p['pinned'] else 'pageable'}): {p['new_allocations_per_cycle']:g} new "
        f"allocations per offload/reload cycle after warm-up ({p['cycles']} cycles)"
    )
    s = result["step_after_move"]
    if on_sim:
        lines.append(f"after a move: host syncs per step {s['syncs_per_step']}")
    else:
        lines.append(
            f"step time after move: optimshift {s['moved_vs_fresh']:.2f}x a fresh optimizer's, naive loop "
            f"{s['naive_vs_fresh']:.2f}x; host syncs per step {s['syncs_per_step']}"
        )
    o = result["overhead_meta"]
    lines.append(
        f"per-tensor overhead, host -> meta, {o['tensors']} tensors: move {o['move_us_per_tensor']:.2f} us, "
        f"bare .to() loop {o['bare_us_per_tensor']:.2f} us ({o['move_vs_bare']:.2f}x)"
    )
    st = result.get("streamed")
    if st is not None:
        cpu = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in st["cpu_step_s"].items() if v is not None)
        extra = st["extra_device_bytes_streamed_step"]
        head = (
            f"\nstreamed step, fused AdamW, {st['state_bytes'] / 1e6:.1f} MB of state in {st['chunks']} chunks of "
            f"{st['chunk_bytes'] >> 20} MiB"
        )
        if on_sim:
            lines.append(head)
        else:
            lines.append(
                f"{head}: {st['streamed_step_s'] * 1e3:.1f} ms; all on the device "
                f"{st['device_step_s'] * 1e3:.1f} ms; flat copies (pinned on CUDA) {st['flat_h2d_GBps']:.2f} GB/s "
                f"down, {st['flat_d2h_GBps']:.2f} GB/s up (state down and up: {st['link_s'] * 1e3:.1f} ms); CPU "
                f"steps: {cpu}"
            )
        lines.append(
            f"extra device memory during the streamed step: "
            f"{'n/a' if extra is None else f'{extra / 2**20:.1f} MiB'} (bound "
            f"{st['extra_device_bytes_bound'] / 2**20:.0f} MiB); host syncs per step {st['syncs_per_step']}"
        )
        goals = {k: v for k, v in st["goals"].items() if not (on_sim and k in _TIME_GOALS)}
        verdicts = "; ".join(f"{k}: {'met' if v else 'NOT met'}" for k, v in goals.items())
        if on_sim:
            lines.append(f"goals: {verdicts} (the time goals are not checked on the simulator)")
        else:
            lines.append(f"goals: {verdicts} (streamed / budget {st['streamed_vs_budget']:.2f})")
            if st.get("note"):
                lines.append(f"({st['note']})")
    return "\n".join(lines)


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "bench", help="measure offload/reload/move against baselines in one run", description=DESCRIPTION
    )
    _add_arguments(parser)
    parser.set_defaults(func=_main)


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--out", default=None, help="also write the JSON results to this file")
    parser.add_argument("--quick", action="store_true", help="smaller sizes, fewer repetitions")
    parser.add_argument("--device", default=None, help="device to measure (default: cuda:0, else the simulated one)")
    parser.add_argument(
        "--case",
        choices=("all", "verl", "deepspeed", "rl-loop"),
        default="all",
        help="all: the measurements above; verl: verl's optimizer offload/load, shipped vs patched; deepspeed: "
        "DeepSpeed ZeRO-1/2's optimizer-state offload/reload and fp32 partition buffers, shipped vs patched; "
        "rl-loop: an RL pipeline's offload/reload loop around a compiled step",
    )
    parser.add_argument(
        "--keep-addresses",
        action="store_true",
        help="rl-loop: offload with keep_addresses='auto' (the state back at the same device addresses)",
    )


# The cases that measure a framework's own functions, and the package each needs (a GPU check's interpreter may not
# have it: then the case says so in one line and succeeds).
_FRAMEWORK_CASES = {"verl": ("verl", "verl"), "deepspeed": ("deepspeed", "optimshift[deepspeed]")}


def _out_problem(out: str) -> str | None:
    """Why ``--out`` cannot be written, asked before the run (a run can take minutes), or None."""
    import os

    from ..checkpoint import _atomic

    target = os.path.realpath(os.path.abspath(out))
    if os.path.isdir(target):
        return f"--out {out} is a directory; give a file path"
    if (kind := _atomic.not_a_file(target)) is not None:
        return f"--out {out} is {kind}, not a file: writing would replace it; give a file path"
    if (problem := _atomic.read_only(target)) is not None:
        return f"--out {out}: {problem}"
    if not os.path.isdir(os.path.dirname(target)):
        return f"--out {out}: folder {os.path.dirname(target)} does not exist"
    if not os.access(os.path.dirname(target), os.W_OK):
        return f"--out {out}: folder {os.path.dirname(target)} is not writable"
    return None


def _write_out(out: str, result: dict[str, Any]) -> None:
    """``result`` as JSON at ``out``, atomically: through a hidden temporary of its own (removed on failure), with
    the replaced file's permissions; a file made read-only meanwhile is refused, as save refuses one."""
    import os

    from ..checkpoint import _atomic

    target = os.path.realpath(os.path.abspath(out))  # (through a link: the file it points at, as save does)
    if (problem := _atomic.read_only(target)) is not None:
        raise PermissionError(problem)
    _atomic.sweep(target)
    made: dict[str, int] = {}  # (the temporary and its descriptor once they exist: a Ctrl-C as made included)
    try:
        fd, tmp = _atomic.create_temp(target, made)
        with os.fdopen(fd, "w", closefd=False) as f:  # (made's descriptor: closed after the rename, with its lock)
            _atomic.keep_mode(tmp, target)
            json.dump(result, f, indent=2)
            f.flush()
            os.fsync(f.fileno())
            os.replace(tmp, target)
    finally:
        _atomic.drop_temps(made)
    _atomic.fsync_dir(os.path.dirname(target))


def _main(args: argparse.Namespace) -> int:
    if args.keep_addresses and args.case != "rl-loop":  # (the other cases offload as their framework does)
        return failure("bench", f"--keep-addresses is for --case rl-loop, not --case {args.case}", as_json=args.json)
    if args.out and (problem := _out_problem(args.out)):
        return failure("bench", problem, as_json=args.json)
    try:
        device = demo_accelerator(args.device)
    except (ValueError, TypeError) as e:  # (a device this machine lacks, a name torch does not know)
        return failure("bench", f"--device {args.device}: {e}", as_json=args.json, error=e)
    if device.type in ("cpu", "meta"):
        return failure(
            "bench",
            f"--device {args.device}: bench measures moving optimizer state between the host and an accelerator; "
            f"give one (cuda, or sim: the simulated one)",
            as_json=args.json,
        )
    text: Callable[[dict[str, Any]], str] = render
    if args.case in _FRAMEWORK_CASES:
        import importlib.util

        package, install = _FRAMEWORK_CASES[args.case]
        if importlib.util.find_spec(package) is None:
            print(f"optimshift bench --case {args.case}: skipped, {package} is not installed (pip install '{install}')")
            return 0
    if args.case == "verl":
        from ._bench_verl import render_verl, run_verl_case

        result = run_verl_case(device, quick=args.quick)
        text = render_verl
    elif args.case == "deepspeed":
        from ._bench_deepspeed import render_deepspeed, run_deepspeed_case

        result = run_deepspeed_case(device, quick=args.quick)
        text = render_deepspeed
    elif args.case == "rl-loop":
        from ._bench_rl import render_rl_loop, run_rl_loop_case

        if args.keep_addresses:
            result = run_rl_loop_case(device, quick=args.quick, keep_addresses="auto")
        else:
            result = run_rl_loop_case(device, quick=args.quick)
        text = render_rl_loop
    else:
        result = run_bench(device, quick=args.quick)
    if not args.json:
        print(text(result))  # (first: a failed write loses nothing)
    if args.out:
        try:
            _write_out(args.out, result)
        except OSError as e:  # (--json: the error is the one document on stdout)
            return failure("bench", f"cannot write --out {args.out}: {e}", as_json=args.json, error=e)
    if args.json:
        print(json.dumps(result, indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m optimshift.bench", description=DESCRIPTION, formatter_class=HelpFormatter
    )
    _add_arguments(parser)
    return run_command(lambda: _main(parser.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
