"""offload(keep_addresses=True) and reload on the simulated accelerator, through the public API: the state comes
back as the same objects at the same data_ptr(), bitwise, its memory unmapped while offloaded; every driver call
failing in turn; views held outside the optimizer; two devices; non-blocking cycles under strict schedules.

The simulator's driver (optimshift.testing._sim_vmm) is the same interface the CUDA driver implements: a reserved
host range whose pages are released and mapped again, where an access to unmapped memory raises.
"""

from __future__ import annotations

import copy as copy_module
import gc
import inspect
import logging
import threading
import time
import warnings

import pytest
import torch

import optimshift
from _matrix import Model, bitwise_equal, snapshot, train
from _schedules import SCHEDULES, drain_queued  # noqa: F401  (drain_queued: an autouse fixture)
from optimshift import _addresses, _device_streams, _engine, _vmm
from optimshift._state import leaves
from optimshift.testing import deferred_streams, simulated_memory_allocated
from optimshift.testing._sim_vmm import FaultyDriver, SimDriver

SHAPES = [(3, 2), (4,), (2, 5), (1,)]
CONFIGS = [
    pytest.param(torch.optim.Adam, {"foreach": True}, id="Adam-foreach"),
    pytest.param(torch.optim.AdamW, {"fused": True}, id="AdamW-fused"),
    pytest.param(torch.optim.Adam, {"capturable": True, "foreach": True}, id="Adam-capturable"),
    pytest.param(torch.optim.SGD, {"momentum": 0.9, "foreach": False}, id="SGD-momentum"),
]


class _FromHere:
    """The simulator's driver (one per process), its mapped bytes counted from the test's start: what an earlier
    test that failed left mapped (its optimizer kept alive by the traceback pytest holds) is not this test's.
    Everything else is the driver's."""

    def __init__(self, driver: SimDriver) -> None:
        self._driver = driver
        self._base = {device: driver.mapped(device) for device in (0, 1)}

    def mapped(self, device: int = 0) -> int:
        return self._driver.mapped(device) - self._base.get(device, 0)

    def __getattr__(self, name: str) -> object:
        return getattr(self._driver, name)


@pytest.fixture
def driver(sim, request):
    """The simulator's driver (:class:`_FromHere`). A test that passed must leave nothing mapped once its objects
    are gone: checked after it, so that a leak is its own error, whatever runs next."""
    d = _vmm.driver_for(sim)
    assert isinstance(d, SimDriver)
    gc.collect()  # (an earlier test's optimizers, gone but for cycles)
    here = _FromHere(d)
    yield here
    report = getattr(request.node, "rep_call", None)
    if report is not None and report.passed:
        gc.collect()
        assert [here.mapped(0), here.mapped(1)] == [0, 0], "the test left device memory mapped"


def _trained(device, cls=torch.optim.Adam, kwargs=None, shapes=SHAPES, steps=2):
    model = Model(shapes).to(device)
    opt = cls(list(model.parameters()), **({"foreach": True} if kwargs is None else kwargs))
    train(model, opt, range(steps))
    return model, opt


def _where(opt):
    """{(param index, path): (id, data_ptr, device)} of every state tensor on an accelerator."""
    params = [p for g in opt.param_groups for p in g["params"]]
    return {
        (i, path): (id(t), t.data_ptr(), t.device)
        for i, p in enumerate(params)
        for path, t in leaves(opt.state.get(p, {}))
        if t.device.type != "cpu"
    }


def _device_state_bytes(opt):
    return sum(
        t.numel() * t.element_size() for st in opt.state.values() for _, t in leaves(st) if t.device.type != "cpu"
    )


def _state_values(opt):
    return [snapshot(dict(st)) for st in opt.state.values()]


@pytest.mark.parametrize("cls, kwargs", CONFIGS)
def test_ten_cycles_keep_objects_and_addresses_bitwise(sim, driver, cls, kwargs):
    ref_model, ref = _trained(sim, cls, kwargs)
    model, opt = _trained(sim, cls, kwargs)
    first = None
    for cycle in range(10):
        optimshift.offload(opt, keep_addresses=True)
        assert driver.mapped(0) == 0 or cycle == 0  # (the first offload leaves allocator memory)
        optimshift.reload(opt)
        now = _where(opt)
        if first is None:
            first = now  # the first reload lays the state out in a reserved range: addresses change once
        assert now == first, f"cycle {cycle}: an object or an address changed"
        train(model, opt, range(2 + cycle, 3 + cycle))
        train(ref_model, ref, range(2 + cycle, 3 + cycle))
        assert _where(opt) == first  # the step writes in place
    assert bitwise_equal(_state_values(opt), _state_values(ref))
    assert all(bitwise_equal(a, b) for a, b in zip(model.parameters(), ref_model.parameters()))
    assert [f for f in optimshift.check(opt).findings if f.severity != "info"] == []


def test_the_state_memory_is_released_while_offloaded(sim, driver):
    model, opt = _trained(sim, shapes=[(64, 64), (64,), (32, 48)])
    optimshift.keep_addresses(opt)
    state = _device_state_bytes(opt)
    on = simulated_memory_allocated(0)
    before = _where(opt)
    optimshift.offload(opt, keep_addresses=True)
    off = simulated_memory_allocated(0)
    assert on - off >= 0.95 * state, (on, off, state)
    assert driver.mapped(0) == 0
    optimshift.reload(opt)
    assert _where(opt) == before and simulated_memory_allocated(0) == on


def test_without_keep_addresses_addresses_change_and_a_kept_range_is_released(sim, driver):
    """The control: today's offload gives new addresses; one without keep_addresses of state kept in a range
    takes it out of the range (and unmaps it)."""
    model, opt = _trained(sim)
    optimshift.keep_addresses(opt)
    kept = _where(opt)
    optimshift.offload(opt)  # (not keeping: the reload allocates as usual)
    assert driver.mapped(0) == 0
    optimshift.reload(opt)
    assert {k: v[1] for k, v in _where(opt).items()} != {k: v[1] for k, v in kept.items()}
    assert {k: v[0] for k, v in _where(opt).items()} == {k: v[0] for k, v in kept.items()}  # objects kept


@pytest.mark.parametrize("to", ["sim:1", "cpu"])
def test_a_rebind_that_takes_the_state_out_of_its_range_releases_it(sim, driver, to):
    """``rebind`` onto params on another device takes the state out of its range, as a move does: the range's
    memory is unmapped. Before, it stayed mapped (the state's memory on the old device) until the next offload."""
    model, opt = _trained(sim)
    optimshift.keep_addresses(opt)
    assert driver.mapped(0) > 0
    values = _state_values(opt)
    moved = copy_module.deepcopy(model).to(torch.device(to))
    optimshift.rebind(opt, moved.parameters())
    gc.collect()
    assert driver.mapped(0) == 0 and bitwise_equal(_state_values(opt), values)


