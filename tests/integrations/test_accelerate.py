"""optimshift.integrations.accelerate against the real Accelerate: ``prepare`` of an optimizer that has state,
``save_state``/``load_state`` with both ``map_location`` values, on the host and on the simulated accelerator
(``ACCELERATE_TORCH_DEVICE`` selects it, as it would select any device).

Placements are compared with a fresh optimizer of the same class and flags over params placed like the live
ones, after one step. Each Accelerate bug gets a test that shows it unpatched and fixed patched.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from _integrations_support import (
    bitwise_same,
    count_step_syncs,
    devices,
    fresh_layout,
    layout,
    snapshot,
    step_with_grads,
)

pytest.importorskip("accelerate")
from accelerate import Accelerator  # noqa: E402

import optimshift  # noqa: E402
import optimshift.integrations.accelerate as osa  # noqa: E402
from optimshift.testing import deferred_streams  # noqa: E402
from optimshift.testing.accelerate import on_device  # noqa: E402

O = torch.optim
CONFIGS = {
    "Adam": ("Adam", {"foreach": False}),
    "Adam-fused": ("Adam", {"fused": True}),
    "AdamW-foreach-amsgrad": ("AdamW", {"foreach": True, "amsgrad": True}),
    "NAdam": ("NAdam", {}),
    "Adagrad-fused": ("Adagrad", {"fused": True}),
    "ASGD": ("ASGD", {}),
    "SGD-momentum": ("SGD", {"momentum": 0.9}),
    "Adam-capturable": ("Adam", {"capturable": True}),  # capturable cannot step on a CPU: device only
}
HOST_CONFIGS = [c for c in CONFIGS if "capturable" not in c]


@pytest.fixture
def accelerator_on():
    """``accelerator_on(device)``: a fresh ``Accelerator`` whose device is ``device`` (optimshift.testing's recipe)."""
    with contextlib.ExitStack() as blocks:

        def make(device: torch.device) -> Accelerator:
            blocks.enter_context(on_device(device))
            accelerator = Accelerator()
            assert accelerator.device == device
            return accelerator

        yield make


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))


def _make(config: str):
    name, kwargs = CONFIGS[config]
    return lambda params: getattr(O, name)(params, **kwargs)


def _trained_on_host(config: str, steps: int = 2):
    model = _model()
    opt = _make(config)(model.parameters())
    for seed in range(steps):
        step_with_grads(list(model.parameters()), opt, seed)
    return model, opt


def _fresh_syncs(make, params) -> int:
    twins = [torch.nn.Parameter(torch.zeros(p.shape, device=p.device)) for p in params]
    fresh = make(twins)
    step_with_grads(twins, fresh, seed=0)
    return count_step_syncs(twins, fresh, seed=7)


@pytest.mark.parametrize("config", HOST_CONFIGS)
def test_prepare_places_existing_state(sim, accelerator_on, accelerate_patch, config):
    accelerate_patch(True)
    model, opt = _trained_on_host(config)
    before = snapshot(opt)
    model, prepared = accelerator_on(sim).prepare(model, opt)
    params = list(model.parameters())
    assert layout(opt) == fresh_layout(_make(config), params)
    assert bitwise_same(snapshot(opt), before), "prepare must not change a value"
    assert count_step_syncs(params, prepared, seed=7) == _fresh_syncs(_make(config), params)


def test_prepare_unpatched_puts_step_on_device(sim, accelerator_on, accelerate_patch):
    """Accelerate's bug: ``move_to_device`` over the whole state dict puts Adam's ``step`` on the device,
    where Adam reads it on the host: at least one sync per param per step, none when placed correctly."""
    counts = {}
    for patched in (False, True):
        accelerate_patch(patched)
        model, opt = _trained_on_host("Adam")
        model, prepared = accelerator_on(sim).prepare(model, opt)
        steps = {row[2] for row in layout(opt) if row[1] == "step"}
        assert steps == ({"cpu"} if patched else {str(sim)})
        counts[patched] = count_step_syncs(list(model.parameters()), prepared, seed=7)
    assert counts[True] == 0
    assert counts[False] >= len(list(model.parameters()))


