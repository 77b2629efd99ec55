"""Cached plans (optimshift._plan_cache): a repeated operation on an unchanged optimizer reuses its plan and its
adoption decisions; every change that could alter a decision rebuilds it (one test per invalidation).

A rebuild is seen as a call of ``build_plan``; every scenario also checks the result against the rule (state
where a fresh optimizer keeps it, values bitwise, objects kept), so a stale plan would fail twice.
"""

import contextlib
import copy
import gc
import weakref

import pytest
import torch

import optimshift
from _custom_optimizers import Averaged, Placed
from _matrix import Model, bitwise_equal, snapshot, tensor_ids, train
from optimshift import _device_streams, _plan, _plan_cache, _session

SHAPES = [(3, 2), (4,), (2, 5)]


@pytest.fixture
def builds(monkeypatch):
    """The number of plans built so far (cache misses)."""
    count = [0]
    real = _plan_cache.build_plan

    def counting(*args, **kwargs):
        count[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(_plan_cache, "build_plan", counting)
    return count


def _trained(device, cls=torch.optim.Adam, **kwargs):
    model = Model(SHAPES).to(device)
    opt = cls(list(model.parameters()), **({"foreach": True} | kwargs))
    train(model, opt, range(2))
    return model, opt


def _cycle(opt):
    optimshift.offload(opt)
    optimshift.reload(opt)


def _placed_like_fresh(opt):
    assert not optimshift.check(opt).findings


def test_an_unchanged_optimizer_reuses_its_offload_and_reload_plans(sim, builds, monkeypatch):
    model, opt = _trained(sim)
    values = [snapshot(dict(st)) for st in opt.state.values()]
    objects = tensor_ids(opt)
    _cycle(opt)
    _cycle(opt)
    assert builds[0] == 4  # the first two offloads and reloads: a plan is kept from its second build
    decided = []
    real_decide = optimshift._engine.decide_all
    monkeypatch.setattr(optimshift._engine, "decide_all", lambda pairs: decided.append(1) or real_decide(pairs))
    targets = []
    real_target = _plan.policy_target
    monkeypatch.setattr(optimshift.api, "policy_target", lambda *a: targets.append(1) or real_target(*a))
    for _ in range(3):
        _cycle(opt)
    assert builds[0] == 4 and decided == [], "no plan built and no adoption decided again"
    assert tensor_ids(opt) == objects
    for st, before in zip(opt.state.values(), values):
        assert bitwise_equal(dict(st), before)
    session = _session.of(opt)
    assert {k[0] for k in session.plans} == {"offload", "reload"}
    assert [c.hits for kept in session.plans.values() for c in kept] == [3, 3]
    train(model, opt, range(2, 3))
    _placed_like_fresh(opt)


def test_a_repeated_move_reuses_its_plan(sim, builds):
    model, opt = _trained(sim)
    for _ in range(4):
        model.to("cpu")
        optimshift.move(opt)
        model.to(sim)
        optimshift.move(opt)
    assert builds[0] == 4  # each direction's first two
    _placed_like_fresh(opt)


def test_a_one_off_operation_keeps_nothing_per_tensor(sim, builds):
    """The first plan under a key leaves a marker (no layout) and no per-tensor record: a one-off move pays
    nothing for the cache. The second build under that key is kept with its layout; a call over that layout
    reuses it, a call over another leaves a marker of that layout beside it (a move that follows its params back
    and forth: ``PER_KEY`` layouts per key)."""
    model, opt = _trained(sim)

    def follow(device):
        model.to(device)
        optimshift.move(opt)

    follow("cpu")
    (entry,) = next(iter(_session.of(opt).plans.values()))
    assert entry.template is None and entry.ids == [] and entry.metas == [] and entry.hows is None
    assert entry.layout is None  # (not even the layout: it is asked from the second call under the key on)
    follow(sim)  # (the second build under the key: kept, with this layout)
    assert builds[0] == 2 and entry.template is not None and entry.hits == 0
    assert entry.layout == _plan_cache.layout(opt)
    follow("cpu")  # (another layout: built, a marker of it left beside the kept plan)
    (marker, same) = next(iter(_session.of(opt).plans.values()))
    assert builds[0] == 3 and same is entry and marker.template is None and marker.layout == _plan_cache.layout(opt)
    follow(sim)  # (the kept plan's layout: reused)
    assert builds[0] == 3 and entry.hits == 1
    follow("cpu")  # (the marker's layout, built the second time: kept)
    assert builds[0] == 4 and marker.template is not None
    follow(sim)
    follow("cpu")
    assert builds[0] == 4 and (entry.hits, marker.hits) == (2, 1)
    _placed_like_fresh(opt)


# -- each invalidation ------------------------------------------------------------------------------------


def _rebuilt_after(sim, builds, change, *, cls=torch.optim.Adam, kwargs=None):
    """Cycle once (two plans), apply ``change(model, opt)``, cycle again: returns how many plans that built."""
    model, opt = _trained(sim, cls, **(kwargs or {}))
    _cycle(opt)
    _cycle(opt)  # (kept from the second build)
    before = builds[0]
    change(model, opt)
    _cycle(opt)
    train(model, opt, range(2, 3))
    _placed_like_fresh(opt)
    return builds[0] - before


def test_control_nothing_changed_builds_nothing(sim, builds):
    assert _rebuilt_after(sim, builds, lambda model, opt: None) == 0


def test_a_new_param_group_rebuilds(sim, builds):
    def change(model, opt):
        extra = torch.nn.Parameter(torch.ones(3, device=sim))
        extra.grad = torch.ones_like(extra)
        opt.add_param_group({"params": [extra]})
        opt.step()

    assert _rebuilt_after(sim, builds, change) == 2


def test_another_param_object_rebuilds(sim, builds):
    def change(model, opt):
        old = opt.param_groups[0]["params"][0]
        new = torch.nn.Parameter(old.detach().clone())
        opt.param_groups[0]["params"][0] = new
        opt.state[new] = opt.state.pop(old)
        model.parts[0].weight = new

    assert _rebuilt_after(sim, builds, change) == 2


def test_another_tensor_object_at_a_site_rebuilds(sim, builds):
    def change(model, opt):
        st = next(iter(opt.state.values()))
        st["exp_avg"] = st["exp_avg"].clone()

    assert _rebuilt_after(sim, builds, change) == 2


@pytest.mark.parametrize("what", ["a frozen Parameter", "an inference tensor"])
def test_a_new_tensor_that_reuses_a_freed_ones_id_rebuilds(sim, builds, what):
    """Sites are matched by id (the cache holds no tensor), and a tensor created after a freed one may get its
    id. Such a tensor of another kind (a Parameter another module owns, kept as state; an inference tensor)
    must not inherit the cached decisions: the plan is rebuilt and the tensor replaced, never changed in place.
    (The reuse is made certain here by giving the cache the new tensor's id.)"""
    model, opt = _trained(sim)
    st = opt.state[opt.param_groups[0]["params"][0]]
    st["extra"] = torch.ones(3, 2, device=sim)
    _cycle(opt)
    _cycle(opt)  # the plans and their adoption decisions are cached
    optimshift.offload(opt)
    cached = next(kept[0] for key, kept in _session.of(opt).plans.items() if key[0] == "reload")
    i = cached.ids.index(id(st["extra"]))
    if what == "a frozen Parameter":
        new = torch.nn.Parameter(torch.full((3, 2), 7.0), requires_grad=False)  # a frozen weight, on the host
    else:
        with torch.inference_mode():
            new = torch.full((3, 2), 7.0)
    st["extra"] = new
    cached.ids[i] = id(new)  # as if it had landed where the freed tensor was
    before = builds[0]
    optimshift.reload(opt)
    assert builds[0] == before + 1, "rebuilt"
    assert st["extra"] is not new and new.device.type == "cpu", "replaced; the original left where it was"
    assert st["extra"].device == sim and torch.equal(st["extra"].cpu(), torch.full((3, 2), 7.0))
    if what == "an inference tensor":
        assert new.is_inference() and repr(new)  # still a working inference tensor


@pytest.mark.parametrize("what", ["dtype", "shape", "strides", "device"])
def test_a_site_whose_tensor_changed_in_place_rebuilds(sim, builds, what):
    def change(model, opt):
        st = opt.state[opt.param_groups[0]["params"][0]]  # a (3, 2) param
        t = st["exp_avg"]
        if what == "dtype":
            t.data = t.data.double()
        elif what == "shape":
            t.data = t.data.reshape(2, 3).reshape(3, 2).clone().resize_(3, 2)
            st["max"] = torch.zeros(1, device=sim)  # (and a new entry: a site that was not there)
        elif what == "strides":
            t.data = t.data.t().contiguous().t()
        else:
            torch.utils.swap_tensors(opt.state[opt.param_groups[0]["params"][1]]["exp_avg_sq"], torch.zeros(4))

    model, opt = _trained(sim)
    _cycle(opt)
    before = builds[0]
    change(model, opt)
    optimshift.offload(opt)
    assert builds[0] == before + 1
    optimshift.reload(opt)


def test_a_param_that_moved_rebuilds_and_its_state_follows(sim, builds):
    sim1 = torch.device(sim.type, 1)

    def change(model, opt):
        model.to(sim1)

    model, opt = _trained(sim)
    _cycle(opt)
    before = builds[0]
    change(model, opt)
    optimshift.move(opt)
    optimshift.move(opt)  # (the state it starts from is not the first move's: a plan of its own, moving nothing)
    _cycle(opt)
    assert builds[0] - before == 4  # the two moves, and a new offload and reload
    assert {r.device for r in optimshift.placement(opt) if r.key != "step"} == {str(sim1)}
    _placed_like_fresh(opt)


def test_a_registered_policy_rebuilds(sim, builds):
    class Mine(torch.optim.Adam):
        pass

    def change(model, opt):
        optimshift.register_policy(Mine, lambda key, value, param, group, device: None)

    try:
        assert _rebuilt_after(sim, builds, change, cls=Mine) == 2
    finally:
        optimshift.unregister_policy(Mine)


def test_an_implementation_flag_rebuilds(sim, builds):
    def change(model, opt):
        opt.param_groups[0]["foreach"] = False

    assert _rebuilt_after(sim, builds, change) == 2


def test_a_hyperparameter_that_became_a_tensor_rebuilds(sim, builds):
    def change(model, opt):
        opt.param_groups[0]["lr"] = torch.tensor(opt.param_groups[0]["lr"])

    assert _rebuilt_after(sim, builds, change, kwargs={"foreach": False}) == 2


def test_a_float_hyperparameter_change_rebuilds_nothing(sim, builds):
    """A scheduler stepping lr every iteration: not a reason to plan again."""

    def change(model, opt):
        opt.param_groups[0]["lr"] *= 0.5

    assert _rebuilt_after(sim, builds, change) == 0


def test_a_group_mapping_keyed_by_the_params_is_keyed_by_their_kind_not_their_values(sim, builds):
    """A hyperparameter mapping keyed by the params (``group["masks"][param]``): the layout keyed each key by its
    str(), which prints the param's values (a host sync per param on a device) and changed with every step, so no
    cached plan was ever reused."""

    def change(model, opt):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)  # (what a step does to the keys' values)

    def masked(model, opt):
        opt.param_groups[0]["masks"] = {p: torch.ones(p.shape, device=sim) for p in opt.param_groups[0]["params"]}

    model, opt = _trained(sim)
    masked(model, opt)
    for _ in range(2):
        optimshift.offload(opt)
        optimshift.reload(opt)
    with optimshift.count_syncs() as steady:  # (a blocking offload's own wait, its plans cached)
        optimshift.offload(opt)
        optimshift.reload(opt)
    before = builds[0]
    change(model, opt)
    with optimshift.count_syncs() as syncs:
        optimshift.offload(opt)
        optimshift.reload(opt)
    assert builds[0] == before and syncs.total == steady.total


