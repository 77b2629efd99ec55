"""load_state_dict refuses, before anything changes, what PyTorch accepts and fails on later: state keys left
as text by a JSON round trip, optimizer-wide entries a torch.optim class never has, state a torch.optim step
cannot use (LBFGS's history lists in a dtype it refuses too), param groups without a key the step reads,
expanded views that would allocate GiBs, and containers nested thousands deep. Errors name the param, the key
and, for a path, the file."""

from __future__ import annotations

import copy
import json
import re

import pytest
import torch

import optimshift
from _crafted import nest_in_place
from _matrix import bitwise_equal, grad_for, snapshot, tensor_ids
from _optim_db_cases import collect, common_optimizers
from optimshift.checkpoint._resume import IMPLEMENTATION_FLAGS

O = torch.optim


def _trained(cls=O.Adam, shapes=((4, 3), (3,)), **kwargs):
    params = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    opt = cls(params, **kwargs)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    return opt


def _snapshot(opt):
    return (
        id(opt.state),
        [(id(p), id(st), snapshot(st)) for p, st in opt.state.items()],
        [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups],
        (id(opt.param_groups), [id(g) for g in opt.param_groups], tensor_ids(opt)),
    )


def _refused(target, sd, exc, match, **kwargs):
    """load_state_dict raises, and the optimizer is the same objects with the same bits as before."""
    before = _snapshot(target)
    with pytest.raises(exc, match=match):
        optimshift.load_state_dict(target, sd, **kwargs)
    after = _snapshot(target)
    assert before[0] == after[0] and before[2] == after[2] and before[3] == after[3]
    assert [(a, b) for a, b, _ in before[1]] == [(a, b) for a, b, _ in after[1]]
    assert all(bitwise_equal(x, y) for (_, _, x), (_, _, y) in zip(before[1], after[1])), "nothing may change"


# --- item 5: text keys from a JSON round trip -----------------------------------------------------------------


def test_state_keyed_by_text_is_refused_not_dropped():
    sd = _trained(foreach=False).state_dict()
    # What json.loads(json.dumps(...)) does to the keys (tensors kept): "0", "1" while the groups list 0, 1.
    texted = {"state": {str(k): v for k, v in sd["state"].items()}, "param_groups": sd["param_groups"]}
    assert json.loads(json.dumps({str(k): 0 for k in sd["state"]})) == {"0": 0, "1": 0}
    plain = _trained(foreach=False)
    plain.load_state_dict(copy.deepcopy(texted))  # PyTorch: every param's state silently gone
    assert not any(isinstance(k, torch.Tensor) for k in plain.state)
    _refused(
        _trained(foreach=False),
        texted,
        ValueError,
        r"Adam: load_state_dict: state_dict\['state'\] is keyed by text \('0', '1'\) while the param groups "
        r"list the ids 0, 1: it went through JSON .* sd\['state'\] = \{int\(k\): v",
    )


@pytest.mark.parametrize("cls, kwargs", [(O.Adam, {"foreach": False}), (O.SGD, {"lr": 0.1, "momentum": 0.9})])
def test_a_param_whose_state_is_none_is_refused_not_dropped(cls, kwargs):
    """``state[1] = None`` (a hand-edited file): PyTorch's load fails on it (Adam) or installs it (SGD, whose step
    then fails); it was taken for "no state", and that param's moments silently restarted from zero."""
    sd = _trained(cls, **kwargs).state_dict()
    sd["state"][1] = None
    _refused(
        _trained(cls, **kwargs),
        sd,
        TypeError,
        rf"{cls.__name__}: load_state_dict: group 0, param 1: its state is None, expected a dict",
    )


def test_a_torch_optim_class_has_no_optimizer_wide_entries():
    sd = _trained(foreach=False).state_dict()
    sd["state"]["k"] = torch.tensor([3])
    _refused(
        _trained(foreach=False),
        sd,
        ValueError,
        r"state_dict\['state'\] has entries \['k'\] that are no param's id, but torch\.optim\.adam\.Adam keeps "
        r"all of its state per param",
    )


