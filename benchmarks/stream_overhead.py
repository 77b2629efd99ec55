"""Benchmark: the Python overhead of a streamed step against an ordinary step, on the simulated accelerator.

AdamW (foreach, the default) over P small params on ``sim:0``, so that the step's arithmetic is negligible and
what is measured is per-call and per-tensor work. Four steps, interleaved over ``--reps`` rounds (the same
conditions for all): the ordinary step with all state on the device; the same ordinary optimizer's own step
called once per ``--per-chunk`` params with its state on the device (what chunking alone costs: torch's
per-call work, no copies); a streamed step in one chunk (the default ``chunk_bytes``); a streamed step in
chunks of ``--per-chunk`` params. Reported: median ms per step, and the streamed step's extra time per state
tensor and per chunk (and how much of the latter is torch's own per-call cost).

The streamed steps' copies are synchronous here (the simulator taken as a device without streams, as
``optimshift._device_streams`` treats one): the simulator's own streams queue every
op issued on a side stream and check every access against every other stream's (its race detector), which
costs far more than optimshift's work and nothing like a GPU's streams. ``--sim-streams`` measures with them.
The simulator runs every copy and view through
Python, so the extra time here is an upper bound on optimshift's own Python work; on CUDA copies are queued in
microseconds and overlap the compute.

    .venv/bin/python benchmarks/stream_overhead.py [--params 2000] [--per-chunk 50] [--reps 7] [--sim-streams]
        [--cpu-time]

``--cpu-time``: each step timed in this process's CPU time (``time.process_time``), not wall time: on a machine
other work shares, the ratios then move far less from run to run.

Not a test: timings depend on the machine and its load. Record results in benchmarks/results/.
"""

from __future__ import annotations

import argparse
import gc
import platform
import statistics
import time

import torch

import optimshift
from optimshift import _device_streams
from optimshift.testing import simulated_accelerator


def _optimizer(n: int, device: torch.device) -> tuple[list[torch.nn.Parameter], torch.optim.Optimizer]:
    params = [torch.nn.Parameter(torch.randn(16, device=device)) for _ in range(n)]
    for p in params:
        p.grad = torch.randn(16, device=device)
    opt = torch.optim.AdamW(params)
    opt.step()  # state exists: every measured step is a steady-state step
    return params, opt


def _chunked(opt: torch.optim.Optimizer, per_chunk: int):
    """The optimizer's own (undecorated) step over ``per_chunk`` params at a time, state where it is."""
    raw = type(opt).step.__wrapped__
    group = opt.param_groups[0]
    everyone = group["params"]

    def step() -> None:
        groups = opt.param_groups
        opt.param_groups = [group]
        try:
            for i in range(0, len(everyone), per_chunk):
                group["params"] = everyone[i : i + per_chunk]
                raw(opt)
        finally:
            group["params"] = everyone
            opt.param_groups = groups

    return step


def run(n_params: int, per_chunk: int, reps: int, clock=time.perf_counter) -> dict:
    sim = simulated_accelerator()
    _, ordinary = _optimizer(n_params, sim)
    _, cut = _optimizer(n_params, sim)
    cut_step = _chunked(cut, per_chunk)
    _, one = _optimizer(n_params, sim)
    _, many = _optimizer(n_params, sim)
    optimshift.stream(one)  # default chunk_bytes: one chunk
    # AdamW state per 16-float param: exp_avg and exp_avg_sq, 64 bytes each (step stays on the host).
    handle = optimshift.stream(many, chunk_bytes=per_chunk * 128)
    steps = (ordinary.step, cut_step, one.step, many.step)
    for step in steps:
        step()  # warm-up
    times: dict[str, list[float]] = {
        "ordinary": [],
        f"ordinary, own step per {per_chunk} params": [],
        "streamed, 1 chunk": [],
        f"streamed, {handle.chunks} chunks": [],
    }
    for _ in range(reps):
        for name, step in zip(times, steps):
            gc.collect()
            t0 = clock()
            step()
            times[name].append(clock() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    tensors = 2 * n_params
    base = med["ordinary"]
    one_s, many_s = med["streamed, 1 chunk"], med[f"streamed, {handle.chunks} chunks"]
    cut_s = med[f"ordinary, own step per {per_chunk} params"]
    return {
        "params": n_params,
        "state_tensors": tensors,
        "chunks": handle.chunks,
        "reps": reps,
        "median_ms": {k: v * 1e3 for k, v in med.items()},
        "extra_us_per_tensor_1_chunk": (one_s - base) / tensors * 1e6,
        "extra_us_per_chunk": (many_s - one_s) / (handle.chunks - 1) * 1e6 if handle.chunks > 1 else None,
        "torch_us_per_call": (cut_s - base) / (handle.chunks - 1) * 1e6 if handle.chunks > 1 else None,
        "streamed_vs_ordinary": {"1 chunk": one_s / base, f"{handle.chunks} chunks": many_s / base},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=int, default=2000)
    parser.add_argument("--per-chunk", type=int, default=50)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument(
        "--sim-streams",
        action="store_true",
        help="copy on the simulator's deferred, race-checked streams instead of synchronously",
    )
    parser.add_argument("--cpu-time", action="store_true", help="time each step in this process's CPU time")
    args = parser.parse_args()
    if not args.sim_streams:
        sim = simulated_accelerator()  # (registers its streams with _device_streams first)
        _device_streams._chosen[sim.type] = None  # no streams: each copy is complete when it returns
    r = run(args.params, args.per_chunk, args.reps, time.process_time if args.cpu_time else time.perf_counter)
    copies = "the simulator's streams" if args.sim_streams else "synchronous copies"
    print(
        f"torch {torch.__version__}, python {platform.python_version()}, simulated accelerator ({copies}); AdamW "
        f"(foreach) over {r['params']} params of 16 floats ({r['state_tensors']} streamed state tensors), median "
        f"of {r['reps']}" + (", CPU time" if args.cpu_time else "")
    )
    for k, v in r["median_ms"].items():
        print(f"  {k:<38} {v:8.1f} ms")
    print(
        f"  streamed extra: {r['extra_us_per_tensor_1_chunk']:.1f} us per state tensor (1 chunk); "
        + (
            f"{r['extra_us_per_chunk']:.0f} us per additional chunk, of which {r['torch_us_per_call']:.0f} us is "
            f"the optimizer's own step called once more"
            if r["extra_us_per_chunk"] is not None
            else ""
        )
    )
    print("  streamed / ordinary: " + ", ".join(f"{k} {v:.2f}x" for k, v in r["streamed_vs_ordinary"].items()))


if __name__ == "__main__":
    main()