def test_a_host_checkpoint_is_written_into_kept_state_in_place(sim, driver):
    """A host checkpoint loaded into state kept at fixed addresses is written into the slots: same objects, same
    addresses, the range still mapped, nothing else allocated on the device. Before, its entries were copied to
    the device and the copies adopted: the state left its slots (new addresses for a CUDA graph) and was, during
    the load, twice on the device."""
    model, opt = _trained(sim, shapes=[(64, 64), (64,), (32, 48)])
    _, other = _trained(sim, shapes=[(64, 64), (64,), (32, 48)], steps=3)
    host = {"state": {i: {k: v.cpu() for k, v in st.items()} for i, st in other.state_dict()["state"].items()}}
    host["param_groups"] = other.state_dict()["param_groups"]
    optimshift.keep_addresses(opt)
    kept, mapped, on = _where(opt), driver.mapped(0), simulated_memory_allocated(0)
    optimshift.load_state_dict(opt, host)
    assert _where(opt) == kept and driver.mapped(0) == mapped > 0 and simulated_memory_allocated(0) == on
    assert bitwise_equal(_state_values(opt), _state_values(other))


def test_a_load_that_takes_the_state_out_of_its_range_releases_it(sim, driver):
    """A load whose copies the live tensors adopt (a checkpoint of another dtype, cast to the param's: each entry
    is cast on the device and the cast adopted) leaves the slots, as a move does: their memory is unmapped, not
    held beside the loaded state. Before: the range stayed mapped until the next move or offload (the state's
    memory twice)."""
    model, opt = _trained(sim, shapes=[(64, 64), (64,), (32, 48)])
    sd = opt.state_dict()
    host = {
        "state": {
            i: {k: v.cpu() if k == "step" else v.cpu().double() for k, v in st.items()} for i, st in sd["state"].items()
        }
    }
    host["param_groups"] = sd["param_groups"]
    values = _state_values(opt)
    on = simulated_memory_allocated(0)
    optimshift.keep_addresses(opt)
    assert driver.mapped(0) > 0
    objects = {k: v[0] for k, v in _where(opt).items()}
    optimshift.load_state_dict(opt, host, cast="param")
    gc.collect()
    assert driver.mapped(0) == 0 and simulated_memory_allocated(0) <= on
    assert {k: v[0] for k, v in _where(opt).items()} == objects and bitwise_equal(_state_values(opt), values)
    optimshift.keep_addresses(opt)  # (laid out in the range again)
    assert driver.mapped(0) > 0


def test_a_load_unmaps_the_slots_it_left_only_after_the_queued_work(sim, driver, monkeypatch):
    """A checkpoint already on the device is loaded without a host wait, and the last step's work may still use
    the slots the load leaves: the device is synchronized before they are unmapped (unmapping does not wait).
    (``copy=False``: the load installs the checkpoint's own tensors; with a copy, the live tensors take the values
    in place and leave nothing: the test below.)"""
    model, opt = _trained(sim)
    optimshift.keep_addresses(opt)
    sd = copy_module.deepcopy(opt.state_dict())  # (on the device)
    order = []
    real_sync, real_unmap = _device_streams.synchronize, SimDriver.unmap

    def sync(devices):
        devices = list(devices)
        if any(d.type == sim.type for d in devices):
            order.append("synchronize")
        return real_sync(devices)

    def unmap(self, *args, **kwargs):
        order.append("unmap")
        return real_unmap(self, *args, **kwargs)

    monkeypatch.setattr(_device_streams, "synchronize", sync)
    monkeypatch.setattr(SimDriver, "unmap", unmap)
    optimshift.load_state_dict(opt, sd, copy=False)
    assert "unmap" in order and "synchronize" in order[: order.index("unmap")], order


def test_a_load_of_a_device_checkpoint_writes_kept_state_in_place(sim, driver):
    """Into state kept at fixed addresses, a checkpoint on the device is written in place: the same objects at the
    same addresses, the range still mapped, nothing allocated. Before, on the simulator a live tensor never took
    values in place (the Python storage object the simulator makes counted as a second user of its storage)."""
    model, opt = _trained(sim)
    optimshift.keep_addresses(opt)
    kept, mapped = _where(opt), driver.mapped(0)
    sd = {"state": {i: {k: v.clone() + 1 for k, v in st.items()} for i, st in opt.state_dict()["state"].items()}}
    sd["param_groups"] = opt.state_dict()["param_groups"]
    values = [snapshot(dict(st)) for st in sd["state"].values()]
    on = simulated_memory_allocated(0)
    optimshift.load_state_dict(opt, sd)
    assert _where(opt) == kept and driver.mapped(0) == mapped > 0
    assert simulated_memory_allocated(0) == on and bitwise_equal(_state_values(opt), values)


def test_keep_addresses_before_the_first_capture_fixes_them_for_good(sim, driver):
    model, opt = _trained(sim)
    values = _state_values(opt)
    assert optimshift.keep_addresses(opt) is opt
    fixed = _where(opt)
    assert bitwise_equal(_state_values(opt), values)
    for _ in range(3):
        with optimshift.offloaded(opt, keep_addresses=True):
            assert driver.mapped(0) == 0
        assert _where(opt) == fixed
    assert bitwise_equal(_state_values(opt), values)


def test_an_access_to_unmapped_memory_raises_and_reads_right_after_reload(sim, driver):
    """What a graph captured by hand does: it reads the recorded address. Offloaded, that faults; reloaded, it
    reads the state."""
    model, opt = _trained(sim)
    optimshift.keep_addresses(opt)
    t = next(iter(opt.state.values()))["exp_avg"]
    address, nbytes, expected = t.data_ptr(), t.numel() * t.element_size(), t.cpu().view(torch.uint8).clone()
    assert torch.equal(driver.read(sim, address, nbytes), expected.reshape(-1))
    optimshift.offload(opt, keep_addresses=True)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        driver.read(sim, address, nbytes)
    optimshift.reload(opt)
    assert torch.equal(driver.read(sim, address, nbytes), expected.reshape(-1))


