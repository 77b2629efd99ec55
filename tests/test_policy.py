"""The placement rules: derived from the installed torch, checked against fresh optimizers on fake cuda:0."""

import copy

import pytest
import torch
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode

import optimshift
from optimshift import _probe, policy

CUDA0 = torch.device("cuda", 0)
O = torch.optim

# Every torch.optim class with a 0-dim scalar in its state, each flag it supports that may move scalars.
SCALAR_CASES = [
    (O.Adam, {}),
    (O.Adam, {"fused": True}),
    (O.Adam, {"capturable": True}),
    (O.Adam, {"foreach": True}),
    (O.AdamW, {}),
    (O.AdamW, {"fused": True}),
    (O.AdamW, {"capturable": True}),
    (O.Adagrad, {}),
    (O.Adagrad, {"fused": True}),
    (O.Adagrad, {"foreach": True}),
    (O.Adadelta, {}),
    (O.Adadelta, {"capturable": True}),
    (O.Adamax, {}),
    (O.Adamax, {"capturable": True}),
    (O.NAdam, {}),
    (O.NAdam, {"capturable": True}),
    (O.RAdam, {}),
    (O.RAdam, {"capturable": True}),
    (O.RMSprop, {"centered": True, "momentum": 0.9}),
    (O.RMSprop, {"capturable": True}),
    (O.Rprop, {}),
    (O.Rprop, {"capturable": True}),
    (O.ASGD, {}),
    (O.ASGD, {"capturable": True}),
    (O.Adafactor, {}),
    (O.Adafactor, {"foreach": True}),
]


def _ids(case):
    cls, kw = case
    return cls.__name__ + ("-" + "-".join(f"{k}" for k in kw) if kw else "")


def _fresh_state_on_fake_cuda(cls, kw, shapes):
    """State of a fresh optimizer over fake cuda:0 params after (the start of) one step."""
    params = [torch.nn.Parameter(torch.zeros(s, device=CUDA0)) for s in shapes]
    for p in params:
        p.grad = torch.zeros_like(p)
    opt = cls(params, **kw)
    try:
        opt.step()
    except (DataDependentOutputException, RuntimeError, AssertionError):
        pass  # ASGD/Adafactor read scalars; a CPU build cannot launch some fused kernels: the state exists by then
    return params, opt


def _trained_on_cpu(cls, kw, shapes, steps=2):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    cpu_kw = {k: v for k, v in kw.items() if k != "capturable"}  # capturable cannot step on a CPU
    opt = cls(params, **cpu_kw)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
    for g in opt.param_groups:
        g.update({k: v for k, v in kw.items() if k in g})
    return params, opt


@pytest.mark.parametrize("case", SCALAR_CASES, ids=_ids)
def test_probe_agrees_with_static_table(case):
    """The rule derived from the installed torch equals the fallback table for every built-in scalar."""
    cls, kw = case
    p = torch.nn.Parameter(torch.zeros(2, 2))
    group = cls([p], **kw).param_groups[0]
    observed = _probe.probe(cls, group, 2)
    assert observed is not None and observed.state, f"probe could not run for {cls.__name__}"
    for key, on_device in observed.state.items():
        assert policy._table_rule(cls, group, key, torch.zeros(())) == on_device, (cls.__name__, kw, key)


@pytest.mark.parametrize("case", SCALAR_CASES, ids=_ids)
def test_move_to_fake_cuda_places_like_a_fresh_optimizer(case):
    cls, kw = case
    shapes = [(3, 2), (3,)]
    params, opt = _trained_on_cpu(cls, kw, shapes)
    before = {(i, k): v.dtype for i, p in enumerate(params) for k, v in opt.state[p].items() if torch.is_tensor(v)}
    with FakeTensorMode(allow_non_fake_inputs=True):
        fresh_params, fresh = _fresh_state_on_fake_cuda(cls, kw, shapes)
        # what model.to(cuda) does to the params, then move the state after them
        for g in opt.param_groups:
            g["params"] = [torch.nn.Parameter(p.detach().to(CUDA0)) for p in g["params"]]
        for old, new in zip(params, opt.param_groups[0]["params"]):
            opt.state[new] = opt.state.pop(old)
        optimshift.move(opt)
        moved = opt.param_groups[0]["params"]
        for i, (p, q) in enumerate(zip(moved, fresh_params)):
            got = {k: v.device for k, v in opt.state[p].items() if torch.is_tensor(v)}
            want = {k: v.device for k, v in fresh.state[q].items() if torch.is_tensor(v)}
            assert got == want, (cls.__name__, kw, i)
            for k, v in opt.state[p].items():
                if torch.is_tensor(v):
                    assert v.dtype == before[(i, k)], "a move must never change a dtype"
        assert optimshift.check(opt).ok


