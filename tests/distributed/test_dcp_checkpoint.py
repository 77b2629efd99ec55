"""optimshift.distributed.save/load/describe_dcp: N→M resharding, device types, atomic commit, clear errors.

Bitwise throughout: resharding only moves bytes, and the 1-process reference run computes the same
floating-point operations as the 2-rank FSDP2 run (see _dist_workers), so no tolerance is needed.
"""

from __future__ import annotations

import json
import os
import signal
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _dist_harness import JOB_TIMEOUT_S
from _dist_workers import (
    HIDDEN,
    IN,
    OUT,
    WORLD,
    K,
    S,
    bitwise_equal,
    build_model,
    build_optimizer,
    full_state,
    local_step,
    state_differences,
)

import optimshift
from optimshift.distributed import describe_dcp, load, save


def _state_of(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[tuple[str, torch.Tensor]]:
    out = [(f"param {n}", p.detach().clone()) for n, p in model.named_parameters()]
    for i, p in enumerate(model.parameters()):
        for key, value in opt.state.get(p, {}).items():
            out.append((f"state {i} {key} {value.device}", value.detach().clone()))
    return out


def _unchanged(before: list, model: torch.nn.Module, opt: torch.optim.Optimizer) -> bool:
    after = _state_of(model, opt)
    return [k for k, _ in before] == [k for k, _ in after] and all(
        bitwise_equal(a, b) for (_, a), (_, b) in zip(before, after)
    )


def _placement(opt: torch.optim.Optimizer) -> list[tuple[str, str, str, str]]:
    return [(r.param, r.key, r.device, r.dtype) for r in optimshift.placement(opt)]


def _fresh_placement(device: Any) -> list[tuple[str, str, str, str]]:
    """Where a fresh optimizer over the model on ``device`` keeps its state after a step."""
    model = build_model().to(device)
    opt = build_optimizer(model)
    local_step(model, opt, 0, device)
    return _placement(opt)


# --- N→M ----------------------------------------------------------------------------------------------------


def test_save_two_ranks_load_two_ranks(job_train, job_load):
    ref, res0 = job_train.value(0), job_load.value(0)
    assert state_differences(res0["ck2_state"], ref["ref_S"]) == []
    assert state_differences(res0["ck2_final"], ref["ref_SK"]) == []  # training continues bitwise
    for rank in range(WORLD):
        res = job_load.value(rank)
        assert res["ck2_check"] and res["ck2_extra"] == {"step": S, "note": "two ranks"}
        # same placement as the run that saved it: DTensor shards on the host, step a plain host tensor
        assert res["ck2_rows"] == job_train.value(rank)["rows"]


def test_save_one_process_load_two_ranks(job_load, job_train, single_run):
    res0 = job_load.value(0)
    assert state_differences(res0["ck1_state"], single_run["S"]) == []
    assert state_differences(res0["ck1_final"], job_train.value(0)["ref_SK"]) == []
    for rank in range(WORLD):
        res = job_load.value(rank)
        assert res["ck1_check"] and res["ck1_extra"] == {"step": S, "note": "one process"}
        assert res["ck1_rows"] == job_train.value(rank)["rows"]  # resharded into the 2-rank layout
        for key, entry in res["ck1_snapshot"].items():
            assert entry["type"] == ("Tensor" if key[2] == "step" else "DTensor")


def test_save_two_ranks_load_one_process(job_train, dist_dir):
    assert not dist.is_initialized()  # no process group in the test process
    ref = job_train.value(0)
    model = build_model(hidden=HIDDEN)
    opt = build_optimizer(model)
    assert load(dist_dir / "ck2", model, opt) == {"step": S, "note": "two ranks"}
    assert state_differences(full_state(model, opt), ref["ref_S"]) == []
    assert optimshift.check(opt).ok
    assert _placement(opt) == _fresh_placement("cpu")
    for i in range(S, S + K):
        local_step(model, opt, i)
    assert state_differences(full_state(model, opt), ref["ref_SK"]) == []


# --- device types ---------------------------------------------------------------------------------------


def test_saved_on_the_accelerator_loaded_on_the_host_and_back(tmp_path, sim):
    model = build_model().to(sim)
    opt = build_optimizer(model)
    for i in range(S):
        local_step(model, opt, i, sim)
    save(tmp_path / "ck", model, opt)
    saved = full_state(model, opt)
    for i in range(S, S + K):
        local_step(model, opt, i, sim)
    uninterrupted = full_state(model, opt)

    host_model = build_model()
    host_opt = build_optimizer(host_model)
    load(tmp_path / "ck", host_model, host_opt)
    assert state_differences(full_state(host_model, host_opt), saved) == []
    assert _placement(host_opt) == _fresh_placement("cpu") and optimshift.check(host_opt).ok

    sim_model = build_model().to(sim)
    sim_opt = build_optimizer(sim_model)
    load(tmp_path / "ck", sim_model, sim_opt)
    assert _placement(sim_opt) == _fresh_placement(sim) and optimshift.check(sim_opt).ok
    for i in range(S, S + K):
        local_step(sim_model, sim_opt, i, sim)
    assert state_differences(full_state(sim_model, sim_opt), uninterrupted) == []


def test_saved_on_the_accelerator_loaded_on_two_cpu_ranks(job_load, job_train, sim_run):
    res0 = job_load.value(0)
    assert state_differences(res0["ck_sim_state"], sim_run["S"]) == []
    # the simulator runs the host's kernels, so this model's numbers agree across the two device types and
    # the 2-rank continuation on CPU matches the uninterrupted run on sim (and the 2-rank reference) bitwise
    assert state_differences(res0["ck_sim_final"], sim_run["SK"]) == []
    assert state_differences(sim_run["SK"], job_train.value(0)["ref_SK"]) == []
    for rank in range(WORLD):
        res = job_load.value(rank)
        assert res["ck_sim_check"] and res["ck_sim_extra"] is None
        assert res["ck_sim_rows"] == job_train.value(rank)["rows"]  # host shards, host step: fresh placement


def test_two_rank_host_checkpoint_loads_onto_the_accelerator(job_train, dist_dir, sim):
    model = build_model().to(sim)
    opt = build_optimizer(model)
    load(dist_dir / "ck2", model, opt)
    assert state_differences(full_state(model, opt), job_train.value(0)["ref_S"]) == []
    assert _placement(opt) == _fresh_placement(sim) and optimshift.check(opt).ok


def test_device_places_the_state_as_move_would(job_train, dist_dir, sim):
    model = build_model()
    opt = build_optimizer(model)
    load(dist_dir / "ck2", model, opt, device=sim)
    expected_model = build_model()
    expected = build_optimizer(expected_model)
    load(dist_dir / "ck2", expected_model, expected)
    # params stay on the host; the state sits where a fresh optimizer over params on sim keeps it
    assert _placement(opt) == _placement(optimshift.move(expected, sim))


def test_load_places_the_state_by_the_checkpoints_flags(tmp_path, sim):
    """The saved param groups replace the live ones (torch's load_state_dict), flags included: a fused
    checkpoint makes a fused optimizer, whose step must sit on the device, and the other way round."""
    for saved_fused, live_fused in ((True, None), (None, True)):
        model = build_model().to(sim)
        opt = torch.optim.AdamW(model.parameters(), fused=saved_fused)
        local_step(model, opt, 0, sim)
        save(tmp_path / "ck", model, opt)
        local_step(model, opt, 1, sim)
        uninterrupted = full_state(model, opt)

        live = build_model().to(sim)
        live_opt = torch.optim.AdamW(live.parameters(), fused=live_fused)
        load(tmp_path / "ck", live, live_opt)
        assert live_opt.param_groups[0]["fused"] is saved_fused
        assert optimshift.check(live_opt).ok
        step_device = {str(v.device) for st in live_opt.state.values() for k, v in st.items() if k == "step"}
        assert step_device == ({str(sim)} if saved_fused else {"cpu"})
        local_step(live, live_opt, 1, sim)
        assert state_differences(full_state(live, live_opt), uninterrupted) == []


def test_a_tensor_lr_keeps_its_object(tmp_path, sim):
    """torch's load_state_dict deep-copies the loaded param groups: a tensor lr on the device (what a captured
    step reads at its address, and a scheduler writes in place) was a new object after the load, while the state
    tensors kept theirs (and optimshift.load_state_dict keeps the lr's)."""
    model = build_model().to(sim)
    opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(0.01, device=sim), fused=True)
    local_step(model, opt, 0, sim)
    save(tmp_path / "ck", model, opt)
    local_step(model, opt, 1, sim)
    uninterrupted = full_state(model, opt)

    live = build_model().to(sim)
    live_opt = torch.optim.AdamW(live.parameters(), lr=torch.tensor(0.5, device=sim), fused=True)
    lr = live_opt.param_groups[0]["lr"]
    load(tmp_path / "ck", live, live_opt)
    assert live_opt.param_groups[0]["lr"] is lr and lr.device == sim and torch.equal(lr.cpu(), torch.tensor(0.01))
    assert optimshift.check(live_opt).ok
    local_step(live, live_opt, 1, sim)
    assert state_differences(full_state(live, live_opt), uninterrupted) == []