def test_tensors_sharing_a_storage_share_a_slot(sim, driver):
    model, opt = _trained(sim, torch.optim.SGD, {"momentum": 0.9, "foreach": False})
    for p in model.parameters():
        n = p.numel()
        flat = torch.arange(2 * n, dtype=torch.float32, device=sim)
        opt.state[p].update(flat=flat, a=flat[:n].view_as(p), b=flat[n:].view_as(p))
    values = _state_values(opt)
    first = None
    for _ in range(3):
        optimshift.offload(opt, keep_addresses=True)
        optimshift.reload(opt)
        first = first or _where(opt)
        assert _where(opt) == first
        for st in opt.state.values():
            base = st["flat"].untyped_storage().data_ptr()
            assert st["a"].untyped_storage().data_ptr() == base == st["b"].untyped_storage().data_ptr()
            assert st["a"].data_ptr() == st["flat"].data_ptr()
            st["flat"].add_(0)  # an update through one shows through the others: one storage
    assert bitwise_equal(_state_values(opt), values)
    st = next(iter(opt.state.values()))
    st["flat"].add_(1)
    assert torch.equal(st["a"].cpu().reshape(-1), st["flat"][: st["a"].numel()].cpu())


def test_state_created_later_joins_at_the_next_reload(sim, driver):
    model, opt = _trained(sim)
    optimshift.keep_addresses(opt)
    old = _where(opt)
    extra = torch.nn.Parameter(torch.randn(7, device=sim))
    opt.add_param_group({"params": [extra]})
    extra.grad = torch.ones_like(extra)
    opt.step()  # its state: allocated as usual
    optimshift.offload(opt, keep_addresses=True)
    optimshift.reload(opt)
    joined = _where(opt)
    assert {k: v for k, v in joined.items() if k in old} == old  # the older state kept its addresses
    assert len(joined) > len(old)
    optimshift.offload(opt, keep_addresses=True)
    optimshift.reload(opt)
    assert _where(opt) == joined


def test_a_group_added_while_offloaded_sharing_the_lr_keeps_its_address(sim, driver):
    """torch's add_param_group fills a new group's lr from the defaults: the kept lr tensor, now at a site the
    layout did not know. It took a new slot (a new address under a captured graph); it keeps its own."""
    params = [torch.nn.Parameter(torch.randn(64, 64, device=sim)), torch.nn.Parameter(torch.randn(64, device=sim))]
    opt = torch.optim.Adam(params, lr=torch.tensor(0.01, device=sim), capturable=True, foreach=True)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    optimshift.keep_addresses(opt)
    lr = opt.param_groups[0]["lr"]
    kept, at = _where(opt), lr.data_ptr()
    optimshift.offload(opt, keep_addresses=True)
    opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(3, device=sim))]})
    optimshift.reload(opt)
    assert opt.param_groups[1]["lr"] is lr and lr.device == sim and lr.data_ptr() == at
    assert _where(opt) == kept


def test_a_tensor_kept_at_all_its_sites_keeps_its_slot_before_one_known_at_some(sim, driver):
    """Groups 0 and 1 share the kept lr L; while offloaded group 0 takes a new lr T, shared by a group added
    then. T sits at one of L's sites and at one the layout does not know: L, known at every site it is held,
    keeps its slot (T, claiming first, took it: L, still group 1's lr, moved under a captured graph)."""
    lr = torch.tensor(0.01, device=sim)
    opt = torch.optim.Adam([torch.nn.Parameter(torch.randn(16, device=sim))], lr=lr, capturable=True, foreach=True)
    opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(16, device=sim))]})
    for g in opt.param_groups:
        for p in g["params"]:
            p.grad = torch.ones_like(p)
    opt.step()
    optimshift.keep_addresses(opt)
    at = lr.data_ptr()
    optimshift.offload(opt, keep_addresses=True)
    other = torch.tensor(0.02)
    opt.param_groups[0]["lr"] = other
    opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(16, device=sim))], "lr": other})
    optimshift.reload(opt)
    assert opt.param_groups[1]["lr"] is lr and lr.data_ptr() == at and other.data_ptr() != at


@pytest.mark.parametrize("operation", ["offload", "move", "stream", "offloaded", "streamed"])
def test_the_warning_about_a_view_held_outside_names_the_line_that_called_the_operation(sim, driver, operation):
    """The release's warning pointed a fixed two frames up: inside optimshift (the offload's or move's done
    callback, the ``streamed`` block's stream) but for a direct ``stream``. It names the caller's line, as
    optimshift's other warnings do (``_errors.warn``)."""
    model, opt = _trained(sim)
    optimshift.keep_addresses(opt)
    exp_avg = next(iter(opt.state.values()))["exp_avg"]
    held = torch.empty(0, device=sim).set_(exp_avg.untyped_storage(), 0, (1,), (1,))
    del exp_avg
    with pytest.warns(UserWarning, match="still viewed by tensors outside the optimizer") as warned:
        if operation == "offload":
            line = inspect.currentframe().f_lineno + 1
            optimshift.offload(opt, keep_addresses=True)
        elif operation == "move":
            line = inspect.currentframe().f_lineno + 1
            optimshift.move(opt, "cpu")
        elif operation == "stream":
            line = inspect.currentframe().f_lineno + 1
            optimshift.stream(opt)
        elif operation == "offloaded":
            line = inspect.currentframe().f_lineno + 1
            with optimshift.offloaded(opt, keep_addresses=True):
                pass
        else:
            line = inspect.currentframe().f_lineno + 1
            with optimshift.streamed(opt):
                pass
    assert {(w.filename, w.lineno) for w in warned} == {(__file__, line)}  # (streamed: its stream's, its unstream's)
    del held
    if optimshift.is_streamed(opt):
        optimshift.unstream(opt)
    optimshift.reload(opt)
    optimshift.move(opt, sim)


def test_views_held_outside_the_optimizer_stay_mapped_with_a_warning(sim, driver):
    model, opt = _trained(sim, shapes=[(64, 1024), (64, 1024), (64, 1024)])  # several blocks of 128 KiB
    optimshift.keep_addresses(opt)
    before = _where(opt)
    state = _device_state_bytes(opt)
    exp_avg = next(iter(opt.state.values()))["exp_avg"]
    # a tensor over its memory kept by the caller (through the storage: a view's autograd base would make the
    # simulator replace exp_avg's object, which only a swap keeps here; on CUDA set_data keeps it either way)
    held = torch.empty(0, device=sim).set_(exp_avg.untyped_storage(), 0, (2, 1024), (1024, 1))
    del exp_avg
    expected = held.cpu()
    with pytest.warns(UserWarning, match="still viewed by tensors outside the optimizer"):
        optimshift.offload(opt, keep_addresses=True)
    assert torch.equal(held.cpu(), expected)  # still readable: its memory was not unmapped under it
    assert 0 < driver.mapped(0) <= 64 * 1024 * 4 + 2 * 128 * 1024  # its slot's blocks only
    assert driver.mapped(0) < 0.5 * state
    optimshift.reload(opt)
    assert _where(opt) == before
    assert held.data_ptr() == next(iter(opt.state.values()))["exp_avg"].data_ptr()
    del held
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        optimshift.offload(opt, keep_addresses=True)
    assert driver.mapped(0) == 0
    optimshift.reload(opt)
    assert _where(opt) == before


