"""Offload/reload edge cases: shared pool memory, grads, params that moved, failures part-way."""

import gc
import inspect
import types
import weakref

import pytest
import torch

import optimshift
from _matrix import Model, bitwise_equal, state_layout, tensor_ids, train
from _schedules import SCHEDULES, drain_queued  # noqa: F401  (drain_queued: an autouse fixture)
from optimshift import _copy as batch_mod
from optimshift.pool import host_pool
from optimshift.testing import deferred_streams


def _adam(sim, n=3, **kw):
    model = Model([(3, 2)] * n).to(sim)
    opt = torch.optim.Adam(model.parameters(), **kw)
    train(model, opt, range(1))
    return model, opt


def test_memory_viewed_after_reload_is_never_overwritten_by_a_later_offload(sim):
    """A tensor that still looks into an offload buffer after the reload (a view taken while offloaded) keeps
    its bytes: the pool must not hand that buffer to a later offload."""
    host_pool.release_idle()
    model_a, a = _adam(sim, foreach=False)
    model_b, b = _adam(sim, foreach=False)
    optimshift.offload(a)
    # Views of offload's host copies (the host `step` was never moved: it is the live tensor, skipped)
    kept = {i: {k: v.view_as(v) for k, v in st.items() if k != "step"} for i, st in a.state_dict()["state"].items()}
    snapshot = {i: {k: v.clone() for k, v in st.items()} for i, st in kept.items()}
    optimshift.reload(a)
    train(model_a, a, range(1, 3))  # a's live state changes on the device
    optimshift.offload(a)
    optimshift.offload(b)
    for i, st in kept.items():
        assert bitwise_equal(st, snapshot[i])


def test_a_kept_state_dict_is_never_overwritten_by_a_later_offload(sim):
    """A state_dict() taken while offloaded holds compact copies of the host state (not views into the pool):
    later training, offloads and other optimizers' offloads never change it."""
    host_pool.release_idle()
    model_a, a = _adam(sim, foreach=False)
    model_b, b = _adam(sim, foreach=False)
    optimshift.offload(a)
    # (the host `step` was never moved, so it is the live tensor, which Adam updates in place)
    kept = {i: {k: v for k, v in st.items() if k != "step"} for i, st in a.state_dict()["state"].items()}
    snapshot = {i: {k: v.clone() for k, v in st.items()} for i, st in kept.items()}
    optimshift.reload(a)
    train(model_a, a, range(1, 3))  # a's live state changes on the device
    optimshift.offload(a)
    optimshift.offload(b)
    for i, st in kept.items():
        assert bitwise_equal(st, snapshot[i])


def test_move_to_host_after_offload_keeps_state_out_of_the_pool(sim):
    host_pool.release_idle()  # so that b's offload would be handed a's buffer if the pool allowed it
    model_a, a = _adam(sim, foreach=False)
    model_b, b = _adam(sim, foreach=False)
    optimshift.offload(a)
    optimshift.move(a, "cpu")  # (the state leaves the offload buffers: copies of its own on the host)
    before = {i: {k: v.clone() for k, v in st.items()} for i, st in enumerate(a.state.values())}
    optimshift.offload(b)  # must not be handed a's buffers
    for i, st in enumerate(a.state.values()):
        assert bitwise_equal(dict(st), before[i])


def _owns_its_bytes(t):
    return t.untyped_storage().nbytes() == t.numel() * t.element_size()


