"""optimshift.integrations.verl against the real verl package, on the simulated accelerator.

verl's FSDP engine calls ``load_fsdp_optimizer(optimizer, device)`` when it enters ``train_mode()`` and
``offload_fsdp_optimizer(optimizer)`` when it leaves, through the names its module imported. The tests call the
functions the same way, through ``verl.workers.engine.fsdp.transformer_impl``, patched and as shipped, and compare
the state with a fresh optimizer of the same class and flags over params placed like the live ones.
(The same on 2 gloo ranks with FSDP2 DTensor state and FSDP1 flat params: tests/distributed/test_verl_fsdp.py.)
"""

from __future__ import annotations

import importlib
import inspect
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from _integrations_support import count_step_syncs, fresh_layout, layout, step_with_grads

pytest.importorskip("verl")

import optimshift  # noqa: E402
import optimshift.integrations.verl as osv  # noqa: E402  (patches verl at import)
from _schedules import drain_queued  # noqa: F401  (drain_queued: an autouse fixture)
from optimshift.testing import deferred_streams  # noqa: E402

with osv._quiet_verl_import():
    from verl.utils import fsdp_utils  # noqa: E402
    from verl.workers.engine.fsdp import transformer_impl as engine  # noqa: E402

osv.unpatch()
SHIPPED = {"offload": fsdp_utils.offload_fsdp_optimizer, "load": fsdp_utils.load_fsdp_optimizer}
assert all(f.__module__ == "verl.utils.fsdp_utils" for f in SHIPPED.values()), "verl's own functions"

O = torch.optim
CONFIGS = {
    "AdamW-foreach": (O.AdamW, {"foreach": True}),
    "AdamW-single": (O.AdamW, {"foreach": False}),
    "AdamW-fused": (O.AdamW, {"fused": True}),
    "SGD-momentum": (O.SGD, {"lr": 0.1, "momentum": 0.9}),
}
# Host syncs per param of one step after verl's shipped reload: it puts `step` on the device, where AdamW's
# foreach path reads it twice per param (.item()) and the single-tensor path once; fused AdamW keeps it there
# anyway; SGD has no `step`.
SHIPPED_SYNCS_PER_PARAM = {"AdamW-foreach": 2, "AdamW-single": 1, "AdamW-fused": 0, "SGD-momentum": 0}
CYCLES = 10


@pytest.fixture
def verl_patch():
    """``verl_patch(on)``: patch verl (on=True) or make sure it is not patched; always unpatched afterwards."""

    def apply(on: bool) -> None:
        (osv.patch if on else osv.unpatch)()

    yield apply
    osv.unpatch()


def _make(config: str):
    cls, kwargs = CONFIGS[config]
    return lambda params: cls(params, **kwargs)


def _model(device: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(4, 3).to(device)


def _values(optimizer) -> dict:
    """A host copy of every state tensor, read through ``state_dict()`` (as verl's checkpointing reads it: it waits
    for a transfer in flight), keyed by (param index, key)."""
    out = {}
    for index, entries in optimizer.state_dict()["state"].items():
        for key, value in entries.items():
            out[(index, key)] = value.detach().to("cpu", copy=True) if isinstance(value, torch.Tensor) else value
    return out


def _bitwise(a: dict, b: dict) -> bool:
    def bits(t):
        return t.contiguous().reshape(-1).view(torch.uint8)

    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and torch.equal(bits(a[k]), bits(b[k])) for k in a
    )


def _ids(optimizer) -> list[int]:
    return [id(v) for st in optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor)]


# --- the swap ---------------------------------------------------------------------------------------------------


def test_patch_swaps_the_functions_where_verls_engine_reads_them(verl_patch):
    verl_patch(True)
    for module in (fsdp_utils, engine):
        assert module.offload_fsdp_optimizer.__module__ == "optimshift.integrations.verl"
        assert module.load_fsdp_optimizer.__module__ == "optimshift.integrations.verl"
        assert module.offload_fsdp_optimizer.__name__ == "offload_fsdp_optimizer"  # verl's logs read the same
    assert {
        "verl.utils.fsdp_utils.offload_fsdp_optimizer",
        "verl.utils.fsdp_utils.load_fsdp_optimizer",
        "verl.workers.engine.fsdp.transformer_impl.offload_fsdp_optimizer",
        "verl.workers.engine.fsdp.transformer_impl.load_fsdp_optimizer",
    } <= set(osv.patched_functions())
    assert osv.is_patched()
    verl_patch(True)  # again: a no-op
    assert engine.load_fsdp_optimizer is fsdp_utils.load_fsdp_optimizer