def test_two_devices_each_keep_their_own_range(sim, driver):
    sim1 = torch.device(sim.type, 1)
    model = Model(SHAPES)
    model.parts[0].to(sim), model.parts[1].to(sim), model.parts[2].to(sim1), model.parts[3].to(sim1)
    opt = torch.optim.Adam(list(model.parameters()), foreach=False)
    train(model, opt, range(2))
    values = _state_values(opt)
    optimshift.keep_addresses(opt)
    kept = _where(opt)
    assert {v[2] for v in kept.values()} == {sim, sim1}
    layout = _addresses.layout_of(opt)
    assert layout is not None and {r.mapped.device for r in layout.ranges} == {sim, sim1}
    for (_, _), (_, ptr, device) in kept.items():  # each tensor in a range of its own device
        assert any(
            r.mapped.device == device and r.mapped.address <= ptr < r.mapped.address + r.mapped.size
            for r in layout.ranges
        )
    for _ in range(3):
        optimshift.offload(opt, keep_addresses=True)
        assert driver.mapped(0) == 0 and driver.mapped(1) == 0
        optimshift.reload(opt)
        assert _where(opt) == kept and driver.mapped(0) > 0 and driver.mapped(1) > 0
    assert bitwise_equal(_state_values(opt), values)


def test_a_move_elsewhere_leaves_the_range_and_frees_it(sim, driver):
    sim1 = torch.device(sim.type, 1)
    model, opt = _trained(sim)
    optimshift.keep_addresses(opt)
    assert driver.mapped(0) > 0
    values = _state_values(opt)
    model.to(sim1)
    optimshift.move(opt)  # each param's state follows it
    assert driver.mapped(0) == 0
    assert bitwise_equal(_state_values(opt), values)
    optimshift.offload(opt, keep_addresses=True)
    optimshift.reload(opt, device=sim)  # reload(device=) allocates as usual there
    assert driver.mapped(0) == 0 and driver.mapped(1) == 0


def test_streaming_state_kept_at_fixed_addresses_frees_its_range(sim, driver):
    """``stream()`` lays the state out on the host: the memory its reserved range held is unmapped then, as after
    a move (it stayed mapped until the next offload or move). Unstreamed, it is allocated as usual, bitwise."""
    model, opt = _trained(sim)
    optimshift.keep_addresses(opt)
    assert driver.mapped(0) > 0
    values = _state_values(opt)
    optimshift.stream(opt)
    assert driver.mapped(0) == 0
    optimshift.unstream(opt)
    assert bitwise_equal(_state_values(opt), values)
    assert all(t.device == sim for st in opt.state.values() for k, t in st.items() if k != "step")


def test_keep_addresses_of_a_streamed_optimizer_is_refused_naming_keep_addresses(sim, driver):
    """``keep_addresses(opt)`` of a streamed optimizer was refused by the offload it runs, so the error said
    "offload would take it from there": it names keep_addresses now, with nothing changed."""
    model, opt = _trained(sim)
    optimshift.stream(opt)
    values = _state_values(opt)
    with pytest.raises(ValueError, match="keep_addresses would take it from there") as info:
        optimshift.keep_addresses(opt)
    assert "offload" not in str(info.value) and "optimshift.unstream(optimizer)" in str(info.value)
    assert optimshift.is_streamed(opt) and driver.mapped(0) == 0
    assert bitwise_equal(_state_values(opt), values)
    optimshift.unstream(opt)


def test_streaming_with_a_view_held_outside_warns_once_streamed(sim, driver):
    """A slot a view outside keeps alive stays mapped, with the release's warning: raised as an error (``-W
    error``), it comes once the optimizer is streamed, never between the layout and the mode (found by review:
    the state was on the host and the optimizer not streamed)."""
    model, opt = _trained(sim)
    optimshift.keep_addresses(opt)
    outside = next(iter(opt.state.values()))["exp_avg"][:]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(UserWarning, match="still viewed"):
            optimshift.stream(opt)
    assert optimshift.is_streamed(opt)
    assert driver.mapped(0) > 0  # (the viewed slot's blocks)
    optimshift.unstream(opt)
    del outside


def test_a_collected_optimizer_frees_its_ranges(sim, driver):
    reserved, mapped = driver.reserved(), driver.mapped(0)
    model, opt = _trained(sim)
    optimshift.keep_addresses(opt)
    assert driver.reserved() > reserved
    del model, opt
    gc.collect()
    assert driver.reserved() == reserved and driver.mapped(0) == mapped


def test_state_dict_and_save_while_offloaded(sim, driver, tmp_path):
    model, opt = _trained(sim)
    optimshift.keep_addresses(opt)
    kept, values = _where(opt), _state_values(opt)
    optimshift.offload(opt, keep_addresses=True)
    sd = opt.state_dict()
    assert bitwise_equal([dict(v) for v in sd["state"].values()], values)
    sd = {"state": {k: snapshot(dict(v)) for k, v in sd["state"].items()}, "param_groups": sd["param_groups"]}
    optimshift.save(opt, tmp_path / "opt.pt")
    loaded = optimshift.load(tmp_path / "opt.pt")
    saved = loaded["state"] if "state" in loaded else loaded["optimizer"]["state"]
    assert bitwise_equal([dict(v) for v in saved.values()], values)
    optimshift.reload(opt)
    assert _where(opt) == kept
    # a load into the live state: written in place where a live tensor fits, else copied and adopted (a host
    # checkpoint): either way the next cycle puts the state back at its addresses
    train(model, opt, range(2, 3))
    optimshift.load_state_dict(opt, sd)
    assert bitwise_equal(_state_values(opt), values)
    optimshift.offload(opt, keep_addresses=True)
    optimshift.reload(opt)
    assert _where(opt) == kept and bitwise_equal(_state_values(opt), values)


@pytest.mark.parametrize("seed, progress", SCHEDULES)
def test_non_blocking_cycles_under_deferred_streams(sim, driver, seed, progress):
    ref_model, ref = _trained(sim)
    for c in range(3):
        optimshift.offload(ref)
        optimshift.reload(ref)
        train(ref_model, ref, range(2 + c, 3 + c))
    model, opt = _trained(sim)
    optimshift.keep_addresses(opt)
    kept = _where(opt)
    with deferred_streams(seed=seed, progress=progress), warnings.catch_warnings():
        warnings.simplefilter("error")  # (no slot looks held from outside once the copies are done)
        for c in range(3):
            handle = optimshift.offload(opt, non_blocking=True, keep_addresses=True)
            if progress == 0.0:
                assert not handle.done(), "the offload is in flight"
                assert driver.mapped(0) > 0, "unmapped under copies still in flight"
            handle.wait()
            assert driver.mapped(0) == 0
            optimshift.reload(opt, non_blocking=True)
            train(model, opt, range(2 + c, 3 + c))  # step() waits for the reload on the device
            assert _where(opt) == kept
    assert bitwise_equal(_state_values(opt), _state_values(ref))


