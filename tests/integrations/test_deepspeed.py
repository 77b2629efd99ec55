"""optimshift.integrations.deepspeed against the real deepspeed package.

Two halves. The module-level functions DeepSpeed's ZeRO-1/2 ``offload_states``/``reload_states`` call for the
optimizer state (``offload_optimizer_states``/``reload_optimizer_states``, through the names
``deepspeed.runtime.zero.stage_1_and_2`` imported), on the simulated accelerator, shipped and patched: host syncs
per step after a reload, objects kept, placement against a fresh optimizer, host allocations per cycle, values.
And the real engine (``deepspeed.initialize``, ZeRO stage 1 and 2, bf16, a torch client optimizer) on DeepSpeed's
CPU accelerator with a 1-rank gloo group: offload/reload cycles against a run that never offloaded, the pool
buffers the fp32 partitions go to, a checkpoint taken while offloaded. (DeepSpeed's engine cannot run on the
simulated accelerator: its offload swaps ``.data`` between host and device tensors, which torch refuses for a
Python-defined backend; on its CPU accelerator the optimizer state never leaves the host, so the first half
is where the seed bug shows. 2 ranks: tests/distributed/test_deepspeed_zero.py.)
"""

from __future__ import annotations

import importlib
import inspect
import logging
import os
import sys
import types

import pytest

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # read when deepspeed is first imported
pytest.importorskip("deepspeed")

import deepspeed  # noqa: E402, I001
import torch  # noqa: E402
from _integrations_support import count_step_syncs, fresh_layout, layout, step_with_grads  # noqa: E402
from deepspeed.runtime.zero import offload_states as ds_functions  # noqa: E402
from deepspeed.runtime.zero import stage_1_and_2 as zero12  # noqa: E402

import optimshift  # noqa: E402
import optimshift.integrations.deepspeed as osd  # noqa: E402  (patches deepspeed at import)
from _schedules import drain_queued  # noqa: E402, F401  (drain_queued: an autouse fixture)
from optimshift.testing import deferred_streams  # noqa: E402

osd.unpatch()
SHIPPED = {
    "offload": zero12.offload_optimizer_states,
    "reload": zero12.reload_optimizer_states,
    "offload_states": zero12.DeepSpeedZeroOptimizer.offload_states,
    "reload_states": zero12.DeepSpeedZeroOptimizer.reload_states,
    "state_dict": zero12.DeepSpeedZeroOptimizer.state_dict,
}
assert SHIPPED["offload"].__module__ == ds_functions.__name__, "deepspeed's own functions"

O = torch.optim
CONFIGS = {
    "AdamW-foreach": (O.AdamW, {"lr": 1e-2, "foreach": True}),
    "AdamW-single": (O.AdamW, {"lr": 1e-2, "foreach": False}),
    "SGD-momentum": (O.SGD, {"lr": 0.1, "momentum": 0.9}),
}
SIM_CONFIGS = {**CONFIGS, "AdamW-fused": (O.AdamW, {"lr": 1e-2, "fused": True})}
# Host syncs per param of one step after DeepSpeed's shipped reload: it puts `step` on the device, where
# AdamW's foreach path reads it twice per param (.item()) and the single-tensor path once.
SHIPPED_SYNCS_PER_PARAM = {"AdamW-foreach": 2, "AdamW-single": 1, "AdamW-fused": 0, "SGD-momentum": 0}
CYCLES = 3


@pytest.fixture
def ds_patch():
    """``ds_patch(on)``: patch DeepSpeed (on=True) or make sure it is not patched; always unpatched afterwards."""

    def apply(on: bool) -> None:
        (osd.patch if on else osd.unpatch)()

    yield apply
    osd.unpatch()


def _make(config: str, table: dict = SIM_CONFIGS):
    cls, kwargs = table[config]
    return lambda params: cls(params, **kwargs)


def _values(optimizer) -> dict:
    out = {}
    for index, entries in optimizer.state_dict()["state"].items():
        for key, value in entries.items():
            out[(index, key)] = value.detach().to("cpu", copy=True) if isinstance(value, torch.Tensor) else value
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)


def _bitwise(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and torch.equal(_bits(a[k]), _bits(b[k])) for k in a
    )


def _tensors(optimizer) -> list[torch.Tensor]:
    """The state tensors themselves (compared with ``is``: a freed tensor's id can come back on a new one)."""
    return [v for st in optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor)]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return sum(x is y for x, y in zip(a, b)) / len(b)