def test_unpatch_restores_verls_own_functions(verl_patch):
    verl_patch(True)
    assert engine.load_fsdp_optimizer is not SHIPPED["load"]
    verl_patch(False)
    for module in (fsdp_utils, engine):
        assert module.offload_fsdp_optimizer is SHIPPED["offload"]
        assert module.load_fsdp_optimizer is SHIPPED["load"]
    assert not osv.is_patched() and osv.patched_functions() == []


def test_holders_are_found_by_scanning_loaded_modules(verl_patch, monkeypatch):
    """A verl module that binds a function under another name (one verl adds later) is patched and restored; a
    verl function that only looks like an optimizer offload is reported, not touched."""
    verl_patch(False)
    holder = types.ModuleType("verl.optimshift_probe_holder")
    holder.load_opt = SHIPPED["load"]  # e.g. `from verl.utils.fsdp_utils import load_fsdp_optimizer as load_opt`
    lookalike = types.ModuleType("verl.optimshift_probe_engine")
    exec("def offload_probe_optimizer(optimizer):\n    pass\n", lookalike.__dict__)
    lookalike.offload_probe_optimizer.__module__ = lookalike.__name__
    monkeypatch.setitem(sys.modules, holder.__name__, holder)
    monkeypatch.setitem(sys.modules, lookalike.__name__, lookalike)
    with pytest.warns(RuntimeWarning, match=r"verl\.optimshift_probe_engine\.offload_probe_optimizer"):
        verl_patch(True)
    assert holder.load_opt is fsdp_utils.load_fsdp_optimizer is not SHIPPED["load"]
    assert "verl.optimshift_probe_holder.load_opt" in osv.patched_functions()
    assert osv.unknown_functions() == ["verl.optimshift_probe_engine.offload_probe_optimizer"]
    verl_patch(False)
    assert holder.load_opt is SHIPPED["load"]


def test_the_warning_of_the_patch_on_import_names_the_importing_line(verl_patch, monkeypatch):
    """Importing the module patches (VERL_USE_EXTERNAL_MODULES): its look-alike warning named the module's own last
    line, not the line that imported it."""
    verl_patch(False)
    lookalike = types.ModuleType("verl.optimshift_probe_engine")
    exec("def offload_probe_optimizer(optimizer):\n    pass\n", lookalike.__dict__)
    lookalike.offload_probe_optimizer.__module__ = lookalike.__name__
    monkeypatch.setitem(sys.modules, lookalike.__name__, lookalike)
    with pytest.warns(RuntimeWarning, match=r"offload_probe_optimizer") as warned:
        importlib.reload(osv)
    assert [(w.filename, w.lineno) for w in warned] == [(__file__, inspect.currentframe().f_lineno - 1)]


def test_a_module_imported_after_patch_gets_the_replacement_and_loses_it_on_unpatch(verl_patch, monkeypatch):
    verl_patch(True)
    late = types.ModuleType("verl.optimshift_probe_late")
    exec("from verl.utils.fsdp_utils import offload_fsdp_optimizer", late.__dict__)
    monkeypatch.setitem(sys.modules, late.__name__, late)
    assert late.offload_fsdp_optimizer is fsdp_utils.offload_fsdp_optimizer is not SHIPPED["offload"]
    verl_patch(False)
    assert late.offload_fsdp_optimizer is SHIPPED["offload"]


# --- the replacements, through the engine's module attributes ------------------------------------------------