@pytest.mark.parametrize("mutated", [False, True], ids=["after-the-copies", "at-once"])
def test_the_release_waits_for_the_copies_in_flight(sim, driver, monkeypatch, mutated):
    """On CUDA a tensor over mapped memory dies as soon as the commit drops it (record_stream does not hold memory
    the caching allocator does not own), while its device-to-host copy may still be queued; the simulator's queue
    holds the tensors, so here every slot is made to look free at once, as on CUDA. Released once the copies are
    done, nothing faults; released right after the commit (the mutation), the queued copies read unmapped memory."""
    model, opt = _trained(sim)
    optimshift.keep_addresses(opt)
    values = _state_values(opt)
    monkeypatch.setattr(_addresses._Slot, "live", lambda self: False)
    if mutated:
        monkeypatch.setattr(optimshift.api, "_release_when_done", lambda o, pending: _addresses.release(o, "opt"))
        with pytest.raises(RuntimeError, match="illegal memory access"):
            with deferred_streams(seed=0, progress=0.0):
                optimshift.offload(opt, non_blocking=True, keep_addresses=True).wait()
        return
    with deferred_streams(seed=0, progress=0.0):
        handle = optimshift.offload(opt, non_blocking=True, keep_addresses=True)
        assert driver.mapped(0) > 0
        handle.wait()
    assert driver.mapped(0) == 0 and bitwise_equal(_state_values(opt), values)


def test_a_range_freed_under_queued_copies_waits_for_them(sim, driver, monkeypatch):
    """An optimizer dropped right after ``offload(non_blocking=True, keep_addresses=True)``: on CUDA its leases die
    with the device tensors the commit drops (see above), and its range with it, while the copies from it may still
    be queued. The simulator's queue holds the tensors, and their leases the range: here a lease does not hold it,
    as on CUDA. The range's finalizer unmapped it under those copies; it now waits for the device first."""
    monkeypatch.setattr(_addresses._Lease, "__init__", lambda self, owner: None)
    model, opt = _trained(sim)
    optimshift.keep_addresses(opt)
    values = _state_values(opt)
    with deferred_streams(seed=0, progress=0.0):
        handle = optimshift.offload(opt, non_blocking=True, keep_addresses=True)
        offloaded = list(opt.state.values())
        del model, opt
        gc.collect()
        handle.wait()
    assert driver.mapped(0) == 0 and bitwise_equal([snapshot(dict(st)) for st in offloaded], values)


def test_a_range_freed_while_a_graph_is_captured_is_left_alone(sim, driver, monkeypatch, caplog):
    """A range collected while the current stream captures a graph (a CUDA graph of the step): its finalizer's
    synchronize would invalidate the capture, so it neither synchronizes nor unmaps, and says so."""
    model, opt = _trained(sim)
    optimshift.keep_addresses(opt)
    mapped = driver.mapped(0)
    ranges = [o for o in gc.get_objects() if isinstance(o, _addresses._Mapped)]
    syncs: list[object] = []
    monkeypatch.setattr(_addresses._device_streams, "synchronize", syncs.append)
    monkeypatch.setattr(torch.sim, "is_current_stream_capturing", lambda: True, raising=False)
    with caplog.at_level(logging.WARNING, logger="optimshift"):
        del model, opt
        gc.collect()
    assert mapped > 0 and driver.mapped(0) == mapped and not syncs
    assert "left to the process's exit" in caplog.text
    monkeypatch.undo()  # (the process's exit, here: the fixture checks nothing is left mapped)
    for left in ranges:
        _addresses._close(left)


def test_a_release_by_another_thread_s_wait_waits_for_a_reload_under_way(sim, driver, monkeypatch):
    """Another thread's ``wait()`` on the offload's handle runs its release; the reload that found the handle done
    went on meanwhile. The release unmapped the blocks the reload had just mapped (its leases not yet the slots'),
    and the reload's copies wrote unmapped memory. It now waits for the reload, which then holds the slots."""
    model, opt = _trained(sim)
    optimshift.keep_addresses(opt)
    values, kept = _state_values(opt), _where(opt)
    staged, released = threading.Event(), threading.Event()
    real_stage, real_release = _addresses.stage, _addresses.release

    def stage(*args, **kwargs):  # (the reload mapped its slots: the other thread's release may run now)
        placement = real_stage(*args, **kwargs)
        staged.set()
        released.wait(0.5)
        return placement

    def release(*args, **kwargs):
        if threading.current_thread() is not threading.main_thread():
            staged.wait(5)
        real_release(*args, **kwargs)
        released.set()

    monkeypatch.setattr(_addresses, "stage", stage)
    monkeypatch.setattr(_addresses, "release", release)
    with deferred_streams(seed=0, progress=0.0):
        handle = optimshift.offload(opt, non_blocking=True, keep_addresses=True)
        waiter = threading.Thread(target=handle.wait)
        waiter.start()
        while handle.event is not None:  # (the waiter took the handle's release, not yet run)
            time.sleep(0.001)
        optimshift.reload(opt)
        waiter.join()
    assert _where(opt) == kept and bitwise_equal(_state_values(opt), values)
    assert driver.mapped(0) > 0


def test_a_release_by_another_thread_s_wait_leaves_a_later_offload_s_copies_alone(sim, driver, monkeypatch):
    """That waiter's release, held by the lock, may run only after this thread reloaded and offloaded again, its
    copies from the slots still queued: their tensors gone, as on CUDA (see above), it unmapped the slots under
    them. The later offload's own release frees them once they landed."""
    model, opt = _trained(sim)
    optimshift.keep_addresses(opt)
    values = _state_values(opt)
    late = threading.Event()
    real_release = _addresses.release

    def release(*args, **kwargs):
        if threading.current_thread() is not threading.main_thread():
            late.wait(5)
        real_release(*args, **kwargs)

    monkeypatch.setattr(_addresses, "release", release)
    with deferred_streams(seed=0, progress=0.0):
        handle = optimshift.offload(opt, non_blocking=True, keep_addresses=True)
        waiter = threading.Thread(target=handle.wait)
        waiter.start()
        while handle.event is not None:  # (the waiter took the handle's release, not yet run)
            time.sleep(0.001)
        optimshift.reload(opt)
        second = optimshift.offload(opt, non_blocking=True, keep_addresses=True)
        monkeypatch.setattr(_addresses._Slot, "live", lambda self: False)
        late.set()
        waiter.join()
        assert driver.mapped(0) > 0
        second.wait()
    assert driver.mapped(0) == 0
    optimshift.reload(opt)
    assert bitwise_equal(_state_values(opt), values)