def test_other_classes_keep_their_optimizer_wide_entries():
    class Madgradish(O.SGD):  # MADGRAD's optimizer-wide counter state["k"]
        pass

    src = _trained(Madgradish, lr=0.1, momentum=0.9)
    src.state["k"] = torch.tensor([3])
    target = _trained(Madgradish, lr=0.1, momentum=0.9)
    optimshift.load_state_dict(target, src.state_dict())
    assert torch.equal(target.state["k"], torch.tensor([3]))
    texted = src.state_dict()
    texted["state"] = {(str(k) if not isinstance(k, str) else k): v for k, v in texted["state"].items()}
    _refused(target, texted, ValueError, r"is keyed by text \('0', '1'\)")


# --- item 8: no amplification ------------------------------------------------------------------------------------


def test_an_expanded_step_is_refused_before_any_copy(tmp_path):
    """A few-KB file whose ``step`` is zeros(1).expand(16384, 16384) made load_state_dict allocate 1 GiB."""
    sd = _trained(foreach=False).state_dict()
    sd["state"][0]["step"] = torch.zeros(1).expand(16384, 16384)
    path = tmp_path / "amplify.pt"
    torch.save(sd, path)
    assert path.stat().st_size < 4096
    _refused(
        _trained(foreach=False),
        path,
        ValueError,
        rf"Adam: load_state_dict: {path}: group 0, param 0, state key 'step': expected a 0-dim tensor \(or a "
        rf"number\), got a tensor of shape \(16384, 16384\)",
    )


def test_an_expanded_view_is_refused_for_any_class():
    class Custom(O.Adam):  # its own step: what it keeps is not known, but no state is an expanded view
        def step(self, closure=None):
            return super().step(closure)

    sd = _trained(Custom, foreach=False).state_dict()
    sd["state"][1]["history"] = [torch.zeros(1).expand(4096, 4096)]
    _refused(
        _trained(Custom, foreach=False),
        sd,
        ValueError,
        r"group 0, param 1, state key 'history'\[0\]: a tensor of shape \(4096, 4096\) \(67108864 bytes once "
        r"copied\) is a view of a storage of 4 bytes",
    )
    small = _trained(Custom, foreach=False).state_dict()
    small["state"][1]["history"] = [torch.zeros(1).expand(8)]  # a small broadcast is harmless
    target = _trained(Custom, foreach=False)
    optimshift.load_state_dict(target, small)
    assert torch.equal(target.state[target.param_groups[0]["params"][1]]["history"][0], torch.zeros(8))


@pytest.mark.parametrize(
    "cls, kwargs, key",
    [
        (O.NAdam, {"foreach": False}, "mu_product"),
        (O.ASGD, {"foreach": False}, "eta"),
        (O.Adam, {"foreach": False}, "step"),
    ],
)
def test_scalar_keys_have_one_element(cls, kwargs, key):
    sd = _trained(cls, **kwargs).state_dict()
    sd["state"][0][key] = torch.zeros(4, 3)
    _refused(_trained(cls, **kwargs), sd, ValueError, rf"state key '{key}': expected a 0-dim tensor")


# --- "Also": what a torch.optim step needs ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "value, exc, match",
    [
        ("abc", TypeError, r"expected a tensor, got str 'abc'"),
        ([1.0], TypeError, r"expected a tensor, got a list of 1"),
        (None, TypeError, r"expected a tensor, got None"),
        (3, TypeError, r"expected a tensor, got an int$"),  # the article its sound takes
        (torch.zeros(4, 3).to_sparse(), TypeError, r"expected a dense tensor, got a sparse_coo one"),
        (torch.zeros(4, 3, dtype=torch.int64), TypeError, r"expected a floating-point tensor, got int64"),
    ],
)
def test_a_buffer_a_step_cannot_use_is_refused(value, exc, match):
    sd = _trained(foreach=False).state_dict()
    sd["state"][0]["exp_avg"] = value
    _refused(
        _trained(foreach=False), sd, exc, rf"Adam: load_state_dict: group 0, param 0, state key 'exp_avg': {match}"
    )


def test_a_missing_entry_is_refused():
    sd = _trained(foreach=False, amsgrad=True).state_dict()
    del sd["state"][1]["max_exp_avg_sq"]
    _refused(
        _trained(foreach=False, amsgrad=True),
        sd,
        ValueError,
        r"group 0, param 1: its state has no 'max_exp_avg_sq'; Adam\.step keeps 'exp_avg', 'exp_avg_sq', "
        r"'max_exp_avg_sq', 'step'",
    )