@pytest.mark.parametrize(
    "way",
    [
        "move(opt, 'cpu')",
        "model.to('cpu'); move(opt)",
        "model.to('cpu'); reload(opt)",
        "half to cpu; non-blocking reload",
        "load_state_dict",
    ],
)
def test_state_and_grads_an_offload_leaves_on_the_host_own_their_bytes(sim, way):
    """Every way the offload ends with the state staying on the host gives each entry (and each grad it took) a
    storage of its own, as a fresh optimizer's, the same objects with the same bits: left as views into the
    offload's pool buffers they kept them (pinned memory the pool counts as free) and ``torch.save`` wrote each
    whole buffer, the bytes of whatever it held before (other optimizers' state) included."""
    host_pool.release_idle()
    model, opt = _adam(sim, foreach=False)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimshift.offload(opt, include=("grads",))
    ids = tensor_ids(opt)
    values = [v.clone() for st in opt.state.values() for v in st.values()]
    grads = [g.clone() for _, g in optimshift._offload.record_of(opt).grads.values()]
    if way == "move(opt, 'cpu')":
        optimshift.move(opt, "cpu")
    elif way == "load_state_dict":  # (the grads: the loaded state is the checkpoint's copies)
        model.to("cpu")
        sd = _adam(sim, foreach=False)[1].state_dict()
        optimshift.load_state_dict(opt, sd)
        ids, values = tensor_ids(opt), [v.clone() for st in sd["state"].values() for v in st.values()]
    elif way == "half to cpu; non-blocking reload":  # (the host copies beside the side stream's)
        model.parts[0].to("cpu")
        with deferred_streams(progress=0.0):
            optimshift.reload(opt, non_blocking=True).wait()
    else:
        model.to("cpu")
        (optimshift.move if "move" in way else optimshift.reload)(opt)
    assert tensor_ids(opt) == ids
    assert all(bitwise_equal(a, b) for a, b in zip(values, [v for st in opt.state.values() for v in st.values()]))
    assert all(_owns_its_bytes(v) for st in opt.state.values() for v in st.values())
    assert all(_owns_its_bytes(p.grad) and bitwise_equal(p.grad, g) for p, g in zip(model.parameters(), grads))
    assert way == "move(opt, 'cpu')" or optimshift.check(opt).ok  # (its params stay on sim:0)
    assert host_pool.stats().in_use == 0


def test_state_unstream_leaves_on_the_host_owns_its_bytes(sim):
    """``model.to("cpu")`` and then ``unstream(opt)``: the state stays on the host, where it was laid out in the
    streamed chunks' pool buffers, which unstream gives back; each entry was left a view into one (the pool counted
    it free, ``torch.save`` wrote 1 MiB for three 4-element params). Each gets a storage of its own, as after an
    offload: the same objects, the same bits."""
    host_pool.release_idle()
    model, opt = _adam(sim, foreach=False)
    optimshift.stream(opt)
    train(model, opt, range(1, 2))
    model.to("cpu")
    optimshift.wait(opt)  # (the step's write-backs into the chunks, before the state is read here)
    ids = tensor_ids(opt)
    values = [v.clone() for st in opt.state.values() for v in st.values()]
    optimshift.unstream(opt)
    assert tensor_ids(opt) == ids
    assert all(bitwise_equal(a, b) for a, b in zip(values, [v for st in opt.state.values() for v in st.values()]))
    assert all(_owns_its_bytes(v) for st in opt.state.values() for v in st.values())
    assert host_pool.stats().in_use == 0 and optimshift.check(opt).ok


def test_grads_follow_params_that_moved_while_offloaded(sim):
    sim1 = torch.device(sim.type, 1)
    model, opt = _adam(sim, fused=True)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    grads = [p.grad.cpu() for p in model.parameters()]
    optimshift.offload(opt, include=("grads",))
    model.to(sim1)
    optimshift.reload(opt)  # the params are on sim:1 now: state and grads go there, not back to sim:0
    assert {row.device for row in optimshift.placement(opt)} == {str(sim1)}
    assert optimshift.check(opt).ok
    for p, g in zip(model.parameters(), grads):
        assert p.grad.device == sim1 and bitwise_equal(p.grad, g)


def _go_back(opt, back, sd):
    """The ways an offloaded optimizer's state and grads come back."""
    if back == "reload":
        optimshift.reload(opt)
    elif back == "move":
        optimshift.move(opt)
    else:
        optimshift.load_state_dict(opt, sd)


@pytest.mark.parametrize("back", ["reload", "move", "load_state_dict"])
def test_every_way_back_refuses_to_overwrite_a_grad_set_while_offloaded(sim, back):
    # One rule for every way back (_offload.grads_back). Before: load_state_dict kept the new grad and dropped
    # the offloaded one without a word.
    model, opt = _adam(sim, foreach=False)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    sd = opt.state_dict()
    optimshift.offload(opt, include=("grads",))
    first = next(iter(model.parameters()))
    first.grad = torch.full_like(first, 7.0)
    layout = {row.key: row.device for row in optimshift.placement(opt)}
    ids = tensor_ids(opt)
    with pytest.raises(ValueError, match=r"Adam: group 0, param 0 got a new \.grad while its offloaded grad"):
        _go_back(opt, back, sd)
    assert {row.key: row.device for row in optimshift.placement(opt)} == layout and optimshift.is_offloaded(opt)
    assert tensor_ids(opt) == ids and torch.equal(first.grad.cpu(), torch.full((3, 2), 7.0))
    first.grad = None
    _go_back(opt, back, sd)
    assert torch.equal(first.grad.cpu(), torch.ones(3, 2)) and first.grad.device == sim