# -- failure ----------------------------------------------------------------------------------------------


def _cycle_steps(opt):
    return [
        lambda: optimshift.offload(opt, keep_addresses=True),
        lambda: optimshift.reload(opt),
        lambda: optimshift.offload(opt, keep_addresses=True),
        lambda: optimshift.reload(opt),
    ]


def _calls_of_a_cycle(sim, driver):
    counting = FaultyDriver(driver)
    with _vmm.use_driver(sim.type, counting):
        model, opt = _trained(sim)
        for step in _cycle_steps(opt):
            step()
        steps = len(counting.calls)
        del model, opt, step
        gc.collect()  # (the range's finalizer: its calls too)
    return list(counting.calls), steps


def _free_leaked(driver, before):
    """Give back what a failed finalizer left to the process's exit (the driver is shared by the whole session)."""
    for address in set(driver._ranges) - before:
        r = driver._ranges[address]
        for a, (n, handle, _) in list(driver._mappings.items()):
            if address <= a < address + r.size:
                driver.unmap(r_device(driver, r), a, n)
                driver.release(r_device(driver, r), handle)
        driver.free_reserved(r_device(driver, r), address, r.size)


def r_device(driver, r):
    return torch.device("sim", r.index)


def test_every_driver_call_failing_in_turn_leaves_the_state_safe(sim, driver, caplog):
    calls, steps = _calls_of_a_cycle(sim, driver)
    assert {"reserve", "create", "map", "set_access", "wrap", "unmap", "release", "free_reserved"} <= set(calls)
    for k, call in enumerate(calls):
        reserved, created, base = driver.reserved(), list(driver.created), driver.mapped(0)
        ranges = set(driver._ranges)
        caplog.clear()
        faulty = FaultyDriver(driver, fail_at=k)
        with _vmm.use_driver(sim.type, faulty):
            model, opt = _trained(sim)
            values = _state_values(opt)
            for step in _cycle_steps(opt):
                offloaded = optimshift.is_offloaded(opt)
                try:
                    step()
                except _vmm.DriverError:
                    # a failed reload: still offloaded, on the host, nothing left mapped or reserved by it
                    assert faulty.failed == [call] and offloaded and optimshift.is_offloaded(opt)
                    assert driver.mapped(0) == base, f"fault at {call} (call {k}): memory left mapped"
                    assert bitwise_equal(_state_values(opt), values)
                    step()  # the same reload again, with no fault: it goes through
            during = k < steps  # (else the fault is among the finalizer's calls, below)
            if during:
                assert faulty.failed == [call], (k, call, faulty.failed)
                if call in ("unmap", "release"):  # an offload's release: warned, the state safe on the host
                    assert "could not unmap" in caplog.text
            else:
                faulty.fail_at = None  # (not in the clean cycle below: in the finalizer, once it runs)
            assert bitwise_equal(_state_values(opt), values), f"fault at {call} (call {k})"
            kept = _where(opt)
            optimshift.offload(opt, keep_addresses=True)  # a clean cycle: everything released, addresses kept
            assert driver.mapped(0) == base, f"fault at {call} (call {k}): memory left mapped"
            optimshift.reload(opt)
            assert _where(opt) == kept
            if not during:
                faulty.fail_at = len(faulty.calls) + k - steps
        del model, opt, step
        gc.collect()
        assert faulty.failed == [call]
        if not during:  # the range's finalizer failed: it says so, and leaves the range to the process's exit
            assert "could not free a reserved range" in caplog.text
            _free_leaked(driver, ranges)
            continue
        assert driver.reserved() == reserved, f"fault at {call} (call {k}): a range left reserved"
        if call != "release":  # (a failed release leaves its handle to the driver's exit: the fake keeps it)
            assert driver.created == created, f"fault at {call} (call {k}): physical memory left"


def test_out_of_memory_while_mapping_retries_once_after_emptying_the_cache(sim, driver, monkeypatch):
    emptied = []
    monkeypatch.setattr(_device_streams, "empty_cache", lambda: emptied.append(1))
    faulty = FaultyDriver(driver, oom=True)  # (a range keeps the driver it was reserved with)
    with _vmm.use_driver(sim.type, faulty):
        model, opt = _trained(sim)
        values = _state_values(opt)
        optimshift.offload(opt, keep_addresses=True)
        # once (a first reload calls granularity, reserve, then create): the retry after empty_cache maps it
        faulty.fail_at = len(faulty.calls) + 2
        optimshift.reload(opt)
        assert faulty.failed == ["create"] and emptied == [1]
        kept = _where(opt)
        assert bitwise_equal(_state_values(opt), values)
        optimshift.offload(opt, keep_addresses=True)
        # twice in a row: an out-of-memory error, nothing changed, nothing mapped
        faulty.fail_at, faulty.times = len(faulty.calls), 2
        with pytest.raises(torch.OutOfMemoryError, match="also after emptying the cache; the state is still"):
            optimshift.reload(opt)
        assert faulty.failed == ["create", "create", "create"]
        assert emptied == [1, 1] and optimshift.is_offloaded(opt) and driver.mapped(0) == 0
        assert bitwise_equal(_state_values(opt), values)
        optimshift.reload(opt)
        assert _where(opt) == kept


def test_out_of_physical_memory_raises_with_the_state_on_the_host(sim, driver, monkeypatch):
    model, opt = _trained(sim, shapes=[(64, 64)])
    values = _state_values(opt)
    optimshift.offload(opt, keep_addresses=True)
    small = SimDriver(capacity=4096)  # less than the state needs
    with _vmm.use_driver(sim.type, small):
        with pytest.raises(torch.OutOfMemoryError):
            optimshift.reload(opt)
        assert small.mapped(0) == 0 and small.reserved() == 0 and small.created == [0, 0]
    assert optimshift.is_offloaded(opt) and bitwise_equal(_state_values(opt), values)
    optimshift.reload(opt)


