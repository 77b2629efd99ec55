"""Run a worker of ``_dist_workers`` on N spawned processes with a gloo process group, with hard time limits.

Each rank runs ``_dist_workers.<name>(rank, world, workdir, **kwargs)`` (``module=`` names another module of
workers) and its return value (or its traceback) is saved to ``workdir/<name>.rank<r>.pt`` before the process
group is torn down. The parent waits until a deadline, then kills whatever is still running and reports it as
a hang, so no test can block CI.
Rendezvous goes through a FileStore in ``workdir`` (no port to pick); gloo's own sockets use free ports.
"""

from __future__ import annotations

import datetime
import os
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

PG_TIMEOUT_S = 45  # a collective whose peer is gone fails after this long at most
JOB_TIMEOUT_S = 150  # the whole job, start-up included


@dataclass
class Job:
    name: str
    results: list[dict[str, Any] | None]  # per rank: {"ok": value} or {"error": traceback}; None if it died
    exitcodes: list[int | None]
    seconds: float

    def value(self, rank: int) -> Any:
        """What rank ``rank``'s worker returned; fails the test with the rank's traceback if it raised."""
        result = self.results[rank]
        if result is None:
            raise AssertionError(f"{self.name}: rank {rank} wrote no result (exit code {self.exitcodes[rank]})")
        if "error" in result:
            raise AssertionError(f"{self.name}: rank {rank} raised:\n{result['error']}")
        return result["ok"]


def run(
    name: str,
    world: int,
    workdir: Path,
    *,
    timeout: float = JOB_TIMEOUT_S,
    module: str = "_dist_workers",
    **kwargs: Any,
) -> Job:
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    store = workdir / f"{name}.store"
    if store.exists():
        store.unlink()
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(target=_entry, args=(name, rank, world, str(store), str(workdir), kwargs, module))
        for rank in range(world)
    ]
    start = time.monotonic()
    for p in procs:
        p.start()
    deadline = start + timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    hung = [rank for rank, p in enumerate(procs) if p.is_alive()]
    for rank in hung:
        procs[rank].kill()
        procs[rank].join(10)
    seconds = time.monotonic() - start
    if hung:
        raise AssertionError(f"{name}: ranks {hung} still running after {timeout:.0f}s (a hang); killed")
    results = []
    for rank in range(world):
        out = workdir / f"{name}.rank{rank}.pt"
        results.append(torch.load(out, weights_only=False) if out.exists() else None)
    return Job(name, results, [p.exitcode for p in procs], seconds)


def _entry(name: str, rank: int, world: int, store: str, workdir: str, kwargs: dict, module: str) -> None:
    torch.set_num_threads(1)  # the same kernels in every process: per-rank results are comparable bitwise
    import importlib

    import torch.distributed as dist

    workers = importlib.import_module(module)

    result: dict[str, Any]
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{store}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=PG_TIMEOUT_S),
        )
        result = {"ok": getattr(workers, name)(rank, world, Path(workdir), **kwargs)}
    except BaseException:  # noqa: BLE001 - reported to the parent
        result = {"error": traceback.format_exc()}
    out = Path(workdir) / f"{name}.rank{rank}.pt"
    torch.save(result, str(out) + ".part")
    os.replace(str(out) + ".part", out)
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - a peer may be gone (the kill test)
        pass