@pytest.mark.parametrize("back", ["reload", "move", "load_state_dict"])
def test_offloaded_grads_of_a_dtype_the_param_allows_go_back(sim, back):
    # fp32 grads of bf16 params (param.grad_dtype, torch >= 2.9): every way back gives them back. Before the
    # shared rule, reload and move refused them (the grad's dtype against the param's), and a load did since it.
    model = Model([(3, 2)] * 2).to(sim).to(torch.bfloat16)
    opt = torch.optim.Adam(model.parameters())
    if not hasattr(next(iter(model.parameters())), "grad_dtype"):
        pytest.skip("no grad_dtype in this torch")
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    sd = opt.state_dict()
    for p in model.parameters():
        p.grad = None
        p.grad_dtype = torch.float32  # (an fp32 grad, as one accumulated for a mixed-precision step)
        p.grad = torch.ones(p.shape, device=sim)
    grads = [p.grad for p in model.parameters()]
    optimshift.offload(opt, include=("grads",))
    _go_back(opt, back, sd)
    for p, g in zip(model.parameters(), grads):
        assert p.grad is g and g.device == sim and g.dtype == torch.float32 and torch.equal(g.cpu(), torch.ones(3, 2))
    assert not optimshift.is_offloaded(opt) and optimshift.check(opt).ok


def test_move_with_offloaded_grads_gives_them_back(sim):
    model, opt = _adam(sim, foreach=False)
    for p in model.parameters():
        p.grad = torch.full_like(p, 2.0)
    optimshift.offload(opt, include=("grads",))
    optimshift.move(opt)  # params are still on sim: state and grads follow them
    assert all(p.grad.device == sim and float(p.grad.sum().cpu()) == 12.0 for p in model.parameters())
    assert not optimshift.is_offloaded(opt)


def test_a_failing_staging_copy_leaks_no_buffer(sim, monkeypatch):
    model, opt = _adam(sim, foreach=False)
    in_use = host_pool.stats().in_use

    def boom(*args, **kwargs):
        raise MemoryError("injected: out of memory in torch.cat on the device")

    monkeypatch.setattr(batch_mod.torch, "cat", boom)
    with pytest.raises(MemoryError) as err:
        optimshift.offload(opt)
    monkeypatch.undo()
    assert host_pool.stats().in_use == in_use
    assert not optimshift.is_offloaded(opt)
    assert any("the optimizer was left unchanged" in note for note in getattr(err.value, "__notes__", []))


def test_non_blocking_move_returns_its_staging_buffers(sim):
    model = Model([(3, 2)] * 4)
    opt = torch.optim.Adam(model.parameters(), foreach=False)
    train(model, opt, range(1))
    in_use = host_pool.stats().in_use
    for device in (sim, torch.device("cpu"), sim):
        model.to(device)
        optimshift.move(opt, non_blocking=True)
    assert host_pool.stats().in_use == in_use
    assert state_layout(opt)[(0, "exp_avg")] == sim


def test_rebind_refuses_an_offloaded_optimizer(sim):
    model, opt = _adam(sim, foreach=False)
    optimshift.offload(opt)
    with pytest.raises(ValueError, match="reload\\(\\) it first"):
        optimshift.rebind(opt, list(model.parameters()))


def test_load_state_dict_while_offloaded_releases_the_buffers_and_gives_grads_back(sim):
    model, opt = _adam(sim, foreach=False)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    sd = {k: v for k, v in opt.state_dict().items()}
    optimshift.offload(opt, include=("grads",))
    optimshift.load_state_dict(opt, sd)
    assert not optimshift.is_offloaded(opt)
    assert all(p.grad is not None and p.grad.device == sim for p in model.parameters())