# --- the swap ---------------------------------------------------------------------------------------------------


def test_patch_swaps_the_functions_where_zero_reads_them_and_unpatch_restores(ds_patch):
    ds_patch(True)
    for module in (ds_functions, zero12):
        assert module.offload_optimizer_states.__module__ == "optimshift.integrations.deepspeed"
        assert module.reload_optimizer_states.__module__ == "optimshift.integrations.deepspeed"
        assert module.offload_optimizer_states.__name__ == "offload_optimizer_states"
    for name in ("offload_states", "reload_states", "state_dict"):
        assert getattr(zero12.DeepSpeedZeroOptimizer, name) is not SHIPPED[name]
    assert {
        "deepspeed.runtime.zero.stage_1_and_2.offload_optimizer_states",
        "deepspeed.runtime.zero.stage_1_and_2.reload_optimizer_states",
        "deepspeed.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer.offload_states",
        "deepspeed.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer.reload_states",
    } <= set(osd.patched_functions())
    assert osd.is_patched() and osd.unknown_functions() == []
    ds_patch(True)  # again: a no-op
    ds_patch(False)
    assert zero12.offload_optimizer_states is ds_functions.offload_optimizer_states is SHIPPED["offload"]
    assert zero12.reload_optimizer_states is ds_functions.reload_optimizer_states is SHIPPED["reload"]
    for name in ("offload_states", "reload_states", "state_dict"):
        assert zero12.DeepSpeedZeroOptimizer.__dict__[name] is SHIPPED[name]
    assert not osd.is_patched() and osd.patched_functions() == []


def test_a_deepspeed_whose_reload_differs_is_left_alone_with_a_warning(ds_patch, monkeypatch):
    """A version whose reload_states no longer drops the pin buffers it was handed (it reads other names) is
    not one this patch knows: its methods stay DeepSpeed's, with a warning naming it; the optimizer-state
    functions, which still match, are patched."""
    ds_patch(False)

    def reload_states(self, non_blocking=False):  # a look-alike: same signature, other code
        self.optimizer.zero_grad()

    monkeypatch.setattr(zero12.DeepSpeedZeroOptimizer, "reload_states", reload_states)
    with pytest.warns(RuntimeWarning, match=r"DeepSpeedZeroOptimizer\.reload_states \(no longer reads"):
        ds_patch(True)
    assert zero12.DeepSpeedZeroOptimizer.__dict__["reload_states"] is reload_states
    assert zero12.DeepSpeedZeroOptimizer.__dict__["offload_states"] is SHIPPED["offload_states"]
    assert zero12.reload_optimizer_states is not SHIPPED["reload"]
    assert [u.split(" ")[0] for u in osd.unknown_functions()] == [
        "deepspeed.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer.reload_states"
    ]
    ds_patch(False)
    assert zero12.reload_optimizer_states is SHIPPED["reload"]


def test_the_warning_of_the_patch_on_import_names_the_importing_line(ds_patch, monkeypatch):
    """Importing the module patches: its warning about a function it does not know named the module's own last
    line (stacklevel 2 from patch()), not the line that imported it."""
    ds_patch(False)
    monkeypatch.setattr(zero12.DeepSpeedZeroOptimizer, "reload_states", lambda self, non_blocking=False: None)
    with pytest.warns(RuntimeWarning, match=r"DeepSpeedZeroOptimizer\.reload_states") as warned:
        importlib.reload(osd)
    assert [(w.filename, w.lineno) for w in warned] == [(__file__, inspect.currentframe().f_lineno - 1)]


def test_a_module_imported_after_patch_gets_the_replacement_and_loses_it_on_unpatch(ds_patch, monkeypatch):
    ds_patch(True)
    late = types.ModuleType("deepspeed.optimshift_probe_late")
    exec("from deepspeed.runtime.zero.offload_states import reload_optimizer_states", late.__dict__)
    monkeypatch.setitem(sys.modules, late.__name__, late)
    assert late.reload_optimizer_states is zero12.reload_optimizer_states is not SHIPPED["reload"]
    ds_patch(False)
    assert late.reload_optimizer_states is SHIPPED["reload"]


# --- the optimizer-state functions, on the simulated accelerator -------------------------------------------------


def _sim_params(sim) -> list[torch.nn.Parameter]:
    torch.manual_seed(0)
    return list(torch.nn.Linear(4, 3).to(sim).parameters())


