"""DeepSpeed ZeRO-2 offload_states/reload_states on 2 gloo ranks (DeepSpeed's CPU accelerator), patched by
optimshift.integrations.deepspeed and as shipped: each rank's half of the fp32 partitions goes to pool buffers,
reused every cycle, and training matches a run that never offloaded. The worker is
``_deepspeed_workers.deepspeed_zero`` (about 20 s: two spawned ranks importing deepspeed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import _dist_harness
import pytest
from _dist_workers import WORLD

pytest.importorskip("deepspeed")


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    workdir: Path = tmp_path_factory.mktemp("deepspeed_zero")
    done = _dist_harness.run("deepspeed_zero", WORLD, workdir, module="_deepspeed_workers", timeout=240)
    return [done.value(rank) for rank in range(WORLD)]


@pytest.mark.parametrize("run", ["stage2-patched"])
def test_each_rank_offloads_its_partition_into_reused_pool_buffers_and_trains_on_unchanged(job, run):
    for res in job:
        r = res[run]
        assert sum(r["partition_numel"]) * WORLD >= r["model_numel"] > sum(r["partition_numel"])  # a half each
        assert r["bitwise"], "not the training that never offloaded"
        assert r["objects_kept"]
        assert all(r["in_pool"]) and r["same_buffers"]
        assert r["allocations"][1:] == [0, 0], "new host buffers after the first cycle"


def test_shipped_trains_on_unchanged_but_pins_new_buffers(job):
    for res in job:
        r = res["stage2-shipped"]
        assert r["bitwise"] and not any(r["in_pool"]) and r["allocations"] == [0, 0, 0]
