"""check() and placement(): findings name where, what, why, and the host syncs each costs (re-measured here)."""

import contextlib
import copy
import inspect
import types
import warnings

import pytest
import torch

import optimshift
from _custom_optimizers import CopiesByKeyword, Fp32Moments
from optimshift.report import DIFFERENTIABLE_SYNC_COST, SYNC_COST

O = torch.optim


def _syncs_of_a_step(opt, params):
    """The host syncs one ``opt.step()`` makes, each of ``params`` given a new grad first."""
    for p in params:
        p.grad = torch.randn_like(p)
    with optimshift.count_syncs() as syncs:
        opt.step()
    return syncs.total


def _cost_of(opt, stepped, misplace):
    """check()'s report once ``misplace()`` moved entries of ``opt`` to the device, and the syncs a step over
    ``stepped`` makes more with them there than on the host (the state made by a step before)."""

    def step():
        return _syncs_of_a_step(opt, stepped)

    step()
    on_the_host = step()
    misplace()
    report = optimshift.check(opt)
    return report, step() - on_the_host


def _misplaced_cost(sim, name, key, params, **kwargs):
    """check()'s figure for ``key`` of every param moved to the device, and the syncs a step makes more with
    them there than with them on the host (a step's own syncs, Adafactor's norms, are not the entry's)."""
    opt = getattr(O, name)(params, **kwargs)

    def misplace():
        for st in opt.state.values():
            st[key] = st[key].to(sim)

    report, caused = _cost_of(opt, params, misplace)
    assert not report.ok and {f.key for f in report.findings} == {key}
    return report.syncs_per_step, caused


@pytest.mark.parametrize("foreach", [False, True], ids=["single", "foreach"])
@pytest.mark.parametrize("name, key", sorted(SYNC_COST))
def test_sync_cost_table_matches_this_torch(sim, name, key, foreach):
    """Each figure check() reports is what this torch really costs: measured with count_syncs on the sim. The
    syncs the misplaced entries cause, not the step's: Adafactor's step reads two norms per param on the host
    wherever its ``step`` is, and its row said 3 and 5 where the entry costs 1 and 3."""
    params = [torch.nn.Parameter(torch.randn(3, 2, device=sim)) for _ in range(4)]
    reported, caused = _misplaced_cost(sim, name, key, params, foreach=foreach)
    assert caused == len(params) * SYNC_COST[(name, key)][int(foreach)] == reported


@pytest.mark.parametrize("name, key", sorted(k for k in SYNC_COST if k[0] != "Adafactor"))
def test_sync_cost_under_differentiable_matches_this_torch(sim, name, key):
    """differentiable=True runs a single-tensor step of its own, which keeps Adam's ``step`` and NAdam's
    ``mu_product`` as tensors: check() said 1 and 2 syncs per param where a step makes none."""
    params = [torch.randn(3, 2, device=sim, requires_grad=True).clone() for _ in range(4)]
    reported, caused = _misplaced_cost(sim, name, key, params, differentiable=True)
    assert caused == len(params) * DIFFERENTIABLE_SYNC_COST.get((name, key), SYNC_COST[(name, key)][0]) == reported


@pytest.mark.parametrize(
    "name, kwargs",
    [("Adafactor", {}), ("Adam", {"lr": torch.tensor(0.01)}), ("AdamW", {"lr": torch.tensor(0.01)}), ("NAdam", {})],
    ids=["Adafactor", "Adam-tensor-lr", "AdamW-tensor-lr", "NAdam"],
)
def test_sync_cost_under_torch_s_default_implementation_is_the_one_it_runs(sim, name, kwargs):
    """foreach=None on accelerator params: torch runs foreach, but the single-tensor step for Adafactor and for
    Adam/AdamW given a tensor lr without capturable; check() priced all of them as foreach."""
    params = [torch.nn.Parameter(torch.randn(3, 2, device=sim)) for _ in range(4)]
    reported, caused = _misplaced_cost(sim, name, "step", params, **kwargs)
    assert reported == caused


@pytest.mark.parametrize("foreach", [False, True, None], ids=["single", "foreach", "default"])
def test_a_host_scalar_on_another_accelerator_than_its_param(sim, foreach):
    """Adam's ``step`` on sim:1 beside its param on sim:0: the single-tensor step reads it with a sync (a
    warning, priced), the foreach one (torch's default here) refuses to group it with the param's tensors: check()
    called that a warning costing 2 syncs per step, and step() raised."""
    params = [torch.nn.Parameter(torch.randn(3, 2, device=sim)) for _ in range(2)]
    opt = O.Adam(params, foreach=foreach)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    opt.state[params[1]]["step"] = opt.state[params[1]]["step"].to(torch.device(sim.type, 1))
    (finding,) = optimshift.check(opt).findings
    assert (finding.param, finding.key, finding.device, finding.expected) == (
        "group 0, param 1",
        "step",
        "sim:1",
        "cpu",
    )
    for p in params:
        p.grad = torch.randn_like(p)
    if foreach is False:
        assert (finding.severity, finding.syncs_per_step) == ("warning", 1)
        with optimshift.count_syncs() as syncs:
            opt.step()
        assert syncs.total == 1
    else:
        assert finding.severity == "error" and "step() raises" in finding.why
        with pytest.raises(RuntimeError, match="same device"):
            opt.step()


class _OwnParam(torch.nn.Parameter):
    """A Parameter subclass of a user's own: torch's default picks the single-tensor step for it."""


@pytest.mark.parametrize("beside", ["same", "other"], ids=["on-its-device", "on-another"])
@pytest.mark.parametrize("group", ["fused=False", "a host param", "a Parameter subclass"])
def test_torch_s_default_runs_the_single_tensor_step_for_these_groups(sim, group, beside):
    """foreach=None where torch's default still runs the single-tensor step: ``fused=False`` given (torch defaults
    only when neither flag is), a group holding a host param, params of a Tensor subclass of their own (its
    ``_default_to_fused_or_foreach`` asks every param's type and device). Adam's ``step`` on the device: check()
    priced it at the foreach step's 2 syncs where the step makes 1, and on another device than its param called
    it an error (the foreach step refuses it) where step() runs, with the sync it priced."""
    make = _OwnParam if group == "a Parameter subclass" else torch.nn.Parameter
    params = [make(torch.randn(3, 2, device=sim)) for _ in range(2)]
    if group == "a host param":
        params.append(torch.nn.Parameter(torch.randn(3, 2)))
    opt = O.Adam(params, **({"fused": False} if group == "fused=False" else {}))
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    where = sim if beside == "same" else torch.device(sim.type, 1)
    for p in params[:2]:
        opt.state[p]["step"] = opt.state[p]["step"].to(where)
    findings = optimshift.check(opt).findings
    assert [(f.param, f.key, f.severity, f.syncs_per_step) for f in findings] == [
        (f"group 0, param {i}", "step", "warning", 1) for i in range(2)
    ]
    for p in params:
        p.grad = torch.randn_like(p)
    with optimshift.count_syncs() as syncs:
        opt.step()
    assert syncs.total == sum(f.syncs_per_step for f in findings)


