"""offload / reload / offloaded: state to the host and back exactly where it was."""

import pytest
import torch

import optimshift
from _matrix import CASES, Delegating, Model, bitwise_equal, snapshot, state_layout, tensor_ids, train


def _all_on_host(opt):
    return all(row.device == "cpu" for row in optimshift.placement(opt))


@pytest.mark.parametrize("cls, kwargs, shapes", [pytest.param(c, k, s, id=n) for n, c, k, _, s in CASES])
def test_round_trip_restores_placement_and_bits(sim, cls, kwargs, shapes):
    model = Model(shapes).to(sim)
    opt = cls(list(model.parameters()), **kwargs)
    train(model, opt, range(2))
    layout = state_layout(opt)
    values = {i: snapshot(dict(st)) for i, st in enumerate(opt.state.values())}
    objects = tensor_ids(opt)
    optimshift.offload(opt)
    assert _all_on_host(opt) and optimshift.is_offloaded(opt)
    assert tensor_ids(opt) == objects, "offload keeps every tensor object"
    optimshift.reload(opt)
    assert state_layout(opt) == layout and not optimshift.is_offloaded(opt)
    assert tensor_ids(opt) == objects, "reload keeps every tensor object"
    for i, st in enumerate(opt.state.values()):
        assert bitwise_equal(dict(st), values[i])

    # and it trains on exactly like an optimizer that never left
    still_model = Model(shapes).to(sim)
    still = cls(list(still_model.parameters()), **kwargs)
    train(still_model, still, range(2))
    train(model, opt, range(2, 4))
    train(still_model, still, range(2, 4))
    for a, b in zip(model.parameters(), still_model.parameters()):
        assert bitwise_equal(a, b)


def test_fused_step_goes_back_to_the_device(sim):
    model = Model([(3, 2)]).to(sim)
    opt = torch.optim.Adam(model.parameters(), fused=True)
    train(model, opt, range(1))
    optimshift.offload(opt)
    (st,) = opt.state.values()
    assert st["step"].device.type == "cpu"
    optimshift.reload(opt)
    assert st["step"].device == sim and st["step"].dtype == torch.float32
    train(model, opt, range(1, 2))  # the fused kernel accepts it: the sim rejects host tensors there


def test_offload_twice_and_reload_without_offload_are_no_ops(sim):
    model = Model([(3, 2), (2,)]).to(sim)
    opt = torch.optim.Adam(model.parameters(), capturable=True)
    train(model, opt, range(1))
    layout = state_layout(opt)
    ids = [id(v) for st in opt.state.values() for v in st.values()]
    optimshift.reload(opt)
    assert [id(v) for st in opt.state.values() for v in st.values()] == ids
    optimshift.offload(opt)
    optimshift.offload(opt)
    optimshift.reload(opt)
    assert state_layout(opt) == layout


def test_params_split_over_host_and_device(sim):
    model = Model([(3, 2), (2,), (2, 2)])
    model.parts[0].to(sim)
    model.parts[2].to(sim)
    opt = torch.optim.Adam(model.parameters(), foreach=False)
    train(model, opt, range(1))
    layout = state_layout(opt)
    optimshift.offload(opt)
    assert _all_on_host(opt)
    optimshift.reload(opt)
    assert state_layout(opt) == layout


def test_reload_to_another_device_places_like_fresh(sim):
    sim1 = torch.device(sim.type, 1)
    model = Model([(3, 2), (2,)]).to(sim)
    opt = torch.optim.NAdam(model.parameters(), capturable=True)
    train(model, opt, range(1))
    optimshift.offload(opt)
    model.to(sim1)
    optimshift.reload(opt, sim1)
    fresh_model = Model([(3, 2), (2,)]).to(sim1)
    fresh = torch.optim.NAdam(fresh_model.parameters(), capturable=True)
    train(fresh_model, fresh, range(1))
    assert state_layout(opt) == state_layout(fresh)
    assert not optimshift.is_offloaded(opt)


def test_reload_to_a_device_of_a_never_offloaded_optimizer_moves_it_as_documented(sim):
    """``reload(opt)`` of an optimizer that is not offloaded changes nothing; ``reload(opt, device)`` puts its
    state where a fresh optimizer on ``device`` keeps it, as ``move`` does, and the docstring says both."""
    doc = " ".join(optimshift.reload.__doc__.split())
    assert "without ``device``, a no-op for an optimizer that is not offloaded" in doc
    assert "With ``device``, the state goes where a fresh optimizer on ``device`` keeps it, offloaded or not" in doc
    host = torch.device("cpu")
    model = Model([(3, 2), (2,)])
    opt = torch.optim.Adam(model.parameters(), foreach=False)
    train(model, opt, range(1))
    ids, layout = tensor_ids(opt), state_layout(opt)
    assert optimshift.reload(opt) is opt and state_layout(opt) == layout and tensor_ids(opt) == ids
    model.to(sim)
    moved = Model([(3, 2), (2,)])
    other = torch.optim.Adam(moved.parameters(), foreach=False)
    train(moved, other, range(1))
    moved.to(sim)
    optimshift.move(other)
    optimshift.reload(opt, sim)
    assert state_layout(opt) == state_layout(other) and tensor_ids(opt) == ids and not optimshift.is_offloaded(opt)
    assert {row.key: row.device for row in optimshift.placement(opt)} == {
        "step": str(host),
        "exp_avg": str(sim),
        "exp_avg_sq": str(sim),
    }