@pytest.mark.parametrize("config", ["Adam", "Adam-fused"])
def test_prepare_params_on_two_devices(sim, accelerator_on, accelerate_patch, config):
    """A model placed by hand over sim:0 and sim:1 (``device_placement=False`` for it): each param's state
    follows that param; unpatched, every ``step`` goes to the accelerator's one device."""
    d0, d1 = torch.device(sim.type, 0), torch.device(sim.type, 1)
    results = {}
    for patched in (False, True):
        accelerate_patch(patched)
        model, opt = _trained_on_host(config)
        model[0].to(d0)
        model[1].to(d1)
        model, prepared = accelerator_on(d0).prepare(model, opt, device_placement=[False, True])
        results[patched] = layout(opt)
    params = list(model.parameters())
    reference = fresh_layout(_make(config), params)
    assert {row[2] for row in reference} >= {"sim:0", "sim:1"}
    assert results[True] == reference
    if config == "Adam":
        assert results[False] != reference
    assert count_step_syncs(params, prepared, seed=7) == _fresh_syncs(_make(config), params)


def _save_on(accelerator_on, device, config, directory, steps=2):
    accelerator = accelerator_on(device)
    model = _model()
    model, opt = accelerator.prepare(model, _make(config)(model.parameters()))
    for seed in range(steps):
        step_with_grads(list(model.parameters()), opt, seed)
    accelerator.save_state(str(directory), safe_serialization=False)
    return snapshot(opt.optimizer)


def _load_on(accelerator_on, device, config, directory, map_location):
    accelerator = accelerator_on(device)
    model = _model()
    model, opt = accelerator.prepare(model, _make(config)(model.parameters()))
    accelerator.load_state(str(directory), map_location=map_location)
    return model, opt


@pytest.mark.parametrize("map_location", ["cpu", "on_device"])
@pytest.mark.parametrize("config", ["Adam", "Adam-fused", "NAdam", "Adagrad-fused", "ASGD"])
def test_load_host_state_on_device(sim, tmp_path, accelerator_on, accelerate_patch, config, map_location):
    """The seed's scenario through Accelerate: ``save_state`` on the host, ``load_state`` on the accelerator."""
    accelerate_patch(True)
    saved = _save_on(accelerator_on, torch.device("cpu"), config, tmp_path)
    model, opt = _load_on(accelerator_on, sim, config, tmp_path, map_location)
    params = list(model.parameters())
    assert any(row[2] == str(sim) for row in layout(opt.optimizer))
    assert layout(opt.optimizer) == fresh_layout(_make(config), params)
    assert bitwise_same(snapshot(opt.optimizer), saved)
    assert count_step_syncs(params, opt, seed=7) == _fresh_syncs(_make(config), params)


@pytest.mark.parametrize("map_location", ["cpu", "on_device"])
@pytest.mark.parametrize("config", ["Adam", "Adam-capturable", "NAdam"])
def test_save_and_load_state_on_device(sim, tmp_path, accelerator_on, accelerate_patch, config, map_location):
    """State trained, saved and loaded on the accelerator (capturable included)."""
    accelerate_patch(True)
    saved = _save_on(accelerator_on, sim, config, tmp_path)
    model, opt = _load_on(accelerator_on, sim, config, tmp_path, map_location)
    params = list(model.parameters())
    assert layout(opt.optimizer) == fresh_layout(_make(config), params)
    assert bitwise_same(snapshot(opt.optimizer), saved)