def test_each_tensor_of_tensor_betas_keeps_its_object(tmp_path, sim):
    """As a tensor lr (above): torch's load_state_dict made each tensor of a group's tensor betas a new object;
    the live ones take the loaded values and their places back."""

    def adam(model: torch.nn.Module, beta1: float) -> torch.optim.Optimizer:
        betas = (torch.tensor(beta1, device=sim), torch.tensor(0.999, device=sim))
        return torch.optim.Adam(model.parameters(), lr=0.01, betas=betas, capturable=True, foreach=True)

    model = build_model().to(sim)
    opt = adam(model, 0.8)
    local_step(model, opt, 0, sim)
    save(tmp_path / "ck", model, opt)
    live = build_model().to(sim)
    live_opt = adam(live, 0.5)
    betas = live_opt.param_groups[0]["betas"]
    load(tmp_path / "ck", live, live_opt)
    loaded = live_opt.param_groups[0]["betas"]
    assert all(b is old for b, old in zip(loaded, betas))
    assert bitwise_equal(loaded[0].cpu(), torch.tensor(0.8)) and optimshift.check(live_opt).ok


def test_live_betas_holding_one_tensor_twice_load_each_value(tmp_path, sim):
    """Live betas holding one tensor twice: it took each loaded value in turn, beta1 left holding beta2's. Now each
    place keeps its own loaded value, as torch loads them."""
    model = build_model().to(sim)
    opt = torch.optim.Adam(model.parameters(), betas=(torch.tensor(0.8), torch.tensor(0.7)), capturable=True)
    local_step(model, opt, 0, sim)
    save(tmp_path / "ck", model, opt)
    live = build_model().to(sim)
    beta = torch.tensor(0.5, device=sim)
    live_opt = torch.optim.Adam(live.parameters(), betas=(beta, beta), capturable=True)
    load(tmp_path / "ck", live, live_opt)
    loaded = live_opt.param_groups[0]["betas"]
    assert [float(b.cpu()) for b in loaded] == [float(b) for b in opt.param_groups[0]["betas"]]
    assert float(beta.cpu()) == 0.5 and optimshift.check(live_opt).ok


