"""Bad input gets a clear error naming what is wrong, raised before anything changes."""

import copy

import pytest
import torch

import optimshift
from _custom_optimizers import Fp32Moments


def _adam(n=3):
    params = [torch.nn.Parameter(torch.randn(4, 3)) for _ in range(n)]
    opt = torch.optim.Adam(params)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    return params, opt


def _snapshot(opt):
    return [(id(p), {k: (id(v), v.device) for k, v in st.items()}) for p, st in opt.state.items()]


@pytest.mark.parametrize(
    "fn", [optimshift.move, optimshift.offload, optimshift.reload, optimshift.check, optimshift.placement]
)
def test_not_an_optimizer(fn):
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        fn(torch.nn.Linear(2, 2))


@pytest.mark.parametrize(
    "device, exc, match",
    [
        ("cuda:7", ValueError, "cuda:7 is not available"),
        ("nonsense", ValueError, "not a device PyTorch knows"),
        (3.5, TypeError, "must be a torch.device"),
        (True, TypeError, "must be a torch.device"),
        (-1, ValueError, ">= 0"),
    ],
)
def test_bad_device(device, exc, match):
    _, opt = _adam()
    before = _snapshot(opt)
    with pytest.raises(exc, match=match):
        optimshift.move(opt, device)
    assert _snapshot(opt) == before


def test_simulated_index_out_of_range(sim):
    _, opt = _adam()
    with pytest.raises(ValueError, match=rf"{sim.type}:7 is not available: this machine has 2 {sim.type} devices"):
        optimshift.move(opt, f"{sim.type}:7")


def test_state_for_a_param_in_no_group(sim):
    params, opt = _adam()
    stray = torch.nn.Parameter(torch.zeros(5))
    opt.state[stray] = {"exp_avg": torch.zeros(5)}
    before = _snapshot(opt)
    with pytest.raises(
        ValueError, match=r"Adam: state holds an entry \(keys \['exp_avg'\]\) for a param of shape \(5,\)"
    ):
        optimshift.move(opt, sim)
    assert _snapshot(opt) == before


def test_rebind_checks_count_and_shapes_first():
    params, opt = _adam()
    before = _snapshot(opt)
    with pytest.raises(ValueError, match="rebind got 2 params, the optimizer holds 3"):
        optimshift.rebind(opt, params[:2])
    with pytest.raises(ValueError, match=r"group 0, param 1 has shape \(4, 3\), the new param \(3, 4\)"):
        optimshift.rebind(opt, [params[0], torch.nn.Parameter(torch.zeros(3, 4)), params[2]])
    with pytest.raises(TypeError, match="not a tensor"):
        optimshift.rebind(opt, [params[0], "x", params[2]])
    with pytest.raises(ValueError, match="given twice"):
        q = torch.nn.Parameter(torch.zeros(4, 3))
        optimshift.rebind(opt, [params[0], q, q])
    assert _snapshot(opt) == before
    assert [p for p in opt.param_groups[0]["params"]] == params


def test_rebind_refuses_a_non_leaf_param_and_a_dtype_its_state_does_not_fit():
    """A non-leaf tensor never gets a .grad (torch refuses to add one to an optimizer, unless it retains its grad
    or the optimizer is differentiable), and fp32 Adam moments under a bf16 param failed the next step: both were
    accepted, with nothing said. A dtype the step takes (SGD's fp32 momentum under bf16 params) is rebound."""
    params, opt = _adam()
    before = _snapshot(opt)
    leaf = torch.nn.Parameter(torch.zeros(4, 3))
    with pytest.raises(ValueError, match="group 0, param 1 is a non-leaf tensor"):
        optimshift.rebind(opt, [params[0], leaf * 2, params[2]])
    bf16 = [torch.nn.Parameter(p.detach().to(torch.bfloat16)) for p in params]
    with pytest.raises(ValueError, match=r"param 0 is bfloat16, and a step rejects its state 'exp_avg' in float32"):
        optimshift.rebind(opt, bf16)
    assert _snapshot(opt) == before and opt.param_groups[0]["params"] == params
    fresh = torch.optim.Adam(params)  # (no state yet: nothing to refuse)
    optimshift.rebind(fresh, bf16)
    assert fresh.param_groups[0]["params"] == bf16
    sgd_params = [torch.nn.Parameter(torch.randn(4, 3)) for _ in range(2)]
    sgd = torch.optim.SGD(sgd_params, lr=0.1, momentum=0.9)
    for p in sgd_params:
        p.grad = torch.randn_like(p)
    sgd.step()
    sgd_bf16 = [torch.nn.Parameter(p.detach().to(torch.bfloat16)) for p in sgd_params]
    optimshift.rebind(sgd, sgd_bf16)  # (its step takes fp32 momentum with bf16 params)
    for p in sgd_bf16:
        p.grad = torch.randn_like(p)
    sgd.step()
    kept = torch.randn(4, 3, requires_grad=True) * 2
    kept.retain_grad()
    optimshift.rebind(sgd, [kept, sgd_params[1]])
    assert sgd.param_groups[0]["params"][0] is kept