@pytest.mark.parametrize("map_location", ["cpu", "on_device"])
def test_load_state_keeps_a_device_lr_the_object_it_is(sim, tmp_path, accelerator_on, accelerate_patch, map_location):
    """Capturable Adam given its lr on the device (a captured step reads it at its address): ``load_state`` writes
    the saved lr into that tensor, which stays on the device; with ``map_location="cpu"`` it went to the host."""
    accelerate_patch(True)

    def build(lr):
        accelerator = accelerator_on(sim)
        model = _model().to(sim)
        opt = O.Adam(model.parameters(), lr=torch.tensor(lr, device=sim), capturable=True)
        return (accelerator, *accelerator.prepare(model, opt))

    accelerator, model, opt = build(0.02)
    step_with_grads(list(model.parameters()), opt, 0)
    accelerator.save_state(str(tmp_path), safe_serialization=False)
    accelerator, model, opt = build(0.01)
    live = opt.optimizer.param_groups[0]["lr"]
    accelerator.load_state(str(tmp_path), map_location=map_location)
    lr = opt.optimizer.param_groups[0]["lr"]
    assert lr is live and lr.device == sim and lr.item() == pytest.approx(0.02)
    assert optimshift.check(opt.optimizer).ok


@pytest.mark.parametrize(
    "map_location, config, key",
    [("on_device", "Adam", "step"), ("cpu", "NAdam", "mu_product")],
    ids=["on_device-Adam-step", "cpu-NAdam-mu_product"],
)
def test_load_state_unpatched_misplaces_host_scalars(
    sim, tmp_path, accelerator_on, accelerate_patch, map_location, config, key
):
    """``load_state(map_location="on_device")`` loads every ``step`` onto the device and it stays there;
    with ``"cpu"``, PyTorch's cast (passed through by Accelerate) puts NAdam's ``mu_product`` there."""
    accelerate_patch(False)
    _save_on(accelerator_on, torch.device("cpu"), config, tmp_path)
    found = {}
    for patched in (False, True):
        accelerate_patch(patched)
        _, opt = _load_on(accelerator_on, sim, config, tmp_path, map_location)
        found[patched] = {row[2] for row in layout(opt.optimizer) if row[1] == key}
    assert found == {False: {str(sim)}, True: {"cpu"}}


@pytest.mark.parametrize("map_location", ["cpu", "on_device"])
def test_cpu_prepare_save_load(tmp_path, accelerator_on, accelerate_patch, map_location):
    """The whole cycle on a CPU-only Accelerator: nothing may change place, dtype or value."""
    accelerate_patch(True)
    cpu = torch.device("cpu")
    model, opt = _trained_on_host("Adam-fused")
    before = snapshot(opt)
    model, prepared = accelerator_on(cpu).prepare(model, opt)
    assert bitwise_same(snapshot(opt), before)
    saved = _save_on(accelerator_on, cpu, "NAdam", tmp_path)
    model, opt = _load_on(accelerator_on, cpu, "NAdam", tmp_path, map_location)
    assert devices(opt.optimizer) == {"cpu"}
    assert layout(opt.optimizer) == fresh_layout(_make("NAdam"), list(model.parameters()))
    assert bitwise_same(snapshot(opt.optimizer), saved)


def test_patch_is_idempotent_and_unpatch_restores(accelerate_patch):
    from accelerate.optimizer import AcceleratedOptimizer

    init, load = AcceleratedOptimizer.__dict__["__init__"], AcceleratedOptimizer.__dict__["load_state_dict"]
    accelerate_patch(True)
    assert osa.is_patched()
    patched = AcceleratedOptimizer.__dict__["__init__"], AcceleratedOptimizer.__dict__["load_state_dict"]
    assert patched[0] is not init and patched[1] is not load
    osa.patch()
    assert (AcceleratedOptimizer.__dict__["__init__"], AcceleratedOptimizer.__dict__["load_state_dict"]) == patched
    osa.unpatch()
    assert not osa.is_patched()
    assert AcceleratedOptimizer.__dict__["__init__"] is init
    assert AcceleratedOptimizer.__dict__["load_state_dict"] is load
    osa.unpatch()


def test_device_placement_false_is_left_alone(sim, accelerator_on, accelerate_patch):
    """``prepare(..., device_placement=[..., False])``: the user places the state; nothing is moved."""
    accelerate_patch(True)
    model, opt = _trained_on_host("Adam")
    model, prepared = accelerator_on(sim).prepare(model, opt, device_placement=[True, False])
    assert devices(opt) == {"cpu"}
    assert prepared.device_placement is False