def test_report_table_and_placement_rows(sim):
    params = [torch.nn.Parameter(torch.randn(4, 3, device=sim)), torch.nn.Parameter(torch.randn(3, device=sim))]
    opt = O.NAdam(params, foreach=False)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    rows = optimshift.placement(opt)
    assert [(r.param, r.key, r.device, r.dtype, r.shape, r.bytes) for r in rows[:4]] == [
        ("group 0, param 0", "step", "cpu", "float32", (), 4),
        ("group 0, param 0", "mu_product", "cpu", "float32", (), 4),
        ("group 0, param 0", "exp_avg", "sim:0", "float32", (4, 3), 48),
        ("group 0, param 0", "exp_avg_sq", "sim:0", "float32", (4, 3), 48),
    ]
    assert str(optimshift.check(opt)).endswith("every entry is where a fresh optimizer would keep it.")
    opt.state[params[1]]["mu_product"] = opt.state[params[1]]["mu_product"].to(sim)
    report = optimshift.check(opt)
    assert not report.ok
    (finding,) = report.findings
    assert (finding.param, finding.key, finding.device, finding.expected, finding.group, finding.index) == (
        "group 0, param 1",
        "mu_product",
        "sim:0",
        "cpu",
        0,
        1,
    )
    assert finding.syncs_per_step == 2 and "device-to-host sync" in finding.why
    text = str(report)
    assert "NOT OK" in text and "mu_product" in text and "syncs/step" in text


def test_param_names_label_findings(sim):
    model = torch.nn.Linear(3, 2)
    opt = O.Adam(model.named_parameters(), foreach=False)
    model(torch.randn(5, 3)).sum().backward()
    opt.step()
    model.to(sim)
    report = optimshift.check(opt)
    assert {f.param for f in report.findings} == {"group 0, param 0 (weight)", "group 0, param 1 (bias)"}
    assert all(f.severity == "error" for f in report.findings if f.key != "step")
    optimshift.move(opt)
    assert optimshift.check(opt).ok


def test_check_reports_a_dtype_the_next_step_would_reject(sim):
    """Placement is right but a float64 exp_avg sits in a float32 Adam: the next step() raises, so check() is
    not ok and names the key and both dtypes. A dtype the step accepts (a float64 exp_avg_sq there, SGD's
    float32 momentum for bfloat16 params) is no finding."""
    params = [torch.nn.Parameter(torch.randn(3, 2, device=sim))]
    opt = O.Adam(params, foreach=False)
    params[0].grad = torch.randn_like(params[0])
    opt.step()
    assert optimshift.check(opt).ok
    state = opt.state[params[0]]
    state["exp_avg_sq"] = state["exp_avg_sq"].double()  # addcmul_/addcdiv_ take it: no finding
    assert optimshift.check(opt).ok
    state["exp_avg"] = state["exp_avg"].double()  # lerp_ wants it in the grad's dtype
    report = optimshift.check(opt)
    assert not report.ok
    [finding] = report.findings
    assert (finding.severity, finding.param, finding.key, finding.dtype, finding.expected) == (
        "error",
        "group 0, param 0",
        "exp_avg",
        "float64",
        "float32",
    )
    assert "step() rejects" in finding.why and "cast='param'" in finding.why
    with pytest.raises(RuntimeError):
        opt.step()  # what check() said

    bf16 = [torch.nn.Parameter(torch.randn(3, 2, device=sim, dtype=torch.bfloat16))]
    sgd = O.SGD(bf16, lr=0.1, momentum=0.9)
    bf16[0].grad = torch.randn_like(bf16[0])
    sgd.step()
    sgd.state[bf16[0]]["momentum_buffer"] = sgd.state[bf16[0]]["momentum_buffer"].float()
    assert optimshift.check(sgd).ok
    sgd.step()


def test_check_does_not_judge_a_subclass_with_a_step_of_its_own_by_its_base(sim):
    """A subclass with a step of its own keeps what it keeps: a trial of Adam's step called its float32 moments
    under bfloat16 params an error. What its step takes is its own (the trial never builds a user's class: a
    review found one that logged, drew random numbers and joined a collective from check()); a subclass stepping
    with Adam's own step is judged as Adam."""

    class Inheriting(O.Adam):
        pass

    built: list[object] = []

    class Counting(Fp32Moments):
        def __init__(self, *args, **kwargs):
            built.append(self)  # (a side effect of building one)
            super().__init__(*args, **kwargs)

    for cls, errors in ((Inheriting, [("exp_avg", "float32", "bfloat16")]), (Fp32Moments, []), (Counting, [])):
        params = [torch.nn.Parameter(torch.randn(3, 2, device=sim))]
        opt = cls(params, foreach=False)
        params[0].grad = torch.randn_like(params[0])
        opt.step()
        params[0].data = params[0].data.to(torch.bfloat16)
        count = len(built)
        found = [(f.key, f.dtype, f.expected) for f in optimshift.check(opt).findings if f.severity == "error"]
        assert found == errors, cls.__name__
        assert len(built) == count, "check() built an instance of the user's class"


def test_check_reports_lbfgs_history_in_a_dtype_the_next_step_would_reject():
    """LBFGS keeps its history in lists (old_dirs, old_stps): float64 ones for float32 params make the next
    step() raise in a dot product; check() names the list. Its ro (0-dim tensors) in float64 is taken."""
    p = torch.nn.Parameter(torch.randn(5))
    opt = O.LBFGS([p], history_size=3)

    def closure(target):
        with torch.no_grad():
            p.grad = 2 * (p - target)
            return ((p - target) ** 2).sum()

    for step in range(2):
        opt.step(lambda: closure(float(step)))
    state = opt.state[p]
    assert state["old_dirs"] and optimshift.check(opt).ok
    state["ro"] = [r.double() for r in state["ro"]]
    assert optimshift.check(opt).ok
    state["old_dirs"] = [d.double() for d in state["old_dirs"]]
    [finding] = optimshift.check(opt).findings
    assert (finding.severity, finding.param, finding.key, finding.dtype, finding.expected) == (
        "error",
        "group 0, param 0",
        "old_dirs",
        "float64",
        "float32",
    )
    assert "step() rejects" in finding.why and "cast='param'" in finding.why
    with pytest.raises(RuntimeError, match="dot"):
        opt.step(lambda: closure(2.0))  # what check() said


@pytest.mark.parametrize("history", ["empty", "filled after the first step"])
def test_check_reports_lbfgs_state_a_later_step_would_reject(history):
    """Issue 31: the same rule for LBFGS's every state. Its line search converged, its history is empty and
    ``H_diag`` a number: float64 ``d`` and ``prev_flat_grad`` can pass a step together (``y.dot(s)``, both
    float64) and fail the next (``prev_flat_grad`` keeps its dtype, ``d`` is made anew in float32). With
    ``max_iter=1`` the history appears only after the first step: float64 ``old_dirs`` fail the walk over it.
    check() names each (it said ok to both: its trial stepped once, and held no history to try)."""
    params = [torch.nn.Parameter(torch.randn(s, generator=torch.Generator().manual_seed(3))) for s in [(2, 3), (3,)]]
    kwargs = {"line_search_fn": "strong_wolfe"} if history == "empty" else {"history_size": 2, "max_iter": 1}
    opt = O.LBFGS(params, **kwargs)

    def step(k):
        g = torch.Generator().manual_seed(k)
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step(lambda: sum((p * p).sum() for p in params))

    for k in range(3):
        step(k)
    state = opt.state[params[0]]
    assert len(state["old_dirs"]) == (0 if history == "empty" else 2) and optimshift.check(opt).ok
    keys = ["d", "prev_flat_grad"] if history == "empty" else ["old_dirs"]
    for key in keys:
        state[key] = state[key].double() if key in ("d", "prev_flat_grad") else [t.double() for t in state[key]]
    report = optimshift.check(opt)
    assert sorted((f.severity, f.param, f.key, f.dtype, f.expected) for f in report.findings) == [
        ("error", "group 0, param 0", key, "float64", "float32") for key in sorted(keys)
    ]
    assert all("step() rejects" in f.why and "cast='param'" in f.why for f in report.findings)
    with pytest.raises(RuntimeError, match="dot"):
        for k in range(3, 5):
            step(k)  # what check() said