def test_grads_present_matter_when_grads_are_offloaded(sim, builds):
    model, opt = _trained(sim)
    for _ in range(3):
        optimshift.offload(opt, include=("grads",))
        optimshift.reload(opt)
    assert builds[0] == 4  # (kept from the second build)
    model.parts[0].weight.grad = None
    optimshift.offload(opt, include=("grads",))
    optimshift.reload(opt)
    assert builds[0] == 6
    assert model.parts[0].weight.grad is None and model.parts[1].weight.grad is not None


def test_the_adoption_inputs_are_checked_before_reusing_decisions(sim, builds):
    """A weak reference taken to a state tensor after the first cycle (as dynamo does once it traced a step):
    the cached swap decision no longer holds; the commit decides again (it replaces that tensor) instead of
    raising half-way in swap_tensors."""
    model, opt = _trained(sim)
    _cycle(opt)
    _cycle(opt)  # (kept from the second build)
    st = next(iter(opt.state.values()))
    watched = st["exp_avg"]
    ref = weakref.ref(watched)
    values = [snapshot(dict(s)) for s in opt.state.values()]
    _cycle(opt)
    # the offload plan still holds (only its decisions are made again); the reload's does not: the site holds the
    # replacement now
    assert builds[0] == 5
    offload_plan = _session.of(opt).plans[("offload", False)][0]
    assert offload_plan.hits == 1
    assert ref() is watched and st["exp_avg"] is not watched  # replaced (the documented fallback)
    for s, before in zip(opt.state.values(), values):
        assert bitwise_equal(dict(s), before)