def test_int_valued_flags_are_not_confused_in_the_rule_cache():
    from optimshift import _probe

    p = torch.nn.Parameter(torch.zeros(2, 2))
    on = {**torch.optim.Adam([p]).param_groups[0], "capturable": 1}
    off = {**torch.optim.Adam([p]).param_groups[0], "capturable": 0}
    assert _probe.probe_key(torch.optim.Adam, on, 2) != _probe.probe_key(torch.optim.Adam, off, 2)


@pytest.mark.parametrize("back", ["reload", "non_blocking", "reload_to", "move", "load_state_dict"])
def test_offloaded_grads_keep_their_objects(sim, back):
    """Grads keep their objects like every other tensor (a compiled step reads them too): while offloaded each
    ``.grad`` is None and the grad, the same object, holds its values on the host; every way back gives it back."""
    model, opt = _adam(sim, foreach=False)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    grads = [p.grad for p in model.parameters()]
    values = [g.cpu() for g in grads]
    sd = opt.state_dict()
    if back == "non_blocking":
        optimshift.offload(opt, include=("grads",), non_blocking=True).wait()
    else:
        optimshift.offload(opt, include=("grads",))
    assert all(p.grad is None for p in model.parameters())
    assert all(g.device.type == "cpu" for g in grads)  # (the objects the caller holds moved too: no device memory)
    if back == "reload":
        optimshift.reload(opt)
    elif back == "non_blocking":
        optimshift.reload(opt, non_blocking=True).wait()
    elif back == "reload_to":
        optimshift.reload(opt, sim)
    elif back == "move":
        optimshift.move(opt)
    else:
        optimshift.load_state_dict(opt, sd)
    for p, g, v in zip(model.parameters(), grads, values):
        assert p.grad is g and g.device == sim and bitwise_equal(g, v)
    train(model, opt, range(1))  # the step runs on them


def _failing_to(monkeypatch, victim):
    """``victim.to(...)`` (the copy of one grad) runs out of memory."""
    real = torch.Tensor.to

    def to(self, *args, **kwargs):
        if self is victim:
            raise torch.OutOfMemoryError("out of memory (test)")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", to)


@pytest.mark.parametrize("way", ["offload", "reload", "move", "load_state_dict"])
def test_a_failed_grad_copy_names_the_param_and_changes_nothing(sim, monkeypatch, way):
    """A grad's copy that fails names the param it belongs to (group, index and name), on every way a grad moves."""
    model = Model([(3, 2)] * 3).to(sim)
    names, params = zip(*model.named_parameters())
    opt = torch.optim.Adam(model.named_parameters(), foreach=False)
    train(model, opt, range(1))
    for p in params:  # (a transposed grad is copied on its own, by .to: not staged with the others)
        p.grad = torch.ones(tuple(reversed(p.shape)), device=sim).t()
    victim = params[2].grad
    if way != "offload":
        optimshift.offload(opt, include=("grads",))
        victim = optimshift._offload.record_of(opt).grads[id(params[2])][1]
    if way == "move":
        optimshift.reload(opt, sim)  # (take the grads back by another way first: the move below is the test)
        optimshift.offload(opt, include=("grads",))
        victim = optimshift._offload.record_of(opt).grads[id(params[2])][1]
    sd = opt.state_dict()
    layout = state_layout(opt)
    _failing_to(monkeypatch, victim)
    with pytest.raises(torch.OutOfMemoryError) as info:
        if way == "offload":
            optimshift.offload(opt, include=("grads",))
        elif way == "reload":
            optimshift.reload(opt)
        elif way == "move":
            optimshift.move(opt, sim)
        else:
            optimshift.load_state_dict(opt, sd)
    notes = " ".join(getattr(info.value, "__notes__", []))
    assert f".grad of group 0, param 2 ({names[2]})" in notes, notes
    assert state_layout(opt) == layout
    assert optimshift.is_offloaded(opt) == (way != "offload")


def _sgd_run(sim, offload, set_to_none, steps=3):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2).to(sim)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x = torch.ones(3, 4, device=sim)
    grads = []
    for _ in range(steps):
        model(x).sum().backward()
        opt.step()
        grads = [p.grad for p in model.parameters()]
        if offload:
            with optimshift.offloaded(opt, include=("grads",)):
                opt.zero_grad(set_to_none=set_to_none)
        else:
            opt.zero_grad(set_to_none=set_to_none)
    return model, opt, grads