def _trained_on(device, n=3, **flags):
    params = [torch.nn.Parameter(torch.randn(4, 3, device=device)) for _ in range(n)]
    opt = torch.optim.Adam(params, **flags)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    return opt


@pytest.mark.parametrize("flags, moved", [({"fused": True}, 9), ({"foreach": True}, 6)])  # (foreach: step on host)
def test_check_of_an_offloaded_optimizer_says_so_in_one_finding(sim, flags, moved):
    """Deliberately offloaded state is one finding that says so and that reload() comes before step(), not one
    error per tensor; placement() still lists every tensor where it is now."""
    opt = _trained_on(sim, **flags)
    assert optimshift.check(opt).ok
    optimshift.offload(opt)
    report = optimshift.check(opt)
    assert report.ok, report
    (finding,) = report.findings
    assert finding.severity == "info" and f"offloaded by optimshift.offload: {moved} state tensors" in finding.why
    assert "optimshift.reload(optimizer) before step()" in finding.why
    assert len(report.rows) == 9 and {row.device for row in optimshift.placement(opt)} == {"cpu"}
    optimshift.reload(opt)
    assert optimshift.check(opt).findings == []


def test_check_of_an_offloaded_optimizer_whose_state_torch_replaced_says_none_is_on_the_host(sim):
    """After torch's own ``load_state_dict`` of device state while offloaded, the record is still open (the step
    refuses until reload()), but nothing is in host memory: the finding no longer counts the device tensors as
    host ones."""
    opt = _trained_on(sim, fused=True)
    sd = copy.deepcopy(opt.state_dict())
    optimshift.offload(opt)
    opt.load_state_dict(sd)
    (finding,) = optimshift.check(opt).findings
    assert "no state is in host memory any more" in finding.why and "optimshift.reload(optimizer)" in finding.why
    optimshift.reload(opt)
    assert optimshift.check(opt).findings == []


def test_check_of_an_offloaded_optimizer_whose_state_is_on_meta_says_it_stayed_there():
    """An offload of state on meta leaves it there (it holds no data): check() said something had replaced the
    state (such as optimizer.load_state_dict), where nothing did; it now says the offload found none in device
    memory."""
    p = torch.nn.Parameter(torch.zeros(3, device="meta"))
    p.grad = torch.zeros(3, device="meta")
    opt = O.Adam([p])
    opt.step()
    optimshift.offload(opt)
    (finding,) = optimshift.check(opt).findings
    assert finding.severity == "info" and "replaced" not in finding.why, finding.why
    assert "found no state in device memory" in finding.why and "meta" in finding.why
    optimshift.reload(opt)
    assert optimshift.check(opt).findings == []


def test_check_of_an_offloaded_optimizer_reports_what_reload_leaves_misplaced(sim):
    """An entry misplaced before the offload is reloaded where it was: check() still reports it, as it will be."""
    opt = _trained_on(sim, n=2, foreach=True)
    for st in opt.state.values():
        st["step"] = st["step"].to(sim)  # what torch's own load_state_dict leaves after map_location=device
    before = [(f.param, f.key, f.device, f.syncs_per_step) for f in optimshift.check(opt).findings]
    assert before == [(f"group 0, param {i}", "step", str(sim), 2) for i in range(2)]
    optimshift.offload(opt, include=("grads",))
    report = optimshift.check(opt)
    assert [(f.param, f.key, f.device, f.syncs_per_step) for f in report.findings[1:]] == before
    assert all(f.why.startswith("after reload(): ") for f in report.findings[1:])
    assert "6 state tensors and 2 grads in host memory" in report.findings[0].why and not report.ok


class _Lookahead(torch.optim.Optimizer):
    """A Lookahead-style wrapper: the inner optimizer's param groups, a state of its own (the slow weights)."""

    def __init__(self, inner):
        self.optimizer = inner
        super().__init__([p for g in inner.param_groups for p in g["params"]], {})
        self.param_groups = inner.param_groups

    @torch.no_grad()
    def step(self, closure=None):
        self.optimizer.step()
        for g in self.param_groups:
            for p in g["params"]:
                slow = self.state[p].setdefault("slow", p.detach().clone())
                slow.add_(p - slow, alpha=0.5)
                p.copy_(slow)


def test_a_wrapper_holding_an_optimizer_with_a_state_of_its_own(sim):
    """Lookahead keeps its inner optimizer's state apart: a move of the wrapper moved its slow weights only, and
    check() said it was fine while the inner state stayed behind (the next step mixed devices). check() reports
    the inner optimizer's entries, named by its attribute; an operation warns that it does not reach them; the
    inner optimizer moved too, all is well."""
    params = [torch.nn.Parameter(torch.randn(4, 3, device=sim))]
    opt = _Lookahead(O.AdamW(params, foreach=False))
    params[0].grad = torch.randn_like(params[0])
    opt.step()
    optimshift.move(opt.optimizer, "cpu")  # (the inner state on the host, as a resume on the host leaves it)
    with pytest.warns(
        RuntimeWarning, match=r"holds another optimizer \(optimizer: AdamW\) .* optimshift\.move on it"
    ) as warned:
        optimshift.move(opt)
    # (attributed to the line that called the operation: a stacklevel one too far named its caller's, pytest's)
    assert [(w.filename, w.lineno) for w in warned] == [(__file__, inspect.currentframe().f_lineno - 2)]
    report = optimshift.check(opt)
    assert not report.ok
    assert {(f.param, f.key) for f in report.findings} == {
        ("optimizer: group 0, param 0", "exp_avg"),
        ("optimizer: group 0, param 0", "exp_avg_sq"),
    }
    optimshift.move(opt.optimizer)
    assert optimshift.check(opt).ok
    opt.step()


def test_reload_to_a_device_warns_once_about_an_inner_optimizer(sim):
    """reload(wrapper, device) moves by move's function: it warned twice, once as reload at the user's line and
    once as move at a line inside optimshift."""
    params = [torch.nn.Parameter(torch.randn(4, 3, device=sim))]
    opt = _Lookahead(O.AdamW(params, foreach=False))
    params[0].grad = torch.randn_like(params[0])
    opt.step()
    with pytest.warns(RuntimeWarning, match=r"optimshift\.reload on it") as warned:
        optimshift.reload(opt, "cpu")
    assert [(w.filename, w.lineno) for w in warned] == [(__file__, inspect.currentframe().f_lineno - 1)]
    assert opt.state[params[0]]["slow"].device.type == "cpu"