def test_naive_move_found_by_check_on_fake_cuda():
    """The seed's bug: Adam's `step` moved to the GPU; check names it and what it costs, move fixes it."""
    params, opt = _trained_on_cpu(O.Adam, {"foreach": False}, [(4, 4), (4,)])
    with FakeTensorMode(allow_non_fake_inputs=True):
        new = [torch.nn.Parameter(p.detach().to(CUDA0)) for p in params]
        optimshift.rebind(opt, new)
        assert optimshift.check(opt).ok
        for state in opt.state.values():  # the naive every-tensor move
            for k, v in list(state.items()):
                state[k] = v.to(CUDA0)
        report = optimshift.check(opt)
        assert not report.ok and {f.key for f in report.findings} == {"step"}
        assert report.syncs_per_step == 2 * policy_cost("Adam")
        optimshift.move(opt)
        assert optimshift.check(opt).ok
        assert all(st["step"].device.type == "cpu" for st in opt.state.values())


def test_cpu_fused_adam_moves_to_fake_cuda_and_steps_without_syncing():
    """Lightning skips `step` always: a CPU-fused Adam moved to a GPU keeps a CPU step its kernel rejects.
    optimshift moves it, and the fused step then runs with no host sync (fake tensors would raise on one)."""
    params, opt = _trained_on_cpu(O.Adam, {"fused": True}, [(4, 4), (4,)])
    with FakeTensorMode(allow_non_fake_inputs=True):
        new = [torch.nn.Parameter(p.detach().to(CUDA0)) for p in params]
        optimshift.rebind(opt, new)
        assert all(st["step"].device == CUDA0 for st in opt.state.values())
        for p in new:
            p.grad = torch.zeros_like(p)
        opt.step()
        for st in opt.state.values():  # Lightning's rule: everything but `step` back on the device
            st["step"] = st["step"].to("cpu")
        report = optimshift.check(opt)
        assert [f.severity for f in report.findings] == ["error", "error"]
        assert "fused kernel rejects" in report.findings[0].why


def policy_cost(name):
    from optimshift.report import SYNC_COST

    return SYNC_COST[(name, "step")][0]  # foreach=False


def test_unknown_optimizer_uses_default_rule_and_check_says_so():
    """A class the probe cannot build from a param and its group (a required argument the group does not hold)
    gets the default rule, and check() says so and why."""

    class Mine(torch.optim.Optimizer):
        def __init__(self, params, num_data):
            super().__init__(params, {"lr": 0.1})

        def step(self, closure=None):
            for g in self.param_groups:
                for p in g["params"]:
                    st = self.state[p]
                    st.setdefault("step", torch.tensor(0.0))
                    st.setdefault("buf", torch.zeros_like(p))
                    st["step"] += 1

    p = torch.nn.Parameter(torch.zeros(3))
    opt = Mine([p], num_data=8)
    opt.step()
    with FakeTensorMode(allow_non_fake_inputs=True):
        q = torch.nn.Parameter(torch.zeros(3, device=CUDA0))
        optimshift.rebind(opt, [q])
        assert opt.state[q]["step"].device.type == "cpu" and opt.state[q]["buf"].device == CUDA0
        report = optimshift.check(opt)
        assert report.ok
        (info,) = [f for f in report.findings if f.severity == "info"]
        assert "register_policy" in info.why
        assert "the probe could not build Mine" in info.why and "'num_data'" in info.why