@pytest.mark.parametrize("set_to_none", [True, False])
def test_zero_grad_while_grads_are_offloaded_clears_them(sim, set_to_none):
    """``opt.zero_grad()`` while the grads are offloaded clears them as it clears grads on the params: dropped
    (``set_to_none``), or zeroed, the same objects. Before, it found every ``.grad`` None and did nothing, and the
    reload gave the old grads back: the next backward added onto them (the weights drifted from a reference)."""
    ref_model, _, _ = _sgd_run(sim, False, set_to_none)
    model, opt, grads = _sgd_run(sim, True, set_to_none)
    assert bitwise_equal(model.weight, ref_model.weight) and bitwise_equal(model.bias, ref_model.bias)
    for p, ref, held in zip(model.parameters(), ref_model.parameters(), grads):
        if set_to_none:
            assert p.grad is None and ref.grad is None
        else:
            assert p.grad is held and bitwise_equal(p.grad, ref.grad) and not p.grad.any()
    assert "zero_grad" not in opt.__dict__  # (taken away with the offload)


def test_zero_grad_while_offloaded_calls_the_one_the_optimizer_had(sim):
    """An instance's own ``zero_grad`` (a wrapper's patch) is still called while grads are offloaded, and is back in
    place after the reload."""
    model, opt = _adam(sim)
    calls = []

    def own(set_to_none=True):
        calls.append(set_to_none)
        return torch.optim.Adam.zero_grad(opt, set_to_none)

    opt.zero_grad = own
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optimshift.offload(opt, include=("grads",))
    opt.zero_grad(False)
    optimshift.reload(opt)
    assert calls == [False] and opt.zero_grad is own
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())


@pytest.mark.parametrize("first", [{}, {"capturable": True}], ids=["plain-first", "capturable-first"])
def test_a_group_removed_while_offloaded_gives_no_other_group_its_devices(sim, first):
    """The offload record names each site by its group's and param's positions: a group removed while offloaded
    shifts them, and the reload gave the remaining group's ``step`` the removed group's device (a fused group's
    ``step`` on the host: its step raised; a plain one's on the device: a host sync per step)."""
    a, b = torch.nn.Linear(3, 3).to(sim), torch.nn.Linear(3, 3).to(sim)
    second = {"fused": True} if not first else {}
    opt = torch.optim.AdamW([{"params": list(a.parameters()), **first}, {"params": list(b.parameters()), **second}])
    (a(torch.ones(2, 3, device=sim)).sum() + b(torch.ones(2, 3, device=sim)).sum()).backward()
    opt.step()
    where = {k: v.device for k, v in opt.state[b.weight].items()}
    optimshift.offload(opt)
    opt.param_groups.pop(0)
    for p in a.parameters():
        del opt.state[p]
    optimshift.reload(opt)
    assert {k: v.device for k, v in opt.state[b.weight].items()} == where
    assert optimshift.check(opt).ok
    b(torch.ones(2, 3, device=sim)).sum().backward()
    opt.step()


def test_offloaded_grads_go_back_to_params_whose_group_moved_or_left(sim):
    """Offloaded grads are kept by their param, not its position: after a group is removed while offloaded, each
    grad goes back to its own param, the removed group's too (nothing is lost)."""
    a, b = torch.nn.Linear(3, 3).to(sim), torch.nn.Linear(3, 3).to(sim)
    opt = torch.optim.SGD([{"params": list(a.parameters())}, {"params": list(b.parameters())}], lr=0.1)
    for p in [*a.parameters(), *b.parameters()]:
        p.grad = torch.full_like(p, float(p.numel()))
    held = {id(p): (p.grad, p.grad.clone()) for p in [*a.parameters(), *b.parameters()]}
    optimshift.offload(opt, include=("grads",))
    opt.param_groups.pop(0)
    optimshift.reload(opt)
    for p in [*a.parameters(), *b.parameters()]:
        grad, values = held[id(p)]
        assert p.grad is grad and p.grad.device == sim and bitwise_equal(p.grad, values)