@pytest.mark.parametrize("operation", ["keep_addresses", "offloaded"])
def test_keep_addresses_and_offloaded_warn_once_about_an_inner_optimizer(sim, operation):
    """Each is an offload and a reload: each of those warned, naming itself, at a line inside optimshift (once on
    entering an ``offloaded`` block, once on leaving it). One warning, naming the call, at the user's line."""
    params = [torch.nn.Parameter(torch.randn(4, 3, device=sim))]
    opt = _Lookahead(O.AdamW(params, foreach=False))
    params[0].grad = torch.randn_like(params[0])
    opt.step()
    with pytest.warns(RuntimeWarning, match=rf"optimshift\.{operation} on it") as warned:
        if operation == "keep_addresses":
            line = inspect.currentframe().f_lineno + 1
            optimshift.keep_addresses(opt)
        else:
            line = inspect.currentframe().f_lineno + 1
            with optimshift.offloaded(opt):
                assert optimshift.is_offloaded(opt)
    assert [(w.filename, w.lineno) for w in warned] == [(__file__, line)]
    assert not optimshift.is_offloaded(opt)


def test_stream_unstream_and_streamed_of_a_wrapper_warn_once_about_an_inner_optimizer(sim):
    """unstream(wrapper) warned as optimshift.move at a line of optimshift (its move's), stream(wrapper) not at
    all though it leaves the inner state as unreached, a ``streamed`` block as unstream. Each warns once, naming
    itself, at the user's line."""
    optimshift.register_policy(_Lookahead, lambda *a: None, separable=True)
    try:
        params = [torch.nn.Parameter(torch.randn(4, 3, device=sim))]
        opt = _Lookahead(O.AdamW(params, foreach=False))
        params[0].grad = torch.randn_like(params[0])
        opt.step()
        lines = {}
        with pytest.warns(RuntimeWarning) as warned:
            lines["stream"] = inspect.currentframe().f_lineno + 1
            optimshift.stream(opt)
            assert optimshift.is_streamed(opt)
            lines["unstream"] = inspect.currentframe().f_lineno + 1
            optimshift.unstream(opt)
            assert not optimshift.is_streamed(opt)
            lines["streamed"] = inspect.currentframe().f_lineno + 1
            with optimshift.streamed(opt):
                opt.step()
        assert not optimshift.is_streamed(opt)
        assert [(w.filename, w.lineno, str(w.message).split(":")[0]) for w in warned] == [
            (__file__, line, f"optimshift.{operation}") for operation, line in lines.items()
        ]
        assert all(f"call optimshift.{operation} on it too" in str(w.message) for w, operation in zip(warned, lines))
    finally:
        optimshift.unregister_policy(_Lookahead)


def test_rebind_of_a_wrapper_re_keys_the_inner_optimizer_over_the_same_groups(sim):
    """Lookahead shares its inner optimizer's param groups: rebind of the wrapper put the new params in the inner's
    groups too, its state still keyed by the old ones, so that the inner optimizer (and check()) raised, and the
    rebind the warning advised was refused. Its state follows the new params, the same objects; the advised rebind
    of the inner optimizer places it for their device."""
    params = [torch.nn.Parameter(torch.randn(4, 3, device=sim))]
    opt = _Lookahead(O.AdamW(params, foreach=False))
    params[0].grad = torch.randn_like(params[0])
    opt.step()
    inner = dict(opt.optimizer.state[params[0]])
    new = [torch.nn.Parameter(params[0].detach().cpu())]
    optimshift.offload(opt.optimizer)
    with pytest.warns(RuntimeWarning), pytest.raises(ValueError, match="while AdamW is offloaded"):
        optimshift.rebind(opt, new)  # (its state keyed by the new params would lose where the record says it was)
    assert opt.param_groups[0]["params"][0] is params[0] and params[0] in opt.optimizer.state
    optimshift.reload(opt.optimizer)
    optimshift.stream(opt.optimizer)  # (named as the one held by the optimizer given, whose rebind it refuses)
    with (
        pytest.warns(RuntimeWarning),
        pytest.raises(ValueError, match="AdamW is streamed.*rebind of _Lookahead, which"),
    ):
        optimshift.rebind(opt, new)
    assert opt.param_groups[0]["params"][0] is params[0] and params[0] in opt.optimizer.state
    optimshift.unstream(opt.optimizer)
    with pytest.warns(RuntimeWarning, match=r"optimshift\.rebind on it"):
        optimshift.rebind(opt, new)
    assert all(p is new[0] for p in (*opt.optimizer.param_groups[0]["params"], *opt.optimizer.state))
    optimshift.rebind(opt.optimizer, new)
    assert all(opt.optimizer.state[new[0]][k] is v for k, v in inner.items())
    assert optimshift.check(opt).ok
    new[0].grad = torch.randn_like(new[0])
    opt.step()


@pytest.mark.parametrize("first", ["the inner optimizer", "the wrapper"])
def test_rebind_of_the_inner_optimizer_and_then_of_the_wrapper_re_keys_both(sim, monkeypatch, first):
    """A user rebinding each optimizer they hold, the inner one first: its rebind put the new params in the
    wrapper's groups (the same dicts), the wrapper's own state (the slow weights, a mapping keyed by the params) still
    keyed by the old ones, and the wrapper's rebind was refused ('in no param group ... Remove it'). Either order
    re-keys both, each tensor the same object; a rebind of the wrapper that fails leaves its state as it was."""
    params, opt = _stepped_lookahead(sim)
    inner, slow = [dict(opt.optimizer.state[p]) for p in params], [opt.state[p]["slow"] for p in params]
    new = [torch.nn.Parameter(p.detach().cpu()) for p in params]
    if first == "the inner optimizer":
        optimshift.rebind(opt.optimizer, new)
        assert opt.param_groups[0]["params"] == new and [*opt.state] == [*params, "seen"]  # (what the wrapper holds)
        monkeypatch.setattr(optimshift._engine, "run", lambda *a, **k: 1 / 0)
        with pytest.warns(RuntimeWarning), pytest.raises(ZeroDivisionError):
            optimshift.rebind(opt, new)
        assert [*map(id, opt.state)] == [*map(id, (*params, "seen"))] and list(opt.state["seen"]) == params
        monkeypatch.undo()
    with pytest.warns(RuntimeWarning, match=r"optimshift\.rebind on it"):
        optimshift.rebind(opt, new)
    optimshift.rebind(opt.optimizer, new)
    assert {id(k) for k in opt.state} == {*map(id, (*new, "seen"))} and list(opt.state["seen"]) == new
    assert all(opt.state[q]["slow"] is t for q, t in zip(new, slow))
    assert all(opt.optimizer.state[q][k] is v for q, d in zip(new, inner) for k, v in d.items())
    assert optimshift.check(opt).ok
    for p in new:
        p.grad = torch.randn_like(p)
    opt.step()


def _stepped_lookahead(sim):
    """A stepped ``_Lookahead`` over AdamW, a mapping keyed by its params in its own state; its params."""
    params = [torch.nn.Parameter(torch.randn(4, 3, device=sim)) for _ in range(2)]
    opt = _Lookahead(O.AdamW(params, foreach=False))
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    opt.state["seen"] = {p: i for i, p in enumerate(params)}
    return params, opt


