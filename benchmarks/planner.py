"""Benchmark: issue 18's goals, each a ratio against the least work, run in the same process (interleaved).

- ``move`` host -> meta (no bytes copied: the plan, decisions and adoption), first call on a fresh optimizer,
  against a bare loop that keeps identity (``torch.utils.swap_tensors(v, v.to("meta"))``, skipping the host
  ``step`` as the rule says);
- the same move repeated on an unchanged optimizer (its plan cached): fake ``cpu`` <-> fake ``cuda:0``
  (FakeTensorMode: copies cost only their dispatch), against the same bare loop on the same device pair;
- an offload + reload cycle of an unchanged optimizer (cached plans) against a bare per-tensor identity-keeping
  loop on the same device pair, on the simulated accelerator and on fake ``cuda:0``;
- ``load_state_dict`` (copy=True) into a fresh optimizer against a bare clone loop, and into existing state
  against a bare ``copy_`` loop and against the least validating in-place load (issue 27's baseline);
- ``load_state_dict`` of a host checkpoint into a fresh optimizer on ``meta`` and on the simulated accelerator
  (the common resume) against a bare ``.to(device)`` loop of the entries that move (``step`` left shared), and
  against the loop issue 27 names, ``state[p] = {k: v.to(device)}`` (every entry moved);
- the floors: the least any implementation of each does, against the same baselines (see :func:`floors`).

    .venv/bin/python benchmarks/planner.py [--tensors 50000] [--cycle-tensors 10000] [--params 16000] [--reps 5]
                                           [--only move|cycle|load|floors ...] [--fresh]

Not a test: timings depend on the machine and its load. Record results in benchmarks/results/.
"""

from __future__ import annotations

import argparse
import gc
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from itertools import repeat
from operator import itemgetter
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import optimshift
from optimshift.testing import simulated_accelerator

swap = torch.utils.swap_tensors


def _adam(n_params: int, device: torch.device | str, numel: int = 8) -> torch.optim.Optimizer:
    params = [torch.nn.Parameter(torch.zeros(numel, device=device)) for _ in range(n_params)]
    opt = torch.optim.Adam(params, foreach=False)
    for p in params:
        p.grad = torch.zeros_like(p)
    opt.step()
    for p in params:
        p.grad = None
    return opt


def _bare_move(opt: torch.optim.Optimizer, device: torch.device | str) -> None:
    """The least an identity-keeping move does: every tensor that changes device, by swap_tensors."""
    for st in opt.state.values():
        for k, v in st.items():
            if k != "step":
                swap(v, v.to(device))


def _checked_copy(live: list[Any], saved: list[Any]) -> None:
    """Issue 27's baseline for a load into existing state, the least validating in-place load: keys equal;
    dtype, shape and device equal; ``copy_``."""
    for st, sv in zip(live, saved):
        if st.keys() != sv.keys():
            raise ValueError("keys")
        for k, v in st.items():
            w = sv[k]
            if v.dtype != w.dtype or v.shape != w.shape or v.device != w.device:
                raise ValueError(k)
        for k, v in st.items():
            v.copy_(sv[k])


def _median_ratio(a: list[float], b: list[float]) -> tuple[float, float, float]:
    ma, mb = statistics.median(a), statistics.median(b)
    return ma, mb, ma / mb


def _timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


@optimshift.api._one_at_a_time  # (what move() runs in: its lock, the collector paused until its frame is gone)
def _move_to_meta(opt: torch.optim.Optimizer) -> None:
    """``move(opt, "meta")`` (which move() refuses: meta tensors have no values): the same plan, copies and
    commit, under the cache key move() uses (a first call leaves its marker in the session)."""
    meta = torch.device("meta")
    if hasattr(optimshift.api, "_move_key"):
        key = optimshift.api._move_key(opt, meta)
    else:  # (an older optimshift on PYTHONPATH, for a before/after run: move()'s key as it built it)
        key = ("move", meta, frozenset(optimshift._session.get(opt).group_sides.items()))
    plan = getattr(optimshift, "_plan", None) or optimshift.plan  # (an older optimshift named it plan)
    optimshift.api._transfer(opt, plan.policy_target(opt, meta), what="move", cache_key=key)