def test_rebind_to_another_dtype_of_a_complex_param_or_a_class_with_its_own_step():
    """A complex64 param's Adam state under a complex128 param is refused (the next step failed), by the host
    trial as for floating-point params; SGD's step takes complex64 momentum under a complex128 param, so that
    rebind goes through (it was refused: complex params had no trial, and any other complex dtype was refused).
    PyTorch's cast leaves a complex param's state as saved, so the message does not offer cast='param'. A class
    with a step of its own may keep any dtypes: as load_state_dict and check(), rebind does not judge it by its
    torch base's step."""
    params = [torch.nn.Parameter(torch.randn(3, dtype=torch.complex64))]
    opt = torch.optim.Adam(params, foreach=False)
    params[0].grad = torch.randn_like(params[0])
    opt.step()
    wider = [torch.nn.Parameter(params[0].detach().to(torch.complex128))]
    with pytest.raises(ValueError, match=r"complex128, and a step rejects its state 'exp_avg' in complex64") as raised:
        optimshift.rebind(opt, wider)
    assert "cast='param'" not in str(raised.value) and "Cast its state to complex128" in str(raised.value)
    assert opt.param_groups[0]["params"] == params
    sgd_params = [torch.nn.Parameter(torch.randn(3, dtype=torch.complex64))]
    sgd = torch.optim.SGD(sgd_params, lr=0.1, momentum=0.9)
    sgd_params[0].grad = torch.randn_like(sgd_params[0])
    sgd.step()
    wider = [torch.nn.Parameter(sgd_params[0].detach().to(torch.complex128))]
    optimshift.rebind(sgd, wider)
    assert sgd.param_groups[0]["params"] == wider and sgd.state[wider[0]]["momentum_buffer"].dtype == torch.complex64
    wider[0].grad = torch.randn_like(wider[0])
    sgd.step()

    class Inheriting(torch.optim.Adam):
        pass  # (Adam's step: judged as Adam)

    for cls, taken in ((Fp32Moments, True), (Inheriting, False)):
        params, _ = _adam()
        opt = cls(params)
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
        bf16 = [torch.nn.Parameter(p.detach().to(torch.bfloat16)) for p in params]
        if not taken:
            with pytest.raises(ValueError, match="a step rejects its state 'exp_avg' in float32"):
                optimshift.rebind(opt, bf16)
            continue
        optimshift.rebind(opt, bf16)
        for p in bf16:
            p.grad = torch.randn_like(p)
        opt.step()


def test_rebind_repoints_groups_and_state():
    params, opt = _adam()
    new = [torch.nn.Parameter(p.detach().clone()) for p in params]
    values = {i: {k: v.clone() for k, v in opt.state[p].items()} for i, p in enumerate(params)}
    optimshift.rebind(opt, new)
    assert opt.param_groups[0]["params"] == new
    assert set(opt.state) == set(new)
    for i, q in enumerate(new):
        for k, v in values[i].items():
            assert torch.equal(opt.state[q][k], v)
    for p, q in zip(params, new):
        q.grad = p.grad
    opt.step()  # still a working optimizer


def test_rebind_with_named_params_renames_the_params_of_groups_that_name_theirs():
    """``rebind(opt, model.named_parameters())`` after the model was wrapped (its names changed): the groups'
    ``param_names`` follow (they kept the old names, which later checkpoints and messages used)."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 2))
    opt = torch.optim.Adam(model.named_parameters())
    wrapped = torch.nn.Sequential(model)
    optimshift.rebind(opt, wrapped.named_parameters())
    assert opt.param_groups[0]["param_names"] == ["0.0.weight", "0.0.bias"]
    assert opt.param_groups[0]["params"] == list(wrapped.parameters())


def test_rebind_refuses_names_for_some_params_and_none_for_others():
    """Pairs for some params and bare params for others: before, every name was dropped silently (the groups kept
    the old names). Refused, naming a param given each way, with the optimizer unchanged."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 2))
    opt = torch.optim.Adam([{"params": [model[0].weight]}, {"params": [model[0].bias]}])
    wrapped = torch.nn.Sequential(copy.deepcopy(model))
    weight, bias = wrapped.named_parameters()
    with pytest.raises(TypeError, match=r"Adam: rebind .*group 1, param 0.*group 0, param 0.*one way"):
        optimshift.rebind(opt, [weight[1], bias])
    assert opt.param_groups[0]["params"][0] is model[0].weight and opt.param_groups[1]["params"][0] is model[0].bias