def test_rebind_of_the_wrapper_to_other_params_than_the_inner_rebind_gave_re_keys_its_mappings_to_them(sim):
    """Inner rebound to B, the wrapper to D: its state's keys went to D, but a mapping keyed by the params in it was
    re-keyed to B only (the inner rebind's params, no longer in any group)."""
    params, opt = _stepped_lookahead(sim)
    b, d = ([torch.nn.Parameter(p.detach().cpu()) for p in params] for _ in range(2))
    optimshift.rebind(opt.optimizer, b)
    with pytest.warns(RuntimeWarning, match=r"optimshift\.rebind on it"):
        optimshift.rebind(opt, d)
    assert [*map(id, opt.state["seen"])] == [*map(id, d)] and {*map(id, opt.state)} == {*map(id, (*d, "seen"))}


def test_rebind_of_the_wrapper_re_keys_no_two_entries_to_one_param(sim):
    """Inner rebound to B, a wrapper step (state for B: the slow weights afresh), inner rebound to C: the wrapper's
    entries for A and for B both had C in their place, and its rebind kept one, dropping the other with no word.
    It is refused, nothing changed (which to keep is the user's call)."""
    params, opt = _stepped_lookahead(sim)
    b, c = ([torch.nn.Parameter(p.detach().cpu()) for p in params] for _ in range(2))
    optimshift.rebind(opt.optimizer, b)
    for p in b:
        p.grad = torch.randn_like(p)
    opt.step()
    optimshift.rebind(opt.optimizer, c)
    before = list(opt.state.items())
    with pytest.warns(RuntimeWarning), pytest.raises(ValueError, match="in no param group"):
        optimshift.rebind(opt, c)
    assert [(id(k), id(v)) for k, v in opt.state.items()] == [(id(k), id(v)) for k, v in before]


def test_a_ctrl_c_at_any_bytecode_of_a_wrappers_rebind_re_keys_its_state_or_leaves_it(sim):
    """A SIGINT at each bytecode of the wrapper's rebind from its stale entries on: its state is as it was (keys,
    order, objects) or re-keyed. (The re-key before the plan popped an entry outside the try: a Ctrl-C there lost
    it; its undo ran after a completed commit too, putting the old keys back over the groups' new params.)"""
    import os
    import signal
    import sys

    from optimshift import api

    handler = signal.getsignal(signal.SIGINT)
    codes = {api._rebind.__code__, api._stale.__code__, api._remember.__code__}
    n = 0
    while True:
        n += 1
        params, opt = _stepped_lookahead(sim)
        new = [torch.nn.Parameter(p.detach().cpu()) for p in params]
        optimshift.rebind(opt.optimizer, new)
        before, seen = list(opt.state.items()), list(opt.state["seen"])
        count = [0, False]

        def traced(frame, event, arg):
            if frame.f_code not in codes:
                return None
            count[1] = count[1] or frame.f_code is api._stale.__code__
            frame.f_trace_opcodes = True
            return local

        def local(frame, event, arg):
            if event == "opcode" and count[1]:
                count[0] += 1
                if count[0] == n:
                    os.kill(os.getpid(), signal.SIGINT)  # (raised here unless an operation holds it)
            return local

        sys.settrace(traced)
        try:
            with warnings.catch_warnings(action="ignore"):
                optimshift.rebind(opt, new)
            interrupted = False
        except KeyboardInterrupt:
            interrupted = True
        finally:
            sys.settrace(None)
        pairs = [(id(k), id(v)) for k, v in opt.state.items()]
        same = pairs == [(id(k), id(v)) for k, v in before] and list(opt.state["seen"]) == seen
        done = {*map(id, opt.state)} == {*map(id, (*new, "seen"))} and list(opt.state["seen"]) == new
        assert same or done, n
        assert signal.getsignal(signal.SIGINT) is handler, n  # (a section holding it gave it back)
        if not interrupted:
            break
    assert n > 50


def test_a_failure_after_the_commit_of_a_wrappers_rebind_leaves_its_state_keyed_by_the_params_in_its_groups(
    sim, monkeypatch
):
    """The undo of the stale keys' re-key ran on any failure, one after the commit too: the old keys came back over
    groups holding the new params (and a mapping the commit had re-keyed)."""
    params, opt = _stepped_lookahead(sim)
    new = [torch.nn.Parameter(p.detach().cpu()) for p in params]
    optimshift.rebind(opt.optimizer, new)
    monkeypatch.setattr(optimshift.api, "remember_sides", lambda *a: 1 / 0)
    with pytest.warns(RuntimeWarning), pytest.raises(ZeroDivisionError):
        optimshift.rebind(opt, new)
    assert {*map(id, opt.state)} == {*map(id, (*new, "seen"))} and list(opt.state["seen"]) == new


def test_an_operation_on_a_wrapper_after_a_rebind_of_its_inner_optimizer_says_to_rebind_the_wrapper(sim):
    """The wrapper's state for the params a rebind of its inner optimizer replaced was refused with 'Remove it (del
    optimizer.state[param])', which throws its slow weights away; it says to rebind the wrapper, which re-keys it."""
    params, opt = _stepped_lookahead(sim)
    new = [torch.nn.Parameter(p.detach().cpu()) for p in params]
    optimshift.rebind(opt.optimizer, new)
    for call in (optimshift.check, optimshift.move):
        with pytest.warns(RuntimeWarning) if call is optimshift.move else contextlib.nullcontext():
            with pytest.raises(ValueError, match=r"\(optimizer: AdamW\) replaced .* optimshift\.rebind _Lookahead"):
                call(opt)
    with pytest.warns(RuntimeWarning):
        optimshift.rebind(opt, new)
    assert optimshift.check(opt).ok
    opt.state[params[0]] = {"slow": torch.zeros(4, 3)}  # (state for a param no rebind replaced: remove it)
    with pytest.raises(ValueError, match=r"Remove it \(del optimizer\.state\[param\]\)"):
        optimshift.check(opt)


class _Partial(torch.optim.Optimizer):
    """A wrapper over the first of its inner optimizer's param groups only: that very dict, or a dict of its own
    holding that very params list."""

    def __init__(self, inner, how):
        self.optimizer = inner
        group = inner.param_groups[0]
        super().__init__(list(group["params"]), {})
        self.param_groups = [group if how == "the dict" else {**group}]  # (``{**group}``: the same params list)

    def step(self, closure=None):
        self.optimizer.step()


@pytest.mark.parametrize("how", ["the dict", "its params list"])
def test_rebind_of_a_wrapper_re_keys_an_inner_optimizer_sharing_some_of_its_groups(how):
    """An inner optimizer holding the wrapper's one group among others of its own: the new params landed in its
    groups (the dict, or the list rewritten in place) but its state was re-keyed only where it held all of them as
    the wrapper's very dicts, so that it and check() raised. The entries of the shared group's params follow them;
    the others stay as they were."""
    a = [torch.nn.Parameter(torch.randn(4, 3)) for _ in range(2)]
    c = torch.nn.Parameter(torch.randn(2))
    inner = O.AdamW([{"params": a}, {"params": [c]}], foreach=False)
    opt = _Partial(inner, how)
    for p in (*a, c):
        p.grad = torch.randn_like(p)
    opt.step()
    states = [inner.state[p] for p in (*a, c)]
    new = [torch.nn.Parameter(p.detach().clone()) for p in a]
    with pytest.warns(RuntimeWarning, match=r"optimshift\.rebind on it"):
        optimshift.rebind(opt, new)
    assert inner.param_groups[0]["params"] == new
    assert {id(k) for k in inner.state} == {id(p) for p in (*new, c)}
    assert [inner.state[p] for p in (*new, c)] == states
    assert optimshift.check(inner).ok
    for p in (*new, c):
        p.grad = torch.randn_like(p)
    inner.step()