@pytest.mark.parametrize("cls, kwargs", [(O.Adam, {"foreach": False}), (O.SGD, {"momentum": 0.9}), (O.Adagrad, {})])
def test_the_state_of_a_0_dim_param_is_checked_as_any_other(cls, kwargs):
    """A 0-dim param's state went unchecked (probed at rank 0, its buffers could not be told from ``step``): a
    missing buffer or one of another shape loaded, and the next step failed (KeyError, a broadcast error)."""
    shapes = ((3,), ())
    key = {O.Adam: "exp_avg", O.SGD: "momentum_buffer", O.Adagrad: "sum"}[cls]
    if cls is not O.SGD:  # (SGD's step makes a missing momentum_buffer: torch takes one as missing)
        sd = _trained(cls, shapes, **kwargs).state_dict()
        del sd["state"][1][key]
        _refused(_trained(cls, shapes, **kwargs), sd, ValueError, rf"group 0, param 1: its state has no '{key}'")
    sd = _trained(cls, shapes, **kwargs).state_dict()
    sd["state"][1][key] = torch.zeros(2)
    _refused(
        _trained(cls, shapes, **kwargs),
        sd,
        ValueError,
        rf"group 0, param 1, state key '{key}': the checkpoint's tensor has shape \(2,\), the param has shape \(\)",
    )
    target = _trained(cls, shapes, **kwargs)
    optimshift.load_state_dict(target, _trained(cls, shapes, **kwargs).state_dict())  # (a valid one loads)
    target.step()


def test_a_subclass_that_steps_like_its_torch_class_is_checked_like_it():
    class Sub(O.Adam):
        pass

    # What Optimizer.__init__ does when a subclass is built before its base ever was: a wrapper of its own.
    Sub.step = Sub.profile_hook_step(O.Adam.step)
    Sub.step.hooked = True
    sd = _trained(Sub, foreach=False).state_dict()
    sd["state"][0]["exp_avg"] = None
    _refused(
        _trained(Sub, foreach=False),
        sd,
        TypeError,
        r"Sub: load_state_dict: group 0, param 0, state key "
        r"'exp_avg': expected a tensor, got None",
    )


@pytest.fixture
def steps_without_state(monkeypatch):
    """Set whether a param without state can step (Adagrad's step creates a missing state from torch 2.12 on,
    not before), as the probe finds it; the probe's cache cleared around."""
    from optimshift import _probe

    def set_to(value):
        monkeypatch.setattr(_probe, "_steps_without_state", lambda *args: value)
        _probe.clear_cache()

    yield set_to
    _probe.clear_cache()


def test_eager_classes_need_every_params_state_where_a_param_without_one_cannot_step(steps_without_state):
    steps_without_state(False)  # (torch <= 2.11)
    sd = _trained(O.Adagrad).state_dict()
    del sd["state"][1]
    _refused(
        _trained(O.Adagrad),
        sd,
        ValueError,
        r"group 0, param 1: the checkpoint has no state for it, but Adagrad creates every param's state when it "
        r"is built \('step', 'sum'\)",
    )


def test_a_param_added_by_add_param_group_loads_without_state_where_its_step_creates_one(steps_without_state):
    """A param ``add_param_group`` added has no state until it steps; where the class's step creates a missing
    state (Adagrad from torch 2.12), a checkpoint without it is complete, as torch's own load takes it. Before, the
    load refused it as incomplete: a resume through optimshift failed where ``opt.load_state_dict`` worked."""
    steps_without_state(True)
    a, b = torch.nn.Linear(3, 3), torch.nn.Linear(3, 3)
    opt = O.Adagrad(a.parameters())
    a(torch.randn(2, 3)).sum().backward()
    opt.step()
    opt.add_param_group({"params": list(b.parameters())})
    sd = opt.state_dict()
    fresh = O.Adagrad(a.parameters())
    fresh.add_param_group({"params": list(b.parameters())})
    optimshift.load_state_dict(fresh, sd)
    assert [bool(fresh.state.get(p)) for p in [*a.parameters(), *b.parameters()]] == [True, True, False, False]
    assert bitwise_equal(fresh.state[a.weight]["sum"], opt.state[a.weight]["sum"])


