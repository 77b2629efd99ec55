"""Benchmark: the Python overhead of the one transfer path, as ratios against the least work in the same process.

- ``move`` host -> meta over N tensors (pure overhead: no bytes are copied) against a bare ``.to()`` loop that
  already knows the rule (skips Adam's host ``step``) and replaces the tensors: optimshift plans, copies and
  keeps every tensor object (on meta by swapping, the only identity-keeping mechanism torch allows there);
- ``load_state_dict`` (copy=True) of an Adam state over P params against a bare per-tensor clone loop into new
  dicts (the least a copying load can do), into a fresh optimizer and into one that already has state (where
  every tensor keeps its object).

    .venv/bin/python benchmarks/one_path.py [--tensors 50000] [--params 16000] [--reps 5]

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
from optimshift.cli._bench import _overhead_case


def _adam_state_dict(n: int) -> tuple[list[torch.nn.Parameter], dict]:
    params = [torch.nn.Parameter(torch.randn(16)) for _ in range(n)]
    opt = torch.optim.Adam(params, foreach=False)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    return params, opt.state_dict()


def load_case(n: int, reps: int) -> dict[str, float]:
    params, sd = _adam_state_dict(n)

    def bare() -> dict:
        return {
            k: {kk: vv.clone() if isinstance(vv, torch.Tensor) else vv for kk, vv in st.items()}
            for k, st in sd["state"].items()
        }

    def fresh() -> torch.optim.Optimizer:
        return torch.optim.Adam(params, foreach=False)

    optimshift.load_state_dict(fresh(), sd)  # warm up the probes
    t_bare, t_fresh, t_existing = [], [], []
    for _ in range(reps):  # interleaved: the same conditions for all three
        gc.collect()
        t0 = time.perf_counter()
        bare()
        t1 = time.perf_counter()
        opt = fresh()
        gc.collect()
        t2 = time.perf_counter()
        optimshift.load_state_dict(opt, sd)
        t3 = time.perf_counter()
        gc.collect()
        t4 = time.perf_counter()
        optimshift.load_state_dict(opt, sd)
        t5 = time.perf_counter()
        t_bare.append(t1 - t0)
        t_fresh.append(t3 - t2)
        t_existing.append(t5 - t4)
    b = statistics.median(t_bare)
    return {
        "params": n,
        "bare_ms": b * 1e3,
        "fresh_vs_bare": statistics.median(t_fresh) / b,
        "existing_vs_bare": statistics.median(t_existing) / b,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tensors", type=int, default=50_000)
    parser.add_argument("--params", type=int, default=16_000)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {platform.machine()}, python {platform.python_version()}")
    move = _overhead_case(args.tensors, args.reps)
    print(
        f"move host->meta, {move['tensors']} tensors: bare .to() loop {move['bare_us_per_tensor']:.2f} us/tensor, "
        f"optimshift.move {move['move_us_per_tensor']:.2f} us/tensor: {move['move_vs_bare']:.2f}x (goal <= 1.5x)"
    )
    load = load_case(args.params, args.reps)
    print(
        f"load_state_dict copy=True, {load['params']} params: bare clone loop {load['bare_ms']:.1f} ms; "
        f"into a fresh optimizer {load['fresh_vs_bare']:.2f}x, into existing state {load['existing_vs_bare']:.2f}x "
        f"(goal <= 1.5x)"
    )


if __name__ == "__main__":
    main()