def test_a_cached_plan_pins_no_tensor_the_state_let_go(sim):
    """A tensor the commit replaced (a weak reference blocks the swap, as dynamo's do on a compiled step's
    state) is freed with the state: the cached plans hold no tensor, so an offload frees all the state's device
    memory (it freed none while the offload plan held the tensors it was built over)."""
    from optimshift.testing import simulated_memory_allocated

    model, opt = _trained(sim)
    for cycle in range(2):
        gc.collect()
        refs = [weakref.ref(v) for st in opt.state.values() for v in st.values() if v.device == sim]
        state_bytes = sum(v.numel() * v.element_size() for v in map(weakref.ref.__call__, refs))
        before = simulated_memory_allocated(0)
        optimshift.offload(opt)
        gc.collect()
        assert all(r() is None for r in refs), cycle  # replaced, and nothing else holds them
        assert before - simulated_memory_allocated(0) == state_bytes, cycle
        optimshift.reload(opt)
        _placed_like_fresh(opt)


def test_a_plan_whose_sites_are_named_by_params_is_reused_and_holds_none(sim, builds):
    """Sites under a mapping keyed by the params (TRAC's ``state["_trac"][param]["ref"]``): the plan is reused as any
    other, and keeps each param key by its id (it held the params, which outlived the optimizer's use of them);
    each use names the sites by today's params, as the offload record a reload builds from needs them."""
    model, opt = _trained(sim, Averaged)
    first = next(iter(model.parameters()))
    host_ref = opt.state["_trac"][first]["ref"].cpu()  # (kept on the host by the user: a reload puts it back there)
    opt.state["_trac"][first]["ref"] = host_ref
    _cycle(opt)
    _cycle(opt)
    assert builds[0] == 4
    optimshift.offload(opt)  # a hit: its record of where each site was comes from the cached plan
    session = _session.of(opt)
    cached = [c for key, kept in session.plans.items() if key[0] == "offload" for c in kept]
    assert cached and cached[0].hits == 1
    held = {id(p) for p in model.parameters()}
    assert not [k for c in cached for ident, *_ in c.template for _, k in ident[2] if id(k) in held]
    assert not [k for c in cached for k in c.sources if any(isinstance(s[1], torch.Tensor) for s in k[2])]
    for key in [k for k in session.plans if k[0] == "reload"]:
        del session.plans[key]  # (the reload builds its plan from the offload's record)
    optimshift.reload(opt)
    assert builds[0] == 5
    assert opt.state["_trac"][first]["ref"] is host_ref and host_ref.device.type == "cpu"
    assert all(opt.state["_trac"][p]["ref"].device == sim for p in list(model.parameters())[1:])