def test_zero_grad_while_offloaded_keeps_its_signature_and_default(sim):
    """Accelerate reads ``inspect.signature(optimizer.zero_grad)`` for ``set_to_none``: the front shows the one it
    stands before; and a class whose ``zero_grad`` defaults to ``set_to_none=False`` zeroes the offloaded grads."""

    class Zeroing(torch.optim.SGD):
        def zero_grad(self, set_to_none: bool = False) -> None:
            super().zero_grad(set_to_none)

    model = torch.nn.Linear(3, 2).to(sim)
    opt = Zeroing(model.parameters(), lr=0.1)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    before = inspect.signature(opt.zero_grad)
    optimshift.offload(opt, include=("grads",))
    assert inspect.signature(opt.zero_grad) == before
    opt.zero_grad()
    optimshift.reload(opt)
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())


def test_an_offloaded_optimizer_with_its_own_zero_grad_is_freed_when_dropped(sim):
    """The front holds the optimizer's own bound ``zero_grad`` (apex's pattern), which holds the optimizer: the
    session must not hold the front, or a dropped offloaded optimizer (and its pool buffers) is never freed."""
    model, opt = _adam(sim)
    opt.zero_grad = types.MethodType(lambda self, set_to_none=True: None, opt)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optimshift.offload(opt, include=("grads",))
    gone = weakref.ref(opt)
    del opt
    gc.collect()
    assert gone() is None


def test_a_group_out_for_a_while_when_its_record_is_read_still_comes_back_offloaded(sim):
    """A group taken out and put back while offloaded, the record read meanwhile (``is_offloaded``, ``check``):
    nothing recorded is dropped, the step still refuses, and the reload puts everything back."""
    model, opt = _adam(sim, n=2)
    where = {k: v.device for st in opt.state.values() for k, v in st.items()}
    optimshift.offload(opt)
    group = opt.param_groups.pop(0)
    assert optimshift.is_offloaded(opt)
    opt.param_groups.append(group)
    assert optimshift.check(opt).ok
    with pytest.raises(RuntimeError, match="offloaded"):
        opt.step()
    optimshift.reload(opt)
    assert {k: v.device for st in opt.state.values() for k, v in st.items()} == where


def test_a_second_offload_that_fails_leaves_the_record_as_it_was(sim, monkeypatch):
    """A second offload (of an offloaded optimizer, a group added meanwhile) that fails part-way leaves the
    record as it was: its sites were the live record's own dict, which the failed plan had already written to."""
    model, opt = _adam(sim, n=1)
    optimshift.offload(opt)
    extra = torch.nn.Parameter(torch.ones(2, device=sim))
    opt.add_param_group({"params": [extra], "lr": torch.tensor(0.01, device=sim)})
    optimshift.offload(opt)
    record = optimshift._offload.record_of(opt)
    before = dict(record.devices)
    opt.param_groups[1]["extra"] = torch.zeros(1, device=sim)  # (a group tensor the next offload records)
    extra.grad = torch.ones(4, device=sim)[::2]  # (strided: copied on its own, by .to)
    _failing_to(monkeypatch, extra.grad)
    with pytest.raises(torch.OutOfMemoryError):
        optimshift.offload(opt, include=("grads",))
    assert optimshift._offload.record_of(opt) is record and record.devices == before


def test_a_group_dict_given_other_params_while_offloaded_is_not_given_its_old_devices(sim):
    """A group is the same one by its dict and its params (a dict's id alone is reused by a new dict once the old
    one is freed): a group dict whose params and lr were replaced while offloaded keeps its new host lr."""
    a, b = torch.nn.Parameter(torch.ones(2, device=sim)), torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.Adam([{"params": [a], "lr": torch.tensor(0.01, device=sim)}, {"params": [b]}], foreach=False)
    for p in (a, b):
        p.grad = torch.ones_like(p)
    opt.step()
    optimshift.offload(opt)
    del opt.state[a]
    group = opt.param_groups[0]
    group["params"], group["lr"] = [torch.nn.Parameter(torch.ones(2))], torch.tensor(0.01)
    optimshift.reload(opt)
    assert opt.param_groups[0]["lr"].device.type == "cpu" and optimshift.check(opt).ok