@pytest.mark.parametrize("config", list(CONFIGS))
def test_patched_cycles_keep_objects_values_placement_and_pool(sim, verl_patch, config):
    verl_patch(True)
    model = _model(sim)
    params = list(model.parameters())
    opt = _make(config)(params)
    pool = optimshift.host_pool.stats()
    engine.offload_fsdp_optimizer(opt)  # no state yet: nothing happens (verl's contract)
    engine.load_fsdp_optimizer(opt, "sim")
    assert len(opt.state) == 0 and not optimshift.is_offloaded(opt)
    assert optimshift.host_pool.stats().allocations == pool.allocations

    step_with_grads(params, opt, seed=0)
    expected = fresh_layout(_make(config), params)
    objects = _ids(opt)
    allocations = None
    for cycle in range(CYCLES):
        before = _values(opt)
        engine.offload_fsdp_optimizer(opt)
        assert {row[2] for row in layout(opt)} == {"cpu"}
        assert _bitwise(_values(opt), before), "offloaded values must be unchanged"
        device_id = [0, "sim", torch.device("sim", 0), "sim:0"][cycle % 4]  # every form verl passes
        engine.load_fsdp_optimizer(opt, device_id)
        assert layout(opt) == expected, f"cycle {cycle}: not where a fresh optimizer keeps it"
        assert _ids(opt) == objects, f"cycle {cycle}: a state tensor was replaced"
        assert _bitwise(_values(opt), before), f"cycle {cycle}: values changed"
        assert optimshift.check(opt).ok
        if cycle == 0:
            allocations = optimshift.host_pool.stats().allocations
        assert count_step_syncs(params, opt, seed=cycle + 1) == 0
    assert optimshift.host_pool.stats().allocations == allocations, "new host buffers after the first cycle"


@pytest.mark.parametrize("keep", [False, True], ids=["default", "OPTIMSHIFT_VERL_KEEP_ADDRESSES=1"])
def test_the_environment_variable_keeps_addresses_through_patched_cycles(sim, verl_patch, monkeypatch, keep):
    if keep:
        monkeypatch.setenv("OPTIMSHIFT_VERL_KEEP_ADDRESSES", "1")
    else:
        monkeypatch.delenv("OPTIMSHIFT_VERL_KEEP_ADDRESSES", raising=False)
    verl_patch(True)
    model = _model(sim)
    params = list(model.parameters())
    opt = _make("AdamW-foreach")(params)
    step_with_grads(params, opt, seed=0)
    addresses = []
    for _ in range(3):
        before = _values(opt)
        engine.offload_fsdp_optimizer(opt)
        engine.load_fsdp_optimizer(opt, "sim")
        optimshift.wait(opt)
        assert _bitwise(_values(opt), before)
        addresses.append([v.data_ptr() for st in opt.state.values() for v in st.values() if v.device == sim])
    if keep:  # (the first reload lays the state out at the addresses it keeps)
        assert addresses[1] == addresses[2]
    # off by default: no state kept at fixed addresses (host malloc may hand back the same addresses anyway)
    assert (optimshift._addresses.layout_of(opt) is not None) == keep


@pytest.mark.parametrize("config", list(CONFIGS))
def test_a_step_after_a_cycle_syncs_as_a_fresh_optimizer_and_the_shipped_functions_do_not(sim, verl_patch, config):
    """Both ways on the same training: the shipped functions put `step` on the device (2 host syncs per param per
    step for foreach AdamW) and replace every object; patched, 0 syncs (a fresh optimizer's count) and none."""
    results = {}
    for patched in (False, True):
        verl_patch(patched)
        model = _model(sim)
        params = list(model.parameters())
        opt = _make(config)(params)
        step_with_grads(params, opt, seed=0)
        objects = _ids(opt)
        engine.offload_fsdp_optimizer(opt)
        engine.load_fsdp_optimizer(opt, "sim")
        results[patched] = (
            count_step_syncs(params, opt, seed=1),
            _ids(opt) == objects,
            {row[2] for row in layout(opt) if row[1] == "step"},
            [p.detach().cpu() for p in params],
        )
    twins = [torch.nn.Parameter(torch.zeros(p.shape, device=sim)) for p in params]
    fresh = _make(config)(twins)
    step_with_grads(twins, fresh, seed=0)
    fresh_syncs = count_step_syncs(twins, fresh, seed=1)
    shipped, ours = results[False], results[True]
    assert ours[0] == fresh_syncs == 0
    assert shipped[0] == SHIPPED_SYNCS_PER_PARAM[config] * len(params)
    assert ours[1] and not shipped[1], "patched keeps every object, shipped replaces every one"
    if config != "SGD-momentum":
        assert shipped[2] == {"sim:0"}
        assert ours[2] == ({"sim:0"} if config == "AdamW-fused" else {"cpu"})
    assert all(torch.equal(a, b) for a, b in zip(ours[3], shipped[3])), "the same arithmetic either way"