@pytest.mark.parametrize(
    "key, value, match",
    [
        ("lr", "0.1", r"key 'lr': expected a number \(or a one-element tensor\), got str '0.1'"),
        ("lr", torch.ones(2), r"key 'lr': expected a number .* got a tensor of shape \(2,\)"),
        ("lr", True, r"key 'lr': expected a number"),
        ("betas", 0.9, r"key 'betas': expected a pair of numbers like \(0.9, 0.999\), got a float"),
        ("betas", (0.9, 0.99, 0.9), r"key 'betas': expected a pair of numbers .* got a tuple of 3"),
        ("betas", (0.9, "x"), r"key 'betas': item 1 must be a number, got str 'x'"),
        ("amsgrad", "no", r"key 'amsgrad': expected True or False, got str 'no'"),
    ],
)
def test_hyperparameters_of_the_wrong_type_are_refused(key, value, match):
    sd = _trained(foreach=False).state_dict()
    sd["param_groups"][0][key] = value
    _refused(_trained(foreach=False), sd, TypeError, rf"Adam: load_state_dict: param group 0, {match}")


def test_what_older_pytorch_saved_still_loads():
    """Python-number steps (PyTorch < 1.12), one-element steps (1.12/1.13 capturable), tensor lr, list betas."""
    src = _trained(foreach=False)
    sd = copy.deepcopy(src.state_dict())
    sd["state"][0]["step"] = 1.0
    sd["state"][1]["step"] = torch.tensor([1.0])
    sd["param_groups"][0]["lr"] = torch.tensor(0.001)
    sd["param_groups"][0]["betas"] = [0.9, 0.999]
    target = _trained(foreach=False)
    optimshift.load_state_dict(target, sd)
    states = list(target.state.values())
    assert torch.equal(states[0]["step"], torch.tensor(1.0)) and torch.equal(states[1]["step"], torch.tensor([1.0]))
    assert bitwise_equal(states[0]["exp_avg"], src.state_dict()["state"][0]["exp_avg"])
    target.step()  # and PyTorch's step takes them
    assert states[0]["step"].item() == 2.0 and states[1]["step"].item() == 2.0


# --- issue 17, item 7: a group missing a key the step reads -------------------------------------------------------

# One configuration of every class in PyTorch's optimizer test database (its first, "default", input).
INFOS = {info.optim_cls.__name__: info for info in common_optimizers().optim_db}


def _db_params(dtype=torch.float32):
    # 2-D: Muon takes nothing else. Seeds other than grad_for's (a target equal to its param has no grad).
    return [
        torch.nn.Parameter(torch.randn(s, dtype=dtype, generator=torch.Generator().manual_seed(100 + i)))
        for i, s in enumerate([(3, 2), (2, 3)])
    ]


def _db_step(info, opt, params, step):
    """One step towards a target that moves with ``step`` (a quadratic: LBFGS builds its history), with sparse
    grads for a class that takes only those, through a closure for a class that needs one."""
    targets = [grad_for(step, i, p.shape).to(p.dtype) for i, p in enumerate(params)]

    def closure():
        with torch.no_grad():
            for p, t in zip(params, targets):
                g = 2 * (p - t)
                p.grad = g.to_sparse() if info.only_supports_sparse_grads else g
            return sum(((p - t) ** 2).sum() for p, t in zip(params, targets))

    if info.step_requires_closure:
        opt.step(closure)
    else:
        closure()
        opt.step()


def _db_trained(info, kwargs, dtype=torch.float32, steps=1):
    params = _db_params(dtype)
    opt = info.optim_cls(params, **copy.deepcopy(kwargs))
    for step in range(steps):
        _db_step(info, opt, params, step)
    return opt, params


def _without(sd, key):
    sd = copy.deepcopy(sd)
    del sd["param_groups"][0][key]
    return sd


def _torch_needs(info, kwargs, sd, key, flags, steps):
    """Whether PyTorch's own load_state_dict of ``sd`` (with the live implementation flags for
    ``flags="live"``, as optimshift keeps them) into an optimizer trained ``steps`` steps takes it, and its next
    step then raises ``KeyError(key)``."""
    theirs, params = _db_trained(info, kwargs, steps=steps)
    sd = copy.deepcopy(sd)
    if flags == "live":
        for flag in IMPLEMENTATION_FLAGS:
            if flag in theirs.param_groups[0]:
                sd["param_groups"][0][flag] = theirs.param_groups[0][flag]
    theirs.load_state_dict(sd)
    try:
        _db_step(info, theirs, params, steps)
    except KeyError as e:
        assert e.args == (key,), f"{info.optim_cls.__name__} without {key!r}: {e!r}"
        return True
    return False