@pytest.mark.parametrize("patched", [False, True])
def test_load_state_dict_keeps_dtypes_and_strings_when_patched(sim, accelerator_on, accelerate_patch, patched):
    """Through AcceleratedOptimizer.load_state_dict, PyTorch's load casts fp32 state to bf16 params and turns a
    string in state into the text of a generator; the patch loads with optimshift.load_state_dict instead, which
    keeps SGD's fp32 momentum (its step takes it with bf16 params)."""
    accelerate_patch(patched)
    model = torch.nn.Linear(3, 2).to(torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _, prepared = accelerator_on(sim).prepare(model, opt)
    sd = {
        "state": {0: {"momentum_buffer": torch.ones(2, 3), "note": "warm"}},
        "param_groups": [{**{k: v for k, v in opt.param_groups[0].items() if k != "params"}, "params": [0, 1]}],
    }
    prepared.load_state_dict(sd)
    weight = next(iter(model.parameters()))
    state = opt.state[weight]
    if patched:
        assert state["momentum_buffer"].dtype == torch.float32 and state["note"] == "warm"
        assert state["momentum_buffer"].device == sim
        weight.grad = torch.ones_like(weight)
        opt.step()  # the kept dtype is one the step accepts
        assert state["momentum_buffer"].dtype == torch.float32
    else:
        assert state["momentum_buffer"].dtype == torch.bfloat16 and state["note"] != "warm"


@pytest.mark.parametrize("patched", [False, True])
def test_load_state_dict_casts_where_the_step_would_refuse_the_saved_dtype(
    sim, accelerator_on, accelerate_patch, patched
):
    """An fp32 Adam checkpoint resumed with bf16 params: PyTorch's load casts it and the resume runs unpatched. The
    patch's load keeps dtypes only where the step takes them: here it casts as PyTorch does (it refused the resume,
    a cast Accelerate's caller cannot ask for; found by a new-user hunt)."""
    accelerate_patch(patched)
    source = torch.nn.Linear(3, 2)
    saved = torch.optim.Adam(source.parameters(), foreach=False)
    step_with_grads(list(source.parameters()), saved, seed=0)
    model = torch.nn.Linear(3, 2).to(torch.bfloat16)
    opt = torch.optim.Adam(model.parameters(), foreach=False)
    _, prepared = accelerator_on(sim).prepare(model, opt)
    prepared.load_state_dict(saved.state_dict())
    weight = next(iter(model.parameters()))
    assert opt.state[weight]["exp_avg"].dtype == torch.bfloat16 and opt.state[weight]["exp_avg"].device == sim
    weight.grad = torch.ones_like(weight)
    opt.step()


class _OwnLoad(torch.optim.AdamW):
    """A class with its own load_state_dict (as bitsandbytes' 8-bit optimizers have)."""

    calls = 0

    def load_state_dict(self, state_dict):
        type(self).calls += 1
        super().load_state_dict(state_dict)


@pytest.mark.parametrize("patched", [False, True])
def test_load_state_dict_of_a_class_with_its_own_load_is_accelerates(sim, accelerator_on, accelerate_patch, patched):
    """optimshift's load refuses a class that overrides load_state_dict (it cannot know what that does); the patch
    hands such a class to Accelerate's own load, which calls the override, as unpatched. It raised TypeError (found
    by a new-user hunt)."""
    accelerate_patch(patched)
    model = _model().to(sim)
    opt = _OwnLoad(model.parameters())
    _, prepared = accelerator_on(sim).prepare(model, opt)
    step_with_grads(list(model.parameters()), opt, seed=0)
    before = snapshot(opt)
    _OwnLoad.calls = 0
    prepared.load_state_dict(opt.state_dict())
    assert _OwnLoad.calls == 1 and bitwise_same(snapshot(opt), before)


def test_load_state_into_an_optimizer_offloaded_by_optimshift_is_optimshifts(sim, accelerator_on, accelerate_patch):
    """A group removed while offloaded (its state then one optimshift cannot place): Accelerate's own load (torch's)
    replaced the state and left the offload recorded, and the next step() was refused as offloaded."""
    accelerate_patch(True)
    p, q = (torch.nn.Parameter(torch.zeros(n, device=sim)) for n in (2, 3))
    opt = O.SGD([{"params": [p]}, {"params": [q]}], lr=0.1, momentum=0.9)
    for t in (p, q):
        opt.state[t]["momentum_buffer"] = torch.ones_like(t)
    prepared = accelerator_on(sim).prepare(opt)
    group = {k: v for k, v in opt.param_groups[0].items() if k != "params"}
    saved = {"state": {0: {"momentum_buffer": torch.full((2,), 2.0)}}, "param_groups": [{**group, "params": [0]}]}
    with deferred_streams(seed=0, progress=0.0):
        optimshift.offload(opt, non_blocking=True)
        del opt.param_groups[1]
        prepared.load_state_dict(saved)
        assert not optimshift.is_offloaded(opt)
        p.grad = torch.zeros_like(p)
        prepared.step()
    assert opt.state[p]["momentum_buffer"].device == sim
    assert torch.equal(opt.state[p]["momentum_buffer"].cpu(), torch.full((2,), 1.8))


def test_prepare_places_an_optimizer_wide_entry_by_optimshift(sim, accelerator_on, accelerate_patch):
    """MADGRAD's ``state["k"]`` (under a plain key): once left to Accelerate's move of the whole state dict, which
    put it on the device (1 host sync per step); optimshift keeps it where a fresh MADGRAD does, on the host."""
    madgrad = pytest.importorskip("pytorch_optimizer").MADGRAD
    accelerate_patch(True)
    model = _model()
    opt = madgrad(model.parameters(), lr=0.01)
    step_with_grads(list(model.parameters()), opt, seed=0)
    model, prepared = accelerator_on(sim).prepare(model, opt)
    params = list(model.parameters())
    assert opt.state["k"].device.type == "cpu" and all(opt.state[p]["s"].device == sim for p in params)
    assert count_step_syncs(params, prepared, seed=1) == 0


def test_load_state_dict_optimshift_refuses_but_torch_takes_is_accelerates(sim, accelerator_on, accelerate_patch):
    """An Adam given an optimizer-wide entry by hand (``state["k"]``, no torch.optim class keeps one): torch's load
    keeps it; optimshift's load refuses it, so the load is Accelerate's, as before 580e5f5 (which let such an
    optimizer through to optimshift's load, and the load raised)."""
    accelerate_patch(True)
    model = _model().to(sim)
    opt = O.Adam(model.parameters(), foreach=False)
    step_with_grads(list(model.parameters()), opt, seed=0)
    opt.state["k"] = torch.tensor(1.0)
    _, prepared = accelerator_on(sim).prepare(model, opt)
    prepared.load_state_dict(opt.state_dict())
    assert torch.equal(opt.state["k"].cpu(), torch.tensor(1.0))
    step_with_grads(list(model.parameters()), prepared, seed=1)


def test_load_state_dict_of_an_optimizer_wide_entry_its_class_keeps_is_optimshifts(
    sim, accelerator_on, accelerate_patch, monkeypatch
):
    """MADGRAD's ``k`` (its class keeps it): the load is optimshift's, which keeps ``k`` on the host."""
    madgrad = pytest.importorskip("pytorch_optimizer").MADGRAD
    from optimshift.checkpoint import _resume

    accelerate_patch(True)
    model = _model()
    opt = madgrad(model.parameters(), lr=0.01)
    step_with_grads(list(model.parameters()), opt, seed=0)
    model, prepared = accelerator_on(sim).prepare(model, opt)
    loads, original = [], _resume.load_as_torch_would
    monkeypatch.setattr(_resume, "load_as_torch_would", lambda o, sd: loads.append(o) or original(o, sd))
    prepared.load_state_dict(opt.state_dict())
    assert loads == [opt] and opt.state["k"].device.type == "cpu"
    assert all(opt.state[p]["s"].device == sim for p in model.parameters())
