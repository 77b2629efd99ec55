"""verl's optimizer offload/load, patched by optimshift.integrations.verl, on 2 gloo ranks: FSDP2 (``fully_shard``)
DTensor state, the layout verl's FSDP2 mode uses, and FSDP1 flat-param state; the shipped functions alongside.
The worker is ``_verl_workers.verl_fsdp`` (about 20 s: two spawned ranks importing FSDP and verl)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import _dist_harness
import pytest
from _dist_workers import WORLD, state_differences

pytest.importorskip("verl")


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    workdir: Path = tmp_path_factory.mktemp("verl_fsdp")
    done = _dist_harness.run("verl_fsdp", WORLD, workdir, module="_verl_workers", timeout=240)
    return [done.value(rank) for rank in range(WORLD)]


def test_the_worker_calls_the_patched_engine_names(job):
    for res in job:
        assert res["engine_functions"] == ["optimshift.integrations.verl"] * 2
        assert res["patched_fsdp2_empty"] == res["patched_fsdp1_empty"] == 0  # no state yet: nothing happens


def test_fsdp2_dtensor_state_patched(job):
    for res in job:
        assert res["patched_fsdp2_types"] == {"step": "Tensor", "exp_avg": "DTensor", "exp_avg_sq": "DTensor"}
        fresh = res["patched_fsdp2_fresh"]
        assert {d for (_, k), d in fresh.items() if k == "step"} == {"cpu"}
        assert {d for (_, k), d in fresh.items() if k != "step"} == {"sim:0"}
        cycles = res["patched_fsdp2"]
        assert all(set(devices.values()) == {"cpu"} for devices in cycles["offloaded"])
        assert all(devices == fresh for devices in cycles["loaded"]), "step stays where a fresh optimizer keeps it"
        assert all(cycles["objects_kept"]) and all(cycles["bitwise"]) and cycles["dtensor_layout_kept"]
        assert cycles["syncs"] == [0, 0, 0]
        assert cycles["new_allocations_after_first_cycle"] == 0
        assert cycles["check"]


def test_fsdp2_dtensor_state_shipped_puts_step_on_the_device(job):
    """The control: verl's own functions on the same run put every ``step`` on sim (2 host syncs per param per
    foreach AdamW step) and replace every object."""
    for res in job:
        cycles = res["shipped_fsdp2"]
        assert all({d for (_, k), d in devices.items() if k == "step"} == {"sim:0"} for devices in cycles["loaded"])
        assert cycles["syncs"] == [2 * res["shipped_fsdp2_params"]] * 3
        assert not any(cycles["objects_kept"])
        assert not cycles["check"]


def test_fsdp2_patched_and_shipped_train_to_the_same_bits(job):
    """The same steps either way (the patched run's last cycle runs on deferred, race-checked streams): the
    gathered model and optimizer state agree bitwise."""
    ours, theirs = job[0]["patched_fsdp2_final"], job[0]["shipped_fsdp2_final"]
    assert ours and state_differences(ours, theirs) == []


def test_fsdp1_flat_param_state_patched(job):
    for res in job:
        assert res["patched_fsdp1_flat"] == [(True, res["patched_fsdp1_flat"][0][1])]
        fresh = res["patched_fsdp1_fresh"]
        assert {d for (_, k), d in fresh.items() if k == "step"} == {"cpu"}
        cycles = res["patched_fsdp1"]
        assert all(set(devices.values()) == {"cpu"} for devices in cycles["offloaded"])
        assert all(devices == fresh for devices in cycles["loaded"])
        assert all(cycles["objects_kept"]) and all(cycles["bitwise"])
        assert cycles["new_allocations_after_first_cycle"] == 0
        shipped = res["shipped_fsdp1"]
        assert all({d for (_, k), d in devices.items() if k == "step"} == {"sim:0"} for devices in shipped["loaded"])
        assert not any(shipped["objects_kept"])