class _KeyedAdamW(O.AdamW):
    """AdamW keeping a mapping keyed by its params in an optimizer-wide entry (as TRAC does)."""

    def step(self, closure=None):
        super().step(closure)
        seen = self.state.setdefault("seen", {})
        for p in self.param_groups[0]["params"]:
            seen[p] = seen.get(p, 0) + 1


def test_rebind_of_a_wrapper_re_keys_mappings_keyed_by_the_params_in_the_inner_optimizers_state(sim):
    """The inner optimizer's state keyed by the params inside an entry (TRAC's ``state["_trac"][param]``): rebind of
    the wrapper re-keyed its state's own keys only, and the advised rebind of it then found the params new already:
    the mapping kept the old params (alive) for good, and the next step counted the new ones from zero."""
    params = [torch.nn.Parameter(torch.randn(4, 3, device=sim))]
    opt = _Lookahead(_KeyedAdamW(params, foreach=False))
    params[0].grad = torch.randn_like(params[0])
    opt.step()
    seen = opt.optimizer.state["seen"]
    new = [torch.nn.Parameter(params[0].detach().cpu())]
    opt.optimizer.state["frozen"] = types.MappingProxyType({params[0]: 1})  # (one it cannot re-key: refused first)
    with pytest.warns(RuntimeWarning), pytest.raises(TypeError, match=r"AdamW: rebind: optimizer.state\['frozen'\]"):
        optimshift.rebind(opt, new)
    assert opt.param_groups[0]["params"] == params and list(seen) == params and params[0] in opt.optimizer.state
    del opt.optimizer.state["frozen"]
    with pytest.warns(RuntimeWarning, match=r"optimshift\.rebind on it"):
        optimshift.rebind(opt, new)
    optimshift.rebind(opt.optimizer, new)
    assert opt.optimizer.state["seen"] is seen and [(id(k), v) for k, v in seen.items()] == [(id(new[0]), 1)]
    assert optimshift.check(opt).ok
    new[0].grad = torch.randn_like(new[0])
    opt.step()
    assert seen == {new[0]: 2}


def test_a_dtype_finding_names_a_param_as_every_other_finding_does():
    """A group whose ``param_names`` holds None for a param: check()'s dtype finding called it
    ``group 0, param 0 (None)`` where every other finding and placement() say ``group 0, param 0``."""
    m = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(m.named_parameters())
    m(torch.randn(4, 3)).sum().backward()
    opt.step()
    opt.param_groups[0]["param_names"][0] = None
    p = opt.param_groups[0]["params"][0]
    opt.state[p]["exp_avg"] = opt.state[p]["exp_avg"].double()  # a dtype the step refuses
    (finding,) = [f for f in optimshift.check(opt).findings if f.key == "exp_avg"]
    assert finding.param == "group 0, param 0" == optimshift.placement(opt)[0].param


class _ReadsStepAgain(torch.optim.Adam):
    """An Adam subclass with a step of its own, which reads each ``step`` once more after Adam's."""

    @torch.no_grad()
    def step(self, closure=None):
        out = super().step(closure)
        for group in self.param_groups:
            for p in group["params"]:
                if p in self.state:
                    float(self.state[p]["step"])
        return out


def test_the_sync_cost_of_a_subclass_with_its_own_step_is_its_own(sim):
    """check() prices a misplaced scalar by the step the class runs: Adam's table for Adam, what the probe counts
    for a subclass with a step of its own (it read Adam's table: one sync, where this step costs two), also for a
    library's own class named "Adam" (not torch Adam's table row of that name)."""
    named_adam = type("Adam", (_ReadsStepAgain,), {})
    costs = {}
    for cls in (torch.optim.Adam, _ReadsStepAgain, named_adam):
        p = torch.nn.Parameter(torch.zeros(3, device=sim))
        opt = cls([p], foreach=False)
        p.grad = torch.ones(3, device=sim)
        opt.step()
        opt.state[p]["step"] = opt.state[p]["step"].to(sim)
        (finding,) = [f for f in optimshift.check(opt).findings if f.key == "step"]
        costs[cls] = finding.syncs_per_step
    assert costs == {torch.optim.Adam: 1, _ReadsStepAgain: 2, named_adam: 2}


def _lr_moved_to(sim, opt, stepped):
    """:func:`_cost_of` for the group's tensor ``lr`` moved to the device."""

    def misplace():
        opt.param_groups[0]["lr"] = opt.param_groups[0]["lr"].to(sim)

    return _cost_of(opt, stepped, misplace)


_TENSOR_LR = ["Adam", "AdamW", "NAdam", "RAdam", "Adamax", "Adagrad", "Adadelta", "RMSprop", "SGD", "ASGD", "Adafactor"]


@pytest.mark.parametrize("shape", [(), (1,)], ids=["0-dim", "one-element"])
@pytest.mark.parametrize("foreach", [False, True, None], ids=["single", "foreach", "default"])
@pytest.mark.parametrize("name", _TENSOR_LR)
def test_a_group_tensor_read_on_the_host_is_priced_as_a_step_reads_it(sim, name, foreach, shape):
    """A tensor ``lr`` on the device that the step reads on the host: check() gave its finding no sync cost and
    ``syncs_per_step`` said 0 where a step makes one sync per param (Adam), two (NAdam), or one per step (SGD's
    foreach step): the figure is what a step over the group's params really makes more (count_syncs on the sim),
    and a tensor the step reads on the device has no finding and costs nothing."""
    params = [torch.nn.Parameter(torch.randn(3, 2, device=sim)) for _ in range(4)]
    flags = {} if name == "Adafactor" else {"foreach": foreach}
    if name in ("Adam", "AdamW") and foreach:  # (torch refuses a tensor lr on their foreach step without capturable)
        with pytest.raises(ValueError, match="capturable"):
            getattr(O, name)(params, lr=torch.full(shape, 0.01), **flags)
        return
    opt = getattr(O, name)(params, lr=torch.full(shape, 0.01), **flags)
    report, caused = _lr_moved_to(sim, opt, params)
    assert report.syncs_per_step == caused
    assert [(f.key, f.severity) for f in report.findings] == ([("lr", "warning")] if caused else [])


class _OneParamOnly(torch.optim.Optimizer):
    """A third-party optimizer whose constructor takes exactly one param, reading its tensor ``lr`` on the host."""

    def __init__(self, params, lr=0.01):
        super().__init__(params, {"lr": lr})
        if sum(len(g["params"]) for g in self.param_groups) != 1:
            raise ValueError("takes exactly one param")

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    buf = self.state[p].setdefault("buf", torch.zeros_like(p))
                    buf.mul_(0.9).add_(p.grad)
                    p.add_(buf, alpha=-float(group["lr"]))