def move_first_call(n_tensors: int, reps: int) -> dict[str, float]:
    n = n_tensors // 2
    t_os, t_bare = [], []
    for _ in range(reps):
        a, b = _adam(n, "cpu"), _adam(n, "cpu")
        gc.collect()
        t_bare.append(_timed(lambda: _bare_move(a, "meta")))
        t_os.append(_timed(lambda: _move_to_meta(b)))

    os_s, bare_s, ratio = _median_ratio(t_os, t_bare)
    return {"tensors": 2 * n, "us_per_tensor": os_s / (2 * n) * 1e6, "bare_us": bare_s / (2 * n) * 1e6, "ratio": ratio}


def move_repeated_fake(n_tensors: int, reps: int) -> dict[str, float]:
    n = n_tensors // 2
    cuda = torch.device("cuda", 0)
    with FakeTensorMode(allow_non_fake_inputs=True):
        a, b = _adam(n, "cpu"), _adam(n, "cpu")
        for _ in range(2):  # plans for both directions, kept from their second build
            optimshift.move(b, cuda)
            optimshift.move(b, "cpu")
        t_os, t_bare = [], []
        for _ in range(reps):
            gc.collect()
            t_bare.append(_timed(lambda: (_bare_move(a, cuda), _bare_move(a, "cpu"))))
            t_os.append(_timed(lambda: (optimshift.move(b, cuda), optimshift.move(b, "cpu"))))
    os_s, bare_s, ratio = _median_ratio(t_os, t_bare)
    return {"tensors": 2 * n, "us_per_tensor": os_s / (4 * n) * 1e6, "bare_us": bare_s / (4 * n) * 1e6, "ratio": ratio}


def cycle(n_tensors: int, reps: int, where: str) -> dict[str, float]:
    n = n_tensors // 2
    context: Any
    if where == "sim":
        device: torch.device = simulated_accelerator()
        context = torch.no_grad()
    else:
        device = torch.device("cuda", 0)
        context = FakeTensorMode(allow_non_fake_inputs=True)
    with context:
        a, b = _adam(n, device), _adam(n, device)
        for _ in range(2):  # the cycle's two plans, kept from their second build
            optimshift.offload(b)
            optimshift.reload(b)
        t_os, t_bare = [], []
        for _ in range(reps):
            gc.collect()
            t_bare.append(_timed(lambda: (_bare_move(a, "cpu"), _bare_move(a, device))))
            t_os.append(_timed(lambda: (optimshift.offload(b), optimshift.reload(b))))
    os_s, bare_s, ratio = _median_ratio(t_os, t_bare)
    return {"tensors": 2 * n, "us_per_tensor": os_s / (2 * n) * 1e6, "bare_us": bare_s / (2 * n) * 1e6, "ratio": ratio}


def load(n_params: int, reps: int) -> dict[str, float]:
    opt = _adam(n_params, "cpu", numel=16)
    sd = opt.state_dict()
    params = [p for g in opt.param_groups for p in g["params"]]

    def bare_clone() -> dict[Any, Any]:
        return {
            k: {kk: vv.clone() if isinstance(vv, torch.Tensor) else vv for kk, vv in st.items()}
            for k, st in sd["state"].items()
        }

    existing = torch.optim.Adam(params, foreach=False)
    optimshift.load_state_dict(existing, sd)
    live = list(existing.state.values())

    def bare_copy() -> None:
        for st, saved in zip(live, sd["state"].values()):
            for k, v in st.items():
                v.copy_(saved[k])

    saved_states = list(sd["state"].values())

    def checked_copy() -> None:
        _checked_copy(live, saved_states)

    t_clone, t_fresh, t_copy, t_checked, t_existing = [], [], [], [], []
    for _ in range(reps):
        gc.collect()
        t_clone.append(_timed(bare_clone))
        fresh = torch.optim.Adam(params, foreach=False)
        gc.collect()
        t_fresh.append(_timed(lambda: optimshift.load_state_dict(fresh, sd)))
        gc.collect()
        t_copy.append(_timed(bare_copy))
        gc.collect()
        t_checked.append(_timed(checked_copy))
        gc.collect()
        t_existing.append(_timed(lambda: optimshift.load_state_dict(existing, sd)))
    fresh, clone, fresh_ratio = _median_ratio(t_fresh, t_clone)
    existing, copy, existing_ratio = _median_ratio(t_existing, t_copy)
    checked = statistics.median(t_checked)
    # (the medians too: the baselines run in the same process, and how much a load allocates and frees moves them)
    return {
        "params": n_params,
        "fresh_vs_clone": fresh_ratio,
        "existing_vs_copy": existing_ratio,
        "existing_vs_checked": existing / checked,
        "ms": (fresh * 1e3, clone * 1e3, existing * 1e3, copy * 1e3, checked * 1e3),
    }


