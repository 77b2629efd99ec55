"""Session fixtures for the distributed tests: two 2-rank jobs (gloo on CPU, spawned processes with hard time
limits, see ``_dist_harness``) and one single-process run, shared by the tests that assert on them.

Launch: ``.venv/bin/python -m pytest -q tests/distributed`` (about 40 s on two cores: each of the three
jobs starts two Python processes that import torch.distributed, FSDP2 and DCP, ~10 s).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import _dist_harness
import pytest
from _dist_workers import WORLD, K, S, build_model, build_optimizer, full_state, local_step


@pytest.fixture(scope="session")
def dist_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("distributed")


@pytest.fixture(scope="session")
def job_train(dist_dir: Path) -> _dist_harness.Job:
    """2-rank FSDP2: S steps (with host/sim and offload/reload round trips), save ``ck2``, K more steps."""
    return _dist_harness.run("train_save", WORLD, dist_dir)


@pytest.fixture(scope="session")
def single_run(dist_dir: Path) -> dict[str, Any]:
    """The same training in this process, without a process group: S steps, save ``ck1``, K more steps."""
    from optimshift.distributed import save

    model = build_model()
    opt = build_optimizer(model)
    for i in range(S):
        local_step(model, opt, i)
    save(dist_dir / "ck1", model, opt, extra={"step": S, "note": "one process"})
    at_s = full_state(model, opt)
    for i in range(S, S + K):
        local_step(model, opt, i)
    return {"S": at_s, "SK": full_state(model, opt)}


@pytest.fixture(scope="session")
def sim_run(dist_dir: Path, sim: Any) -> dict[str, Any]:
    """The same training on the simulated accelerator in this process: S steps, save ``ck_sim``, K more."""
    from optimshift.distributed import save

    model = build_model().to(sim)
    opt = build_optimizer(model)
    for i in range(S):
        local_step(model, opt, i, sim)
    save(dist_dir / "ck_sim", model, opt)
    at_s = full_state(model, opt)
    for i in range(S, S + K):
        local_step(model, opt, i, sim)
    return {"S": at_s, "SK": full_state(model, opt)}


@pytest.fixture(scope="session")
def job_load(
    dist_dir: Path, job_train: _dist_harness.Job, single_run: dict[str, Any], sim_run: dict[str, Any]
) -> _dist_harness.Job:
    """2-rank FSDP2 on CPU: load ``ck2``, ``ck1`` and ``ck_sim`` and train on; a mismatched model and optimizer;
    a bad argument on one rank."""
    job_train.value(0)  # its checkpoint must exist
    return _dist_harness.run("load_continue", WORLD, dist_dir)


@pytest.fixture(scope="session")
def job_kill(dist_dir: Path) -> _dist_harness.Job:
    """2-rank FSDP2: save ``ck_kill``, then save over it while rank 1 is killed after writing its shards."""
    return _dist_harness.run("kill_during_save", WORLD, dist_dir)