@pytest.mark.parametrize("shared", ["lr of two groups", "betas list"])
def test_a_live_group_tensor_in_two_places_loads_each_saved_value(tmp_path, sim, shared):
    """One live tensor in two places (two groups' lr, betas [t, t]) where the checkpoint holds two values: DCP read
    each into it in turn, and every place kept the last. Each place now loads its own value; where the values are
    one, the live tensor keeps its places."""

    def adamw(model: torch.nn.Module, a: Any, b: Any) -> torch.optim.Optimizer:
        weights, biases = list(model.parameters())[::2], list(model.parameters())[1::2]
        if shared == "lr of two groups":
            groups = [{"params": weights, "lr": a}, {"params": biases, "lr": b}]
            return torch.optim.AdamW(groups, capturable=True, foreach=True)
        opt = torch.optim.AdamW(model.parameters(), lr=0.01, capturable=True, foreach=True)
        opt.param_groups[0]["betas"] = [a, b]
        return opt

    def places(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
        groups = opt.param_groups
        return [g["lr"] for g in groups] if shared == "lr of two groups" else list(groups[0]["betas"])

    def values(*vs: float) -> list[torch.Tensor]:
        return [torch.tensor(v, device=sim) for v in vs]

    model = build_model().to(sim)
    opt = adamw(model, *values(0.8, 0.7))
    local_step(model, opt, 0, sim)
    save(tmp_path / "ck", model, opt)
    local_step(model, opt, 1, sim)
    uninterrupted = full_state(model, opt)

    live = build_model().to(sim)
    t = torch.tensor(0.5, device=sim)
    live_opt = adamw(live, t, t)
    load(tmp_path / "ck", live, live_opt)
    assert all(bitwise_equal(b.cpu(), torch.tensor(v)) for b, v in zip(places(live_opt), (0.8, 0.7), strict=True))
    assert optimshift.check(live_opt).ok
    local_step(live, live_opt, 1, sim)
    assert state_differences(full_state(live, live_opt), uninterrupted) == []

    same = build_model().to(sim)
    one = torch.tensor(0.9, device=sim)
    same_opt = adamw(same, one, one)
    local_step(same, same_opt, 0, sim)
    save(tmp_path / "one", same, same_opt)
    t = torch.tensor(0.5, device=sim)
    live_opt = adamw(live, t, t)
    load(tmp_path / "one", live, live_opt)
    assert all(b is t for b in places(live_opt)) and torch.equal(t.cpu(), torch.tensor(0.9))


@pytest.mark.parametrize("saved, live", [(tuple, list), (list, tuple)], ids=["tuple into list", "list into tuple"])
def test_tensor_betas_saved_as_a_tuple_load_into_a_list_and_back(tmp_path, sim, saved, live):
    """Tensor betas saved as a tuple (DCP stores it whole) loaded where the live betas are a list (DCP reads it
    element by element), or the other way round: DCP refused it part-way, a RuntimeError saying the model "may now
    be partly loaded". The saved values are loaded, in the saved kind, as torch's load_state_dict installs them."""

    def adam(model: torch.nn.Module, kind: type, *vs: float) -> torch.optim.Optimizer:
        opt = torch.optim.Adam(model.parameters(), lr=0.01, capturable=True, foreach=True)
        opt.param_groups[0]["betas"] = kind(torch.tensor(v, device=sim) for v in vs)
        return opt

    model = build_model().to(sim)
    opt = adam(model, saved, 0.8, 0.7)
    local_step(model, opt, 0, sim)
    save(tmp_path / "ck", model, opt)
    local_step(model, opt, 1, sim)
    uninterrupted = full_state(model, opt)

    live_model = build_model().to(sim)
    live_opt = adam(live_model, live, 0.5, 0.5)
    load(tmp_path / "ck", live_model, live_opt)
    betas = live_opt.param_groups[0]["betas"]
    assert type(betas) is saved and all(bitwise_equal(b.cpu(), torch.tensor(v)) for b, v in zip(betas, (0.8, 0.7)))
    assert optimshift.check(live_opt).ok
    local_step(live_model, live_opt, 1, sim)
    assert state_differences(full_state(live_model, live_opt), uninterrupted) == []


@pytest.mark.parametrize(
    "saved, live",
    [(a, b) for a in ("tf", "ft", "tt") for b in ("tf", "ft", "tt") if a != b],
    ids=lambda kinds: "[" + ", ".join(kinds) + "]",
)
def test_betas_saved_as_a_list_load_into_a_list_holding_tensors_elsewhere(tmp_path, sim, saved, live):
    """Betas saved as a list holding a tensor (DCP stores it element by element) loaded where the live list, holding
    a tensor too, holds a float where a tensor was saved: DCP refused it part-way, a RuntimeError saying the model
    "may now be partly loaded". Each element is read into one of its saved kind, as torch's load_state_dict installs
    the saved list."""

    def adam(model: torch.nn.Module, kinds: str, *vs: float) -> torch.optim.Optimizer:
        opt = torch.optim.Adam(model.parameters(), lr=0.01, capturable=True, foreach=False)
        opt.param_groups[0]["betas"] = [torch.tensor(v, device=sim) if k == "t" else v for k, v in zip(kinds, vs)]
        return opt

    model = build_model().to(sim)
    opt = adam(model, saved, 0.8, 0.7)
    local_step(model, opt, 0, sim)
    save(tmp_path / "ck", model, opt)
    local_step(model, opt, 1, sim)
    uninterrupted = full_state(model, opt)

    live_model = build_model().to(sim)
    live_opt = adam(live_model, live, 0.5, 0.4)
    load(tmp_path / "ck", live_model, live_opt)
    betas = live_opt.param_groups[0]["betas"]
    assert [isinstance(b, torch.Tensor) for b in betas] == [k == "t" for k in saved]
    assert all(bitwise_equal(torch.as_tensor(b).cpu(), torch.tensor(v)) for b, v in zip(betas, (0.8, 0.7)))
    local_step(live_model, live_opt, 1, sim)
    assert state_differences(full_state(live_model, live_opt), uninterrupted) == []


def test_float64_betas_saved_as_a_list_load_bitwise_into_a_float32_list(tmp_path, sim):
    """A live list of tensors was read as it was: DCP cast the saved float64 betas into the live float32 ones (0.8
    became 0.800000011920929). Each is read into one of its saved dtype, installed as torch's load installs it."""

    def adam(model: torch.nn.Module, dtype: torch.dtype, *vs: float) -> torch.optim.Optimizer:
        opt = torch.optim.Adam(model.parameters(), lr=0.01, capturable=True, foreach=False)
        opt.param_groups[0]["betas"] = [torch.tensor(v, dtype=dtype, device=sim) for v in vs]
        return opt

    model = build_model().to(sim)
    opt = adam(model, torch.float64, 0.8, 0.7)
    local_step(model, opt, 0, sim)
    save(tmp_path / "ck", model, opt)
    live_model = build_model().to(sim)
    live_opt = adam(live_model, torch.float32, 0.5, 0.4)
    load(tmp_path / "ck", live_model, live_opt)
    betas = live_opt.param_groups[0]["betas"]
    assert all(bitwise_equal(b.cpu(), torch.tensor(v, dtype=torch.float64)) for b, v in zip(betas, (0.8, 0.7)))


@pytest.mark.parametrize("live_lr", ["float", "one-element", "float64"])
def test_a_saved_tensor_lr_loads_where_the_live_lr_is_another_kind(tmp_path, sim, live_lr):
    """A checkpoint's tensor lr, loaded where the live lr is a float or a tensor of another shape or dtype: DCP
    refused it part-way (its read plan expects the live kind), a RuntimeError saying the model "may now be partly
    loaded"; or read it into the live float64 tensor, cast. The saved tensor is installed, as torch's
    load_state_dict installs the saved groups, on the side the live one was given on."""
    model = build_model().to(sim)
    opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(0.01, device=sim), fused=True)
    local_step(model, opt, 0, sim)
    save(tmp_path / "ck", model, opt)
    local_step(model, opt, 1, sim)
    uninterrupted = full_state(model, opt)

    given = {
        "float": 0.5,
        "one-element": torch.tensor([0.5], device=sim),
        "float64": torch.tensor(0.5, dtype=torch.float64, device=sim),
    }[live_lr]
    live = build_model().to(sim)
    live_opt = torch.optim.AdamW(live.parameters(), lr=given, fused=True)
    load(tmp_path / "ck", live, live_opt)
    lr = live_opt.param_groups[0]["lr"]
    assert bitwise_equal(lr.cpu(), torch.tensor(0.01))
    assert lr.device == (given.device if isinstance(given, torch.Tensor) else torch.device("cpu"))
    assert optimshift.check(live_opt).ok
    local_step(live, live_opt, 1, sim)
    assert state_differences(full_state(live, live_opt), uninterrupted) == []