@pytest.mark.parametrize("seed, progress", SCHEDULES)
@pytest.mark.parametrize("set_to_none", [True, False])
def test_zero_grad_while_a_non_blocking_offload_of_grads_is_in_flight(sim, seed, progress, set_to_none):
    """``zero_grad()`` right after a non-blocking offload of the grads: the host grads are the destinations of
    copies still queued, so the front waits for them before it zeroes (or drops) them."""
    model = torch.nn.Linear(16, 8).to(sim)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    with deferred_streams(seed=seed, progress=progress):
        optimshift.offload(opt, include=("grads",), non_blocking=True)
        opt.zero_grad(set_to_none=set_to_none)
        optimshift.reload(opt)
        grads = [None if p.grad is None else p.grad.cpu() for p in model.parameters()]
    if set_to_none:
        assert grads == [None, None]
    else:
        assert all(g is not None and not g.any() for g in grads)


@pytest.mark.parametrize("how", ["reload to a device", "move"])
@pytest.mark.parametrize("seed", [0, 1])
def test_grads_given_back_by_a_non_blocking_move_are_ordered_before_they_are_read(sim, how, seed):
    """``reload(opt, device, non_blocking=True)`` and ``move(opt, non_blocking=True)`` give offloaded grads back on
    a side stream: the current stream waits for them at once, as after a plain reload (grads are read before
    step(): clipping). Under the strictest schedule a clip right after raised StreamRaceError (found by a
    new-user hunt)."""
    from optimshift.testing import deferred_streams

    model = torch.nn.Linear(4, 4).to(sim)
    opt = torch.optim.Adam(model.parameters())
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    with deferred_streams(seed, progress=0.0):
        optimshift.offload(opt, include=("grads",))
        if how == "move":
            optimshift.move(opt, non_blocking=True)
        else:
            optimshift.reload(opt, sim, non_blocking=True)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        assert all(p.grad.device == sim for p in model.parameters())


def test_a_second_offload_of_grads_refuses_a_grad_set_while_one_is_held(sim):
    """A grad set while the param's offloaded grad is held, then offload(include=("grads",)) again: refused, as a
    reload refuses it, before anything changes (the held grad was dropped silently; found by a new-user hunt)."""
    model = torch.nn.Linear(4, 4).to(sim)
    opt = torch.optim.Adam(model.parameters())
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    optimshift.offload(opt, include=("grads",))
    model.weight.grad = torch.full_like(model.weight, 0.25)
    with pytest.raises(ValueError, match=r"group 0, param 0.*got a new \.grad while its offloaded grad was held"):
        optimshift.offload(opt, include=("grads",))
    model.weight.grad = None
    optimshift.reload(opt)
    assert all(torch.equal(p.grad.cpu(), torch.ones_like(p).cpu()) for p in model.parameters())


@pytest.mark.parametrize("call", ["move", "offload", "reload"])
def test_flags_that_are_not_bools_are_refused_by_name(sim, call):
    """``non_blocking=1`` reached torch's copy_ ("argument 'non_blocking' must be bool, not int", naming neither
    the optimizer nor the call); ``pin_memory="no"`` was taken as True. Refused, before anything changes."""
    model = torch.nn.Linear(2, 2).to(sim)
    opt = torch.optim.Adam(model.parameters())
    fn = getattr(optimshift, call)
    with pytest.raises(TypeError, match=rf"Adam: {call}: non_blocking must be a bool, got 1"):
        fn(opt, non_blocking=1)
    if call == "offload":
        with pytest.raises(TypeError, match=r"pin_memory must be a bool or None, got 'no'"):
            optimshift.offload(opt, pin_memory="no")
    assert not optimshift.is_offloaded(opt)


@pytest.mark.parametrize("flag", ["capturable", "fused"])
def test_flags_switched_on_while_offloaded_place_the_step_as_a_fresh_optimizer(sim, flag):
    """capturable (or fused) switched on while offloaded: the reload put step back on the host where it was, and
    the next step() raised (the kernel wants it on the device). It goes where a fresh optimizer with those flags
    keeps it; a param whose state was all on the host gets it back there, as it was."""
    params = [torch.nn.Parameter(torch.randn(4, 3, device=sim)), torch.nn.Parameter(torch.randn(3, device=sim))]
    opt = torch.optim.Adam(params, lr=0.01, foreach=False)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    host_side = opt.state[params[1]]
    for t in host_side.values():  # (this param's state kept on the host: it stays there)
        torch.utils.swap_tensors(t, t.detach().cpu())
    optimshift.offload(opt)
    opt.param_groups[0][flag] = True
    opt.param_groups[0]["foreach"] = None if flag == "fused" else False
    optimshift.reload(opt)
    assert opt.state[params[0]]["step"].device == sim and opt.state[params[0]]["exp_avg"].device == sim
    assert {t.device.type for t in host_side.values()} == {"cpu"}
    assert [f.param for f in optimshift.check(opt).findings] == ["group 0, param 1"] * 3
    optimshift.move(opt)  # (the host-side state placed by the rule too)
    assert not optimshift.check(opt).findings
    opt.step()