@pytest.mark.parametrize("flags", ["live", "checkpoint"])
@pytest.mark.parametrize("name", sorted(INFOS))
def test_a_group_without_a_key_the_step_reads_is_refused(name, flags):
    """Each key of a saved group deleted in turn. PyTorch says which ones the class needs: its own
    load_state_dict takes every one, and its next step raises ``KeyError`` for some, resuming a trained
    optimizer or (Rprop's ``lr``, read when a param's state is created) a fresh one. Those are refused before
    anything changes, naming the optimizer, group and key and the fix; the rest (what older PyTorch did not
    save, and the class fills with a default) load, and both optimizers step."""
    info = INFOS[name]
    kwargs = info.optim_inputs_func(device="cpu")[0].kwargs
    trained = _db_trained(info, kwargs)[0].state_dict()
    fresh = _db_trained(info, kwargs, steps=0)[0].state_dict()
    refused, accepted = [], []
    for key in [k for k in trained["param_groups"][0] if k not in ("params", "param_names")]:
        if _torch_needs(info, kwargs, _without(trained, key), key, flags, 1) or _torch_needs(
            info, kwargs, _without(fresh, key), key, flags, 0
        ):
            _refused(
                _db_trained(info, kwargs)[0],
                _without(trained, key),
                ValueError,
                rf"^{name}: load_state_dict: param group 0 has no '{key}', which {name}\.step reads .*"
                rf"state_dict\['param_groups'\]\[0\]\['{key}'\] = .*the optimizer is unchanged",
                flags=flags,
            )
            refused.append(key)
        else:
            for sd, steps in ((trained, 1), (fresh, 0)):
                target, params = _db_trained(info, kwargs, steps=steps)
                optimshift.load_state_dict(target, _without(sd, key), flags=flags)
                _db_step(info, target, params, steps)
            accepted.append(key)
    assert "lr" in refused, (refused, accepted)


def test_what_older_pytorch_saved_in_a_group_still_loads():
    """An Adam group as PyTorch 1.10 saved it (no foreach, maximize, capturable, differentiable, fused,
    decoupled_weight_decay) loads with either flags mode; Adam's __setstate__ fills those as PyTorch's
    load_state_dict does. SparseAdam's step reads ``maximize`` with a default (PyTorch < 1.13 had none)."""
    sd = _trained(foreach=False).state_dict()
    newer = ("foreach", "maximize", "capturable", "differentiable", "fused", "decoupled_weight_decay")
    for key in newer:
        del sd["param_groups"][0][key]
    for flags in ("live", "checkpoint"):
        target = _trained(foreach=False)
        optimshift.load_state_dict(target, copy.deepcopy(sd), flags=flags)
        group = target.param_groups[0]
        assert all(key in group for key in newer) and group["maximize"] is False
        assert group["foreach"] is (False if flags == "live" else None)
        target.step()
    info = INFOS["SparseAdam"]
    sd = _db_trained(info, {})[0].state_dict()
    del sd["param_groups"][0]["maximize"]
    target, params = _db_trained(info, {})
    optimshift.load_state_dict(target, sd)
    _db_step(info, target, params, 1)


# --- issue 17, item 8: LBFGS's flat and list-valued state in another dtype --------------------------------------

LBFGS_CASES = [c for c in collect()[0] if c.info.optim_cls is O.LBFGS]  # PyTorch's own LBFGS configurations