@pytest.mark.parametrize("given", ["host float64 lr", "float lr, device=cpu"])
def test_a_saved_tensor_lr_read_into_a_placeholder_leaves_the_state_where_asked(tmp_path, sim, given):
    """The placeholder for a saved tensor lr took the name of the load's target device: a host lr of another dtype
    moved all the state of sim params to the host, a float lr with device="cpu" left it on the device."""
    model = build_model().to(sim)
    opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(0.01, device=sim), fused=True)
    local_step(model, opt, 0, sim)
    save(tmp_path / "ck", model, opt)
    lr, device, expected = {
        "host float64 lr": (torch.tensor(0.5, dtype=torch.float64), None, sim),
        "float lr, device=cpu": (0.5, "cpu", torch.device("cpu")),
    }[given]
    live = build_model().to(sim)
    live_opt = torch.optim.AdamW(live.parameters(), lr=lr, fused=True)
    load(tmp_path / "ck", live, live_opt, device=device)
    assert {v.device for s in live_opt.state.values() for v in s.values()} == {expected}


# --- never stepped, extra, describe -----------------------------------------------------------------------


def test_a_never_stepped_optimizer_round_trips_without_state(tmp_path):
    model = build_model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.25)
    save(tmp_path / "fresh", model, opt)
    assert len(opt.state) == 0  # DCP's initialization step is not left behind
    assert not any(e["path"][:2] == ["optim", "state"] for e in describe_dcp(tmp_path / "fresh")["entries"])

    trained = build_model()
    trained_opt = torch.optim.AdamW(trained.parameters(), lr=1e-3)
    local_step(trained, trained_opt, 0)
    load(tmp_path / "fresh", trained, trained_opt)
    assert len(trained_opt.state) == 0 and trained_opt.param_groups[0]["lr"] == 0.25
    local_step(model, opt, 1)
    local_step(trained, trained_opt, 1)
    assert state_differences(full_state(trained, trained_opt), full_state(model, opt)) == []


@pytest.mark.parametrize("lr", [0.25, torch.tensor(0.25)], ids=["float", "tensor"])
def test_a_never_stepped_optimizer_whose_step_dcp_cannot_run_keeps_its_lr(tmp_path, lr):
    """DCP builds a never-stepped optimizer's state by a step with every lr set to zero; LBFGS's needs a closure,
    so that step raises: the save fails (as DCP's own does), and the lr is the optimizer's own again, the same
    object (it was left at zero). No step hook of the optimizer fires (its own ones did; the global ones were
    quiet already)."""
    model = build_model()
    opt = torch.optim.LBFGS(model.parameters(), lr=lr)
    fired = []
    opt.register_step_pre_hook(lambda *a: fired.append("pre"))
    opt.register_step_post_hook(lambda *a: fired.append("post"))
    with pytest.raises(TypeError) as caught:
        save(tmp_path / "lbfgs", model, opt)
    assert "LBFGS never stepped" in "".join(caught.value.__notes__)
    assert opt.param_groups[0]["lr"] is lr and fired == [] and len(opt.state) == 0
    assert all(p.grad is None for p in model.parameters())
    opt.step(lambda: sum((p * p).sum() for p in model.parameters()))
    assert fired == ["pre", "post"]  # (its hooks are back)


def test_dcp_initializing_step_still_meets_optimshifts_own_hooks(tmp_path, sim):
    """The user's step hooks are quiet during DCP's initializing step, optimshift's are not: a never-stepped
    optimizer whose grads are offloaded refuses that step, and the grads come back (a first version silenced
    every hook of the optimizer: the step ran, DCP's zero_grad dropped the offloaded grads; found by review)."""
    model = torch.nn.Linear(3, 2).to(sim)
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 3, device=sim)).sum().backward()
    grads = [p.grad.cpu() for p in model.parameters()]
    optimshift.offload(opt, include=("grads",))
    with pytest.raises(RuntimeError, match="offloaded"):
        save(tmp_path / "ck", model, opt)
    optimshift.reload(opt)
    assert all(torch.equal(p.grad.cpu(), g) for p, g in zip(model.parameters(), grads))


def test_describe_dcp_reads_metadata_without_a_process_group(job_train, dist_dir):
    job_train.value(0)
    assert not dist.is_initialized()
    info = describe_dcp(dist_dir / "ck2")
    assert json.loads(json.dumps(info)) == info
    entries = {e["key"]: e for e in info["entries"]}
    w = entries["model.0.weight"]
    assert (w["kind"], w["shape"], w["dtype"], w["bytes"], w["chunks"]) == (
        "tensor",
        [HIDDEN, IN],
        "float32",
        HIDDEN * IN * 4,
        WORLD,
    )
    assert entries["model.2.weight"]["shape"] == [OUT, HIDDEN]
    step = entries["optim.state.0.weight.step"]
    assert (step["shape"], step["bytes"], step["path"]) == ([], 4, ["optim", "state", "0.weight", "step"])
    assert entries["optim.param_groups.0.lr"]["kind"] == "object"
    assert entries["optimshift_extra"]["kind"] == "object"
    params = HIDDEN * IN + HIDDEN + OUT * HIDDEN + OUT
    assert info["sections"]["model"] == {"tensors": 4, "objects": 0, "bytes": params * 4}
    assert info["sections"]["optim"]["tensors"] == 12  # step, exp_avg, exp_avg_sq for 4 params
    assert info["tensor_bytes"] == sum(e.get("bytes", 0) for e in info["entries"])
    assert info["tensors"] + info["objects"] == len(info["entries"])
    assert info["files"] == WORLD + 2  # a shard file per rank, .metadata, optimshift.json
    assert info["optimshift"]["world_size"] == WORLD and info["optimshift"]["optimizer"] == "AdamW"
    assert info["optimshift"]["extra"] == ["note", "step"]