def test_device_id_naming_another_device_places_the_state_for_it(sim, verl_patch):
    verl_patch(True)
    model = _model(sim)
    params = list(model.parameters())
    opt = _make("AdamW-foreach")(params)
    step_with_grads(params, opt, seed=0)
    before = _values(opt)
    objects = _ids(opt)
    other = torch.device(sim.type, 1)
    for device_id in (1, "sim:1", other):
        engine.offload_fsdp_optimizer(opt)
        engine.load_fsdp_optimizer(opt, device_id)
        expected = {("step", "cpu"), ("exp_avg", "sim:1"), ("exp_avg_sq", "sim:1")}
        assert {(row[1], row[2]) for row in layout(opt)} == expected
        assert _ids(opt) == objects and _bitwise(_values(opt), before)
        engine.load_fsdp_optimizer(opt, "sim:0")  # not offloaded: the state moves to where verl asks
        assert {row[2] for row in layout(opt) if row[1] != "step"} == {"sim:0"}
    engine.offload_fsdp_optimizer(opt)
    engine.load_fsdp_optimizer(opt, "cpu")
    assert {row[2] for row in layout(opt)} == {"cpu"} and not optimshift.is_offloaded(opt)
    assert _ids(opt) == objects and _bitwise(_values(opt), before)


def test_a_streamed_optimizer_is_left_where_streaming_keeps_it(sim, verl_patch):
    verl_patch(True)
    model = _model(sim)
    params = list(model.parameters())
    opt = _make("AdamW-foreach")(params)
    step_with_grads(params, opt, seed=0)
    handle = optimshift.stream(opt)
    try:
        rows = layout(opt)
        engine.offload_fsdp_optimizer(opt)
        engine.load_fsdp_optimizer(opt, "sim")
        assert layout(opt) == rows
        step_with_grads(params, opt, seed=1)
    finally:
        optimshift.unstream(opt)
    del handle


class _Lookahead(torch.optim.Optimizer):
    """A Lookahead-style wrapper: the inner optimizer's param groups, a state of its own (none here)."""

    def __init__(self, inner: torch.optim.Optimizer):
        self.optimizer = inner
        super().__init__([p for g in inner.param_groups for p in g["params"]], {})
        self.param_groups = inner.param_groups
        self.state[self.param_groups[0]["params"][0]]["slow"] = torch.zeros(1)  # (a state: verl's functions run)

    def step(self, closure=None):
        self.optimizer.step()


def test_the_warning_about_an_inner_optimizer_names_the_line_that_called_the_patched_function(sim, verl_patch):
    """Through a patched function the operation's warning that it does not reach the inner optimizer's state named
    a line of optimshift.integrations.verl (a fixed stacklevel), not the caller's."""
    verl_patch(True)
    params = list(_model(sim).parameters())
    opt = _Lookahead(_make("AdamW-foreach")(params))
    step_with_grads(params, opt, seed=0)
    with pytest.warns(RuntimeWarning, match="does not reach") as warned:
        lines = [inspect.currentframe().f_lineno + 1]
        engine.offload_fsdp_optimizer(opt)
        lines.append(inspect.currentframe().f_lineno + 1)
        engine.load_fsdp_optimizer(opt, sim)
    assert [(w.filename, w.lineno, str(w.message).split(":")[0]) for w in warned] == [
        (__file__, lines[0], "optimshift.offload"),
        (__file__, lines[1], "optimshift.reload"),
    ]
    assert not optimshift.is_offloaded(opt)