_MIXED = ((16,), (4, 4), (8,), (2, 8))  # (a real model's params are of several shapes: kinds one after another)


def load_onto(n_params: int, reps: int, where: str, mixed: bool = False) -> dict[str, float]:
    """A host checkpoint into a fresh optimizer whose params are on ``where`` (the common resume), against a bare
    ``state[p] = {k: v.to(device)}`` loop (issue 27); ``mixed``: params of four shapes in turn."""
    device = torch.device("meta") if where == "meta" else simulated_accelerator()
    shapes = _MIXED if mixed else ((16,),)
    source = [torch.nn.Parameter(torch.zeros(shapes[i % len(shapes)])) for i in range(n_params)]
    opt = torch.optim.Adam(source, foreach=False)
    for p in source:
        p.grad = torch.zeros_like(p)
    opt.step()
    sd = opt.state_dict()
    del opt, source
    params = [torch.nn.Parameter(torch.zeros(shapes[i % len(shapes)], device=device)) for i in range(n_params)]

    def bare_to() -> dict[Any, Any]:
        return {
            p: {k: v.to(device) if isinstance(v, torch.Tensor) and k != "step" else v for k, v in st.items()}
            for p, st in zip(params, sd["state"].values())
        }

    def every_to() -> dict[Any, Any]:
        """The loop issue 27 names (``state[p] = {k: v.to(device)}``): every tensor entry moved, ``step`` too
        (so one op per tensor, as the load makes; the load keeps ``step`` on the host, cloned)."""
        return {
            p: {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in st.items()}
            for p, st in zip(params, sd["state"].values())
        }

    optimshift.load_state_dict(torch.optim.Adam(params, foreach=False), sd)  # (warm: the probes)
    t_bare, t_every, t_os = [], [], []
    for _ in range(reps):
        gc.collect()
        t_bare.append(_timed(bare_to))
        gc.collect()
        t_every.append(_timed(every_to))
        fresh = torch.optim.Adam(params, foreach=False)
        gc.collect()
        t_os.append(_timed(lambda: optimshift.load_state_dict(fresh, sd)))
    ours, bare, ratio = _median_ratio(t_os, t_bare)
    every = statistics.median(t_every)
    return {
        "params": n_params,
        "ratio": ratio,
        "every_ratio": ours / every,
        "ms": (ours * 1e3, bare * 1e3, every * 1e3),
    }