def test_describe_dcp_rejects_what_is_not_a_checkpoint(tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        describe_dcp(tmp_path / "missing")
    with pytest.raises(ValueError, match="no .metadata"):
        describe_dcp(tmp_path)
    with pytest.raises(TypeError, match="str or os.PathLike"):
        describe_dcp(3)  # type: ignore[arg-type]


# --- failures -----------------------------------------------------------------------------------------------


def test_mismatched_model_or_optimizer_fails_on_every_rank_without_hanging(job_load):
    assert job_load.seconds < JOB_TIMEOUT_S
    for rank in range(WORLD):
        res = job_load.value(rank)
        model_error = res["model_mismatch"]
        assert model_error.startswith("ValueError: checkpoint ")
        assert f"model.0.weight: shape ({HIDDEN}, {IN}) in the checkpoint, ({HIDDEN + 2}, {IN}) here" in model_error
        assert "(on ranks 0, 1 of 2)" in model_error
        assert res["model_mismatch_unchanged"] and res["model_mismatch_state"] == 0
        optimizer_error = res["optimizer_mismatch"]
        assert optimizer_error.startswith("ValueError: checkpoint ")
        assert (
            "param group 0: the checkpoint lacks ['dampening', 'momentum'], which SGD uses, and "  # (nesterov:
            "has ['amsgrad', 'betas'" in optimizer_error  # __setstate__ fills it, as torch's load does)
        )
        assert res["optimizer_mismatch_state"] == 0  # the SGD was not initialized by the attempt


def test_an_error_on_one_rank_is_raised_on_every_rank(job_load):
    for rank in range(WORLD):
        res = job_load.value(rank)
        load_error, save_error = res["one_rank_load"], res["one_rank_save"]
        assert load_error.startswith("ValueError: ") and "'nonsense' is not a device PyTorch knows" in load_error
        assert save_error.startswith("TypeError: ") and "extra must be a mapping" in save_error
        if rank == 0:  # the rank whose input was fine learns why the others failed
            assert "failed on another rank" in load_error and "(on rank 1 of 2)" in load_error
            assert "failed on another rank" in save_error
        assert not res["ck_never_exists"]
        # (a StopIteration: "RuntimeError: generator raised StopIteration" on every rank, naming neither)
        stop_error = res["one_rank_stop"]
        assert stop_error.startswith("StopIteration: ") and "exhausted on rank 1 (on rank 1 of 2)" in stop_error
        assert rank == 1 or res["ck_stop_left"] == []  # (rank 0 removes its temporary directory, then returns)
        read_error = res["one_rank_read"]
        assert read_error.startswith("RuntimeError: ") and "EIO on rank 1" in read_error, read_error


def test_a_rank_killed_during_save_leaves_the_previous_checkpoint(job_kill, dist_dir):
    assert job_kill.exitcodes[1] == -signal.SIGKILL and job_kill.results[1] is None
    res0 = job_kill.value(0)
    assert res0["error"] != "no error"  # rank 0 saw its peer die instead of waiting forever
    target = dist_dir / "ck_kill"
    model = build_model()
    opt = build_optimizer(model)
    assert load(target, model, opt) == {"version": 1}
    assert state_differences(full_state(model, opt), res0["saved"]) == []
    assert describe_dcp(target)["optimshift"]["world_size"] == WORLD
    save(target, model, opt, extra={"version": 3})  # the next save clears whatever the dead one left
    assert sorted(p.name for p in dist_dir.glob("ck_kill*")) == ["ck_kill"]
    model = build_model()
    assert load(target, model, build_optimizer(model)) == {"version": 3}


def _trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = build_model()
    opt = build_optimizer(model)
    local_step(model, opt, 0)
    return model, opt


class _BytesPath:
    """An os.PathLike whose ``__fspath__`` gives bytes (as ``os.DirEntry`` from a bytes scan does)."""

    def __init__(self, path: bytes) -> None:
        self.path = path

    def __fspath__(self) -> bytes:
        return self.path


def test_save_load_and_describe_dcp_take_a_bytes_path_as_checkpoint_files_do(tmp_path):
    """A bytes path, or an os.PathLike giving bytes, is taken as ``optimshift.save``/``load`` take one (refused:
    "must be a str or os.PathLike, got bytes"); a path of another type is refused naming the call."""
    from optimshift.distributed._checkpoint import is_dcp_folder

    model, opt = _trained()
    folder = os.fsencode(tmp_path / "ck")
    save(folder, model, opt, extra={"step": 1})
    assert is_dcp_folder(folder) and is_dcp_folder(_BytesPath(folder))
    assert describe_dcp(_BytesPath(folder))["path"] == describe_dcp(tmp_path / "ck")["path"] == str(tmp_path / "ck")
    fresh = build_model()
    fresh_opt = build_optimizer(fresh)
    assert load(_BytesPath(folder), fresh, fresh_opt) == {"step": 1}
    assert _unchanged(_state_of(model, opt), fresh, fresh_opt)
    with pytest.raises(TypeError, match=r"^optimshift\.distributed\.load: path must be .* got an int$"):
        load(3, fresh, fresh_opt)  # type: ignore[arg-type]


def test_load_errors_are_clear_and_change_nothing(tmp_path, single_run, dist_dir):
    model, opt = _trained()
    before = _state_of(model, opt)
    ck = dist_dir / "ck1"
    not_a_checkpoint = tmp_path / "plain"
    not_a_checkpoint.mkdir()
    wide = build_model(hidden=HIDDEN + 1)
    cases = [
        (lambda: load(tmp_path / "missing", model, opt), FileNotFoundError, "no checkpoint at"),
        (lambda: load(not_a_checkpoint, model, opt), ValueError, "no .metadata"),
        (lambda: load(ck, model, opt, device="nonsense"), ValueError, "not a device PyTorch knows"),
        (lambda: load(ck, opt, opt), TypeError, "model must be a torch.nn.Module"),
        (lambda: load(ck, model, model), TypeError, "torch.optim.Optimizer"),  # type: ignore[arg-type]
        (lambda: load(ck, wide, opt), ValueError, "is not a parameter of the Sequential"),
        (lambda: load(None, model, opt), TypeError, "str or os.PathLike"),  # type: ignore[arg-type]
    ]
    for call, exc, match in cases:
        with pytest.raises(exc, match=match):
            call()
        assert _unchanged(before, model, opt)

    double = build_model(dtype=torch.float64)
    double_opt = build_optimizer(double)
    double(torch.ones(1, IN, dtype=torch.float64)).sum().backward()
    double_opt.step()
    double_before = _state_of(double, double_opt)
    with pytest.raises(ValueError, match=r"model.0.weight: dtype float32 in the checkpoint, float64 here"):
        load(ck, double, double_opt)
    assert _unchanged(double_before, double, double_opt)

    fresh = build_model()
    sgd = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(
        ValueError,
        match=r"saved from a Sequential with AdamW\) does not match this Sequential "
        r"with SGD",
    ):
        load(ck, fresh, sgd)
    assert len(sgd.state) == 0


def test_scheduler_keys_in_the_checkpoint_are_not_a_mismatch(tmp_path):
    model, opt = _trained()
    torch.optim.lr_scheduler.StepLR(opt, step_size=1)  # adds initial_lr to every param group
    save(tmp_path / "ck", model, opt)
    fresh = build_model()
    fresh_opt = build_optimizer(fresh)  # no scheduler yet
    load(tmp_path / "ck", fresh, fresh_opt)  # DCP reads the keys this optimizer has; initial_lr stays behind
    saved = full_state(model, opt)
    saved["groups"] = [{k: v for k, v in g.items() if k != "initial_lr"} for g in saved["groups"]]
    assert state_differences(full_state(fresh, fresh_opt), saved) == []


def test_state_keys_of_another_variant_are_a_mismatch(tmp_path):
    model = build_model()
    amsgrad = torch.optim.AdamW(model.parameters(), amsgrad=True)
    local_step(model, amsgrad, 0)
    save(tmp_path / "ck", model, amsgrad)
    plain_model = build_model()
    plain = torch.optim.AdamW(plain_model.parameters())
    before = _state_of(plain_model, plain)
    with pytest.raises(
        ValueError,
        match=r"optim.state.0.weight: keys \['exp_avg', 'exp_avg_sq', 'max_exp_avg_sq', "
        r"'step'\] in the checkpoint, \['exp_avg', 'exp_avg_sq', 'step'\]",
    ):
        load(tmp_path / "ck", plain_model, plain)
    assert _unchanged(before, plain_model, plain) and len(plain.state) == 0  # DCP's initialization undone


def test_load_into_an_optimizer_with_gradients_but_no_state_is_refused(dist_dir, single_run):
    model = build_model()
    opt = build_optimizer(model)
    ((model(torch.ones(1, IN))) ** 2).sum().backward()
    before = _state_of(model, opt)
    with pytest.raises(ValueError, match=r"zero_grad\(set_to_none=True\)"):
        load(dist_dir / "ck1", model, opt)
    assert _unchanged(before, model, opt) and len(opt.state) == 0


def test_save_errors_are_raised_before_anything_is_written(tmp_path):
    model, opt = _trained()
    before = _state_of(model, opt)
    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "notes.txt").write_text("mine")
    a_file = tmp_path / "file"
    a_file.write_text("x")
    link = tmp_path / "link"
    link.symlink_to(occupied)
    cases = [
        (lambda: save(occupied, model, opt), FileExistsError, "not a torch.distributed.checkpoint"),
        (lambda: save(a_file, model, opt), FileExistsError, "is a file"),
        (lambda: save(link, model, opt), ValueError, "is a symlink"),
        (lambda: save(tmp_path / "a", model, opt, extra=[1]), TypeError, "extra must be a mapping"),
        (lambda: save(tmp_path / "b", model, opt, extra={"f": object()}), TypeError, "weights_only"),
        (lambda: save(tmp_path / "c", opt, opt), TypeError, "model must be a torch.nn.Module"),
        (lambda: save(tmp_path / "d", build_model(), opt), ValueError, "is not a parameter of the Sequential"),
    ]
    for call, exc, match in cases:
        with pytest.raises(exc, match=match):
            call()
        assert _unchanged(before, model, opt)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "link", "occupied"]
    assert [p.name for p in occupied.iterdir()] == ["notes.txt"] and a_file.read_text() == "x"