@pytest.mark.parametrize("what", ["fake mode", "streams"])
def test_fake_mode_and_stream_availability_are_part_of_the_layout(sim, builds, monkeypatch, what):
    model, opt = _trained(sim)
    _cycle(opt)
    shape = _plan_cache.layout(opt)
    if what == "streams":
        monkeypatch.setitem(_device_streams._chosen, sim.type, None)
        context = contextlib.nullcontext()
    else:
        from torch._subclasses.fake_tensor import FakeTensorMode

        context = FakeTensorMode(allow_non_fake_inputs=True)
    with context:
        assert _plan_cache.layout(opt) != shape
    if what == "streams":
        before = builds[0]
        optimshift.offload(opt, non_blocking=True).wait()
        optimshift.reload(opt)
        assert builds[0] == before + 2


def test_a_reload_plan_built_for_one_offload_is_not_reused_for_another(sim, monkeypatch):
    """A reload keyed by the offload plan it undoes: by that plan's build, not its object (a marker stays one
    object when it is kept). A reload that failed and was retried keeps its plan at the first offload's
    targets; the next offload (a new build: the state moved) must not reuse it. Found by review: the retried
    reload's plan put exp_avg back on the host."""
    model, opt = _trained(sim)
    st = opt.state[model.parts[0].weight]
    exp_avg = st["exp_avg"]
    torch.utils.swap_tensors(exp_avg, exp_avg.detach().cpu())  # misplaced; a reload puts it back where it was
    optimshift.offload(opt)
    real, calls = optimshift._engine.copy_items, []

    def failing_once(*args, **kwargs):
        if not calls:
            calls.append(1)
            raise torch.OutOfMemoryError("simulated OOM")
        return real(*args, **kwargs)

    monkeypatch.setattr(optimshift._engine, "copy_items", failing_once)
    with pytest.raises(torch.OutOfMemoryError):
        optimshift.reload(opt)  # (all or nothing: still offloaded)
    optimshift.reload(opt)
    assert exp_avg.device.type == "cpu"
    optimshift.move(opt)  # placed by the rule: on the device
    assert st["exp_avg"] is exp_avg and exp_avg.device == sim
    optimshift.offload(opt)
    optimshift.reload(opt)
    assert st["exp_avg"] is exp_avg and exp_avg.device == sim
    _placed_like_fresh(opt)