def test_register_policy_decides_for_third_party_classes():
    class Counting(torch.optim.Optimizer):
        def __init__(self, params):
            super().__init__(params, {"lr": 0.1})

        def step(self, closure=None):
            for g in self.param_groups:
                for p in g["params"]:
                    st = self.state[p]
                    st.setdefault("count", torch.tensor(0, dtype=torch.int64))
                    st.setdefault("scale", torch.tensor(1.0))
                    st["count"] += 1

    calls = []

    def rule(key, value, param, group, device):
        calls.append((key, device))
        return torch.device("cpu") if key == "count" else None  # None: built-in/default rule

    optimshift.register_policy(Counting, rule)
    try:
        p = torch.nn.Parameter(torch.zeros(3))
        opt = Counting([p])
        opt.step()
        with FakeTensorMode(allow_non_fake_inputs=True):
            q = torch.nn.Parameter(torch.zeros(3, device=CUDA0))
            optimshift.rebind(opt, [q])
            assert opt.state[q]["count"].device.type == "cpu"
            assert opt.state[q]["scale"].device.type == "cpu"  # probed: a fresh Counting keeps it on the host
            assert ("count", CUDA0) in calls
            assert optimshift.check(opt).ok
    finally:
        optimshift.unregister_policy(Counting)


def test_register_policy_rejects_bad_input():
    with pytest.raises(TypeError, match="Optimizer subclass"):
        optimshift.register_policy(dict, lambda *a: None)
    with pytest.raises(TypeError, match="callable"):
        optimshift.register_policy(O.Adam, "cpu")


def test_unregister_policy_refuses_an_optimizer_for_its_class():
    class Mine(O.SGD):
        pass

    optimshift.register_policy(Mine, lambda *a: None)
    try:
        with pytest.raises(TypeError, match="unregister_policy expects a torch.optim.Optimizer subclass"):
            optimshift.unregister_policy(Mine([torch.nn.Parameter(torch.zeros(2))], lr=0.1))  # (left it registered)
        assert policy.registered_policy(Mine) is not None
    finally:
        optimshift.unregister_policy(Mine)
    assert policy.registered_policy(Mine) is None


def test_tensor_lr_in_param_group_stays_where_a_fresh_optimizer_keeps_it():
    """torch never moves a group's own tensors. A fused Adam works alike with lr on the host (its kernels read a
    host lr with .item(), no sync) or on the device: it stays on its side. A single-tensor Adam reads lr on the
    host every step (addcdiv_'s value): a device lr goes to the host, where that read costs no sync."""
    p = torch.nn.Parameter(torch.zeros(3))
    opt = O.Adam([p], lr=torch.tensor(0.01), fused=True)
    p.grad = torch.ones(3)
    opt.step()
    with FakeTensorMode(allow_non_fake_inputs=True):
        q = torch.nn.Parameter(torch.zeros(3, device=CUDA0))
        optimshift.rebind(opt, [q])
        assert opt.param_groups[0]["lr"].device.type == "cpu"
        assert opt.state[q]["step"].device == CUDA0
        opt.param_groups[0]["lr"] = torch.zeros((), device=CUDA0)  # a device lr given on purpose (CUDA graphs)
        q2 = torch.nn.Parameter(torch.zeros(3, device=CUDA0))
        optimshift.rebind(opt, [q2])
        assert opt.param_groups[0]["lr"].device == CUDA0
    opt2 = O.Adam([torch.nn.Parameter(torch.zeros(3))], lr=torch.tensor(0.01), foreach=False)
    with FakeTensorMode(allow_non_fake_inputs=True):
        opt2.param_groups[0]["lr"] = torch.zeros((), device=CUDA0)
        q = torch.nn.Parameter(torch.zeros(3, device=CUDA0))
        optimshift.rebind(opt2, [q])
        assert opt2.param_groups[0]["lr"].device.type == "cpu"  # read on the host: it goes there


def test_probes_do_not_fire_the_users_global_step_hooks():
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    fired = []
    handle = register_optimizer_step_pre_hook(lambda opt, args, kwargs: fired.append(type(opt).__name__))
    try:
        _probe.clear_cache()
        p = torch.nn.Parameter(torch.zeros(2, 2))
        group = O.RAdam([p], capturable=True).param_groups[0]
        assert _probe.probe(O.RAdam, group, 2).state == {"step": True}
        assert fired == []
    finally:
        handle.remove()


