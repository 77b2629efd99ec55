"""The model, data and training step shared by the multi-process workers and the single-process tests, and
the workers themselves (run on each rank by ``_dist_harness.run``; they record, the tests assert).

Why the 1-process and 2-rank runs agree bitwise: FSDP2 all-gathers exact copies of the params, each rank
runs its half of the batch through the same kernels, and the gradient reduce-scatter averages two
addends ((g0 + g1) / 2: a two-term sum is commutative and halving is exact). The single-process step
accumulates the same two micro-batch gradients and halves them. The optimizer step is elementwise, so
how the state is sharded does not change any value. One intra-op thread per process keeps kernels alike.
"""

from __future__ import annotations

import dataclasses
import os
import signal
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

import optimshift
from optimshift._dtensor import is_dtensor

IN, HIDDEN, OUT = 6, 10, 3  # OUT=3 rows shard unevenly over 2 ranks (2 + 1)
ROWS = 4  # rows of the batch per rank
WORLD = 2
S, K = 3, 2  # steps before the checkpoint, steps after it

_BITS = {
    torch.float64: torch.int64,
    torch.float32: torch.int32,
    torch.bfloat16: torch.int16,
    torch.float16: torch.int16,
}


# --- the training run ------------------------------------------------------------------------------------


def build_model(hidden: int = HIDDEN, dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN, hidden), nn.Tanh(), nn.Linear(hidden, OUT)).to(dtype)


def build_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    return torch.optim.AdamW(
        [{"params": weights, "weight_decay": 0.1}, {"params": biases, "lr": 5e-3, "weight_decay": 0.0}], lr=1e-2
    )