def floors(n_tensors: int, n_params: int, reps: int) -> dict[str, float]:
    """The least any implementation of each operation does, against the same baselines as the goals (not
    goals: what a ratio can go down to on this machine).

    - move: a ``.to()`` and torch's C swap (``_swap_tensor_impl``, what ``swap_tensors`` ends in) per tensor;
    - load into existing state: per param, its keys against the live ones, and per tensor its dtype, shape and
      device against the live tensor's (the least a load that refuses a mismatched checkpoint asks), then one
      ``copy_`` each;
    - load into a fresh optimizer: the same checks against the param, then one ``clone`` each;
    - a correct load into existing state: that check and copy, after proving that no checkpoint tensor shares a
      storage with another or with a live tensor, and that each live tensor is all that uses its storage;
    - a correct load of a host checkpoint onto meta: a storage identity per checkpoint tensor, then column by
      column (no Python step per entry, as a load may work) a clone of each ``step`` (copy=True: nothing shared
      with the state dict), ``.to`` of the others, one dict a param, the class's ``__setstate__``.
    """
    n = n_tensors // 2
    swap_impl = torch._C._swap_tensor_impl
    meta = torch.device("meta")

    def least_move(opt: torch.optim.Optimizer) -> None:
        for st in opt.state.values():
            for k, v in st.items():
                if k != "step":
                    swap_impl(v, v.to(meta))

    t_least, t_bare = [], []
    for _ in range(reps):
        a, b = _adam(n, "cpu"), _adam(n, "cpu")
        gc.collect()
        t_bare.append(_timed(lambda: _bare_move(a, meta)))
        gc.collect()
        t_least.append(_timed(lambda: least_move(b)))
    move = _median_ratio(t_least, t_bare)[2]

    opt = _adam(n_params, "cpu", numel=16)
    saved = list(opt.state_dict()["state"].values())
    params = [p for g in opt.param_groups for p in g["params"]]
    live = [{k: v.clone() for k, v in st.items()} for st in saved]

    def bare_copy() -> None:
        for st, sv in zip(live, saved):
            for k, v in st.items():
                v.copy_(sv[k])

    def checked_copy() -> None:
        _checked_copy(live, saved)

    def bare_clone() -> list[dict[str, torch.Tensor]]:
        return [{k: v.clone() for k, v in sv.items()} for sv in saved]

    def checked_clone() -> list[dict[str, torch.Tensor]]:
        out: list[dict[str, torch.Tensor]] = []
        for p, sv in zip(params, saved):
            for k, w in sv.items():
                if w.dim() and (w.shape != p.shape or w.dtype != p.dtype or w.device != p.device):
                    raise ValueError(k)
            out.append({k: v.clone() for k, v in sv.items()})
        return out

    # What a correct load must do on top (issue 27's "correct" floors): copy=True never shares a tensor with the
    # state dict (the step that stays on the host is cloned), tensors of the checkpoint that share a storage stay
    # sharing (so which do is known: a storage identity per tensor), a live tensor takes the values in place only
    # where nothing else uses it or is it (a storage identity and use count per live tensor), and the class's
    # __setstate__ runs, as in PyTorch.
    address, use_count = torch._C._storage_address, torch._C._storage_Use_Count
    flat_saved = [v for sv in saved for v in sv.values()]
    flat_live = [v for st in live for v in st.values()]
    owner = torch.optim.Adam(params, foreach=False)

    def safe_copy() -> None:
        got = set(map(address, flat_saved))
        olds = list(map(address, flat_live))
        if len(got) != len(flat_saved) or not got.isdisjoint(olds) or max(map(use_count, olds)) != 1:
            raise ValueError("shared")
        checked_copy()

    onto = [torch.nn.Parameter(torch.zeros(16, device=meta)) for _ in range(n_params)]

    def bare_to() -> dict[Any, Any]:  # (load_onto's baseline)
        return {
            p: {k: v.to(meta) if isinstance(v, torch.Tensor) and k != "step" else v for k, v in sv.items()}
            for p, sv in zip(onto, saved)
        }

    order = tuple(saved[0])

    def least_onto() -> None:
        if len(set(map(address, flat_saved))) != len(flat_saved):
            raise ValueError("shared")
        columns = [
            map(torch.Tensor.clone, column) if k == "step" else map(torch.Tensor.to, column, repeat(meta))
            for k, column in zip(order, zip(*map(itemgetter(*order), saved)))
        ]
        state = dict(zip(onto, map(dict, map(zip, repeat(order), zip(*columns)))))
        owner.__setstate__({"state": state, "param_groups": owner.param_groups})

    t: dict[str, list[float]] = {
        name: [] for name in ("copy", "checked_copy", "safe_copy", "clone", "checked_clone", "to", "least_onto")
    }
    for _ in range(reps):
        for name, fn in (
            ("copy", bare_copy),
            ("checked_copy", checked_copy),
            ("safe_copy", safe_copy),
            ("clone", bare_clone),
            ("checked_clone", checked_clone),
            ("to", bare_to),
            ("least_onto", least_onto),
        ):
            owner.state.clear()  # (as a load into a fresh optimizer: the state it replaces is freed outside its time)
            gc.collect()
            t[name].append(_timed(fn))
    return {
        "move": move,
        "existing": _median_ratio(t["checked_copy"], t["copy"])[2],
        "fresh": _median_ratio(t["checked_clone"], t["clone"])[2],
        "existing_correct": _median_ratio(t["safe_copy"], t["copy"])[2],
        "onto_correct": _median_ratio(t["least_onto"], t["to"])[2],
    }