@pytest.mark.parametrize("case", LBFGS_CASES, ids=[c.ident for c in LBFGS_CASES])
def test_lbfgs_float64_state_for_float32_params_is_refused_and_cast_param_loads_it(case):
    """LBFGS state saved from float64 params, loaded into float32 ones: kept as saved, its next step would raise
    (``dot: expected both vectors to have same dtype``). Its flat entries (``d``, ``prev_flat_grad``) and its
    history lists (``old_dirs``, ``old_stps``) are checked like every other class's state: the load is refused
    before anything changes and says cast='param'; with cast='param' it loads as PyTorch's own load_state_dict
    does (cast to the params' dtype), bit for bit, and steps as it does."""
    assert len(LBFGS_CASES) == 5
    info = case.info
    sd = _db_trained(info, case.kwargs, torch.float64, steps=3)[0].state_dict()
    saved = sd["state"][0]
    assert saved["old_dirs"] and saved["old_dirs"][0].dtype == torch.float64 and saved["d"].dtype == torch.float64
    target, params = _db_trained(info, case.kwargs)
    _refused(
        target,
        sd,
        ValueError,
        r"^LBFGS: load_state_dict: group 0, param 0, state key 'd': the checkpoint holds it as float64 .*"
        r"a step of LBFGS over float32 params rejects that .*cast='param'",
    )
    with pytest.raises(ValueError) as raised:
        optimshift.load_state_dict(target, sd)
    for key in ("old_dirs", "old_stps", "prev_flat_grad"):
        assert f"{key!r}, float64" in str(raised.value), str(raised.value)

    optimshift.load_state_dict(target, sd, cast="param")
    theirs, their_params = _db_trained(info, case.kwargs)
    theirs.load_state_dict(copy.deepcopy(sd))  # PyTorch casts every floating tensor to the param's dtype
    ours, their_state = target.state[params[0]], theirs.state[their_params[0]]
    assert all(t.dtype == torch.float32 for k in ("d", "prev_flat_grad") for t in [ours[k]])
    assert all(t.dtype == torch.float32 for k in ("old_dirs", "old_stps", "ro") for t in ours[k])
    assert bitwise_equal(ours, their_state)
    _db_step(info, target, params, 3)
    _db_step(info, theirs, their_params, 3)
    assert bitwise_equal(params, their_params) and bitwise_equal(target.state[params[0]], their_state)


# --- issue 31: every state LBFGS saves, its history empty or full -------------------------------------------------

F64 = torch.float64


def _lbfgs(kwargs, dtype, device="cpu"):
    torch.manual_seed(3)
    params = [torch.nn.Parameter(torch.randn(s, dtype=F64).to(device, dtype)) for s in [(2, 3), (3,)]]
    return O.LBFGS(params, **kwargs), params


def _lbfgs_step(opt, params, k):
    """The issue's step: grads drawn once (seeded by ``k``), a closure that returns the loss only."""
    g = torch.Generator().manual_seed(k)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g, dtype=F64).to(p.device, p.dtype)
    opt.step(lambda: sum((p * p).sum() for p in params))