@pytest.mark.parametrize("failure", ["out of memory", "driver error"])
def test_keep_addresses_that_cannot_lay_the_state_out_leaves_it_where_it_was(sim, driver, failure):
    """``keep_addresses(opt)`` is an offload and a reload into the range: when the range cannot be mapped (out of
    device memory, or the driver fails), the state is reloaded as usual, and the error says so. Before, the
    optimizer was left offloaded (``step()`` refused) by a call that never asked for an offload, and the error said
    that nothing was changed (found by a new-user hunt)."""
    model, opt = _trained(sim, shapes=[(64, 64)])
    values, objects = _state_values(opt), {k: v[0] for k, v in _where(opt).items()}
    if failure == "out of memory":
        failing, raised, said = SimDriver(capacity=4096), torch.OutOfMemoryError, "could not lay the state out"
    else:
        failing, raised, said = FaultyDriver(driver, fail_at=1), _vmm.DriverError, "reserve"  # (granularity first)
    with _vmm.use_driver(sim.type, failing):
        with pytest.raises(raised, match=said) as caught:
            optimshift.keep_addresses(opt)
    text = str(caught.value) + "".join(getattr(caught.value, "__notes__", []))
    assert "reloaded where it was, allocated as usual" in text
    assert not optimshift.is_offloaded(opt) and {k: v[0] for k, v in _where(opt).items()} == objects
    assert all(v[2] == sim for v in _where(opt).values()) and len(_where(opt)) == 2
    assert bitwise_equal(_state_values(opt), values) and optimshift.check(opt).ok
    assert driver.mapped(0) == 0
    optimshift.keep_addresses(opt)  # (and it can still be laid out, once the memory is there)
    assert driver.mapped(0) > 0 and {k: v[0] for k, v in _where(opt).items()} == objects


def test_keep_addresses_that_cannot_lay_new_state_out_keeps_the_addresses_it_had(sim, driver):
    """State kept at addresses already (a graph may be captured over them), then a new group: ``keep_addresses(opt)``
    cannot map the new state's range. It must not reload everything as usual (the kept state would lose its
    addresses under the graph): the state stays offloaded, the error says so, and the reload once the memory is
    there puts the kept state back at its addresses (found by review of the fallback's first version)."""
    model, opt = _trained(sim, shapes=[(64, 64)])
    optimshift.keep_addresses(opt)
    kept = _where(opt)
    extra = torch.nn.Parameter(torch.randn(64, 64, device=sim))
    opt.add_param_group({"params": [extra]})
    extra.grad = torch.randn_like(extra)
    opt.step()
    values = _state_values(opt)
    with _vmm.use_driver(sim.type, FaultyDriver(driver, fail_at=0, times=100)):
        with pytest.raises(_vmm.DriverError) as caught:
            optimshift.keep_addresses(opt)
    assert "it stays offloaded, so that the state kept at addresses keeps them" in "".join(caught.value.__notes__)
    assert optimshift.is_offloaded(opt) and bitwise_equal(_state_values(opt), values)
    optimshift.reload(opt)
    assert {k: v for k, v in _where(opt).items() if k in kept} == kept and len(_where(opt)) == 4
    assert bitwise_equal(_state_values(opt), values)


def test_keep_addresses_whose_plain_reload_fails_too_stays_offloaded_to_be_laid_out(sim, driver, monkeypatch):
    """Mapping fails and so does the reload as usual: the state stays offloaded with both errors said, and the
    record still asks for the layout, so the next reload lays it out."""
    model, opt = _trained(sim, shapes=[(64, 64)])
    values = _state_values(opt)
    real = _engine.run
    calls = []

    def failing(*args, **kwargs):  # (the first reload's copies fail, and the second's; later ones run)
        calls.append(1)
        if 2 <= len(calls) <= 3:
            raise RuntimeError("injected copy failure")
        return real(*args, **kwargs)

    monkeypatch.setattr(_engine, "run", failing)
    with pytest.raises(RuntimeError, match="injected copy failure") as caught:
        optimshift.keep_addresses(opt)
    assert "failed too" in "".join(caught.value.__notes__)
    assert optimshift.is_offloaded(opt) and bitwise_equal(_state_values(opt), values)
    optimshift.reload(opt)
    assert driver.mapped(0) > 0 and bitwise_equal(_state_values(opt), values)


def test_a_copy_failing_after_the_mapping_gives_it_back(sim, driver, monkeypatch):
    model, opt = _trained(sim)
    values = _state_values(opt)
    optimshift.offload(opt, keep_addresses=True)
    reserved = driver.reserved()
    real = _engine.copy_into

    def failing(pairs, **kwargs):  # (two slots written, then the copy fails)
        real(pairs[:2], **kwargs)
        raise RuntimeError("injected copy failure")

    monkeypatch.setattr(_engine, "copy_into", failing)
    with pytest.raises(RuntimeError, match="injected copy failure"):
        optimshift.reload(opt)
    monkeypatch.setattr(_engine, "copy_into", real)
    gc.collect()
    assert optimshift.is_offloaded(opt) and driver.mapped(0) == 0 and driver.reserved() == reserved
    assert bitwise_equal(_state_values(opt), values)
    optimshift.reload(opt)
    assert bitwise_equal(_state_values(opt), values)


@pytest.mark.parametrize("seed, progress", SCHEDULES)
def test_a_non_blocking_reload_whose_commit_fails_unmaps_only_after_its_queued_copies(
    sim, driver, monkeypatch, seed, progress
):
    """The copies into the slots are queued on the side stream when the commit fails (a Ctrl-C deciding the
    adoptions): the rollback unmapped the slots under them, and they wrote unmapped memory (a fault on CUDA)."""
    model, opt = _trained(sim)
    values = _state_values(opt)
    optimshift.keep_addresses(opt)
    optimshift.offload(opt, keep_addresses=True)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(_engine, "adoptions", interrupted)
    with deferred_streams(seed=seed, progress=progress):
        with pytest.raises(KeyboardInterrupt):
            optimshift.reload(opt, non_blocking=True)
    monkeypatch.undo()
    gc.collect()
    assert optimshift.is_offloaded(opt) and driver.mapped(0) == 0
    assert bitwise_equal(_state_values(opt), values)
    optimshift.reload(opt)
    assert bitwise_equal(_state_values(opt), values)


def test_a_non_blocking_reload_whose_commit_fails_into_slots_mapped_already_leaves_no_copy_queued(
    sim, driver, monkeypatch
):
    """A view held outside kept the slots' block mapped: the failed reload mapped nothing, so its rollback waited for
    nothing, and the release of the next offload, once the view was dropped, unmapped the block under its copies."""
    model, opt = _trained(sim)
    optimshift.keep_addresses(opt)
    values = _state_values(opt)
    exp_avg = next(iter(opt.state.values()))["exp_avg"]
    held = torch.empty(0, device=sim).set_(exp_avg.untyped_storage(), 0, (1,), (1,))
    del exp_avg
    with pytest.warns(UserWarning, match="still viewed by tensors outside the optimizer"):
        optimshift.offload(opt, keep_addresses=True)
    mapped = driver.mapped(0)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(_engine, "adoptions", interrupted)
    with deferred_streams(seed=0, progress=0.0):
        with pytest.raises(KeyboardInterrupt):
            optimshift.reload(opt, non_blocking=True)
        monkeypatch.undo()
        assert driver.mapped(0) == mapped > 0
        del held
        optimshift.offload(opt, keep_addresses=True)  # (offloaded already: nothing to copy, then its release)
        torch.sim.synchronize(0)
    assert driver.mapped(0) == 0
    optimshift.reload(opt)
    assert bitwise_equal(_state_values(opt), values)