def test_a_first_build_that_raises_leaves_the_cache_as_it_was(sim, monkeypatch):
    model, opt = _trained(sim)
    _cycle(opt)
    _cycle(opt)
    kept = {k: list(v) for k, v in _session.of(opt).plans.items()}

    def refusing(*args, **kwargs):
        raise ValueError("refused")

    monkeypatch.setattr(_plan_cache, "build_plan", refusing)
    with pytest.raises(ValueError, match="refused"):
        optimshift.move(opt, "cpu")
    assert {k: list(v) for k, v in _session.of(opt).plans.items()} == kept


def test_plans_in_use_are_evicted_last(sim, builds):
    """The cycle's two plans, used every iteration, outlive a burst of one-off plans under other keys. (Its moves
    between the host and the device re-planned the cycle each time: the plan it found kept was a dead reload's.)"""
    model, opt = _trained(sim)
    for _ in range(2):
        _cycle(opt)
    plans = _session.of(opt).plans
    cycle_keys = set(plans)
    for i in range(2 * _plan_cache.MAX_KEYS):
        _plan_cache.plan_for(opt, _plan.policy_target(opt, None), ("one-off", i))
        before = builds[0]
        _cycle(opt)
        assert builds[0] == before, "the cycle's plans were evicted"
    assert cycle_keys <= set(plans) and len(plans) == _plan_cache.MAX_KEYS


def _reloads_undo_kept_offloads(opt):
    """Whether the reload plans kept are those undoing the offload plans kept, no other."""
    plans = _session.of(opt).plans
    offloads = [c for key, kept in plans.items() if key[0] == "offload" for c in kept if c.kept]
    return {key for key in plans if key[0] == "reload"} == {_plan_cache.undoing(c.serial) for c in offloads}