def test_offloaded_context_reloads_on_exception(sim):
    model = Model([(3, 2)]).to(sim)
    opt = torch.optim.Adam(model.parameters(), fused=True)
    train(model, opt, range(1))
    layout = state_layout(opt)
    with pytest.raises(KeyError):
        with optimshift.offloaded(opt):
            assert _all_on_host(opt)
            raise KeyError("evaluation failed")
    assert state_layout(opt) == layout


def test_offloaded_frees_simulated_device_memory(sim):
    from optimshift.testing import simulated_memory_allocated

    model = Model([(64, 64)]).to(sim)
    opt = torch.optim.Adam(model.parameters(), foreach=False)
    train(model, opt, range(1))
    for p in model.parameters():
        p.grad = None
    import gc

    gc.collect()
    with_state = simulated_memory_allocated(0)
    with optimshift.offloaded(opt):
        gc.collect()
        assert with_state - simulated_memory_allocated(0) == 2 * 64 * 64 * 4  # exp_avg, exp_avg_sq
    gc.collect()
    assert simulated_memory_allocated(0) == with_state


def test_operations_on_a_wrapper_are_the_wrapped_optimizers(sim):
    # Before: offload(wrapper) kept its record on the wrapper, so is_offloaded(inner) was False and reload(inner)
    # was a no-op that left the state on the host.
    model = Model([(4, 3), (3,)]).to(sim)
    inner = torch.optim.Adam(list(model.parameters()))
    train(model, inner, range(1))
    layout, ids = state_layout(inner), tensor_ids(inner)
    wrapper = Delegating(inner)
    assert optimshift.offload(wrapper) is wrapper  # what a call is given back is what it was given
    assert optimshift.is_offloaded(inner) and optimshift.is_offloaded(wrapper)
    assert _all_on_host(inner)
    assert optimshift.reload(inner) is inner
    assert state_layout(inner) == layout and tensor_ids(inner) == ids and not optimshift.is_offloaded(wrapper)
    optimshift.offload(inner)
    assert optimshift.reload(wrapper) is wrapper and state_layout(inner) == layout and tensor_ids(inner) == ids
    assert optimshift.check(wrapper).ok and len(optimshift.placement(wrapper)) == len(optimshift.placement(inner))
    optimshift.offload(wrapper)
    assert optimshift.keep_addresses(wrapper) is wrapper
    optimshift.reload(wrapper)
    assert state_layout(inner) == layout and tensor_ids(inner) == ids

    # The frameworks' reload (verl's, DeepSpeed's: integrations._common.reload_to) of a wrapper offloaded with its
    # addresses kept is the exact reload: the same addresses (a reload to a device would leave the range).
    from optimshift.integrations import _common

    addresses = {id(v): v.data_ptr() for st in inner.state.values() for v in st.values() if v.device == sim}
    optimshift.offload(wrapper, keep_addresses=True)
    _common.reload_to(wrapper, sim, what="device", non_blocking=False)
    assert not optimshift.is_offloaded(inner) and state_layout(inner) == layout and tensor_ids(inner) == ids
    assert {id(v): v.data_ptr() for st in inner.state.values() for v in st.values() if v.device == sim} == addresses

    # and the rest of the public operations
    optimshift.move(wrapper, "cpu")
    assert _all_on_host(inner) and tensor_ids(inner) == ids
    assert optimshift.move(wrapper, sim) is wrapper and state_layout(inner) == layout
    with optimshift.offloaded(wrapper):
        assert optimshift.is_offloaded(inner) and _all_on_host(inner)
    optimshift.wait(wrapper)
    assert state_layout(inner) == layout and tensor_ids(inner) == ids
    fresh = [torch.nn.Parameter(p.detach().clone()) for p in model.parameters()]
    assert optimshift.rebind(wrapper, fresh) is wrapper
    assert [p for g in inner.param_groups for p in g["params"]] == fresh and tensor_ids(inner) == ids


class _Base:
    """schedulefree's ``ScheduleFreeWrapper``: a plain object holding the optimizer as ``.base`` and sharing its
    param_groups and state (not a torch.optim.Optimizer: no hooks of its own)."""

    def __init__(self, optimizer):
        self.base = optimizer
        self.param_groups, self.state = optimizer.param_groups, optimizer.state