def test_step_of_takes_off_torchs_hook_wrapper_and_nothing_else():
    import functools

    from torch.optim.optimizer import _use_grad_for_differentiable

    class Base(O.Optimizer):
        @_use_grad_for_differentiable
        def step(self, closure=None):
            return "base"

    class Sub(Base):  # no step of its own
        pass

    raw = Base.__dict__["step"]  # decorated (the grad mode the step needs), not yet hooked
    Sub([torch.nn.Parameter(torch.zeros(1))], {"differentiable": False})  # torch hooks Sub.step (Base's)
    assert getattr(Sub.__dict__["step"], "hooked", False) and "hooked" not in vars(raw)
    assert policy.step_of(Sub) is raw and policy.step_of(Base) is raw and policy.same_step(Sub, Base)
    Base([torch.nn.Parameter(torch.zeros(1))], {"differentiable": False})  # now Base.step is hooked too
    assert getattr(Base.__dict__["step"], "hooked", False)
    assert policy.step_of(Base) is raw and policy.same_step(Sub, Base)

    class Over(Base):  # its own step, even wrapping Base's hooked one (which copies its marks onto this one)
        @functools.wraps(Base.step)
        def step(self, closure=None):
            return "over"

    assert not policy.same_step(Over, Base) and policy.step_of(Over) is Over.__dict__["step"]


def test_a_subclass_whose_own_step_cannot_be_probed_is_placed_by_its_base():
    """A subclass with a step of its own that its probe cannot build (a required argument) falls back to its
    base's probe: Adam's host ``step`` stays on the host, capturable's goes to the device."""

    class Needy(O.Adam):
        def __init__(self, params, model, **kwargs):
            super().__init__(params, **kwargs)

        def step(self, closure=None):
            return super().step(closure)

    for flags, where in (({}, "cpu"), ({"capturable": True}, "cuda")):
        p = torch.nn.Parameter(torch.zeros(3))
        opt = Needy([p], None)
        p.grad = torch.ones(3)
        opt.step()
        opt.param_groups[0].update(flags)  # (a capturable step cannot run on the host)
        assert policy.probed_by(Needy, opt.param_groups[0], 1)[0] is O.Adam
        with FakeTensorMode(allow_non_fake_inputs=True):
            q = torch.nn.Parameter(p.detach().to(CUDA0))
            optimshift.rebind(opt, [q])
            assert opt.state[q]["step"].device.type == where and opt.state[q]["exp_avg"].device == CUDA0


@pytest.mark.parametrize("flags", [{"capturable": True}, {"fused": True}, {}])
def test_a_subclass_passing_its_keywords_on_is_probed_with_its_groups_flags(flags):
    """A subclass with a step of its own and ``__init__(self, params, **kwargs)``: its probe was built with none of
    the group's keywords (only names in its own signature were passed), so a capturable or fused group was probed
    as neither and ``step`` put on the host, where the next step raised. Its bases' keywords are passed on too."""

    class Forwarding(O.Adam):
        def __init__(self, params, **kwargs):
            super().__init__(params, **kwargs)

        def step(self, closure=None):
            return super().step(closure)

    p = torch.nn.Parameter(torch.zeros(3))
    opt = Forwarding([p])
    p.grad = torch.ones(3)
    opt.step()
    opt.param_groups[0].update(flags)
    cls, observed = policy.probed_by(Forwarding, opt.param_groups[0], 1)
    assert cls is Forwarding and observed is not None and observed.state == {"step": bool(flags)}
    with FakeTensorMode(allow_non_fake_inputs=True):
        q = torch.nn.Parameter(p.detach().to(CUDA0))
        optimshift.rebind(opt, [q])
        assert opt.state[q]["step"].device.type == ("cuda" if flags else "cpu")


def test_a_subclass_whose_own_step_makes_no_state_is_placed_by_its_base():
    """A subclass whose step fails on the probe's fake param before making any state (a collective with no process
    group): its probe ran, so its base's was never asked, and a tensor lr the base's step reads on the host was
    left on the device (a sync per step)."""

    class Reducing(O.Adam):
        def step(self, closure=None):
            raise RuntimeError("Default process group has not been initialized")

    p = torch.nn.Parameter(torch.zeros(3))
    group = Reducing([p], lr=torch.tensor(0.01), foreach=False).param_groups[0]
    cls, observed = policy.probed_by(Reducing, group, 1)
    assert cls is O.Adam and observed is not None and observed.group == {("lr", None): _probe.HOST_READ}