def test_an_optimizer_whose_hooks_cannot_be_registered_is_refused_before_anything_moves(sim):
    """A class that never ran Optimizer.__init__ has no hook dicts (pytorch_optimizer's ScheduleFreeWrapper):
    offload() registered its guards after the copies were committed, so it raised with the state on the host,
    not offloaded, and reload() left it there. Now refused first, the step pre-hook it did register removed."""
    model, opt = _adam(sim)
    del opt._optimizer_state_dict_post_hooks  # (what such a class lacks)
    ids, pre_hooks = tensor_ids(opt), len(opt._optimizer_step_pre_hooks)
    with pytest.raises(TypeError, match="cannot be registered .*nothing was changed"):
        optimshift.offload(opt)
    assert tensor_ids(opt) == ids and not optimshift.is_offloaded(opt)
    assert {t.device for st in opt.state.values() for k, t in st.items() if k != "step"} == {sim}
    assert len(opt._optimizer_step_pre_hooks) == pre_hooks
    train(model, opt, range(1, 2))


@pytest.mark.parametrize("change", ["append", "remove"])
def test_a_group_whose_params_changed_while_offloaded_gets_its_own_lr_back(sim, change):
    """A group is found again by its dict and its params: a param appended to (or taken from) a group while
    offloaded made the record lose the group's own tensor ``lr``, which the offload took from the device, and the
    reload left it on the host (``check()`` found nothing: a group tensor stays on the side it is on). The same
    dict still holding the very tensor the offload took is the same group."""
    a, b = torch.nn.Parameter(torch.ones(2, device=sim)), torch.nn.Parameter(torch.ones(3, device=sim))
    opt = torch.optim.Adam([a, b], lr=torch.tensor(0.01, device=sim), capturable=True)
    for p in (a, b):
        p.grad = torch.ones_like(p)
    opt.step()
    lr = opt.param_groups[0]["lr"]
    optimshift.offload(opt)
    if change == "append":
        extra = torch.nn.Parameter(torch.ones(4, device=sim))
        opt.param_groups[0]["params"].append(extra)
    else:
        opt.param_groups[0]["params"].pop()
        del opt.state[b]
    optimshift.reload(opt)
    assert opt.param_groups[0]["lr"] is lr and lr.device == sim
    for p in opt.param_groups[0]["params"]:
        p.grad = torch.ones_like(p)
    opt.step()


@pytest.mark.parametrize("moved", [False, True], ids=["in-place", "params-moved"])
def test_a_group_added_while_offloaded_sharing_the_lr_survives_a_second_offload(sim, moved):
    """``add_param_group`` fills a new group from the defaults: the same tensor ``lr`` as the first group's. Added
    while offloaded, that tensor sits on the host, and a second offload recorded the host as where the new group's
    lr was: the reload then had one tensor bound for the device and the host, and refused (ValueError), leaving the
    state stranded on the host. The second offload records it where the first took it from."""
    p = torch.nn.Parameter(torch.ones(3, device=sim))
    opt = torch.optim.AdamW([p], lr=torch.tensor(0.01, device=sim), capturable=True)
    p.grad = torch.ones_like(p)
    opt.step()
    lr = opt.param_groups[0]["lr"]
    optimshift.offload(opt)
    extra = torch.nn.Parameter(torch.ones(2, device=sim))
    opt.add_param_group({"params": [extra]})
    assert opt.param_groups[1]["lr"] is lr
    optimshift.offload(opt)
    device = torch.device(sim.type, 1) if moved else sim
    torch.nn.ParameterList([p, extra]).to(device)
    optimshift.reload(opt)
    assert not optimshift.is_offloaded(opt)
    assert opt.param_groups[0]["lr"] is opt.param_groups[1]["lr"] is lr and lr.device == device
    for q in (p, extra):
        q.grad = torch.ones_like(q)
    opt.step()