def test_a_class_that_takes_one_param_is_still_probed_where_its_group_tensors_are_priced(sim):
    """The probe's count of a group tensor over two params built the class over two: a constructor that takes
    exactly one raised there, and the whole probe of the class was lost (check() no longer found its device
    ``lr``, placement fell back to the default rule). Its cost is then unknown; its verdict stands."""
    p = torch.nn.Parameter(torch.randn(3, device=sim))
    opt = _OneParamOnly([p], lr=torch.tensor(0.01))
    p.grad = torch.randn_like(p)
    opt.step()
    opt.param_groups[0]["lr"] = opt.param_groups[0]["lr"].to(sim)
    report = optimshift.check(opt)
    assert [(f.key, f.severity, f.expected) for f in report.findings] == [("lr", "warning", "cpu")]
    optimshift.move(opt)
    assert opt.param_groups[0]["lr"].device.type == "cpu" and optimshift.check(opt).ok


@pytest.mark.parametrize("group", ["frozen params", "two dtypes"])
@pytest.mark.parametrize("name, foreach", [("Adam", False), ("NAdam", False), ("SGD", True), ("RMSprop", True)])
def test_a_group_tensor_is_priced_for_the_params_a_step_reaches(sim, name, foreach, group):
    """The price of a device ``lr`` counted every param of the group, where torch steps those with a grad
    (frozen params in the group: 4 priced, 2 stepped), and a foreach step's once-a-step read once per group,
    where torch's foreach step runs once per (device, dtype) of its params (float32 and float64: 1 priced, 2
    made)."""
    if group == "frozen params":
        params = [torch.nn.Parameter(torch.randn(3, 2, device=sim)) for _ in range(4)]
        stepped = params[:2]
    else:
        params = [torch.nn.Parameter(torch.randn(3, 2, device=sim, dtype=dt)) for dt in (torch.float32, torch.float64)]
        stepped = params
    opt = getattr(O, name)(params, lr=torch.tensor(0.01), foreach=foreach)
    report, caused = _lr_moved_to(sim, opt, stepped)
    assert report.syncs_per_step == caused > 0


def test_torch_s_default_is_judged_over_the_params_a_step_reaches(sim):
    """A group of a param on the device and a frozen host param (no grad, never stepped): torch picks its default
    over the params with a grad, so the step runs foreach, and Adam's ``step`` on another accelerator than its
    param makes it raise; check() judged the default over every param (the host one made it single-tensor) and
    called it a warning costing a sync."""
    params = [torch.nn.Parameter(torch.randn(3, 2, device=sim)), torch.nn.Parameter(torch.randn(3, 2))]
    opt = O.Adam(params)
    params[0].grad = torch.randn_like(params[0])
    opt.step()
    opt.state[params[0]]["step"] = opt.state[params[0]]["step"].to(torch.device(sim.type, 1))
    (finding,) = optimshift.check(opt).findings
    assert finding.severity == "error" and "step() raises" in finding.why
    params[0].grad = torch.randn_like(params[0])
    with pytest.raises(RuntimeError, match="same device"):
        opt.step()


@pytest.mark.parametrize("name, key", [("NAdam", "mu_product"), ("Adam", "step")])
def test_a_low_precision_host_scalar_stays_on_the_host_under_the_single_tensor_step(sim, name, key):
    """A bf16 scalar on the host beside bf16 params on the device (torch's load casts NAdam's ``mu_product`` to
    the params' dtype): the single-tensor step reads it there with no sync, as it reads a float32 one. It was
    placed with its param as for the foreach step (which refuses it on the host), so check() called it misplaced
    and move() took it to the device, where each step then made a sync a read (1 a param for Adam, 2 for NAdam)."""
    p = torch.nn.Parameter(torch.randn(4, 3, dtype=torch.bfloat16, device=sim))
    opt = getattr(O, name)([p], foreach=False)
    p.grad = torch.randn_like(p)
    opt.step()
    opt.state[p][key] = opt.state[p][key].to(torch.bfloat16)
    assert optimshift.check(opt).ok
    optimshift.move(opt)
    assert opt.state[p][key].device.type == "cpu"
    p.grad = torch.randn_like(p)
    with optimshift.count_syncs() as syncs:
        opt.step()
    assert syncs.total == 0
    opt.state[p][key] = opt.state[p][key].to(sim)  # (on the device: priced as the single-tensor step reads it)
    (finding,) = optimshift.check(opt).findings
    assert (finding.key, finding.severity, finding.expected, finding.syncs_per_step) == (
        key,
        "warning",
        "cpu",
        {"NAdam": 2, "Adam": 1}[name],
    )


@pytest.mark.parametrize("name, key", [("NAdam", "mu_product"), ("Adam", "step")])
def test_a_low_precision_host_scalar_under_the_foreach_step_is_an_error(sim, name, key):
    """A bf16 scalar on the host beside bf16 params on the device, under the foreach step: torch groups a param's
    tensors by device and dtype, a float32/float64 host scalar excepted, so step() raises. check() called it a
    warning (a fresh optimizer "keeps this scalar on the param's device", which a fresh one does not)."""
    p = torch.nn.Parameter(torch.randn(4, 3, dtype=torch.bfloat16, device=sim))
    opt = getattr(O, name)([p], foreach=True)
    p.grad = torch.randn_like(p)
    opt.step()
    opt.state[p][key] = opt.state[p][key].to(torch.bfloat16)
    (finding,) = optimshift.check(opt).findings
    assert (finding.key, finding.severity, finding.expected) == (key, "error", str(sim))
    assert "step() raises" in finding.why
    p.grad = torch.randn_like(p)
    with pytest.raises(RuntimeError, match="same device and the same dtype"):
        opt.step()


@pytest.mark.parametrize("name, foreach", [("Adam", False), ("NAdam", False), ("SGD", False)])
def test_a_group_tensor_is_priced_before_any_step_for_the_params_that_take_a_grad(sim, name, foreach):
    """Before any step (no state yet), the price of a device ``lr`` counted every param of the group, frozen ones
    (``requires_grad=False``: they never get a grad, so torch never steps them) included: 4 priced, 2 stepped."""
    params = [torch.nn.Parameter(torch.randn(3, 2, device=sim)) for _ in range(4)]
    for p in params[2:]:
        p.requires_grad_(False)
    opt = getattr(O, name)(params, lr=torch.tensor(0.01).to(sim), foreach=foreach)
    priced = optimshift.check(opt).syncs_per_step

    def step():
        return _syncs_of_a_step(opt, params[:2])

    step()
    on_the_device = step()
    opt.param_groups[0]["lr"] = opt.param_groups[0]["lr"].to("cpu")
    assert priced == on_the_device - step() > 0