def test_a_subclass_inheriting_adamws_step_is_separable_whoever_was_built_first(monkeypatch):
    """AdamW has no step of its own (it inherits Adam's): a subclass built before any Adam gets torch's hook
    wrapper of Adam's step on itself, and still steps with AdamW's step."""
    hooked = O.Adam.__dict__["step"]
    if getattr(hooked, "hooked", False):  # as in a process where no Adam was built yet
        monkeypatch.setattr(O.Adam, "step", hooked.__wrapped__)

    class MyAdamW(O.AdamW):
        pass

    MyAdamW([torch.nn.Parameter(torch.zeros(1))])
    assert getattr(MyAdamW.__dict__["step"], "hooked", False) and "step" not in O.AdamW.__dict__
    assert policy.same_step(MyAdamW, O.AdamW)
    assert policy.separable(MyAdamW) == (True, "torch.optim")


def test_fused_sgd_over_a_0_dim_param_has_a_known_rule(sim, caplog):
    """A probe of fused SGD cannot run (aten._fused_sgd_ has no fake kernel): over a 0-dim param its 0-dim
    momentum_buffer fell to the default rule, and check() said no rule was known for a torch.optim class. The
    table's entry is what a probe of the unfused class observes."""
    p = torch.nn.Parameter(torch.zeros(()))
    group = torch.optim.SGD([p], lr=0.1, momentum=0.9).param_groups[0]
    observed = _probe.probe(torch.optim.SGD, group, 0)
    assert observed is not None and observed.state == {"momentum_buffer": True}
    assert policy._table_rule(torch.optim.SGD, group, "momentum_buffer", torch.zeros(())) is True
    p = torch.nn.Parameter(torch.randn((), device=sim))
    opt = torch.optim.SGD([p], lr=0.1, momentum=0.9, fused=True)
    p.grad = torch.randn_like(p)
    opt.step()
    with caplog.at_level("WARNING", logger="optimshift"):
        assert not optimshift.check(opt).findings
    assert "no placement rule" not in caplog.text
    optimshift.move(opt, "cpu")
    optimshift.move(opt, sim)
    assert opt.state[p]["momentum_buffer"].device == sim


def test_a_policy_answer_naming_a_fake_device_is_taken_outside_the_fake_mode():
    """A policy answering ``str(device)`` for fake cuda:0 params used outside their FakeTensorMode: the answer was
    checked as a device of this machine (none has CUDA) and every move was refused."""

    class Answered(O.Adam):
        pass

    optimshift.register_policy(
        Answered, lambda key, value, param, group, device: str(device) if key == "step" else None
    )
    try:
        mode = FakeTensorMode()
        with mode:
            p = torch.nn.Parameter(torch.ones(3, device=CUDA0))
            opt = Answered([p], capturable=True)
            p.grad = torch.ones(3, device=CUDA0)
            opt.step()
        optimshift.move(opt)
        assert opt.state[p]["step"].device == CUDA0
    finally:
        optimshift.unregister_policy(Answered)


@pytest.mark.parametrize("kw", [{}, {"foreach": False}, {"capturable": True}])
def test_a_one_element_step_is_placed_as_a_fresh_optimizer_keeps_its_step(sim, kw):
    """A checkpoint's ``step`` of shape (1,): torch's load keeps it on the host (a fresh Adam's is a host scalar),
    where each read is no sync. It followed its param to the device (4 host syncs a step), and check() called
    the host copy an error ("step() fails mixing devices")."""
    model = torch.nn.Linear(3, 3).to(sim)
    opt = O.Adam(model.parameters(), **kw)
    model(torch.randn(2, 3, device=sim)).sum().backward()
    opt.step()
    saved = copy.deepcopy(opt.state_dict())
    for st in saved["state"].values():
        st["step"] = st["step"].reshape(1)
    fresh = O.Adam(model.parameters(), **kw)
    optimshift.load_state_dict(fresh, saved)
    where = sim if kw.get("capturable") else torch.device("cpu")
    for road in ("load", "move"):
        if road == "move":
            optimshift.move(fresh, "cpu")
            optimshift.move(fresh, sim)
        assert [st["step"].device for st in fresh.state.values()] == [where, where], road
        assert optimshift.check(fresh).ok, road
    model(torch.randn(2, 3, device=sim)).sum().backward()
    with optimshift.count_syncs() as syncs:
        fresh.step()
    assert syncs.total == 0