def _cycle(opt, device: str) -> None:
    """What ZeRO-1/2's offload_states and reload_states do with the optimizer state: the functions by the names
    stage_1_and_2 imported, with its arguments (pin_memory=True is its default)."""
    zero12.offload_optimizer_states(opt, "cpu", pin_memory=True, non_blocking=False)
    zero12.reload_optimizer_states(opt, device, non_blocking=False)


@pytest.mark.parametrize("config", list(SIM_CONFIGS))
def test_shipped_and_patched_optimizer_state_cycles_on_the_simulated_accelerator(sim, ds_patch, monkeypatch, config):
    """Per cycle, both ways: host syncs of the step after the reload (patched: a fresh optimizer's 0; shipped:
    `step` on the device), objects kept, placement against a fresh optimizer, new host buffers after the first
    cycle (patched: none; shipped: one pinned buffer per tensor per offload), and the values after 3 cycles and
    a step against a run that never offloaded."""
    from deepspeed.accelerator import get_accelerator

    pins = [0]
    accelerator = get_accelerator()
    real_pin = accelerator.pin_empty_like

    def counting_pin(*args, **kwargs):
        pins[0] += 1
        return real_pin(*args, **kwargs)

    monkeypatch.setattr(accelerator, "pin_empty_like", counting_pin)

    reference_params = _sim_params(sim)
    reference = _make(config)(reference_params)
    for seed in range(CYCLES + 1):
        step_with_grads(reference_params, reference, seed=seed)

    results = {}
    for patched in (False, True):
        ds_patch(patched)
        params = _sim_params(sim)
        opt = _make(config)(params)
        step_with_grads(params, opt, seed=0)
        expected = fresh_layout(_make(config), params)
        objects = _tensors(opt)
        syncs, kept, placed, new_host, on_device = [], [], [], [], []
        for cycle in range(CYCLES):
            on_device.append(sum(v.device.type != "cpu" for st in opt.state.values() for v in st.values()))
            pins[0] = 0
            allocations = optimshift.host_pool.stats().allocations
            _cycle(opt, str(sim))
            new_host.append(pins[0] + optimshift.host_pool.stats().allocations - allocations)
            kept.append(_same(_tensors(opt), objects))
            placed.append(layout(opt) == expected)
            syncs.append(count_step_syncs(params, opt, seed=cycle + 1))
        results[patched] = (syncs, kept, placed, new_host, _values(opt), [p.detach().cpu() for p in params])
        results[patched, "on_device"] = on_device

    ours, shipped = results[True], results[False]
    assert ours[0] == [0] * CYCLES, "patched: no host sync in a step after a reload"
    assert shipped[0] == [SHIPPED_SYNCS_PER_PARAM[config] * len(ours[5])] * CYCLES
    assert ours[1] == [1.0] * CYCLES and shipped[1] == [0.0] * CYCLES, "patched keeps every object"
    assert all(ours[2]), "patched: where a fresh optimizer keeps it"
    assert all(shipped[2]) == (config in ("AdamW-fused", "SGD-momentum")), "shipped: step on the device"
    assert ours[3][1:] == [0] * (CYCLES - 1), "patched: no new host buffer after the first cycle"
    # shipped: a new pinned buffer per device tensor per offload (`step` too, once a reload put it there)
    tensors = len([v for v in _values(reference).values() if isinstance(v, torch.Tensor)])
    assert shipped[3] == results[False, "on_device"] and shipped[3][1:] == [tensors] * (CYCLES - 1)
    reference_values = _values(reference)
    for values, final in (ours[4:], shipped[4:]):
        assert _bitwise(values, reference_values), "the values of a run that never offloaded"
        assert all(torch.equal(a, b.detach().cpu()) for a, b in zip(final, reference_params))


def test_no_state_yet_nothing_happens_and_a_cpu_adam_is_left_to_deepspeed(sim, ds_patch, caplog, monkeypatch):
    monkeypatch.setattr(osd, "_logged", set())  # (each reason is logged once per process)
    ds_patch(True)
    params = _sim_params(sim)
    opt = _make("AdamW-foreach")(params)
    allocations = optimshift.host_pool.stats().allocations
    _cycle(opt, str(sim))
    assert len(opt.state) == 0 and not optimshift.is_offloaded(opt)
    assert optimshift.host_pool.stats().allocations == allocations

    # ZeRO-Offload's optimizer (DeepSpeedCPUAdam, whose op does not build here: a class of that name) keeps its
    # state on the host: DeepSpeed's own functions move it, and one line says why.
    cpu_adam = type("DeepSpeedCPUAdam", (O.AdamW,), {})
    host_params = [torch.nn.Parameter(torch.randn(3))]
    opt = cpu_adam(host_params, lr=1e-2)
    step_with_grads(host_params, opt, seed=0)
    with caplog.at_level(logging.INFO, logger="optimshift"):
        for _ in range(2):
            _cycle(opt, "cpu")
    assert not optimshift.is_offloaded(opt)
    lines = [r.getMessage() for r in caplog.records if "left as DeepSpeed made it" in r.getMessage()]
    assert len(lines) == 1 and "DeepSpeedCPUAdam" in lines[0] and "ZeRO-Offload" in lines[0]