def _rows(args: argparse.Namespace) -> list[tuple[str, str, Callable[[], None]]]:
    """(name, part, print the row) for every row, in order."""

    def move_first() -> None:
        r = move_first_call(args.tensors, args.reps)
        print(
            f"move host->meta, first call, {r['tensors']} tensors: {r['us_per_tensor']:.2f} us/tensor against "
            f"{r['bare_us']:.2f} (bare swap_tensors loop): {r['ratio']:.2f}x (goal <= 1.5x)"
        )

    def move_repeated() -> None:
        r = move_repeated_fake(args.cycle_tensors, args.reps)
        print(
            f"move fake cpu<->cuda:0, repeated (cached plans), {r['tensors']} tensors: {r['us_per_tensor']:.2f} "
            f"us/tensor against {r['bare_us']:.2f}: {r['ratio']:.2f}x (goal <= 1.2x)"
        )

    def cycle_on(where: str) -> Callable[[], None]:
        def row() -> None:
            r = cycle(args.cycle_tensors, args.reps, where)
            print(
                f"offload+reload cycle on {where}, cached plans, {r['tensors']} tensors: {r['us_per_tensor']:.2f} "
                f"us/tensor against {r['bare_us']:.2f} (bare per-tensor swap loop): {r['ratio']:.2f}x (goal <= 1.5x)"
            )

        return row

    def load_row() -> None:
        r = load(args.params, args.reps)
        print(
            f"load_state_dict copy=True, {r['params']} params: into a fresh optimizer {r['fresh_vs_clone']:.2f}x a "
            f"bare clone loop; into existing state {r['existing_vs_copy']:.2f}x a bare copy_ loop, "
            f"{r['existing_vs_checked']:.2f}x the least validating in-place load (goal <= 1.5x); medians: fresh "
            "%.0f ms, clone loop %.0f ms, existing %.0f ms, copy_ loop %.0f ms, validating copy_ loop %.0f ms" % r["ms"]
        )

    def onto(where: str, mixed: bool) -> Callable[[], None]:
        def row() -> None:
            r = load_onto(args.params, args.reps, where, mixed)
            print(
                f"load_state_dict of a host checkpoint, {r['params']} params{' of 4 shapes in turn' if mixed else ''}, "
                f"into a fresh optimizer on {where}: {r['ratio']:.2f}x a bare .to({where}) loop of the entries that "
                f"move (goal <= 1.5x), {r['every_ratio']:.2f}x the issue's loop of every entry; medians %.0f ms "
                "against %.0f ms and %.0f ms" % r["ms"]
            )

        return row

    def floors_row() -> None:
        f = floors(args.tensors, args.params, args.reps)
        print(
            f"floors (the least any implementation does, same baselines): move {f['move']:.2f}x; load into a fresh "
            f"optimizer {f['fresh']:.2f}x; load into existing state {f['existing']:.2f}x"
        )
        print(
            "floors of a correct load (copy=True clones the step, shared storages known, in-place writes only into "
            f"tensors nothing else uses, __setstate__ run): into existing state {f['existing_correct']:.2f}x the "
            f"copy_ loop; a host checkpoint onto meta {f['onto_correct']:.2f}x the .to(meta) loop"
        )

    return [
        ("move-first", "move", move_first),
        ("move-repeated", "move", move_repeated),
        ("cycle-sim", "cycle", cycle_on("sim")),
        ("cycle-fake", "cycle", cycle_on("fake")),
        ("load", "load", load_row),
        ("onto-meta", "load", onto("meta", False)),
        ("onto-sim", "load", onto("sim", False)),
        ("onto-meta-mixed", "load", onto("meta", True)),
        ("floors", "floors", floors_row),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tensors", type=int, default=50_000)
    parser.add_argument("--cycle-tensors", type=int, default=10_000, help="(sim and fake ops run in Python: slower)")
    parser.add_argument("--params", type=int, default=16_000)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument(
        "--only", nargs="+", choices=_PARTS, default=list(_PARTS), help="the rows to run (default: all of them)"
    )
    parser.add_argument(
        "--fresh",
        action="store_true",
        help="each row in a process of its own (a row's ratio depends on what ran before it in the process)",
    )
    parser.add_argument("--row", help=argparse.SUPPRESS)  # (--fresh: the one row this process runs)
    args = parser.parse_args()
    rows = _rows(args)
    if args.row is not None:
        next(fn for name, _, fn in rows if name == args.row)()
        return
    print(
        f"torch {torch.__version__}, {platform.machine()}, python {platform.python_version()}, reps {args.reps}"
        + (", each row in a fresh process" if args.fresh else "")
    )
    for name, part, fn in rows:
        if part not in args.only:
            continue
        if not args.fresh:
            fn()
            continue
        sys.stdout.flush()
        sizes = ["--tensors", str(args.tensors), "--cycle-tensors", str(args.cycle_tensors)]
        sizes += ["--params", str(args.params), "--reps", str(args.reps)]
        subprocess.run([sys.executable, __file__, "--row", name, *sizes], check=True)


_PARTS = ("move", "cycle", "load", "floors")  # (--only: the rows of each part)


if __name__ == "__main__":
    main()
