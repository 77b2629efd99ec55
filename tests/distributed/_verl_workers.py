"""The 2-rank worker of test_verl_fsdp.py: verl's optimizer offload/load (patched and as shipped) over FSDP2
DTensor state and FSDP1 flat-param state, called through the names verl's FSDP engine imported.

FSDP runs its forward and backward on the host (gloo); the state then goes to the simulated accelerator with the
params (FSDP2: ``model.to(sim)``, every param a DTensor whose local shard is on sim:0, as verl's FSDP2 engine
keeps them on a GPU) or alone (FSDP1: its flat params hold views of the module's params and cannot be moved).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from _dist_workers import ROWS, build_model, full_state, rank_step, shard, snapshot

import optimshift
from optimshift._offload import pending_of

CYCLES = 3


def _ids(opt: torch.optim.Optimizer) -> list[int]:
    return [id(v) for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]


def _devices(opt: torch.optim.Optimizer) -> dict[tuple[int, str], str]:
    return {
        (i, k): str(v.device)
        for i, st in enumerate(opt.state.values())
        for k, v in st.items()
        if isinstance(v, torch.Tensor)
    }


def _wait(opt: torch.optim.Optimizer) -> None:
    pending_of(opt).wait()  # the transfer verl's next use would wait for: read values only after it


def _cycles(opt: torch.optim.Optimizer, engine: Any, device_id: Any, step: Any) -> dict[str, Any]:
    """CYCLES offload/load cycles through the engine's names, each followed by ``step()`` (None: no step)."""
    out: dict[str, Any] = {"objects_kept": [], "bitwise": [], "offloaded": [], "loaded": [], "syncs": []}
    objects = _ids(opt)
    allocations = []
    for cycle in range(CYCLES):
        _wait(opt)
        before = snapshot(opt)
        engine.offload_fsdp_optimizer(opt)
        out["offloaded"].append(_devices(opt))
        engine.load_fsdp_optimizer(opt, device_id)
        _wait(opt)
        out["loaded"].append(_devices(opt))
        after = snapshot(opt)
        out["bitwise"].append(
            all(torch.equal(before[k]["values"], after[k]["values"]) for k in before) and before.keys() == after.keys()
        )
        out["objects_kept"].append(_ids(opt) == objects)
        out["dtensor_layout_kept"] = all(
            {f: before[k].get(f) for f in ("type", "placements", "mesh", "shape", "stride")}
            == {f: after[k].get(f) for f in ("type", "placements", "mesh", "shape", "stride")}
            for k in before
        )
        allocations.append(optimshift.host_pool.stats().allocations)
        if step is not None:
            with optimshift.count_syncs() as syncs:
                step(cycle)
            out["syncs"].append(syncs.total)
    out["new_allocations_after_first_cycle"] = allocations[-1] - allocations[0]
    out["check"] = optimshift.check(opt).ok
    return out


def verl_fsdp(rank: int, world: int, workdir: Path) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    import optimshift.integrations.verl as osv  # patches verl at import
    from optimshift.testing import deferred_streams, simulated_accelerator

    with osv._quiet_verl_import():
        from verl.workers.engine.fsdp import transformer_impl as engine

    sim = simulated_accelerator()
    mesh = init_device_mesh("cpu", (world,))
    # imported after the patch: the engine module bound the replacements from the patched fsdp_utils
    res: dict[str, Any] = {
        "engine_functions": [engine.offload_fsdp_optimizer.__module__, engine.load_fsdp_optimizer.__module__]
    }

    for patched in (True, False):
        (osv.patch if patched else osv.unpatch)()
        tag = "patched" if patched else "shipped"
        # FSDP2: DTensor state, sharded over the two ranks
        model = shard(build_model(), mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
        engine.offload_fsdp_optimizer(opt)  # no state yet
        engine.load_fsdp_optimizer(opt, "sim")
        res[f"{tag}_fsdp2_empty"] = len(opt.state)
        rank_step(model, opt, 0, rank)
        model.to(sim)
        optimshift.move(opt)  # the state where verl's FSDP2 engine keeps it: with its params' shards
        res[f"{tag}_fsdp2_fresh"] = _devices(opt)
        res[f"{tag}_fsdp2_types"] = {k: type(v).__name__ for k, v in next(iter(opt.state.values())).items()}
        params = list(model.parameters())

        def step(cycle: int, params: list[nn.Parameter] = params, opt: torch.optim.Optimizer = opt) -> None:
            for i, p in enumerate(params):
                p.grad = torch.full_like(p, 0.01 * (cycle + 1) + 0.001 * i)
            opt.step()

        res[f"{tag}_fsdp2"] = _cycles(opt, engine, 0, step)
        res[f"{tag}_fsdp2_params"] = len(params)
        if patched:
            with deferred_streams(seed=rank, progress=0.0):  # the non-blocking copies, race-checked
                engine.offload_fsdp_optimizer(opt)
                opt.state_dict()
                engine.load_fsdp_optimizer(opt, "sim")
                step(CYCLES)
        else:
            step(CYCLES)
        model.to("cpu")
        optimshift.move(opt)
        res[f"{tag}_fsdp2_final"] = full_state(model, opt)

        # FSDP1: one flat param per rank (use_orig_params=False), state alone on sim (where a fresh optimizer over
        # params on sim keeps it)
        torch.manual_seed(0)
        fsdp1 = FSDP(build_model(), device_id=torch.device("cpu"), use_orig_params=False)
        opt1 = torch.optim.AdamW(fsdp1.parameters(), lr=1e-2, foreach=True)
        engine.offload_fsdp_optimizer(opt1)
        engine.load_fsdp_optimizer(opt1, "sim")
        res[f"{tag}_fsdp1_empty"] = len(opt1.state)
        x = torch.randn(2 * ROWS, 6, generator=torch.Generator().manual_seed(rank))
        fsdp1(x).pow(2).mean().backward()
        opt1.step()
        res[f"{tag}_fsdp1_flat"] = [
            (bool(getattr(p, "_is_flat_param", False)), tuple(p.shape)) for p in opt1.param_groups[0]["params"]
        ]
        optimshift.move(opt1, sim)
        res[f"{tag}_fsdp1_fresh"] = _devices(opt1)
        res[f"{tag}_fsdp1"] = _cycles(opt1, engine, torch.device("sim", 0), None)
    return res