def test_a_load_that_re_plans_the_offload_drops_the_reload_plan_of_the_build_it_replaced(sim):
    """A load_state_dict gives the state new tensors (the groups new dicts): the offload is planned again, and the
    reload keyed by a build no longer kept can never be asked again. It was kept until evicted (a dead plan more
    with each load)."""
    model, opt = _trained(sim)
    for _ in range(_plan_cache.MAX_KEYS):
        opt.load_state_dict(copy.deepcopy(opt.state_dict()))
        _cycle(opt)
        _cycle(opt)  # (the new offload plan kept, and the reload plan undoing it)
        assert _reloads_undo_kept_offloads(opt)
        assert len(_session.of(opt).plans) <= 2 * _plan_cache.PER_KEY
    _placed_like_fresh(opt)


def test_dead_reload_plans_push_out_no_plan_in_use(sim, builds):
    """State moved between the host and the device, offloaded and reloaded at each: each offload re-plans (its
    state's devices changed), leaving a reload plan no later offload can ask for; a few rounds of them evicted the
    plan of a move still in use."""
    model, opt = _trained(sim)
    for _ in range(2):
        optimshift.move(opt)  # (where the params are: a plan in use, kept from its second build)
    for _ in range(_plan_cache.MAX_KEYS):
        for device in ("cpu", sim):
            optimshift.move(opt, device)
            _cycle(opt)
        assert _reloads_undo_kept_offloads(opt)
    before = builds[0]
    optimshift.move(opt)
    assert builds[0] == before, "the plan of a move in use was evicted"
    _placed_like_fresh(opt)


def test_a_hyperparameter_the_placement_depends_on_rebuilds_the_cached_plan(sim, builds):
    """A cached plan keys on the group's entries by kind (what the probe that places a third-party class's
    scalars keys on), not only on torch's implementation flags: a group flag switched between moves re-places."""
    model = Model(SHAPES).to(sim)
    opt = Placed(model.parameters())  # (its counter on the host for a vector, unless the group says otherwise)
    train(model, opt, range(2))

    def there_and_back():
        for device in ("cpu", sim):
            for p in model.parameters():
                torch.utils.swap_tensors(p, torch.nn.Parameter(p.detach().to(device)))
            optimshift.move(opt)

    for _ in range(3):  # (plans are kept from their second build: the third round is served from the cache)
        there_and_back()
    vectors = [opt.state[p] for p in model.parameters() if p.dim() == 1]
    assert vectors and all(st["count"].device.type == "cpu" for st in vectors)
    before = builds[0]
    opt.param_groups[0]["device_counter"] = True  # a fresh Placed(..., device_counter=True) keeps it on the device
    there_and_back()
    assert builds[0] > before, "the cached plans were reused for a group whose placement changed"
    assert all(st["count"].device == torch.device(sim) for st in opt.state.values()), "where a fresh one keeps it"
    _placed_like_fresh(opt)


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.optim.Adam,
        lambda: lambda params: torch.optim.Adam(params, lr=torch.tensor(0.01), betas=(0.9, 0.99)),
        lambda: torch.optim.LBFGS,
        lambda: lambda params: Averaged(params, lr=0.1),
        lambda: torch.optim.ASGD,
    ],
    ids=["adam", "adam-tensor-lr", "lbfgs", "averaged", "asgd"],
)
def test_a_cached_plan_is_the_plan_a_fresh_build_makes(sim, make):
    """The two walks of an optimizer that must agree: ``build_plan``'s and the cached plan's (``_current``, which
    takes each site's tensor and param from today's walk by the template). Sites, tensors, params and targets are
    the same, in the same order, for state in containers, a group tensor shared by state, param-keyed mappings."""
    model = Model(SHAPES).to(sim)
    opt = make()(list(model.parameters()))
    train(model, opt, range(2))
    target = _plan.policy_target(opt, torch.device("cpu"))
    key = ("a test's key", "cpu")
    for _ in range(3):  # a marker, the kept build, then a cached plan
        plan, cached = _plan_cache.plan_for(opt, target, key)
    assert cached is not None and cached.hits == 1
    fresh = _plan.build_plan(opt, target)

    def rows(p):
        return [(tr.ident, tr.name, id(tr.tensor), id(tr.param), tr.target, tr.source) for tr in p.transfers]

    assert rows(plan) == rows(fresh) and plan.repeats == fresh.repeats