class _StrayParam(torch.optim.SGD):
    """State for a param in no group: optimshift refuses to place it; verl's own code walks only the groups."""

    def __init__(self, device: torch.device):
        self.p = torch.nn.Parameter(torch.zeros(2, device=device))
        super().__init__([self.p], lr=0.1, momentum=0.9)
        self.state[self.p]["momentum_buffer"] = torch.ones(2, device=device)
        self.state[torch.nn.Parameter(torch.zeros(3))] = {"momentum_buffer": torch.ones(3, device=device)}


def test_an_optimizer_optimshift_cannot_place_is_left_to_verls_own_code(sim, verl_patch):
    """As the other integrations do (``placeable``): the patched functions used to raise optimshift's ValueError."""
    verl_patch(True)
    opt = _StrayParam(sim)
    with pytest.raises(ValueError, match="in no param group"):
        optimshift.offload(opt)
    engine.offload_fsdp_optimizer(opt)
    assert opt.state[opt.p]["momentum_buffer"].device.type == "cpu"
    engine.load_fsdp_optimizer(opt, sim)
    assert opt.state[opt.p]["momentum_buffer"].device == sim


def test_an_optimizer_offloaded_by_optimshift_is_not_handed_to_verls_load(sim, verl_patch):
    """Its state became one optimshift cannot place while offloaded: verl's ``.to()`` read the host copies (in
    flight) and left optimshift's offload recorded; optimshift's reload refuses it, nothing changed."""
    verl_patch(True)
    p, q = (torch.nn.Parameter(torch.zeros(n, device=sim)) for n in (2, 3))
    opt = torch.optim.SGD([{"params": [p]}, {"params": [q]}], lr=0.1, momentum=0.9)
    for t in (p, q):
        opt.state[t]["momentum_buffer"] = torch.ones_like(t)
    engine.offload_fsdp_optimizer(opt)
    del opt.param_groups[1]  # (q's state: in no group now)
    with pytest.raises(ValueError, match="in no param group"):
        engine.load_fsdp_optimizer(opt, sim)
    assert optimshift.is_offloaded(opt) and opt.state[p]["momentum_buffer"].device.type == "cpu"


@pytest.mark.parametrize("copies", ["in flight", "complete"])
def test_an_optimizer_with_a_reload_in_flight_is_verls_once_the_copies_are_complete(sim, verl_patch, copies):
    """A group removed while the reload's copies run (its state then one optimshift cannot place): verl's own offload
    read the device state the copies were still writing (StreamRaceError); then optimshift's ValueError while they
    ran, verl's offload once they were done (a timing's answer). Now verl's offload, after the copies, either way."""
    verl_patch(True)
    p, q = (torch.nn.Parameter(torch.zeros(n, device=sim)) for n in (2, 3))
    opt = torch.optim.SGD([{"params": [p]}, {"params": [q]}], lr=0.1, momentum=0.9)
    for t in (p, q):
        opt.state[t]["momentum_buffer"] = torch.ones_like(t)
    with deferred_streams(seed=0, progress=0.0):
        engine.offload_fsdp_optimizer(opt)
        engine.load_fsdp_optimizer(opt, sim)  # (non-blocking: in flight)
        del opt.param_groups[1]
        if copies == "complete":
            torch.sim.synchronize(0)
        engine.offload_fsdp_optimizer(opt)  # verl's own: every state tensor of its groups .to("cpu")
    assert not optimshift.is_offloaded(opt)
    buf = opt.state[p]["momentum_buffer"]
    assert buf.device.type == "cpu" and torch.equal(buf, torch.ones(2))


# --- non-blocking transfers -----------------------------------------------------------------------------------