@pytest.mark.parametrize("seed, progress", [(0, 0.0), (1, 0.05), (2, 0.3)])
def test_non_blocking_cycles_are_race_free_and_match_the_blocking_run(sim, ds_patch, seed, progress):
    """``non_blocking=True`` (what OpenRLHF passes when it asks for it) offloads and reloads on a side stream;
    under the simulator's deferred streams a checkpoint right after the offload and the steps after each reload
    see exactly what the blocking run sees."""

    def run(deferred: bool):
        ds_patch(True)
        params = _sim_params(sim)
        opt = _make("AdamW-foreach")(params)
        step_with_grads(params, opt, seed=0)
        saved = []
        with deferred_streams(seed=seed, progress=progress) if deferred else _Nothing():
            for cycle in range(CYCLES):
                zero12.offload_optimizer_states(opt, "cpu", pin_memory=True, non_blocking=deferred)
                saved.append(_values(opt))
                zero12.reload_optimizer_states(opt, str(sim), non_blocking=deferred)
                step_with_grads(params, opt, seed=cycle + 1)
        return saved, [p.detach().cpu() for p in params]

    (saved, params), (ref_saved, ref_params) = run(True), run(False)
    assert all(_bitwise(a, b) for a, b in zip(saved, ref_saved))
    assert all(torch.equal(a, b) for a, b in zip(params, ref_params))


@pytest.mark.parametrize("held", ["offloaded", "streamed"])
def test_an_optimizer_optimshift_holds_is_not_handed_to_deepspeeds_reload(sim, ds_patch, held):
    """Its state became one optimshift cannot place (a group removed while offloaded or streamed): DeepSpeed's own
    reload read the host copies still in flight (StreamRaceError) or took the streamed state off the host."""
    ds_patch(True)
    p, q = (torch.nn.Parameter(torch.zeros(n, device=sim)) for n in (2, 3))
    opt = O.SGD([{"params": [p]}, {"params": [q]}], lr=0.1, momentum=0.9)
    for t in (p, q):
        opt.state[t]["momentum_buffer"] = torch.ones_like(t)
    with deferred_streams(seed=0, progress=0.0):
        if held == "offloaded":
            zero12.offload_optimizer_states(opt, "cpu", pin_memory=True, non_blocking=True)
        else:
            optimshift.stream(opt)
        del opt.param_groups[1]
        if held == "offloaded":
            with pytest.raises(ValueError, match="in no param group"):
                zero12.reload_optimizer_states(opt, str(sim), non_blocking=True)
            assert optimshift.is_offloaded(opt)
        else:
            zero12.reload_optimizer_states(opt, str(sim), non_blocking=True)
            assert optimshift.is_streamed(opt)
        optimshift.wait(opt)
    assert opt.state[p]["momentum_buffer"].device.type == "cpu"


class _Nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


# --- the engine: deepspeed.initialize on the CPU accelerator, 1 gloo rank ---------------------------------------


@pytest.fixture(scope="module")
def process_group(tmp_path_factory):
    """One gloo rank for DeepSpeed, through a file store (no port), torn down after this module. DeepSpeed's
    CPU communication also builds a shared-memory all-reduce op on first use (a compiler run of ~40 s); gloo does
    the same collectives, so it is not built."""
    import torch.distributed as dist

    comm = sys.modules["deepspeed.comm.torch"]
    saved = comm.build_shm_op
    comm.build_shm_op = lambda: None
    store = tmp_path_factory.mktemp("deepspeed") / "store"
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    local_rank = os.environ.get("LOCAL_RANK")
    os.environ["LOCAL_RANK"] = "0"  # DeepSpeed's engine asks for it (launchers set it); taken away afterwards:
    # Accelerate and Transformers read a set LOCAL_RANK as a distributed launch
    # The simulated accelerator (set up by the tests above) switches module conversions to swap_tensors, which
    # refuses a param the client optimizer holds weakly; DeepSpeed's engine (its bf16 cast, its checkpoint load)
    # is used with torch's default, .data.
    swapping = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(False)
    yield
    torch.__future__.set_swap_module_params_on_conversion(swapping)
    if local_rank is None:
        os.environ.pop("LOCAL_RANK", None)
    else:
        os.environ["LOCAL_RANK"] = local_rank
    comm.build_shm_op = saved
    if owned:
        dist.destroy_process_group()