# --- atomic commit ----------------------------------------------------------------------------------------


def test_save_replaces_a_checkpoint_and_clears_a_crashed_save(tmp_path):
    model, opt = _trained()
    target = tmp_path / "ck"
    save(target, model, opt, extra={"n": 1})
    stale = tmp_path / "ck.optimshift-tmp"  # what a save killed mid-write leaves
    stale.mkdir()
    (stale / "__0_0.distcp").write_bytes(b"partial")
    local_step(model, opt, 1)
    save(target, model, opt, extra={"n": 2})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]
    fresh_model = build_model()
    fresh_opt = build_optimizer(fresh_model)
    assert load(target, fresh_model, fresh_opt) == {"n": 2}
    assert state_differences(full_state(fresh_model, fresh_opt), full_state(model, opt)) == []


def test_commit_without_an_atomic_exchange(tmp_path, monkeypatch):
    """Where renameat2(RENAME_EXCHANGE) is unavailable the commit takes two renames; a crash between them
    leaves the previous checkpoint at <path>.optimshift-old, which load and describe_dcp then read."""
    from optimshift.checkpoint import _atomic

    monkeypatch.setattr(_atomic, "exchange", lambda a, b: False)
    model, opt = _trained()
    target = tmp_path / "ck"
    save(target, model, opt, extra={"n": 1})
    local_step(model, opt, 1)
    save(target, model, opt, extra={"n": 2})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]
    os.rename(target, tmp_path / "ck.optimshift-old")  # the state a crash between the two renames leaves
    assert describe_dcp(target)["path"].endswith("ck.optimshift-old")
    model = build_model()
    assert load(target, model, build_optimizer(model)) == {"n": 2}


# --- what the hunt of stop 43 found ------------------------------------------------------------------------


def test_a_scheduler_built_before_the_load_keeps_its_keys(tmp_path):
    """The common resume order: optimizer, LR scheduler, load, against a checkpoint saved without a scheduler.
    The scheduler's initial_lr, a key only the live groups have, made DCP fail part-way (its raw error, not an
    Exception) and left a fresh optimizer with DCP's zero-lr first step; it keeps its live value now."""
    model, opt = _trained()
    save(tmp_path / "ck", model, opt)
    fresh = build_model()
    fresh_opt = build_optimizer(fresh)
    torch.optim.lr_scheduler.LinearLR(fresh_opt)  # adds initial_lr to every param group
    initial = [g["initial_lr"] for g in fresh_opt.param_groups]
    load(tmp_path / "ck", fresh, fresh_opt)
    assert [g["initial_lr"] for g in fresh_opt.param_groups] == initial
    saved = full_state(model, opt)
    got = full_state(fresh, fresh_opt)
    got["groups"] = [{k: v for k, v in g.items() if k != "initial_lr"} for g in got["groups"]]
    assert state_differences(got, saved) == []