@pytest.mark.parametrize("seed, progress", [(0, 0.0), (1, 0.05), (2, 0.3)])
def test_non_blocking_cycles_are_race_free_and_match_the_blocking_run(sim, verl_patch, seed, progress):
    """The replacements offload and reload without blocking (copies on a side stream). Under the simulator's
    deferred streams, where an access nothing orders raises: a checkpoint taken right after the offload
    (``state_dict()``, as verl saves one) and the steps after each reload see exactly what the blocking path sees."""

    def run(deferred: bool):
        verl_patch(True)
        model = _model(sim)
        params = list(model.parameters())
        opt = _make("AdamW-foreach")(params)
        step_with_grads(params, opt, seed=0)
        saved = []
        with deferred_streams(seed=seed, progress=progress) if deferred else _nothing():
            for cycle in range(3):
                engine.offload_fsdp_optimizer(opt)
                saved.append(_values(opt))
                engine.load_fsdp_optimizer(opt, "sim")
                step_with_grads(params, opt, seed=cycle + 1)
        return saved, [p.detach().cpu() for p in params]

    (saved, params), (ref_saved, ref_params) = run(True), run(False)
    assert all(_bitwise(a, b) for a, b in zip(saved, ref_saved))
    assert all(torch.equal(a, b) for a, b in zip(params, ref_params))


def test_without_the_state_dict_guard_a_checkpoint_after_the_offload_reads_unfinished_copies(
    sim, verl_patch, monkeypatch
):
    """The control for the test above: take away optimshift's in-flight guards (the pre-hook that makes
    ``state_dict()`` wait) and the checkpoint holds what the simulator puts in a copy's destination until it ran
    (NaN)."""
    verl_patch(True)
    monkeypatch.setattr(optimshift.api, "remember_pending", lambda optimizer, pending: None)
    model = _model(sim)
    params = list(model.parameters())
    opt = _make("AdamW-foreach")(params)
    step_with_grads(params, opt, seed=0)
    before = _values(opt)
    with deferred_streams(seed=0, progress=0.0):
        engine.offload_fsdp_optimizer(opt)
        unguarded = _values(opt)
    assert not _bitwise(unguarded, before)
    assert any(torch.isnan(v).any() for k, v in unguarded.items() if k[1] != "step")


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


# --- the veomni and automodel engines' own copies -------------------------------------------------------------

ENGINE_COPIES = {
    "veomni": ("verl.workers.engine.veomni", "offload_veomni_optimizer", "load_veomni_optimizer"),
    "automodel": ("verl.workers.engine.automodel", "offload_automodel_optimizer", "load_automodel_optimizer"),
}


@pytest.fixture
def engine_utils():
    """``engine_utils(name)``: verl's own ``<engine>.utils`` module, loaded from verl's source file. Its engine
    package needs veomni / nemo_automodel, which do not install here; the package is stood in for by an empty
    one (the module itself needs neither). Both leave sys.modules afterwards."""
    added: list[str] = []

    def load(name: str) -> types.ModuleType:
        package_name = ENGINE_COPIES[name][0]
        assert package_name not in sys.modules, "the engine really cannot be imported here"
        with osv._quiet_verl_import():
            engines = importlib.import_module("verl.workers.engine")
        package = types.ModuleType(package_name)
        package.__path__ = [str(Path(engines.__file__).parent / name)]
        sys.modules[package_name] = package
        added.extend([package_name, f"{package_name}.utils"])
        return importlib.import_module(f"{package_name}.utils")

    yield load
    for name in added:
        sys.modules.pop(name, None)


class _MultiOptimizer:
    """What veomni's MultiOptimizer shows verl's functions: a flag and the sub-optimizers by name."""

    _is_multi_optimizer = True

    def __init__(self, optimizers):
        self.optimizers_dict = optimizers