@pytest.mark.parametrize("h_diag", ["number", "tensor"])
@pytest.mark.parametrize("line_search_fn", ["strong_wolfe", None])
@pytest.mark.parametrize("history", ["empty", "full"])
def test_lbfgs_float64_state_is_refused_whatever_its_history(sim, history, line_search_fn, h_diag):
    """LBFGS state saved from float64 params, loaded into float32 ones on the device, in every shape LBFGS saves:
    its history empty (the line search converged: ``old_dirs``, ``old_stps``, ``ro`` empty, ``H_diag`` 1; or one
    step without it) or full (``history_size=2``, ``max_iter=1``); with and without ``strong_wolfe``; ``H_diag`` a
    number or a 0-dim tensor (LBFGS saves a number with an empty history and a tensor with a full one; the other
    two are those edited, which its step takes alike). Kept as saved, the next steps raise (``dot``: the flat
    entries meet the float32 grad, if not in the first step then in the one after it, which a check that tried one
    step did not see; a history filled only after the first step, as with ``max_iter=1``, was not tried at all).
    Each is refused before anything changes, naming every entry a step rejects and cast='param'; with
    cast='param' it loads as PyTorch's own load_state_dict does, bit for bit, and steps as it does."""
    kwargs = {"line_search_fn": line_search_fn}
    if history == "full":
        kwargs.update(history_size=2, max_iter=1)
    src, src_params = _lbfgs(kwargs, F64)
    for k in range(3 if history == "full" or line_search_fn else 1):
        _lbfgs_step(src, src_params, k)
    sd = src.state_dict()
    saved = sd["state"][0]
    if h_diag == "tensor" and not isinstance(saved["H_diag"], torch.Tensor):
        saved["H_diag"] = torch.tensor(float(saved["H_diag"]), dtype=F64)
    elif h_diag == "number" and isinstance(saved["H_diag"], torch.Tensor):
        saved["H_diag"] = saved["H_diag"].item()
    assert len(saved["old_dirs"]) == len(saved["old_stps"]) == len(saved["ro"]) == (2 if history == "full" else 0)
    assert isinstance(saved["H_diag"], torch.Tensor) is (h_diag == "tensor")
    assert saved["d"].dtype == saved["prev_flat_grad"].dtype == F64

    kept, kept_params = _lbfgs(kwargs, torch.float32)  # what keeping the saved dtypes would give
    kept.load_state_dict(copy.deepcopy(sd))
    kept.state[kept_params[0]].update(copy.deepcopy(saved))
    with pytest.raises(RuntimeError, match="dot : expected both vectors to have same dtype"):
        for k in range(3, 5):
            _lbfgs_step(kept, kept_params, k)

    target, params = _lbfgs(kwargs, torch.float32, sim)
    _lbfgs_step(target, params, 0)
    rejected = {"prev_flat_grad"} | ({"old_dirs", "old_stps"} if history == "full" else set())
    _refused(
        target,
        sd,
        ValueError,
        r"^LBFGS: load_state_dict: group 0, param 0, state key 'd': the checkpoint holds it as float64 .*"
        r"a step of LBFGS over float32 params rejects that \(RuntimeError: dot : .*cast='param'.*"
        r"the optimizer is unchanged$",
    )
    with pytest.raises(ValueError) as raised:
        optimshift.load_state_dict(target, sd)
    named = re.findall(r"\(and '(\w+)', float64\)", str(raised.value))
    assert sorted(named) == sorted(rejected), str(raised.value)

    optimshift.load_state_dict(target, sd, cast="param")
    theirs, their_params = _lbfgs(kwargs, torch.float32, sim)
    _lbfgs_step(theirs, their_params, 0)
    theirs.load_state_dict(copy.deepcopy(sd))  # PyTorch casts every floating tensor to the param's dtype
    ours, their_state = target.state[params[0]], theirs.state[their_params[0]]
    assert ours["d"].dtype == ours["prev_flat_grad"].dtype == torch.float32 and ours["d"].device == sim
    assert bitwise_equal(ours, their_state)
    for k in range(3, 5):
        _lbfgs_step(target, params, k)
        _lbfgs_step(theirs, their_params, k)
    assert bitwise_equal(params, their_params) and bitwise_equal(target.state[params[0]], their_state)


# --- deep nesting ----------------------------------------------------------------------------------------------


def _deep(levels):
    value = []
    for _ in range(levels):
        value = [value]
    return value


@pytest.mark.parametrize("where", ["state", "group"])
def test_state_nested_20000_deep_is_a_value_error(where):
    sd = _trained(foreach=False).state_dict()
    if where == "state":
        sd["state"][0]["history"] = _deep(20000)
        match = r"group 0, param 0, state key 'history': nested more than 64 levels deep"
    else:
        sd["param_groups"][0]["schedule"] = _deep(20000)
        match = r"param group 0, key 'schedule': nested more than 64 levels deep"
    _refused(_trained(foreach=False), sd, ValueError, match)


def test_saving_state_nested_20000_deep_is_a_value_error(tmp_path):
    with pytest.raises(ValueError, match="nested too deeply to pickle"):
        optimshift.save({"history": _deep(20000)}, tmp_path / "deep.pt")
    assert list(tmp_path.iterdir()) == [], "nothing written, no temporary left"


def test_a_file_nested_20000_deep_names_the_file(tmp_path):
    """A crafted file (torch.save itself cannot write one this deep): load works, load_state_dict refuses."""
    sd = _trained(foreach=False).state_dict()
    sd["state"][0]["history"] = "DEEP-MARKER"
    path = tmp_path / "deep.pt"
    optimshift.save(sd, path)
    levels = 20000
    nest_in_place(path, "DEEP-MARKER", levels)
    loaded = optimshift.load(path)
    depth, v = 0, loaded["state"][0]["history"]
    while v:
        depth, v = depth + 1, v[0]
    assert depth == levels - 1
    _refused(
        _trained(foreach=False),
        path,
        ValueError,
        rf"Adam: load_state_dict: {path}: group 0, param 0, state key 'history': nested more than 64 levels",
    )