@pytest.mark.parametrize("name", ["RAdam", "AdamW"])
def test_a_device_lr_of_a_group_over_two_devices_is_found_and_moved_to_the_host(sim, name):
    """A group over a param on the sim and one on the host, its tensor ``lr`` on the sim: the step computes with it
    beside the host param and raises. check() judged it by the first param's device alone and said ok (RAdam, whose
    step reads it nowhere on the host); the host is where it serves both, where move() now puts it."""
    params = [torch.nn.Parameter(torch.randn(3, 2, device=sim)), torch.nn.Parameter(torch.randn(3, 2))]
    opt = getattr(O, name)(params, lr=torch.tensor(0.01).to(sim))
    (finding,) = optimshift.check(opt).findings
    assert (finding.key, finding.device, finding.expected) == ("lr", str(sim), "cpu")
    assert "group 0 holds params on cpu too: a step computing with it beside them raises" in finding.why
    with pytest.raises(RuntimeError, match="same device"):
        _syncs_of_a_step(opt, params)
    optimshift.move(opt)
    assert opt.param_groups[0]["lr"].device.type == "cpu" and optimshift.check(opt).ok
    _syncs_of_a_step(opt, params)


def test_a_device_beta_the_fused_step_reads_as_a_number_is_found_and_moved(sim):
    """Fused Adam takes ``beta1`` as a number: a device ``betas[0]`` costs a sync a step. The probe's fused step
    (no kernel for fake tensors on this build) failed once the betas were taken as numbers, and their reads went
    uncounted: check() was silent and move() kept it on the device."""
    params = [torch.nn.Parameter(torch.randn(3, 2, device=sim)) for _ in range(2)]
    opt = O.Adam(params, fused=True, lr=torch.tensor(1e-3), betas=(torch.tensor(0.9).to(sim), torch.tensor(0.99)))

    def step():
        return _syncs_of_a_step(opt, params)

    assert step() == 1
    (finding,) = optimshift.check(opt).findings
    assert (finding.key, finding.severity, finding.expected) == ("betas[0]", "warning", "cpu")
    optimshift.move(opt)
    assert opt.param_groups[0]["betas"][0].device.type == "cpu" and step() == 0


def test_a_device_lr_of_a_differentiable_adamax_is_found_priced_and_moved(sim):
    """Adamax's differentiable step reads ``lr`` on the host (``value=-clr``). The probe's step stopped before that
    read, at ``exp_inf.copy_``: ``Tensor.copy_``'s binding asks for a CUDA device guard, which a build without CUDA
    has none of for fake tensors. check() was silent and move() kept the lr on the device (a sync a param a step)."""
    params = [torch.randn(3, 2, device=sim, requires_grad=True).clone() for _ in range(2)]
    opt = O.Adamax(params, differentiable=True, lr=torch.tensor(0.01).to(sim))

    def step():
        return _syncs_of_a_step(opt, params)

    step()
    on_the_device = step()
    (finding,) = optimshift.check(opt).findings
    assert (finding.key, finding.severity, finding.expected) == ("lr", "warning", "cpu")
    optimshift.move(opt)
    assert opt.param_groups[0]["lr"].device.type == "cpu"
    assert finding.syncs_per_step == on_the_device - step() == len(params)


def test_a_step_that_calls_copy_by_its_keyword_is_probed_through(sim):
    """The probe runs ``Tensor.copy_`` as ``aten.copy_`` (whose second argument is ``src``, Tensor.copy_'s
    ``other``): a step calling ``copy_(other=...)``, which torch runs, stopped there in the probe, before it read
    lr as a number: check() said nothing of a device lr that costs a sync a param a step."""
    params = [torch.nn.Parameter(torch.randn(3, 2, device=sim)) for _ in range(2)]
    opt = CopiesByKeyword(params, lr=torch.tensor(0.01).to(sim))
    syncs = _syncs_of_a_step(opt, params)
    (finding,) = optimshift.check(opt).findings
    assert (finding.key, finding.expected) == ("lr", "cpu")
    assert finding.syncs_per_step == syncs == len(params)


def test_a_placement_no_rule_decided_is_reported_as_assumed(sim):
    """A class the probe cannot build (its constructor needs ``data``) is placed by the default rule, a guess: its
    findings stated it as a fact ("keeps this scalar on the param's device"); each says it is assumed."""

    class NeedsData(torch.optim.Optimizer):
        def __init__(self, params, data):
            super().__init__(params, {"lr": 0.1})

        def step(self, closure=None):
            for group in self.param_groups:
                for p in group["params"]:
                    self.state[p].setdefault("count", torch.tensor(0.0))

    opt = NeedsData([torch.nn.Parameter(torch.zeros(2, device=sim))], data=None)
    opt.step()
    report = optimshift.check(opt)
    (finding,) = [f for f in report.findings if f.key == "count"]
    assert (finding.device, finding.expected) == ("cpu", str(sim))
    assert finding.why.startswith("assumed by the default rule (no placement rule is known for NeedsData, see below)")
    assert "the probe could not build NeedsData" in report.findings[-1].why


def test_report_still_exports_the_foreach_helpers_that_moved_to_policy():
    """``report.runs_foreach``/``default_foreach`` moved to ``policy``, still importable from ``report`` (as the
    changelog says): a shrink dropped ``default_foreach`` from ``report`` and its ``__all__``."""
    from optimshift import policy, report

    for name in ("runs_foreach", "default_foreach"):
        assert getattr(report, name) is getattr(policy, name)
        assert name in report.__all__


def test_check_reads_a_device_group_tensor_s_value_once(sim):
    """check() asks where the step raises with a group tensor once per entry: a one-element tensor on the device whose
    value decides it (foreach AdamW's ``weight_decay``, 0 skips the raising op) costs one host sync, not two."""
    params = [torch.nn.Parameter(torch.randn(3, device=sim)) for _ in range(2)]
    opt = O.AdamW(params, foreach=True, weight_decay=torch.zeros(1, device=sim))
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    with optimshift.count_syncs() as syncs:
        report = optimshift.check(opt)
    assert [f.key for f in report.findings] == ["weight_decay"]
    assert syncs.total == 1


_WEIGHT_DECAY = ["Adam", "Adamax", "NAdam", "RAdam", "RMSprop", "SGD", "Adadelta", "Adagrad", "ASGD", "Adafactor"]


@pytest.mark.parametrize("foreach", [False, True], ids=["single", "foreach"])
@pytest.mark.parametrize("name", _WEIGHT_DECAY)
def test_a_device_weight_decay_is_priced_for_the_branch_a_nonzero_value_takes(sim, name, foreach):
    """A nonzero 0-dim ``weight_decay`` on the device: the step reads it in ``if weight_decay != 0`` and again in
    the branch (``alpha=weight_decay``). The probe answered the comparison false, skipped the branch and priced
    half of it (Adam single-tensor: 2 for 4); Adafactor's foreach step reads it once per rank class of its params
    (a 2-D and a 1-D param: 2), priced once per (device, dtype). The figure is what a step makes more, and says
    it is for a nonzero value."""
    params = [torch.nn.Parameter(torch.randn(s, device=sim)) for s in ((3, 2), (3,))]
    opt = getattr(O, name)(params, weight_decay=torch.tensor(0.01), foreach=foreach)

    def misplace():
        opt.param_groups[0]["weight_decay"] = opt.param_groups[0]["weight_decay"].to(sim)

    report, caused = _cost_of(opt, params, misplace)
    (finding,) = report.findings
    assert (finding.key, finding.severity, finding.syncs_per_step) == ("weight_decay", "warning", caused)
    assert caused > 0 and "for a nonzero value" in finding.why
