"""Benchmark: ``move`` + ``check`` after an LR scheduler changed ``lr``, against the same with ``lr`` unchanged.

Each optimizer has G param groups (a few small host params each, one step taken, so every group holds 0-dim
state that the placement rule is probed for). Per round: an ``ExponentialLR`` step (``gamma=0.9``: every
group's ``lr`` changes; ``gamma=1.0``: the same call, ``lr`` unchanged), then ``optimshift.move(opt)`` and
``optimshift.check(opt)``, ``--cycles`` times per sample. Both run interleaved in one process; printed: the
median ms of one round each way and the ratio.
Before issue 18 the probe's cache was keyed by every hyperparameter's value, so each scheduler step re-ran the
probes (a step under ``FakeTensorMode``, and the host dtype trial) for every group; now it is keyed by what can
change what they observe (never a float's value), and the ratio is about 1.

    .venv/bin/python benchmarks/probe_cache.py [--groups 16] [--reps 15] [--cycles 5]

Not a test: timings depend on the machine and its load. Record results in benchmarks/results/.
"""

from __future__ import annotations

import argparse
import gc
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

import optimshift

optim = torch.optim

CASES: list[tuple[str, type[torch.optim.Optimizer], dict[str, Any]]] = [
    ("Adam", optim.Adam, {}),
    ("SGD (momentum, nesterov)", optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True}),
    ("Adagrad (weight decay)", optim.Adagrad, {"weight_decay": 0.01}),
]


def _optimizer(cls: type[torch.optim.Optimizer], kwargs: dict[str, Any], groups: int) -> torch.optim.Optimizer:
    params = [[torch.nn.Parameter(torch.randn(8, 8)) for _ in range(4)] for _ in range(groups)]
    opt = cls([{"params": ps, "lr": 0.01 * (1 + i)} for i, ps in enumerate(params)], **kwargs)
    for ps in params:
        for p in ps:
            p.grad = torch.ones_like(p)
    opt.step()
    return opt


def _timed(fn: Callable[[], None]) -> float:
    gc.collect()
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def case(
    cls: type[torch.optim.Optimizer], kwargs: dict[str, Any], groups: int, reps: int, cycles: int
) -> tuple[float, float]:
    """Median ms of one scheduler step + move + check (``cycles`` of them per sample), with lr changing and not."""
    opt = _optimizer(cls, kwargs, groups)
    changing = optim.lr_scheduler.ExponentialLR(opt, gamma=0.9)
    steady = optim.lr_scheduler.ExponentialLR(opt, gamma=1.0)

    def after(scheduler: optim.lr_scheduler.LRScheduler) -> Callable[[], None]:
        def run() -> None:
            for _ in range(cycles):
                scheduler.step()
                optimshift.move(opt)
                optimshift.check(opt)

        return run

    after(steady)()  # warm up: the probes for these groups run once
    changed, unchanged = [], []
    for _ in range(reps):
        changed.append(_timed(after(changing)) / cycles)
        unchanged.append(_timed(after(steady)) / cycles)
    return statistics.median(changed), statistics.median(unchanged)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--groups", type=int, default=16)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--cycles", type=int, default=5, help="scheduler steps + move + check per sample")
    args = parser.parse_args(argv)
    print(f"torch {torch.__version__}, {platform.machine()}, python {platform.python_version()}")
    import warnings

    warnings.filterwarnings("ignore", message=".*lr_scheduler.step.*")  # two schedulers on one optimizer
    for label, cls, kwargs in CASES:
        changed, unchanged = case(cls, kwargs, args.groups, args.reps, args.cycles)
        print(
            f"{label}, {args.groups} groups: move + check after lr changed {changed:.1f} ms, "
            f"lr unchanged {unchanged:.1f} ms: {changed / unchanged:.2f}x (goal <= 1.2x)"
        )


if __name__ == "__main__":
    main()