# -- where it cannot ----------------------------------------------------------------------------------------


class _Refusing:
    """A driver for a device without virtual memory management."""

    def __init__(self, inner):
        self.inner = inner

    def unsupported(self, device):
        return "no virtual memory management here"

    def __getattr__(self, name):
        raise AssertionError(f"{name} called on a device that cannot keep addresses")


def test_true_on_a_device_without_support_raises_before_anything_changes(sim, driver):
    model, opt = _trained(sim)
    before, values = _where(opt), _state_values(opt)
    with _vmm.use_driver(sim.type, _Refusing(driver)):
        with pytest.raises(ValueError, match="sim:0 cannot keep addresses .no virtual memory management here."):
            optimshift.offload(opt, keep_addresses=True)
        with pytest.raises(ValueError, match="cannot keep addresses"):
            optimshift.keep_addresses(opt)
    assert not optimshift.is_offloaded(opt) and _where(opt) == before
    assert bitwise_equal(_state_values(opt), values)
    with pytest.raises(ValueError, match="keep_addresses must be True, False or 'auto'"):
        optimshift.offload(opt, keep_addresses="yes")  # type: ignore[call-overload]
    assert not optimshift.is_offloaded(opt)


def test_auto_falls_back_with_one_log_line(sim, driver, caplog):
    model, opt = _trained(sim)
    values = _state_values(opt)
    with _vmm.use_driver(sim.type, _Refusing(driver)), caplog.at_level(logging.INFO, logger="optimshift"):
        optimshift.offload(opt, keep_addresses="auto")
        optimshift.reload(opt)
    lines = [r.getMessage() for r in caplog.records if "keep_addresses='auto'" in r.getMessage()]
    assert len(lines) == 1 and "no virtual memory management here" in lines[0]
    assert _addresses.layout_of(opt) is None and bitwise_equal(_state_values(opt), values)
    optimshift.offload(opt, keep_addresses="auto")  # where it can: it keeps them
    optimshift.reload(opt)
    kept = _where(opt)
    optimshift.offload(opt, keep_addresses="auto")
    optimshift.reload(opt)
    assert _where(opt) == kept


def test_keeping_addresses_goes_the_one_road(sim, driver, monkeypatch):
    """A keep_addresses offload and reload are one engine.run (one copy_many) and one engine.commit each: the slots
    are a destination allocation, the release a step after the copies; no second copy or commit loop."""
    from optimshift import _engine

    model, opt = _trained(sim)
    seen: dict[str, int] = {}
    for module, name in ((_engine, "run"), (_engine, "commit"), (_engine, "copy_many")):
        real = getattr(module, name)

        def spy(*args, _real=real, _name=name, **kwargs):
            seen[_name] = seen.get(_name, 0) + 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(module, name, spy)
    for op, expected in (
        (lambda: optimshift.keep_addresses(opt), 2),
        (lambda: optimshift.offload(opt, keep_addresses=True), 1),
        (lambda: optimshift.reload(opt), 1),
    ):
        seen.clear()
        op()
        assert seen == {"run": expected, "commit": expected, "copy_many": expected}, seen


def test_a_param_viewing_a_slot_is_a_view_outside_and_warned_of(sim, driver):
    """The release counted the params as the optimizer's own tensors (it walked each group whole): a slot a param
    views stayed mapped without the warning a view held anywhere else gets."""
    model, opt = _trained(sim, torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})
    optimshift.keep_addresses(opt)
    q = opt.param_groups[0]["params"][1]
    buf = opt.state[q]["momentum_buffer"]
    with torch.no_grad():
        q.data = torch.empty(0, device=sim).set_(buf.untyped_storage(), buf.storage_offset(), buf.shape, buf.stride())
    with pytest.warns(UserWarning, match="1 slot of state .* still viewed"):
        optimshift.offload(opt, keep_addresses=True)
    with torch.no_grad():
        q.data = q.data.clone()
    optimshift.reload(opt)


def test_an_empty_view_of_a_shared_storage_reloads_at_kept_addresses_as_a_plain_reload_does(sim, driver):
    """A flat buffer and an empty view of it (``flat[0:0]``): the keep_addresses reload left the empty view out of
    the storage's slot (an empty tensor gets no slot of its own) and the engine refused the pair as entries copied
    into places of their own, where a plain reload keeps them sharing."""
    model, opt = _trained(sim, torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})
    p = opt.param_groups[0]["params"][0]
    flat = torch.arange(8.0, device=sim)
    opt.state[p].update(flat=flat, head=flat[0:0])
    del flat
    ids = {k: id(v) for k, v in opt.state[p].items()}
    optimshift.offload(opt, keep_addresses=True)
    optimshift.reload(opt)
    st = opt.state[p]
    assert {k: id(v) for k, v in st.items()} == ids and st["flat"].device == st["head"].device == sim
    assert st["flat"].untyped_storage().data_ptr() == st["head"].untyped_storage().data_ptr()
    assert torch.equal(st["flat"].cpu(), torch.arange(8.0))


def test_a_ctrl_c_held_through_a_keep_addresses_offload_still_releases_its_memory(sim, driver, monkeypatch):
    """A Ctrl-C that arrives in the offload's commit is held until the offload ends, and the offload's release of
    the device memory still runs: the handler holding it kept the frame it landed in, whose locals (the old device
    tensors) kept their slots mapped."""
    import os
    import signal

    from optimshift import _engine

    model, opt = _trained(sim, shapes=[(64, 64), (64,)])
    optimshift.keep_addresses(opt)
    real = _engine.adopt

    def interrupting(pairs, hows):
        os.kill(os.getpid(), signal.SIGINT)  # (delivered at the next bytecode boundary: inside the commit)
        return real(pairs, hows)

    monkeypatch.setattr(_engine, "adopt", interrupting)
    with pytest.raises(KeyboardInterrupt):
        optimshift.offload(opt, keep_addresses=True)
    monkeypatch.undo()
    assert optimshift.is_offloaded(opt)
    assert driver.mapped(0) == 0
    optimshift.reload(opt)
    train(model, opt, range(2, 3))
