"""The 2-rank worker of test_deepspeed_zero.py: DeepSpeed ZeRO-1/2 engines (bf16, a torch AdamW client optimizer)
on DeepSpeed's CPU accelerator over the harness's gloo group, each rank holding half of every fp32 partition and
of the optimizer state. offload_states/reload_states cycles, patched and as shipped, against the same training
never offloaded."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # read when deepspeed is first imported

import torch  # noqa: E402

CYCLES = 3


def _engine(stage: int) -> Any:
    import deepspeed

    torch.manual_seed(0)  # the same weights on every rank, as a launcher's seeded start gives
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": stage},
        "steps_per_print": 10**9,
    }
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config, dist_init_required=False)
    return engine


def _train(engine: Any, rank: int, seed: int) -> None:
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(100 * seed + rank)).to(torch.bfloat16)
    loss = engine(x).float().pow(2).mean()
    engine.backward(loss)
    engine.step()


def _values(engine: Any) -> dict[Any, torch.Tensor]:
    zero = engine.optimizer
    out: dict[Any, torch.Tensor] = {
        ("hp", i): t.detach().clone() for i, t in enumerate(zero.single_partition_of_fp32_groups)
    }
    for p, st in zero.optimizer.state.items():
        for k, v in st.items():
            out[("state", tuple(p.shape), k)] = v.detach().clone()
    out.update({("lp", n): p.detach().clone() for n, p in engine.module.named_parameters()})
    return out


def _same(a: dict[Any, torch.Tensor], b: dict[Any, torch.Tensor]) -> bool:
    def bits(t: torch.Tensor) -> torch.Tensor:
        return t.contiguous().reshape(-1).view(torch.uint8)

    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(bits(a[k]), bits(b[k])) for k in a)


def deepspeed_zero(rank: int, world: int, workdir: Path) -> dict[str, Any]:
    import deepspeed  # noqa: F401

    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None  # gloo's collectives; no compiled shm op
    os.environ["LOCAL_RANK"] = str(rank)  # (what a launcher sets; one host)
    import optimshift
    import optimshift.integrations.deepspeed as osd

    out: dict[str, Any] = {}
    for stage in (2,):  # (ZeRO-1 partitions the same fp32 groups: tests/integrations covers it on 1 rank)
        osd.unpatch()
        reference = _engine(stage)
        for seed in range(CYCLES + 1):
            _train(reference, rank, seed)
        expected = _values(reference)
        total = sum(p.numel() for p in reference.module.parameters())
        for patched in (False, True):
            (osd.patch if patched else osd.unpatch)()
            engine = _engine(stage)
            zero = engine.optimizer
            _train(engine, rank, 0)
            objects = [v for st in zero.optimizer.state.values() for v in st.values()]
            allocations, in_pool, buffers = [], [], []
            for cycle in range(CYCLES):
                before = optimshift.host_pool.stats().allocations
                engine.offload_states()
                pooled = optimshift.host_pool.in_use_storages()
                in_pool.append(all(b.untyped_storage().data_ptr() in pooled for b in zero.hp_params_pin_buffers))
                buffers.append([b.untyped_storage().data_ptr() for b in zero.hp_params_pin_buffers])
                engine.reload_states()
                allocations.append(optimshift.host_pool.stats().allocations - before)
                _train(engine, rank, cycle + 1)
            now = [v for st in zero.optimizer.state.values() for v in st.values()]
            out[f"stage{stage}-{'patched' if patched else 'shipped'}"] = {
                "partition_numel": [t.numel() for t in zero.single_partition_of_fp32_groups],
                "model_numel": total,
                "bitwise": _same(_values(engine), expected),
                "objects_kept": all(a is b for a, b in zip(now, objects)) and len(now) == len(objects),
                "allocations": allocations,
                "in_pool": in_pool,
                "same_buffers": all(b == buffers[0] for b in buffers),
            }
    osd.unpatch()
    return out