def _engine(stage: int, config: str, **zero):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = _make(config, CONFIGS)(model.parameters())
    ds_config = {
        "train_micro_batch_size_per_gpu": 2,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": stage, **zero},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config, dist_init_required=False)
    return engine


def _train(engine, seed: int) -> None:
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    loss = engine(x).float().pow(2).mean()
    engine.backward(loss)
    engine.step()


def _engine_values(engine) -> dict:
    """The fp32 partitions, the inner optimizer's state and the bf16 weights, as host copies."""
    zero = engine.optimizer
    out = {("hp", i): t.detach().clone() for i, t in enumerate(zero.single_partition_of_fp32_groups)}
    out.update({("state",) + k: v for k, v in _values(zero.optimizer).items() if isinstance(v, torch.Tensor)})
    out.update({("lp", n): p.detach().clone() for n, p in engine.module.named_parameters()})
    return out


@pytest.mark.parametrize(
    "stage, config",
    [(2, c) for c in CONFIGS] + [(1, "AdamW-foreach")],  # (ZeRO-1: the same offload code)
)
def test_engine_cycles_match_a_run_that_never_offloaded_and_reuse_the_pool(process_group, ds_patch, stage, config):
    """3 offload_states/reload_states cycles and a step after each, shipped and patched, against the same training
    never offloaded: bitwise the same. Patched, the fp32 partitions and bf16 flat params go to pool buffers
    (the same ones every cycle: no host allocation after the first), the inner state tensors stay the same objects
    and offload_states moves what DeepSpeed moves; shipped, every offload pins new partition buffers."""
    ds_patch(False)
    reference = _engine(stage, config)
    assert type(reference.optimizer) is zero12.DeepSpeedZeroOptimizer
    for seed in range(CYCLES + 1):
        _train(reference, seed)
    expected = _engine_values(reference)

    for patched in (False, True):
        ds_patch(patched)
        engine = _engine(stage, config)
        zero = engine.optimizer
        _train(engine, 0)
        objects = _tensors(zero.optimizer)
        # (the pool is the process's: idle buffers of this size that earlier tests left would be handed out in
        # turn, so "the same buffers every cycle" is asked of a pool holding only this engine's)
        optimshift.host_pool.release_idle()
        buffers, allocations, in_pool = [], [], []
        for cycle in range(CYCLES):
            before = optimshift.host_pool.stats().allocations
            engine.offload_states()
            assert {s.name for s in zero.offloaded_states} == {"hp_params", "lp_params", "lp_grads", "optim_states"}
            # (patched: only the addresses; a view kept here would keep the pool from handing its buffer out again)
            buffers.append(
                [(None if patched else b, b.untyped_storage().data_ptr()) for b in zero.hp_params_pin_buffers]
            )
            pooled = optimshift.host_pool.in_use_storages()
            in_pool.append(
                [t.untyped_storage().data_ptr() in pooled for t in zero.hp_params_pin_buffers + zero.bit16_groups_flat]
            )
            engine.reload_states()
            assert not zero.offloaded_states and not hasattr(zero, "hp_params_pin_buffers")
            allocations.append(optimshift.host_pool.stats().allocations - before)
            assert _same(_tensors(zero.optimizer), objects) == 1.0  # on the CPU accelerator, shipped too
            _train(engine, cycle + 1)
        got = _engine_values(engine)
        assert _bitwise(got, expected), f"{'patched' if patched else 'shipped'}: not the never-offloaded run"
        first = [ptr for _, ptr in buffers[0]]
        if patched:
            assert all(all(p) for p in in_pool), "the fp32 partitions and bf16 flat params live in the pool"
            assert allocations[0] <= 2 and allocations[1:] == [0] * (CYCLES - 1)  # hp + lp (or idle ones), then reused
            assert all([ptr for _, ptr in b] == first for b in buffers), "the same pool buffers every cycle"
        else:
            assert allocations == [0] * CYCLES and not any(any(p) for p in in_pool)  # DeepSpeed's own buffers
            assert all(b[0][0] is not buffers[0][0][0] for b in buffers[1:]), "a new buffer every offload"
        ds_patch(False)


def test_engine_non_blocking_cycles_match_the_blocking_run(process_group, ds_patch):
    """offload_states(non_blocking=True) / reload_states(non_blocking=True), patched: the optimizer state is
    reloaded after DeepSpeed's own synchronize, left in flight for the step to wait for; same values."""
    runs = []
    for non_blocking in (False, True):
        ds_patch(True)
        engine = _engine(2, "AdamW-foreach")
        _train(engine, 0)
        for cycle in range(CYCLES):
            engine.offload_states(non_blocking=non_blocking)
            engine.reload_states(non_blocking=non_blocking)
            _train(engine, cycle + 1)
        runs.append(_engine_values(engine))
    assert _bitwise(runs[0], runs[1])


def test_a_checkpoint_taken_while_offloaded_resumes_to_the_same_training(process_group, ds_patch, tmp_path):
    """engine.save_checkpoint with every state offloaded (the partitions in pool buffers): each saved tensor
    holds its own bytes (no pool buffer in the file), and an engine resumed from it trains on exactly as the
    offloaded one once reloaded."""
    ds_patch(True)
    engine = _engine(2, "AdamW-foreach")
    for seed in range(2):
        _train(engine, seed)
    engine.offload_states()
    pooled = optimshift.host_pool.in_use_storages()
    assert {t.untyped_storage().data_ptr() for t in engine.optimizer.single_partition_of_fp32_groups} <= pooled
    engine.save_checkpoint(str(tmp_path), tag="offloaded")
    engine.reload_states()
    _train(engine, 2)

    saved = [
        torch.load(f, map_location="cpu", weights_only=False) for f in sorted((tmp_path / "offloaded").glob("*optim*"))
    ]
    assert saved, "a ZeRO checkpoint file"
    for sd in saved:
        for t in sd["optimizer_state_dict"]["single_partition_of_fp32_groups"]:
            assert t.untyped_storage().nbytes() == t.numel() * t.element_size(), "a pool buffer went into the file"

    ds_patch(False)
    resumed = _engine(2, "AdamW-foreach")
    resumed.load_checkpoint(str(tmp_path), tag="offloaded")
    _train(resumed, 2)
    assert _bitwise(_engine_values(resumed), _engine_values(engine))


def test_zero_offload_and_zero_3_are_left_to_deepspeed_with_one_line(process_group, ds_patch, caplog, monkeypatch):
    """ZeRO-Offload (the optimizer on the host, a DeepSpeedCPUAdam: its op does not build here, so a real ZeRO-2
    engine with the flag set and its optimizer's class so named stands in, for the offload) and ZeRO-3 (its own
    offload keeps a persistent buffer and leaves `step` alone) go DeepSpeed's own way: its buffers, none of the
    pool's; one log line per kind says why."""
    monkeypatch.setattr(osd, "_logged", set())  # (each reason is logged once per process)
    ds_patch(True)
    engine = _engine(2, "AdamW-foreach")
    _train(engine, 0)
    zero, inner_class = engine.optimizer, type(engine.optimizer.optimizer)
    zero.cpu_offload = True
    zero.optimizer.__class__ = type("DeepSpeedCPUAdam", (inner_class,), {})
    before = optimshift.host_pool.stats().allocations
    with caplog.at_level(logging.INFO, logger="optimshift"):
        for _ in range(2):
            engine.offload_states()
    assert not optimshift.is_offloaded(zero.optimizer)
    assert optimshift.host_pool.stats().allocations == before
    pooled = optimshift.host_pool.in_use_storages()
    assert not any(t.untyped_storage().data_ptr() in pooled for t in zero.single_partition_of_fp32_groups)
    zero.cpu_offload = False  # (DeepSpeed's reload of a real ZeRO-Offload engine links its host partitions)
    zero.optimizer.__class__ = inner_class
    engine.reload_states()
    _train(engine, 1)

    # ZeRO-3's offload_states moves only DeepSpeed's FusedAdam state (a CUDA op): its own check refuses the torch
    # AdamW here, which shows its own code ran.
    stage3 = _engine(3, "AdamW-foreach")
    _train(stage3, 0)
    with caplog.at_level(logging.INFO, logger="optimshift"):
        for _ in range(2):
            with pytest.raises(AssertionError, match="FusedAdam"):
                stage3.offload_states()
    _train(stage3, 1)
    lines = [r.getMessage() for r in caplog.records if "left as DeepSpeed made it" in r.getMessage()]
    assert len(lines) == 2, lines
    assert "ZeRO-Offload" in lines[0] and "DeepSpeedZeroOptimizer_Stage3" in lines[1]
    assert "persistent" in lines[1]


def test_include_moves_only_what_it_names(process_group, ds_patch):
    """offload_states(include=...) as OpenRLHF and others pass it: only the named states move, each its own way
    (the optimizer state through optimshift, the fp32 partitions into pool buffers), and a second offload of the
    rest completes it."""
    from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum as S

    ds_patch(True)
    engine = _engine(2, "AdamW-foreach")
    zero = engine.optimizer
    _train(engine, 0)
    engine.offload_states(include=[S.optim_states])
    assert optimshift.is_offloaded(zero.optimizer) and not hasattr(zero, "hp_params_pin_buffers")
    assert zero.offloaded_states == {S.optim_states}
    engine.offload_states(include=[S.hp_params])
    pooled = optimshift.host_pool.in_use_storages()
    assert all(t.untyped_storage().data_ptr() in pooled for t in zero.single_partition_of_fp32_groups)
    assert zero.offloaded_states == {S.optim_states, S.hp_params}
    engine.reload_states()
    assert not optimshift.is_offloaded(zero.optimizer) and not zero.offloaded_states
    pooled = optimshift.host_pool.in_use_storages()
    assert not any(t.untyped_storage().data_ptr() in pooled for t in zero.single_partition_of_fp32_groups)
    _train(engine, 1)


def test_partitions_are_copied_out_of_the_pool_only_for_a_reload_onto_the_host(process_group, ds_patch):
    """On DeepSpeed's CPU accelerator its reload (``.to("cpu")``) moves nothing, so the partitions are copied out
    of their pool buffers first; onto an accelerator its ``.to(device)`` is the copy, and nothing is copied on the
    host (a host allocation per cycle on a GPU, which the engine tests here cannot see)."""
    ds_patch(True)
    engine = _engine(2, "AdamW-foreach")
    zero = engine.optimizer
    _train(engine, 0)
    engine.offload_states()
    held = osd._held(zero)
    pooled = optimshift.host_pool.in_use_storages()

    def in_pool() -> list[bool]:
        return [t.untyped_storage().data_ptr() in pooled for t in zero.single_partition_of_fp32_groups]

    assert all(in_pool())
    osd._own_on_host(zero, held, "cuda:0")
    assert all(in_pool()), "copied on the host for a reload onto a device"
    osd._own_on_host(zero, held, "cpu")
    assert not any(in_pool())
    engine.reload_states()
    _train(engine, 1)


def test_engine_offload_and_reload_states_go_the_one_road(process_group, ds_patch, monkeypatch):
    """Patched, ``engine.offload_states()``/``reload_states()`` (what OpenRLHF's sleep calls) move the inner
    optimizer's state by one plan, copy and commit each (a spy on optimshift's engine), as every operation does."""
    from optimshift import _engine as core

    ds_patch(True)
    engine = _engine(2, "AdamW-foreach")
    _train(engine, 0)
    seen: dict[str, int] = {"run": 0, "commit": 0}
    for name in seen:
        real = getattr(core, name)

        def spy(*args, _real=real, _name=name, **kwargs):
            seen[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(core, name, spy)
    engine.offload_states()
    assert seen == {"run": 1, "commit": 1}
    engine.reload_states()
    assert seen == {"run": 2, "commit": 2}
    _train(engine, 1)


def test_a_non_blocking_reload_states_whose_state_reload_fails_still_says_offloaded(
    process_group, ds_patch, monkeypatch
):
    """reload_states(non_blocking=True) takes optim_states off DeepSpeed's list before optimshift reloads the
    state after DeepSpeed's reload: where that reload fails (out of memory), DeepSpeed's record says offloaded
    again (it said reloaded while the state stayed on the host), and a retry reloads it."""
    ds_patch(True)
    engine = _engine(2, "AdamW-foreach")
    _train(engine, 0)
    zero = engine.optimizer
    engine.offload_states()
    real = osd._reload

    def failing(*args, **kwargs):
        raise torch.OutOfMemoryError("no room (a test)")

    monkeypatch.setattr(osd, "_reload", failing)
    with pytest.raises(torch.OutOfMemoryError):
        engine.reload_states(non_blocking=True)
    assert "optim_states" in {s.name for s in zero.offloaded_states}
    assert optimshift.is_offloaded(zero.optimizer)
    monkeypatch.setattr(osd, "_reload", real)
    engine.reload_states()
    assert not zero.offloaded_states and not optimshift.is_offloaded(zero.optimizer)
    _train(engine, 1)


def test_a_non_blocking_reload_states_that_fails_before_deepspeeds_reload_still_says_offloaded(
    process_group, ds_patch, monkeypatch
):
    """reload_states(non_blocking=True) whose copy of the partitions out of their pool buffers (a reload onto the
    host) fails, before DeepSpeed's reload ran: DeepSpeed's record still says the optimizer state is offloaded (it
    said reloaded while the state stayed on the host, and a retry left it there)."""
    ds_patch(True)
    engine = _engine(2, "AdamW-foreach")
    _train(engine, 0)
    zero = engine.optimizer
    engine.offload_states()

    def failing(*args, **kwargs):
        raise torch.OutOfMemoryError("no room on the host (a test)")

    with monkeypatch.context() as patched:
        patched.setattr(osd, "_own_on_host", failing)
        with pytest.raises(torch.OutOfMemoryError):
            engine.reload_states(non_blocking=True)
    assert "optim_states" in {s.name for s in zero.offloaded_states}
    assert optimshift.is_offloaded(zero.optimizer)
    engine.reload_states()
    assert not zero.offloaded_states and not optimshift.is_offloaded(zero.optimizer)
    _train(engine, 1)


@pytest.mark.parametrize("interrupted", [False, True], ids=["failed", "Ctrl-C as its event is recorded"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_non_blocking_reload_states_that_fails_gives_its_buffers_back_after_their_copies(
    sim, monkeypatch, seed, interrupted
):
    """A non-blocking ``reload_states`` that fails after DeepSpeed queued the copies out of the pool buffers it was
    handed (and dropped them: ``del self.hp_params_pin_buffers``), before its closing synchronize: the buffers go back
    to the pool reused only once those copies completed (they went back with none, and the next request overwrote
    them under the copies: the fp32 partitions on the device took the new bytes). Also where a Ctrl-C lands as the
    failure's event is recorded (it left none, and the buffers went back without it)."""
    import signal

    real_event = osd._current_stream_event

    def event_then_ctrl_c(devices):
        os.kill(os.getpid(), signal.SIGINT)  # (delivered as it returns, before the event is recorded)
        return real_event(devices)

    if interrupted:
        monkeypatch.setattr(osd, "_current_stream_event", event_then_ctrl_c)
    monkeypatch.setattr(osd, "_why_not_zero", lambda zero: None)
    at = types.SimpleNamespace(current_device_name=lambda: str(sim))
    monkeypatch.setattr(deepspeed.accelerator, "get_accelerator", lambda: at)

    class Zero:  # (the attributes DeepSpeed's reload_states reads and this patch reads)
        optimizer = None
        offloaded_states: set = set()

    with deferred_streams(seed=seed, progress=0.0):
        zero = Zero()
        values = torch.arange(3 * 1024, dtype=torch.float32)
        zero.single_partition_of_fp32_groups = [values.to(sim)]
        torch.sim.synchronize(0)
        osd._hand_over(zero, "hp_params", osd._held(zero))
        [view] = zero.hp_params_pin_buffers
        view.copy_(values)
        del view  # (a view kept here would keep the pool from reusing the buffer)

        def shipped(self, non_blocking=False):  # DeepSpeed's reload, failing before its closing synchronize
            for buf in self.single_partition_of_fp32_groups:
                buf.data = self.hp_params_pin_buffers[0].to(sim, non_blocking=non_blocking)
            del self.hp_params_pin_buffers
            raise RuntimeError("injected: a failure after the copies were queued")

        # (on a current stream other than the default one, which the simulator never runs behind the host)
        raised = pytest.raises(KeyboardInterrupt) if interrupted else pytest.raises(RuntimeError, match="injected")
        with torch.sim.stream(torch.sim.Stream(sim)), raised:
            osd._make_reload_states(shipped)(zero, non_blocking=True)
        optimshift.host_pool.acquire(values.numel() * 4, pinned=False).fill_(255)  # (the next request writes its own)
        torch.sim.synchronize(0)  # (the copies run: one whose source changed under it raises)
        assert torch.equal(zero.single_partition_of_fp32_groups[0].cpu(), values), "overwritten under its copy"
