"""The uniform load with and without its whole-group lane (``checkpoint/_uniform._whole_group``), alternating in
one process: a host checkpoint of 16k Adam params onto meta (fresh) and into existing host state (exist).

    OMP_NUM_THREADS=1 python benchmarks/uniform_lane.py [--params N] [--reps R]

Prints the median milliseconds of each; ``False`` is the per-row loop alone (every group refused by the lane).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from typing import Any

import torch
from planner import _adam

import optimshift
from optimshift.checkpoint import _uniform


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=int, default=16_000)
    parser.add_argument("--reps", type=int, default=9)
    args = parser.parse_args()
    real = _uniform._whole_group
    meta = torch.device("meta")
    sd = _adam(args.params, "cpu", numel=16).state_dict()
    onto = [torch.nn.Parameter(torch.zeros(16, device=meta)) for _ in range(args.params)]
    source = _adam(args.params, "cpu", numel=16)
    own = source.state_dict()
    existing = torch.optim.Adam([p for g in source.param_groups for p in g["params"]], foreach=False)
    optimshift.load_state_dict(existing, own)
    optimshift.load_state_dict(torch.optim.Adam(onto, foreach=False), sd)  # (warm: the probes)
    times: dict[tuple[str, bool], list[float]] = {(k, on): [] for k in ("fresh", "exist") for on in (True, False)}

    def refuse(*_: Any, **__: Any) -> bool:
        return False

    try:
        for _ in range(args.reps):
            for on in (True, False):
                _uniform._whole_group = real if on else refuse  # type: ignore[assignment]
                fresh = torch.optim.Adam(onto, foreach=False)
                gc.collect()
                t0 = time.perf_counter()
                optimshift.load_state_dict(fresh, sd)
                times[("fresh", on)].append(time.perf_counter() - t0)
                gc.collect()
                t0 = time.perf_counter()
                optimshift.load_state_dict(existing, own)
                times[("exist", on)].append(time.perf_counter() - t0)
    finally:
        _uniform._whole_group = real
    print(f"torch {torch.__version__}, {args.params} params, reps {args.reps}")
    for (case, on), ts in times.items():
        print(f"{case} whole_group={on}: {statistics.median(ts) * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