def batch(step: int, device: Any = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(WORLD * ROWS, IN, generator=g), torch.randn(WORLD * ROWS, OUT, generator=g)
    return x.to(device), y.to(device)


def rank_step(model: nn.Module, opt: torch.optim.Optimizer, step: int, rank: int) -> None:
    """One FSDP2 step: this rank's rows of the batch; FSDP2 averages the gradients over the ranks."""
    x, y = batch(step)
    rows = slice(rank * ROWS, (rank + 1) * ROWS)
    ((model(x[rows]) - y[rows]) ** 2).mean().backward()
    opt.step()
    opt.zero_grad()


def local_step(model: nn.Module, opt: torch.optim.Optimizer, step: int, device: Any = "cpu") -> None:
    """The same step in one process: both ranks' rows as two micro-batches, gradients averaged."""
    x, y = batch(step, device)
    for rank in range(WORLD):
        rows = slice(rank * ROWS, (rank + 1) * ROWS)
        ((model(x[rows]) - y[rows]) ** 2).mean().backward()
    for p in model.parameters():
        p.grad.div_(WORLD)
    opt.step()
    opt.zero_grad()


def shard(model: nn.Module, mesh: Any) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def full_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """Model and optimizer state by parameter name, whole tensors on the host (on rank 0 when distributed)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model_sd, optim_sd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if "state" not in optim_sd:
        return {}  # not rank 0: full_state_dict with cpu_offload gathers on rank 0 only
    host = lambda v: v.detach().to("cpu", copy=True) if isinstance(v, torch.Tensor) else v  # noqa: E731
    return {
        "model": {k: host(v) for k, v in model_sd.items()},
        "state": {n: {k: host(v) for k, v in st.items()} for n, st in optim_sd["state"].items()},
        "groups": [dict(g) for g in optim_sd["param_groups"]],
    }


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape or type(a) is not type(b):
        return False
    a, b = a.detach().cpu(), b.detach().cpu()
    bits = _BITS.get(a.dtype)
    return torch.equal(a.view(bits), b.view(bits)) if bits is not None else torch.equal(a, b)


def state_differences(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """Where two :func:`full_state` results differ (values bitwise, dtypes, keys, param groups)."""
    out = []
    if set(a["model"]) != set(b["model"]):
        out.append(f"model keys {sorted(a['model'])} != {sorted(b['model'])}")
    for k in a["model"]:
        if k in b["model"] and not bitwise_equal(a["model"][k], b["model"][k]):
            out.append(f"model.{k}")
    if set(a["state"]) != set(b["state"]):
        out.append(f"state params {sorted(a['state'])} != {sorted(b['state'])}")
    for n in a["state"]:
        sa, sb = a["state"][n], b["state"].get(n, {})
        if set(sa) != set(sb):
            out.append(f"state.{n} keys {sorted(sa)} != {sorted(sb)}")
        for k in sa:
            if k in sb and not bitwise_equal(sa[k], sb[k]):
                out.append(f"state.{n}.{k}")
    if a["groups"] != b["groups"]:
        out.append(f"param groups {a['groups']} != {b['groups']}")
    return out


def snapshot(opt: torch.optim.Optimizer, mesh: Any = None) -> dict[tuple, dict[str, Any]]:
    """Every state tensor: its class, device, dtype, host copy of its (local) values, and for a DTensor its
    placements, mesh, global shape and strides."""
    out = {}
    for gi, group in enumerate(opt.param_groups):
        for pi, p in enumerate(group["params"]):
            for key, v in opt.state[p].items():
                entry = {"type": type(v).__name__, "device": str(v.device), "dtype": v.dtype}
                local = v
                if is_dtensor(v):
                    local = v.to_local()
                    entry.update(
                        placements=tuple(repr(pl) for pl in v.placements),
                        mesh=(v.device_mesh.device_type, tuple(v.device_mesh.shape), v.device_mesh.mesh.tolist()),
                        same_mesh=mesh is not None and v.device_mesh is mesh,
                        shape=tuple(v.shape),
                        stride=v.stride(),
                        local_stride=local.stride(),
                        local_device=str(local.device),
                    )
                entry["values"] = local.detach().to("cpu", copy=True)
                out[(gi, pi, key)] = entry
    return out


def rows(opt: torch.optim.Optimizer) -> list[dict[str, Any]]:
    return [dataclasses.asdict(r) for r in optimshift.placement(opt)]


def _object_ids(opt: Any) -> list[int]:
    return [id(v) for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]


# --- workers (run on every rank by _dist_harness.run) -----------------------------------------------------


def train_save(rank: int, world: int, workdir: Path) -> dict[str, Any]:
    """FSDP2 on CPU: S steps with a host/sim round trip of model and optimizer and an offload/reload round
    trip on the way; save at step S; K more steps. Also DTensor state on sim outside FSDP2 (step, check,
    count_syncs)."""
    from torch.distributed.device_mesh import init_device_mesh

    from optimshift.distributed import save
    from optimshift.testing import simulated_accelerator

    sim = simulated_accelerator()
    mesh = init_device_mesh("cpu", (world,))
    model = shard(build_model(), mesh)
    opt = build_optimizer(model)
    res: dict[str, Any] = {}
    for i in range(S - 1):
        rank_step(model, opt, i, rank)

    res["rows"] = rows(opt)
    res["check"] = optimshift.check(opt).ok
    res["before"] = snapshot(opt, mesh)
    objects = _object_ids(opt)
    # state alone to sim (params stay on the host): where a fresh optimizer over params on sim keeps it
    optimshift.move(opt, sim)
    res["moved"] = snapshot(opt, mesh)
    optimshift.offload(opt)
    res["offloaded"] = snapshot(opt, mesh)
    res["is_offloaded"] = optimshift.is_offloaded(opt)
    optimshift.reload(opt)
    res["reloaded"] = snapshot(opt, mesh)
    # more cycles on sim: the local shards go through the grouped copies into the persistent pool
    from optimshift.pool import host_pool

    optimshift.move(opt, sim)
    optimshift.offload(opt)
    optimshift.reload(opt)
    allocations = host_pool.stats().allocations
    for _ in range(3):
        optimshift.offload(opt)
        pooled = host_pool.in_use_storages()
        locals_ = [v.to_local() for st in opt.state.values() for v in st.values() if v.dim()]
        res["offloaded_shards_in_pool"] = all(t.untyped_storage().data_ptr() in pooled for t in locals_)
        res["offloaded_shard_buffers"] = len({t.untyped_storage().data_ptr() for t in locals_})
        res["offloaded_shards"] = len(locals_)
        del locals_  # (a view kept into a pool buffer keeps the pool from reusing it)
        optimshift.reload(opt)
    res["pool_allocations_after_warmup"] = host_pool.stats().allocations - allocations
    optimshift.move(opt, "cpu")
    res["back"] = snapshot(opt, mesh)
    res["same_objects"] = _object_ids(opt) == objects  # the DTensor objects stay; their local shards moved
    # the whole FSDP2 model to sim and back, the optimizer following its params (move(opt) without device)
    model.to(sim)
    optimshift.move(opt)
    res["model_on_sim"] = [str(p.device) for p in model.parameters()]
    res["check_on_sim"] = optimshift.check(opt).ok
    res["with_model_on_sim"] = snapshot(opt, mesh)
    model.to("cpu")
    optimshift.move(opt)
    res["with_model_back"] = snapshot(opt, mesh)
    res["check_back"] = optimshift.check(opt).ok
    rank_step(model, opt, S - 1, rank)

    save(workdir / "ck2", model, opt, extra={"step": S, "note": "two ranks"})
    res["ref_S"] = full_state(model, opt)
    for i in range(S, S + K):
        rank_step(model, opt, i, rank)
    res["ref_SK"] = full_state(model, opt)
    res.update(_dtensor_on_sim(mesh, sim))
    res["fsdp_forward_on_sim"] = _error_of(lambda: _fsdp_forward_on(mesh, sim, rank))
    res["fsdp_on_sim_mesh"] = _error_of(lambda: _fsdp_forward_on(init_device_mesh(sim.type, (world,)), sim, rank))
    return res


def _fsdp_forward_on(mesh: Any, device: torch.device, rank: int) -> None:
    """A throwaway FSDP2 model moved to ``device`` runs a forward pass (it cannot: see the test)."""
    model = shard(build_model().to(device), mesh)
    x, _ = batch(0, device)
    model(x[rank * ROWS : (rank + 1) * ROWS])


def _dtensor_on_sim(mesh: Any, sim: torch.device) -> dict[str, Any]:
    """Adam over DTensor params whose shards live on sim (no FSDP: the step needs no collective)."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    g = torch.Generator().manual_seed(7)
    w, b = torch.randn(6, 4, generator=g), torch.randn(4, generator=g)
    params = [
        nn.Parameter(distribute_tensor(w, mesh, [Shard(0)]).to(sim)),
        nn.Parameter(distribute_tensor(b, mesh, [Replicate()]).to(sim)),
    ]
    opt = torch.optim.Adam(params, lr=0.1)

    def step() -> int:
        for p in params:
            p.grad = torch.ones_like(p)
        with optimshift.count_syncs() as syncs:
            opt.step()
        return syncs.total

    out: dict[str, Any] = {"param_devices": [str(p.device) for p in params]}
    step()
    out["fresh"] = snapshot(opt, mesh)
    out["fresh_check"] = optimshift.check(opt).ok
    out["fresh_syncs"] = step()
    for st in opt.state.values():  # the naive move: every tensor, step included, onto the accelerator
        st["step"] = st["step"].to(sim)
    out["naive_check"] = [(f.severity, f.key, f.device, f.expected) for f in optimshift.check(opt).findings]
    out["naive_syncs"] = step()
    optimshift.move(opt)
    out["fixed"] = snapshot(opt, mesh)
    out["fixed_check"] = optimshift.check(opt).ok
    out["fixed_syncs"] = step()
    with optimshift.count_syncs() as syncs:
        params[0].to("cpu")  # a DTensor leaving the device is one device-to-host copy
    out["dtensor_to_host"] = dict(syncs.by_op)
    return out


def load_continue(rank: int, world: int, workdir: Path) -> dict[str, Any]:
    """Load the 2-rank, the 1-process and the sim checkpoints into fresh FSDP2 models on CPU and train on;
    then a mismatched model, a mismatched optimizer, and a bad argument on one rank only."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from optimshift.distributed import load, save

    mesh = init_device_mesh("cpu", (world,))
    res: dict[str, Any] = {}
    for name in ("ck2", "ck1", "ck_sim"):
        model = shard(build_model(), mesh)
        opt = build_optimizer(model)
        res[f"{name}_extra"] = load(workdir / name, model, opt)
        res[f"{name}_check"] = optimshift.check(opt).ok
        res[f"{name}_snapshot"] = snapshot(opt, mesh)
        res[f"{name}_rows"] = rows(opt)
        res[f"{name}_state"] = full_state(model, opt)
        for i in range(S, S + K):
            rank_step(model, opt, i, rank)
        res[f"{name}_final"] = full_state(model, opt)

    # a wider model, and an optimizer of another class: every rank raises, nothing changes, nothing hangs
    wide = shard(build_model(hidden=HIDDEN + 2), mesh)
    wide_opt = build_optimizer(wide)
    before = [p.to_local().clone() for p in wide.parameters()]
    res["model_mismatch"] = _error_of(lambda: load(workdir / "ck2", wide, wide_opt))
    res["model_mismatch_unchanged"] = all(torch.equal(a, p.to_local()) for a, p in zip(before, wide.parameters()))
    res["model_mismatch_state"] = len(wide_opt.state)
    other = shard(build_model(), mesh)
    sgd = torch.optim.SGD(
        [
            {"params": [p for n, p in other.named_parameters() if n.endswith("weight")]},
            {"params": [p for n, p in other.named_parameters() if n.endswith("bias")]},
        ],
        lr=0.1,
        momentum=0.9,
    )
    res["optimizer_mismatch"] = _error_of(lambda: load(workdir / "ck2", other, sgd))
    res["optimizer_mismatch_state"] = len(sgd.state)
    # an error on one rank only: the other rank must raise too instead of waiting in DCP's collectives
    res["one_rank_load"] = _error_of(
        lambda: load(workdir / "ck2", other, build_optimizer(other), device="nonsense" if rank == 1 else None)
    )
    res["one_rank_save"] = _error_of(
        lambda: save(workdir / "ck_never", other, sgd, extra={"fine": 1} if rank == 0 else ["not", "a", "mapping"])
    )
    res["ck_never_exists"] = any(p.name.startswith("ck_never") for p in workdir.iterdir())
    # a StopIteration on one rank (a user's state-dict hook): raised as itself on every rank, naming the rank
    stopping = shard(build_model(), mesh)

    def exhausted(*args: Any) -> None:
        if rank == 1:
            raise StopIteration("exhausted on rank 1")

    stopping.register_state_dict_pre_hook(exhausted)
    res["one_rank_stop"] = _error_of(lambda: save(workdir / "ck_stop", stopping, build_optimizer(stopping)))
    res["ck_stop_left"] = sorted(p.name for p in workdir.iterdir() if p.name.startswith("ck_stop"))
    # a read error on one rank while the checks read the checkpoint (DCP's CheckpointException, a BaseException:
    # it skipped the exchange of errors, and the other rank waited until the group timed out)
    import torch.distributed.checkpoint as dcp

    read_data = dcp.FileSystemReader.read_data
    reads = [0]

    def failing_once(self: Any, *args: Any, **kwargs: Any) -> Any:
        reads[0] += 1
        if rank == 1 and reads[0] == 1:
            raise OSError("EIO on rank 1")
        return read_data(self, *args, **kwargs)

    dcp.FileSystemReader.read_data = failing_once  # type: ignore[method-assign]
    try:
        fresh = shard(build_model(), mesh)
        res["one_rank_read"] = _error_of(lambda: load(workdir / "ck2", fresh, build_optimizer(fresh)))
    finally:
        dcp.FileSystemReader.read_data = read_data  # type: ignore[method-assign]
    dist.barrier()  # the group is still in step after all these errors

    return res


def kill_during_save(rank: int, world: int, workdir: Path) -> dict[str, Any]:
    """Save a checkpoint, train a step, save again over it: rank 1 is killed once its shards are written."""
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.device_mesh import init_device_mesh

    from optimshift.distributed import save

    mesh = init_device_mesh("cpu", (world,))
    model = shard(build_model(), mesh)
    opt = build_optimizer(model)
    rank_step(model, opt, 0, rank)
    save(workdir / "ck_kill", model, opt, extra={"version": 1})
    res = {"saved": full_state(model, opt)}
    rank_step(model, opt, 1, rank)
    if rank == 1:
        write_data = FileSystemWriter.write_data

        def write_then_die(self: Any, plan: Any, planner: Any) -> Any:
            result = write_data(self, plan, planner)  # this rank's shard file is on disk, the metadata is not
            os.kill(os.getpid(), signal.SIGKILL)
            return result

        FileSystemWriter.write_data = write_then_die  # type: ignore[method-assign]
    res["error"] = _error_of(lambda: save(workdir / "ck_kill", model, opt, extra={"version": 2}))
    return res


def _error_of(fn: Any) -> str:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - recorded for the test
        return f"{type(e).__name__}: {e}"
    return "no error"