def test_rebind_given_the_module_says_to_give_its_params():
    """``rebind(opt, model)``: iterating a module yields its children, which were counted as params ("rebind got 2
    params, the optimizer holds 4"); now a TypeError that says what to pass, with nothing changed."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 2))
    opt = torch.optim.Adam(model.parameters())
    with pytest.raises(
        TypeError, match=r"Adam: rebind takes the new params \(model.parameters\(\)\), got a Sequential"
    ):
        optimshift.rebind(opt, copy.deepcopy(model))
    assert opt.param_groups[0]["params"] == list(model.parameters())


def test_rebind_takes_a_parameter_list():
    """A ParameterList yields its params: it is taken as they are (the module refusal above must not catch it)."""
    params = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))])
    opt = torch.optim.Adam(params)
    new = copy.deepcopy(params)
    optimshift.rebind(opt, new)
    assert opt.param_groups[0]["params"] == list(new)


def test_offload_takes_one_include_name_as_a_string(sim):
    """``include="grads"`` is the one name, not its letters (it was refused: "got ['g', 'r', 'a', 'd', 's']")."""
    model = torch.nn.Linear(3, 2).to(sim)
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 3, device=sim)).sum().backward()
    opt.step()
    optimshift.offload(opt, include="grads")
    assert all(p.grad is None for p in model.parameters())
    optimshift.reload(opt)
    assert all(p.grad is not None and p.grad.device == sim for p in model.parameters())


def test_shared_tensor_stays_shared(sim):
    params = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(3))]
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    shared = torch.zeros(3)
    opt.state[params[0]]["momentum_buffer"] = shared
    opt.state[params[1]]["momentum_buffer"] = shared
    optimshift.move(opt, sim)
    assert opt.state[params[0]]["momentum_buffer"] is opt.state[params[1]]["momentum_buffer"] is shared
    assert opt.state[params[0]]["momentum_buffer"].device == sim


def test_shared_tensor_sent_to_two_devices_is_refused(sim):
    params = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(3, device=sim))]
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    shared = torch.zeros(3)
    opt.state[params[0]]["momentum_buffer"] = shared
    opt.state[params[1]]["momentum_buffer"] = shared
    with pytest.raises(
        ValueError, match=r"shared by group 0, param 0, state\['momentum_buffer'\] and group 0, param 1"
    ):
        optimshift.move(opt)
    assert opt.state[params[1]]["momentum_buffer"] is shared


@pytest.mark.parametrize(
    "call",
    [
        lambda opt: optimshift.move(opt, "cpu"),
        optimshift.offload,
        optimshift.check,
        optimshift.placement,
        optimshift.stream,
    ],
)
def test_state_that_is_a_tensor_not_a_dict_is_named(sim, call):
    params = [torch.nn.Parameter(torch.randn(4, 3, device=sim)) for _ in range(2)]
    opt = torch.optim.Adam(params)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    opt.state[params[1]] = torch.zeros(3, device=sim)  # (its truth is ambiguous: torch raises a RuntimeError)
    kept = opt.state[params[0]]
    before = {k: (id(v), v.device) for k, v in kept.items()}
    with pytest.raises(TypeError, match=r"Adam: state of group 0, param 1 is a Tensor, expected a dict"):
        call(opt)
    assert not optimshift.is_offloaded(opt) and not optimshift.is_streamed(opt)
    assert opt.state[params[0]] is kept and {k: (id(v), v.device) for k, v in kept.items()} == before


def test_load_state_dict_replaces_live_state_that_is_a_tensor(sim):
    params = [torch.nn.Parameter(torch.randn(4, 3, device=sim)) for _ in range(2)]
    opt = torch.optim.Adam(params)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    sd = copy.deepcopy(opt.state_dict())
    opt.state[params[1]] = torch.zeros(3, device=sim)
    optimshift.load_state_dict(opt, sd)  # (as torch's own load does)
    assert torch.equal(opt.state[params[1]]["exp_avg"].cpu(), sd["state"][1]["exp_avg"].cpu())


def test_rebind_of_a_group_whose_params_are_a_tuple(sim):
    a = [torch.nn.Parameter(torch.randn(2, device=sim)) for _ in range(2)]
    b = [torch.nn.Parameter(torch.randn(3, device=sim)) for _ in range(2)]
    opt = torch.optim.Adam([{"params": a}, {"params": b}])
    for p in a + b:
        p.grad = torch.ones_like(p)
    opt.step()
    opt.param_groups[1]["params"] = tuple(b)  # (torch steps it as well)
    states = [opt.state[p] for p in a + b]
    new = [torch.nn.Parameter(p.detach().clone()) for p in a + b]
    optimshift.rebind(opt, new)  # (it raised half-way: group 0 held the new params, the state the old ones)
    assert list(opt.param_groups[0]["params"]) == new[:2] and opt.param_groups[1]["params"] == tuple(new[2:])
    assert [opt.state[q] for q in new] == states and len(opt.state) == 4
    for q in new:
        q.grad = torch.ones_like(q)
    opt.step()


@pytest.mark.parametrize(
    "call",
    [
        lambda opt, device: optimshift.move(opt, device),
        lambda opt, device: optimshift.reload(opt, device),
        lambda opt, device: optimshift.stream(opt, device=device),
    ],
)
@pytest.mark.parametrize("device", ["cuda:7", "nonsense", 3.5])
def test_a_bad_device_names_the_optimizer(sim, call, device):
    params = [torch.nn.Parameter(torch.randn(4, 3, device=sim))]
    opt = torch.optim.SGD(params, momentum=0.9)
    params[0].grad = torch.ones_like(params[0])
    opt.step()
    with pytest.raises((TypeError, ValueError), match=r"^SGD: "):
        call(opt, device)
    assert opt.state[params[0]]["momentum_buffer"].device == sim and not optimshift.is_streamed(opt)


@pytest.mark.parametrize("include", [5, None, b"grads", bytearray(b"grads"), ("grads", 3)])
def test_offload_include_that_is_no_names_is_a_type_error_naming_the_optimizer(sim, include):
    _, opt = _adam()
    with pytest.raises(
        TypeError,
        match=r"Adam: offload include= must be names such as \('grads',\) \(a str or an iterable of str\), got",
    ):
        optimshift.offload(opt, include=include)
    assert not optimshift.is_offloaded(opt)


@pytest.mark.parametrize("offloaded_first", [False, True], ids=["fresh", "offloaded"])
@pytest.mark.parametrize(
    "include, error", [(("activations",), ValueError), (b"grads", TypeError), (("grads", 3), TypeError)]
)
def test_offloaded_checks_include_also_when_already_offloaded(sim, include, error, offloaded_first):
    """``offloaded(opt, include=...)`` of an optimizer offloaded already runs no offload, so a bad ``include``
    was silently accepted there: it is checked as offload checks it, either way, before anything changes."""
    params = [torch.nn.Parameter(torch.randn(4, 3, device=sim)) for _ in range(2)]
    opt = torch.optim.Adam(params)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    if offloaded_first:
        optimshift.offload(opt)
    before = _snapshot(opt)
    with pytest.raises(error, match=r"^Adam: offloaded include= "):
        with optimshift.offloaded(opt, include=include):
            pytest.fail("the body ran")
    assert optimshift.is_offloaded(opt) is offloaded_first and _snapshot(opt) == before


@pytest.mark.parametrize("params", [None, 5])
def test_rebind_given_no_iterable_names_the_optimizer(params):
    _, opt = _adam()
    with pytest.raises(TypeError, match=r"Adam: rebind takes the new params \(model.parameters\(\)\), got a"):
        optimshift.rebind(opt, params)


@pytest.mark.parametrize("fn", [optimshift.wait, optimshift.unstream])
def test_wait_and_unstream_refuse_what_is_not_an_optimizer(fn):
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        fn(torch.nn.Linear(2, 2))  # (they did nothing, silently)


@pytest.mark.parametrize("fn", [optimshift.is_offloaded, optimshift.is_streamed])
@pytest.mark.parametrize("given", [torch.nn.Linear(2, 2), "optimizers", None])
def test_the_predicates_refuse_what_is_not_an_optimizer(fn, given):
    _, opt = _adam()
    optimshift.offload(opt)
    for what in (given, [opt]):  # (they answered False: a list of offloaded optimizers was "not offloaded")
        with pytest.raises(TypeError, match="torch.optim.Optimizer"):
            fn(what)


def test_a_param_listed_twice_is_refused_in_one_wording_by_every_operation_and_the_load(sim):
    """An optimizer listing one param twice (a group edited after construction): an operation's check said "the
    same param is listed twice", the load's "the optimizer lists one param twice". One check, one wording,
    naming both places, before anything changes."""
    a, b = torch.nn.Parameter(torch.zeros(3, device=sim)), torch.nn.Parameter(torch.zeros(2, device=sim))
    opt = torch.optim.SGD([a, b], lr=0.1, momentum=0.9)
    opt.param_groups[0]["params"].append(a)
    saved = torch.optim.SGD([torch.nn.Parameter(torch.zeros(n)) for n in (3, 2, 3)], lr=0.2).state_dict()
    twice = r"the same param is listed twice \(group 0, param 0 and group 0, param 2\)"
    with pytest.raises(ValueError, match=f"^SGD: {twice}"):
        optimshift.move(opt, "cpu")
    with pytest.raises(ValueError, match=f"^SGD: load_state_dict: {twice}"):
        optimshift.load_state_dict(opt, saved)
    assert a.device == sim and opt.param_groups[0]["lr"] == 0.1 and not opt.state