@pytest.mark.parametrize("damage", ["truncated", "missing"])
def test_a_checkpoint_cut_short_is_refused_before_anything_changes(tmp_path, damage):
    """A shard file missing or cut short: the load wrote part of the model, left a fresh optimizer with DCP's
    zero-lr first step, and raised DCP's raw error (a BaseException). Its metadata names every file and its bytes:
    refused first, nothing changed."""
    model, opt = _trained()
    save(tmp_path / "ck", model, opt)
    (shard_file,) = (tmp_path / "ck").glob("*.distcp")
    if damage == "truncated":
        os.truncate(shard_file, shard_file.stat().st_size // 2)
    else:
        shard_file.unlink()
    fresh = build_model()
    fresh_opt = build_optimizer(fresh)
    before = _state_of(fresh, fresh_opt)
    with pytest.raises(ValueError, match=rf"is incomplete: it lacks \['{shard_file.name}'\]"):
        load(tmp_path / "ck", fresh, fresh_opt)
    assert _unchanged(before, fresh, fresh_opt) and not fresh_opt.state


@pytest.mark.parametrize(
    ("raised", "expected", "match"),
    [(OSError("EIO"), RuntimeError, "partly loaded"), (KeyboardInterrupt(), KeyboardInterrupt, None)],
    ids=["read-error", "interrupt"],
)
def test_a_failure_while_loading_is_raised_as_itself_and_leaves_no_first_step(
    tmp_path, monkeypatch, raised, expected, match
):
    """DCP's CheckpointException is a BaseException: a user's `except Exception` missed a read error, and an
    optimizer that had no state kept DCP's zero-lr first step. DCP wraps a Ctrl-C during the read in it too: the
    load raised that as a RuntimeError (an I/O failure, "partly loaded"), so a training loop's ``except
    Exception`` went on after the user's Ctrl-C."""
    import torch.distributed.checkpoint as dcp

    model, opt = _trained()
    save(tmp_path / "ck", model, opt)
    fresh = build_model()
    fresh_opt = build_optimizer(fresh)
    read_data = dcp.FileSystemReader.read_data
    calls = [0]

    def failing_late(self, *args, **kwargs):
        calls[0] += 1
        if calls[0] == 2:  # (the first read is the checks' own: the second is the load itself)
            raise raised
        return read_data(self, *args, **kwargs)

    monkeypatch.setattr(dcp.FileSystemReader, "read_data", failing_late)
    with pytest.raises(expected, match=match):
        load(tmp_path / "ck", fresh, fresh_opt)
    assert not fresh_opt.state and all(p.grad is None for p in fresh.parameters())


def test_a_write_error_while_saving_is_an_exception_naming_the_path_and_commits_nothing(tmp_path, monkeypatch):
    """DCP reports a failed write (a full disk) as its CheckpointException, a BaseException naming no file: a
    user's `except Exception` around the save missed it."""
    import errno

    import torch.distributed.checkpoint as dcp

    model, opt = _trained()
    save(tmp_path / "ck", model, opt, extra={"n": 1})
    local_step(model, opt, 1)

    def full(self, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(dcp.FileSystemWriter, "write_data", full)
    with pytest.raises(RuntimeError, match=r"save\(.*ck'?\) failed while writing .*No space left on device"):
        save(tmp_path / "ck", model, opt, extra={"n": 2})
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]
    fresh = build_model()
    assert load(tmp_path / "ck", fresh, build_optimizer(fresh)) == {"n": 1}


def test_an_interrupt_while_saving_stays_an_interrupt(tmp_path, monkeypatch):
    """DCP wraps a Ctrl-C during the write in its CheckpointException: it is raised as the interrupt it was."""
    import torch.distributed.checkpoint as dcp

    model, opt = _trained()

    def interrupted(self, *args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(dcp.FileSystemWriter, "write_data", interrupted)
    with pytest.raises(KeyboardInterrupt):
        save(tmp_path / "ck", model, opt)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("where", ["_write_note", "commit_folder"])
def test_an_interrupt_while_committing_leaves_nothing_behind(tmp_path, monkeypatch, where):
    """A Ctrl-C once the shards were written (the note, the completeness check, the commit) left this save's
    temporary folder beside the checkpoint: only the errors those raise removed it."""
    from optimshift.distributed import _checkpoint

    model, opt = _trained()
    save(tmp_path / "ck", model, opt, extra={"n": 1})

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(_checkpoint, where, interrupted)
    with pytest.raises(KeyboardInterrupt):
        save(tmp_path / "ck", model, opt, extra={"n": 2})
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]
    fresh = build_model()
    assert load(tmp_path / "ck", fresh, build_optimizer(fresh)) == {"n": 1}


def test_a_streamed_optimizer_loads(tmp_path, sim):
    """The load's last move, which places the state as a fresh optimizer keeps it, refused a streamed optimizer:
    every load into one failed, after it had loaded ("partly loaded"), and its extra was lost."""
    model, opt = _trained()
    save(tmp_path / "ck", model, opt, extra={"epoch": 3})
    fresh = build_model().to(sim)
    fresh_opt = build_optimizer(fresh)
    local_step(fresh, fresh_opt, 5, device=sim)
    optimshift.stream(fresh_opt)
    assert load(tmp_path / "ck", fresh, fresh_opt) == {"epoch": 3}
    assert optimshift.is_streamed(fresh_opt)
    optimshift.unstream(fresh_opt)
    assert state_differences(full_state(fresh.cpu(), fresh_opt), full_state(model, opt)) == []


def test_a_streamed_optimizer_refuses_a_device_before_anything_changes(tmp_path, sim):
    """``device=`` an accelerator, where a streamed optimizer keeps its state in host memory: the load went on and
    left it there, ``device`` silently ignored (``optimshift.load_state_dict`` refuses it)."""
    model, opt = _trained()
    save(tmp_path / "ck", model, opt)
    fresh = build_model().to(sim)
    fresh_opt = build_optimizer(fresh)
    local_step(fresh, fresh_opt, 5, device=sim)
    optimshift.stream(fresh_opt)
    before = _state_of(fresh, fresh_opt)
    with pytest.raises(ValueError, match=r"AdamW: it is streamed .* device=sim:0 would put it elsewhere"):
        load(tmp_path / "ck", fresh, fresh_opt, device=sim)
    assert _unchanged(before, fresh, fresh_opt) and optimshift.is_streamed(fresh_opt)


def _interrupt_after_the_state_dicts(monkeypatch):
    """A Ctrl-C right after DCP built the state dicts (its zero-lr first step of a stateless optimizer made)."""
    from optimshift.distributed import _checkpoint

    real = _checkpoint.get_state_dict

    def interrupted(*args, **kwargs):
        real(*args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(_checkpoint, "get_state_dict", interrupted)


def _appears_after_the_check(monkeypatch, target, make):
    """``make()`` runs once, right after the commit found nothing at ``target`` (another process's commit, or a
    user's folder, in that window). Returns whether it ran."""
    from optimshift.checkpoint import _atomic

    real = os.path.lexists
    ran = [False]

    def lexists_then_it_appears(path):
        found = real(path)
        if not found and os.fspath(path) == os.fspath(target) and not ran[0]:
            ran[0] = True
            make()
        return found

    monkeypatch.setattr(_atomic.os.path, "lexists", lexists_then_it_appears)
    return ran


def test_an_interrupted_load_leaves_no_first_step(tmp_path, monkeypatch):
    """A Ctrl-C while the load builds its state dicts left a never-stepped optimizer with DCP's zero-lr first step
    (step 1, zero moments: the next step's bias correction silently off)."""
    model, opt = _trained()
    save(tmp_path / "ck", model, opt)
    fresh = build_model()
    fresh_opt = build_optimizer(fresh)
    _interrupt_after_the_state_dicts(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        load(tmp_path / "ck", fresh, fresh_opt)
    assert not fresh_opt.state


def test_an_interrupted_save_leaves_nothing_behind(tmp_path, monkeypatch):
    """A Ctrl-C while the state dicts were built left this save's locked temporary folder (no later save in the
    process could sweep it) and a never-stepped optimizer with DCP's zero-lr first step."""
    model = build_model()
    opt = build_optimizer(model)
    _interrupt_after_the_state_dicts(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        save(tmp_path / "ck", model, opt)
    assert list(tmp_path.iterdir()) == [] and not opt.state


def test_save_to_a_mount_point_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    """A volume mounted at the path: the save wrote everything beside it, then its rename failed (EBUSY)."""
    model, opt = _trained()
    target = tmp_path / "volume"
    target.mkdir()
    real = os.path.ismount
    monkeypatch.setattr(os.path, "ismount", lambda p: os.fspath(p) == os.fspath(target) or real(p))
    with pytest.raises(ValueError, match="is a mount point"):
        save(target, model, opt)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["volume"] and not any(target.iterdir())


@pytest.mark.parametrize("spelling", [".", "sub/..", "{cwd}", "{link}/run"])
def test_save_to_the_current_folder_is_refused_before_anything_is_written(tmp_path, monkeypatch, spelling):
    """``save(".")`` wrote every shard, then its rename of '.' failed (EBUSY, naming only '.'); the current folder by
    its full path was replaced, which left the process in a deleted folder (``os.getcwd()`` raised)."""
    model, opt = _trained()
    here = tmp_path / "real" / "run"
    here.mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "real")  # (getcwd names the real folder: macOS's /tmp is a link)
    monkeypatch.chdir(here)
    with pytest.raises(ValueError, match="is the current folder or holds it"):
        save(spelling.format(cwd=here, link=tmp_path / "link"), model, opt)
    assert os.getcwd() == str(here) and list(here.iterdir()) == [] and list(here.parent.iterdir()) == [here]


def test_save_into_an_empty_folder(tmp_path):
    """A folder made for the checkpoint beforehand (os.makedirs(path, exist_ok=True)) was refused as 'not a
    checkpoint'; an empty one holds nothing to lose."""
    model, opt = _trained()
    target = tmp_path / "step_100"
    target.mkdir()
    save(target, model, opt)
    fresh = build_model()
    fresh_opt = build_optimizer(fresh)
    load(target, fresh, fresh_opt)
    assert state_differences(full_state(fresh, fresh_opt), full_state(model, opt)) == []


def test_two_first_commits_to_one_path_the_last_wins(tmp_path, monkeypatch):
    """Two saves committing to a path that did not exist: the one that renamed second met the other's folder
    there (ENOTEMPTY) and failed."""
    model, opt = _trained()
    save(tmp_path / "other", model, opt, extra={"n": 1})
    raced = _appears_after_the_check(
        monkeypatch, tmp_path / "ck", lambda: os.rename(tmp_path / "other", tmp_path / "ck")
    )
    local_step(model, opt, 1)
    save(tmp_path / "ck", model, opt, extra={"n": 2})
    monkeypatch.undo()
    assert raced[0] and sorted(p.name for p in tmp_path.iterdir()) == ["ck"]
    fresh = build_model()
    assert load(tmp_path / "ck", fresh, build_optimizer(fresh)) == {"n": 2}


def test_a_checkpoint_without_a_flag_newer_torch_adds_loads(tmp_path):
    """A checkpoint whose groups lack a key a newer torch added (AdamW's decoupled_weight_decay), which torch's
    own load fills: refused as "saved from another optimizer class?". The key keeps its live value."""
    model = build_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    local_step(model, opt, 0)
    for group in opt.param_groups:
        del group["decoupled_weight_decay"]
    save(tmp_path / "ck", model, opt)
    fresh = build_model()
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    load(tmp_path / "ck", fresh, fresh_opt)
    assert all(g["decoupled_weight_decay"] is True for g in fresh_opt.param_groups)
    assert [bitwise_equal(a, b) for a, b in zip(fresh.parameters(), model.parameters())] == [True] * 4


def test_a_folder_of_something_else_that_appears_meanwhile_is_not_replaced(tmp_path, monkeypatch):
    """The commit to a path that did not exist met a folder there (the race above): it replaced it whatever it
    was. A folder that is no checkpoint (a user's) is left as it is, and the save fails, leaving nothing."""
    model, opt = _trained()

    def a_users_folder():
        (tmp_path / "ck").mkdir()
        (tmp_path / "ck" / "notes.txt").write_text("mine")

    raced = _appears_after_the_check(monkeypatch, tmp_path / "ck", a_users_folder)
    with pytest.raises(FileExistsError, match="appeared while this folder was written"):
        save(tmp_path / "ck", model, opt)
    monkeypatch.undo()
    assert raced[0] and sorted(p.name for p in tmp_path.iterdir()) == ["ck"]
    assert (tmp_path / "ck" / "notes.txt").read_text() == "mine"
