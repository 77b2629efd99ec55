"""Benchmark: ``optimshift.load_state_dict`` vs ``optimizer.load_state_dict``, and peak memory of ``optimshift.load``.

Loads one Adam state dict (params of 16 elements, state on the host) into a fresh Adam with each, in the same
process, for each size; prints the best time of a few runs and the ratio. PyTorch scans the param groups once
per state tensor (quadratic); optimshift is linear. Then writes a checkpoint of ``--rss-mb`` MB and measures, in
fresh processes, the peak resident memory ``optimshift.load`` adds with and without mmap.

    .venv/bin/python benchmarks/load_state_dict.py                     # 1k, 4k, 8k, 16k params
    .venv/bin/python benchmarks/load_state_dict.py --sizes 1000,4000,16000,64000 --torch-max 16000

Not a test: timings depend on the machine and its load. Record results in benchmarks/results/.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import subprocess
import sys
import tempfile
import time

import torch

import optimshift


def adam_state(n: int, numel: int = 16) -> tuple[list[torch.nn.Parameter], dict]:
    params = [torch.nn.Parameter(torch.randn(numel)) for _ in range(n)]
    opt = torch.optim.Adam(params, foreach=False)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    return params, opt.state_dict()


def best_of(repeats: int, fn) -> float:
    best = float("inf")
    for _ in range(repeats):
        gc.collect()
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def time_loads(sizes: list[int], torch_max: int, repeats: int) -> list[dict]:
    rows = []
    for n in sizes:
        params, sd = adam_state(n)

        def fresh() -> torch.optim.Adam:
            return torch.optim.Adam(params, foreach=False)

        def ours(copy: bool = True) -> None:
            optimshift.load_state_dict(fresh(), sd, copy=copy)

        optimshift.load_state_dict(fresh(), sd)  # warm up (policy probes)
        row = {"n": n, "ours": best_of(repeats, ours), "ours_nocopy": best_of(repeats, lambda: ours(False))}
        if n <= torch_max:
            row["torch"] = best_of(repeats if n <= 4000 else 1, lambda: fresh().load_state_dict(sd))
        rows.append(row)
        t = row.get("torch")
        nan = float("nan")
        # PyTorch aliases tensors already on the param's device; copy=False does the same, copy=True copies all.
        print(
            f"{n:>7} params ({3 * n} tensors): torch {t * 1e3 if t else nan:8.1f} ms   "
            f"optimshift {row['ours'] * 1e3:6.1f} ms (copy=False {row['ours_nocopy'] * 1e3:6.1f} ms)   "
            f"ratio {t / row['ours'] if t else nan:5.1f}x (copy=False {t / row['ours_nocopy'] if t else nan:5.1f}x)",
            flush=True,
        )
    return rows


_RSS_CHILD = r"""
import sys, torch, optimshift
def kib(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
obj = None
before = kib("VmRSS")
obj = optimshift.load(sys.argv[1], mmap=sys.argv[2] == "1")
print(kib("VmHWM") - before)
"""


def peak_rss(size_mb: int) -> dict:
    """Peak resident memory added by optimshift.load of a ``size_mb`` MB checkpoint, with and without mmap."""
    if not os.path.exists("/proc/self/status"):
        return {}
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "big.pt")
        n = size_mb * (1 << 20) // 4 // 64
        optimshift.save(
            {
                "state": {i: {"exp_avg": torch.randn(n)} for i in range(64)},
                "param_groups": [{"params": list(range(64)), "lr": 1e-3}],
            },
            path,
        )
        file_mb = os.path.getsize(path) / (1 << 20)
        out = {"file_mb": file_mb}
        for mmap in (True, False):
            res = subprocess.run(
                [sys.executable, "-c", _RSS_CHILD, path, "1" if mmap else "0"],
                capture_output=True,
                text=True,
                check=True,
            )
            out["mmap" if mmap else "read"] = int(res.stdout.strip().splitlines()[-1]) / 1024
        return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1000,4000,8000,16000", help="comma-separated param counts")
    parser.add_argument(
        "--torch-max",
        type=int,
        default=16000,
        help="skip optimizer.load_state_dict above this many params (it is quadratic)",
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rss-mb", type=int, default=256, help="checkpoint size for the memory test (0: skip)")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",") if s]
    print(
        f"torch {torch.__version__}, optimshift {optimshift.__version__}, Python {platform.python_version()}, "
        f"{platform.machine()}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}"
    )
    rows = time_loads(sizes, args.torch_max, args.repeats)
    timed = [r for r in rows if "torch" in r]
    if len(rows) >= 2:
        a, b = rows[0], rows[-1]
        print(
            f"growth {a['n']}->{b['n']} params (x{b['n'] / a['n']:.0f}): optimshift x{b['ours'] / a['ours']:.1f}"
            + (
                f", torch x{timed[-1]['torch'] / timed[0]['torch']:.1f} ({timed[0]['n']}->{timed[-1]['n']})"
                if len(timed) >= 2
                else ""
            )
        )
    if args.rss_mb:
        rss = peak_rss(args.rss_mb)
        if rss:
            print(
                f"optimshift.load of a {rss['file_mb']:.0f} MB checkpoint: peak RSS added {rss['mmap']:.0f} MB with "
                f"mmap ({rss['mmap'] / rss['file_mb']:.2f}x the file), {rss['read']:.0f} MB without "
                f"({rss['read'] / rss['file_mb']:.2f}x)"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