class _Sam(torch.optim.Optimizer):
    """SAM's shape: an Optimizer over the params that builds its base optimizer as ``.base_optimizer`` and shares
    its param_groups and state."""

    def __init__(self, params, base_cls, **kwargs):
        super().__init__(params, {})
        self.base_optimizer = base_cls(self.param_groups, **kwargs)
        self.param_groups, self.state = self.base_optimizer.param_groups, self.base_optimizer.state

    def step(self, closure=None):
        return self.base_optimizer.step(closure)


def test_a_wrapper_holding_its_optimizer_under_another_name_is_unwrapped(sim):
    """Only ``.optimizer`` was followed: schedulefree's wrapper (``.base``) was offloaded with no hook (nothing
    guarded a state_dict() taken meanwhile: it viewed pool buffers a later offload overwrote), and SAM's
    (``.base_optimizer``) was placed by a guess (NAdam's host mu_product went to the device: syncs each step)."""
    for make in (lambda ps: _Base(torch.optim.NAdam(ps)), lambda ps: _Sam(ps, torch.optim.NAdam)):
        model = Model([(4, 3), (3,)]).to(sim)
        wrapper = make(list(model.parameters()))
        inner = optimshift._state.unwrap(wrapper)
        assert isinstance(inner, torch.optim.NAdam) and inner is not wrapper
        train(model, inner, range(1))
        fresh = state_layout(inner)
        optimshift.move(wrapper, "cpu")
        optimshift.offload(wrapper)
        assert optimshift.is_offloaded(inner)
        saved = inner.state_dict()  # (the inner optimizer's hooks: compact copies, not pool views)
        assert all(t.untyped_storage().nbytes() == t.nbytes for st in saved["state"].values() for t in st.values())
        optimshift.reload(wrapper, sim)
        assert state_layout(inner) == fresh


class _Tracked(torch.optim.Optimizer):
    """TRAC's shape: a delegating wrapper with state of its own keyed by params, which its load_state_dict
    translates back from indices."""

    def __init__(self, optimizer):
        self.optimizer = optimizer
        self.defaults, self.param_groups, self.state = optimizer.defaults, optimizer.param_groups, optimizer.state

    def load_state_dict(self, state_dict):
        return self.optimizer.load_state_dict(state_dict)


def test_a_wrapper_with_a_load_of_its_own_is_refused_by_optimshifts_load(sim):
    """optimshift.load_state_dict unwrapped first and asked only the inner class whether it overrides the load: a
    wrapper's own load (TRAC's re-keying of its state) was skipped, and the next step raised KeyError."""
    model = Model([(4, 3)]).to(sim)
    opt = _Tracked(torch.optim.Adam(model.parameters()))
    train(model, opt.optimizer, range(1))
    with pytest.raises(TypeError, match="_Tracked wraps Adam and overrides load_state_dict"):
        optimshift.load_state_dict(opt, opt.optimizer.state_dict())


class _Backref(torch.optim.Optimizer):
    """A delegating wrapper whose inner optimizer refers back to it (``opt.wrapper = self``)."""

    def __init__(self, optimizer):
        self.optimizer, optimizer.wrapper = optimizer, self
        self.defaults, self.param_groups, self.state = optimizer.defaults, optimizer.param_groups, optimizer.state


def test_a_wrapper_its_optimizer_refers_back_to_is_unwrapped_once(sim):
    """The wrapper search went back and forth between the two (each shares the other's groups and state) and ended
    on the wrapper: offload() was refused (no hooks) and reload() did nothing."""
    model = Model([(4, 3)]).to(sim)
    inner = torch.optim.Adam(model.parameters())
    train(model, inner, range(1))
    wrapper = _Backref(inner)
    assert optimshift._state.wrapping(wrapper) == [wrapper, inner]
    optimshift.offload(wrapper)
    assert optimshift.is_offloaded(inner)
    optimshift.reload(wrapper)
    assert not optimshift.is_offloaded(inner) and state_layout(inner) == state_layout(inner)


def test_a_file_saved_from_a_wrapper_loads_into_it(sim, tmp_path):
    """A file an older optimshift saved from a SAM-shaped wrapper records the wrapper's class; since the wrapper is
    unwrapped, the load compared it with the inner optimizer's and refused it ("load it into a _Sam": it was)."""
    model = Model([(4, 3)]).to(sim)
    opt = _Sam(list(model.parameters()), torch.optim.Adam)
    train(model, opt.base_optimizer, range(1))
    path = tmp_path / "opt.pt"
    optimshift.save(opt, path)
    saved = torch.load(path, weights_only=True)
    meta = next(k for k in saved if k not in ("state", "param_groups"))
    saved[meta]["class"] = _Sam.__qualname__  # (what the older save recorded)
    saved[meta]["module"] = _Sam.__module__
    optimshift.load_state_dict(opt, saved)
    with pytest.raises(ValueError, match="saved from"):
        optimshift.load_state_dict(torch.optim.SGD(model.parameters(), lr=0.1), saved)