@pytest.mark.parametrize("name", list(ENGINE_COPIES))
def test_the_engines_own_copies_are_patched(sim, verl_patch, engine_utils, name):
    _, offload_name, load_name = ENGINE_COPIES[name]
    verl_patch(False)
    utils = engine_utils(name)
    shipped = (getattr(utils, offload_name), getattr(utils, load_name))
    assert shipped[0].__module__ == utils.__name__
    verl_patch(True)
    offload, load = getattr(utils, offload_name), getattr(utils, load_name)
    assert offload.__module__ == load.__module__ == "optimshift.integrations.verl"
    assert f"{utils.__name__}.{load_name}" in osv.patched_functions()

    model = _model(sim)
    params = list(model.parameters())
    optimizers = [_make("AdamW-foreach")([params[0]]), _make("SGD-momentum")([params[1]])]
    for opt, p in zip(optimizers, params):
        step_with_grads([p], opt, seed=0)
    target = _MultiOptimizer({"ep": optimizers[0], "non_ep": optimizers[1]}) if name == "veomni" else optimizers[0]
    walked = optimizers if name == "veomni" else optimizers[:1]
    expected = [layout(o) for o in walked]
    objects = [_ids(o) for o in walked]
    before = [_values(o) for o in walked]
    offload(target)
    assert all({row[2] for row in layout(o)} == {"cpu"} for o in walked)
    load(target, "sim")
    assert [layout(o) for o in walked] == expected and [_ids(o) for o in walked] == objects
    assert all(_bitwise(_values(o), b) for o, b in zip(walked, before))
    assert count_step_syncs([params[0]], optimizers[0], seed=1) == 0
    verl_patch(False)
    assert (getattr(utils, offload_name), getattr(utils, load_name)) == shipped


# --- compile (a real GPU) --------------------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("config", ["AdamW-foreach", "AdamW-fused", "SGD-momentum"])
def test_a_compiled_step_does_not_recompile_over_10_cycles_on_cuda(verl_patch, config):
    """On CUDA optimshift keeps every object (set_data), so a compiled step keeps its graph; the shipped functions
    replace every tensor and recompile it each cycle. (On the simulated accelerator a tensor dynamo holds a weak
    reference to cannot keep its object across the host: see ARCHITECTURE.md, so this one needs a GPU.)"""

    def run(patched: bool) -> int:
        verl_patch(patched)
        torch._dynamo.reset()
        graphs = [0]

        def backend(gm, example_inputs):
            graphs[0] += 1
            return gm.forward

        model = _model(torch.device("cuda", 0))
        params = list(model.parameters())
        opt = _make(config)(params)

        @torch.compile(backend=backend)
        def step():
            opt.step()

        for seed in range(2):
            for i, p in enumerate(params):
                p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(10 * seed + i)).to(p.device)
            step()
        warm = graphs[0]
        for cycle in range(CYCLES):
            engine.offload_fsdp_optimizer(opt)
            engine.load_fsdp_optimizer(opt, torch.cuda.current_device())
            for i, p in enumerate(params):
                p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(100 + cycle * 10 + i)).cuda()
            step()
        return graphs[0] - warm

    assert run(True) == 0
    assert run(False) > 0


# --- the one line: VERL_USE_EXTERNAL_MODULES, and a quiet import -----------------------------------------------


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    environment = {**os.environ, **env}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180, env=environment)


def test_verl_use_external_modules_patches_the_process_quietly():
    """With the variable set, importing verl patches it (verl imports the module in each of its processes), and
    nothing of verl's start-up notices comes from that; the engine imported afterwards holds the replacements.
    The control at the end: outside the filter, verl's platform detection does print its CPU-only notice."""
    code = (
        "import sys\n"
        "import verl.utils.fsdp_utils\n"
        "osv = sys.modules.get('optimshift.integrations.verl')\n"
        "print(osv is not None and osv.is_patched())\n"
        "print('imported', file=sys.stderr, flush=True)\n"
        "import verl.plugin.platform.platform_manager as pm\n"
        "with osv._quiet_verl_import():\n"
        "    pm._current_platform = None; pm.get_platform()\n"
        "    from verl.workers.engine.fsdp import transformer_impl as engine\n"
        "print(engine.offload_fsdp_optimizer.__module__, engine.load_fsdp_optimizer.__module__)\n"
        "print('quiet', file=sys.stderr, flush=True)\n"
        "pm._current_platform = None; pm.get_platform()\n"
    )
    out = _python(code, VERL_USE_EXTERNAL_MODULES="optimshift.integrations.verl", VERL_PLATFORM="")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True"] + ["optimshift.integrations.verl"] * 2
    quiet, _, loud = out.stderr.partition("quiet")
    assert "imported" in quiet
    assert "No supported accelerator" not in quiet and "engine is not available" not in quiet, quiet
    if not torch.cuda.is_available():
        assert "No supported accelerator" in loud  # the notice exists: the filter is what kept it out