def test_an_error_in_a_registered_policy_names_the_entry_and_an_answer_is_checked(sim):
    """A policy that raises, or answers a device this machine has not, is named with the entry it was placing
    (a bare KeyError, or torch's "Invalid device" from the copy, named nothing), and nothing changes."""

    class Mine(O.SGD):
        pass

    p = torch.nn.Parameter(torch.randn(3, device=sim))
    opt = Mine([p], lr=0.1, momentum=0.9)
    p.grad = torch.randn(3, device=sim)
    opt.step()
    buffer = opt.state[p]["momentum_buffer"]

    def boom(key, value, param, group, device):
        raise KeyError("boom")

    try:
        optimshift.register_policy(Mine, boom)
        with pytest.raises(KeyError) as raised:
            optimshift.move(opt, "cpu")
        assert "group 0, param 0, state['momentum_buffer']" in "\n".join(raised.value.__notes__)
        optimshift.register_policy(Mine, lambda *a: torch.device("sim:5"))
        with pytest.raises(ValueError, match="the device it returned, sim:5 is not available"):
            optimshift.move(opt, "cpu")
    finally:
        optimshift.unregister_policy(Mine)
    assert opt.state[p]["momentum_buffer"] is buffer and buffer.device == sim


class _Counting(torch.optim.Optimizer):
    """A third-party class: a 0-dim ``count`` and a ``buf`` per param."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, {"lr": lr})

    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if not self.state[p]:
                    self.state[p].update(count=torch.zeros(()), buf=torch.zeros_like(p))


@pytest.mark.parametrize(
    ("answer", "error", "says"),
    [
        (KeyError("buf"), KeyError, "raised by the policy registered for _Counting"),
        ("sim:7", ValueError, "the device it returned, sim:7 is not available"),
        (3, TypeError, "it must return a torch.device, a string such as 'cuda:0' or None, got 3"),
        (True, TypeError, "it must return a torch.device, a string such as 'cuda:0' or None, got True"),
    ],
)
def test_a_failing_policy_names_the_optimizer_param_and_key_and_changes_nothing(sim, answer, error, says):
    """A registered policy that raises, or answers what is no usable device: the error names the class, the param
    (group and index) and the key it was asked about (the policy's own exception keeps its type, a note names them;
    an int, undocumented, was read as an index of whatever accelerator is current), and nothing changes."""
    params = [torch.nn.Parameter(torch.ones(2, device=sim)) for _ in range(3)]
    opt = _Counting([{"params": params[:1]}, {"params": params[1:]}])
    opt.step()

    def policy(key, value, param, group, device):
        if param is params[2] and key == "buf":
            if isinstance(answer, BaseException):
                raise answer
            return answer
        return None

    groups = [(g, dict(g)) for g in opt.param_groups]
    state = [(opt.state[p], {k: (v, v.device) for k, v in opt.state[p].items()}) for p in params]
    optimshift.register_policy(_Counting, policy)
    try:
        with pytest.raises(error) as raised:
            optimshift.move(opt, "cpu")
    finally:
        optimshift.unregister_policy(_Counting)
    told = "\n".join([str(raised.value), *getattr(raised.value, "__notes__", ())])
    assert says in told and "_Counting: " in told and "nothing was changed" in told, told
    assert "group 1, param 1, state['buf']" in (told if error is KeyError else str(raised.value)), told
    assert [g for g, _ in groups] == opt.param_groups and all(g == kept for g, kept in groups)
    for p, (entries, kept) in zip(params, state):
        assert opt.state[p] is entries and entries.keys() == kept.keys()
        assert all(entries[k] is v and v.device == device for k, (v, device) in kept.items())


def test_an_interrupt_in_a_policy_passes_through_untouched(sim):
    """A KeyboardInterrupt raised inside a policy is no error of the policy's: it gets no note."""
    p = torch.nn.Parameter(torch.ones(2, device=sim))
    opt = _Counting([p])
    opt.step()
    interrupt = KeyboardInterrupt()

    def policy(key, value, param, group, device):
        raise interrupt

    optimshift.register_policy(_Counting, policy)
    try:
        with pytest.raises(KeyboardInterrupt) as raised:
            optimshift.move(opt, "cpu")
    finally:
        optimshift.unregister_policy(_Counting)
    assert raised.value is interrupt and not getattr(interrupt, "__notes__", None)
    assert opt.state[p]["buf"].device == sim
