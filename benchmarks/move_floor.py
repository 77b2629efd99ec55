"""How close the first move (issue 27's ``move`` host->meta, 50k tensors, goal <= 1.5x the swap loop) can come,
whatever the code around it: a standalone loop that does only what the move must decide for each tensor, against
the same bare ``swap_tensors`` loop as ``benchmarks/planner.py``, in the same process.

The loop, per tensor: the policy's memo key (key, 0-dim, on the host) and a dict lookup; the device compare that
says whether it moves; the storage-sharing check (every storage's address, one set); ``.to``; the checks a swap
needs (class, inference, weak references, use counts, ``requires_grad``), as column passes in C; torch's C swap.
No sites, no error naming, no caching, no wrappers: what remains of 1.5x once this is paid is what they may cost.

    OMP_NUM_THREADS=1 PYTHONPATH=src .venv/bin/python benchmarks/move_floor.py
"""

from __future__ import annotations

import gc
import statistics
import sys
import time
import weakref
from operator import attrgetter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import planner  # noqa: E402  (the same optimizers and bare loop as the planner's first-move row)

_swap_impl = torch._C._swap_tensor_impl
_address = torch._C._storage_address
_use_count = torch.Tensor._use_count  # type: ignore[attr-defined]


def least_move(opt: torch.optim.Optimizer, device: torch.device) -> tuple[float, float, float]:
    """Move every state tensor that belongs with its param to ``device`` (0-dim ones stay), keeping objects;
    returns the seconds spent placing, copying and adopting."""
    t0 = time.perf_counter()
    memo: dict[tuple[object, ...], torch.device] = {}
    tensors: list[torch.Tensor] = []
    targets: list[torch.device] = []
    host = torch.device("cpu")
    by_id = {id(p): entries for p, entries in opt.state.items()}
    for group in opt.param_groups:
        for p in group["params"]:
            entries = by_id.get(id(p))
            if not entries:
                continue
            holder = (id(group), p.dim(), device)
            for key, value in entries.items():
                memo_key = (holder, key, value.dim() == 0, value.is_cpu)
                target = memo.get(memo_key)
                if target is None:
                    target = memo[memo_key] = host if value.dim() == 0 else device
                tensors.append(value)
                targets.append(target)
    t1 = time.perf_counter()
    devices = list(map(attrgetter("device"), tensors))
    moving = [i for i, (source, target) in enumerate(zip(devices, targets)) if source != target]
    addresses = list(map(_address, tensors))
    if len(set(addresses)) != len(addresses):
        raise ValueError("shared storages: not this benchmark's case")
    olds = [tensors[i] for i in moving]
    news = list(map(torch.Tensor.to, olds, [targets[i] for i in moving]))
    t2 = time.perf_counter()
    plain = torch.Tensor
    requires_grad = attrgetter("requires_grad")
    swappable = (
        {*map(type, olds), *map(type, news)} == {plain}
        and not any(map(plain.is_inference, olds))
        and not any(map(plain.is_inference, news))
        and not any(map(weakref.getweakrefcount, olds))
        and not any(map(weakref.getweakrefcount, news))
        and set(map(_use_count, olds)) <= {1}
        and set(map(_use_count, news)) <= {1}
        and not any(map(requires_grad, olds))
        and not any(map(requires_grad, news))
    )
    if not swappable:
        raise ValueError("a tensor that cannot be swapped: not this benchmark's case")
    list(map(_swap_impl, olds, news))
    t3 = time.perf_counter()
    return t1 - t0, t2 - t1, t3 - t2


def main() -> None:
    n, reps, meta = 25_000, 5, torch.device("meta")
    bare: list[float] = []
    least: list[float] = []
    phases: list[tuple[float, float, float]] = []
    for _ in range(reps):
        a, b = planner._adam(n, "cpu"), planner._adam(n, "cpu")
        gc.collect()
        gc.disable()
        try:
            t0 = time.perf_counter()
            planner._bare_move(a, meta)
            t1 = time.perf_counter()
            phases.append(least_move(b, meta))
            t2 = time.perf_counter()
        finally:
            gc.enable()
        bare.append(t1 - t0)
        least.append(t2 - t1)
        del a, b
    ratio = statistics.median(least) / statistics.median(bare)
    place, copy, adopt = (statistics.median(x) * 1e3 for x in zip(*phases))
    print(f"torch {torch.__version__}, {2 * n} tensors, reps {reps}")
    print(
        f"the least first move host->meta: {statistics.median(least) * 1e3:.0f} ms against "
        f"{statistics.median(bare) * 1e3:.0f} ms (bare swap_tensors loop): {ratio:.2f}x "
        f"(place {place:.0f} ms, copy {copy:.0f} ms, adopt {adopt:.0f} ms)"
    )


if __name__ == "__main__":
    main()
