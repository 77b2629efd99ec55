"""The probes (optimshift._probe): they can never take the process down, their one cache key covers everything
that can change what a throwaway step observes and never a float's value, and the placement probe observes where a
step reads a group's tensors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import optimshift

O = torch.optim

# The configurations whose probe aborted the process (SIGABRT from an autograd node over a fake cuda tensor):
# differentiable=True with an op that records an autograd edge (issue 13).
CRASHED = [
    ("Adagrad", {"weight_decay": 0.1}),
    ("Adam", {"weight_decay": 0.1}),
    ("Adamax", {"weight_decay": 0.1}),
    ("NAdam", {"weight_decay": 0.1}),
    ("RAdam", {"weight_decay": 0.1}),
    ("RMSprop", {"momentum": 0.9}),
    ("SGD", {"momentum": 0.9, "nesterov": True}),
    ("SGD", {"weight_decay": 0.1}),
]

_CHILD = r"""
import json, sys, torch, optimshift
for name, kwargs in json.loads(sys.argv[1]):
    cls = getattr(torch.optim, name)
    # Params that do not require grad: a differentiable step refuses in-place updates of leaves that do.
    p = torch.nn.Parameter(torch.rand(2, 3), requires_grad=False)
    opt = cls([p], differentiable=True, **kwargs)
    p.grad = torch.rand(2, 3)
    opt.step()  # state with 0-dim entries: every operation below probes
    assert optimshift.check(opt).ok
    optimshift.move(opt, "cpu")
    optimshift.load_state_dict(opt, opt.state_dict())
    print("survived", name, flush=True)
"""


def _child_env() -> dict:
    env = dict(os.environ)
    src = str(Path(optimshift.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join([src, env.get("PYTHONPATH", "")])
    return env


def test_probe_cannot_abort_the_process_for_differentiable_configurations():
    """check, move and load_state_dict used to die with SIGABRT on these (no except can catch it): run them in a
    child process, so that a regression fails this test instead of killing the run."""
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps(CRASHED)],
        env=_child_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    survived = [line.split()[1] for line in proc.stdout.splitlines() if line.startswith("survived")]
    assert proc.returncode == 0, (
        f"the child died (exit code {proc.returncode}) after {survived}:\n{proc.stderr[-2000:]}"
    )
    assert survived == [name for name, _ in CRASHED]


def test_probe_step_records_no_autograd_graph(monkeypatch):
    """Even a differentiable step with weight decay and nesterov momentum builds no autograd node in the probe:
    it runs in inference mode, over params that do not require grad."""
    import torch.optim.sgd as sgd_module

    from optimshift import _probe

    seen = []
    real = sgd_module.sgd

    def spy(params, grads, momentum_buffer_list, *args, **kwargs):
        out = real(params, grads, momentum_buffer_list, *args, **kwargs)
        seen.append(
            (
                torch.is_inference_mode_enabled(),
                [p.requires_grad for p in params],
                [b.grad_fn for b in momentum_buffer_list if b is not None],
            )
        )
        return out

    monkeypatch.setattr(sgd_module, "sgd", spy)
    _probe.clear_cache()
    group = O.SGD(
        [torch.nn.Parameter(torch.zeros(2, 2))],
        lr=0.1,
        momentum=0.9,
        nesterov=True,
        weight_decay=0.1,
        differentiable=True,
    ).param_groups[0]
    assert _probe.probe(O.SGD, group, 2) is not None
    assert seen and all(inference and not any(grads) and not any(fns) for inference, grads, fns in seen)


def _group(cls, **kwargs):
    return cls([torch.nn.Parameter(torch.zeros(2, 2))], **kwargs).param_groups[0]


def _key(cls, ndim=2, **entries):
    from optimshift import _probe

    return _probe.probe_key(cls, {**_group(cls), **entries}, ndim)


@pytest.mark.parametrize(
    "cls, base, changes",
    [
        (O.Adam, {"weight_decay": 0.1}, {"lr": 0.01, "eps": 1e-6, "betas": (0.8, 0.9), "weight_decay": 0.2}),
        (O.SGD, {"momentum": 0.9, "dampening": 0.1}, {"lr": 0.5, "momentum": 0.5, "dampening": 0.2}),
        (
            O.Adagrad,
            {"lr_decay": 0.1, "initial_accumulator_value": 0.1},
            {"lr_decay": 0.2, "initial_accumulator_value": 0.7},
        ),
        (O.LBFGS, {"lr": 2.0}, {"lr": 3.0, "tolerance_grad": 1e-3, "tolerance_change": 0.5}),
        (O.Rprop, {}, {"etas": (0.3, 1.5), "step_sizes": (1e-3, 50)}),
    ],
)
def test_probe_key_never_holds_a_float_value(cls, base, changes):
    """Floats count by their class against 0 and 1 (what torch.optim's steps and constructors branch on), never
    by value: what an LR or momentum scheduler changes leaves the key as it was, and so does the value of a
    tensor lr or betas (changed in place by a CUDA-graph schedule; reading a device tensor would cost a sync)."""
    for key, value in changes.items():
        assert _key(cls, **base) == _key(cls, **{**base, key: value}), key
    tensor_lr = _key(O.Adam, lr=torch.tensor(0.01), betas=(torch.tensor(0.9), torch.tensor(0.99)))
    assert tensor_lr == _key(O.Adam, lr=torch.tensor(0.02), betas=(torch.tensor(0.8), torch.tensor(0.9)))


# Each change, from the fresh group of `cls` (plus `base`), that can change what a throwaway step observes.
INVALIDATING = [
    ("class", O.Adam, {}, {"__class__": O.AdamW}),
    ("fused", O.Adam, {}, {"fused": True}),
    ("capturable", O.Adam, {}, {"capturable": True}),
    ("foreach True", O.Adam, {}, {"foreach": True}),
    ("foreach False", O.Adam, {}, {"foreach": False}),  # None: torch's choice
    ("differentiable", O.Adam, {}, {"differentiable": True}),
    ("amsgrad", O.Adam, {}, {"amsgrad": True}),
    ("maximize", O.Adam, {}, {"maximize": True}),
    ("weight_decay 0 -> > 0", O.Adam, {}, {"weight_decay": 0.01}),
    ("lr > 0 -> 0", O.Adam, {}, {"lr": 0.0}),
    ("lr > 0 -> < 0", O.Adam, {}, {"lr": -0.01}),
    ("lr (0, 1) -> 1", O.Adam, {}, {"lr": 1.0}),
    ("lr (0, 1) -> > 1", O.Adam, {}, {"lr": 1.5}),
    ("lr nan", O.Adam, {}, {"lr": float("nan")}),
    ("lr inf", O.Adam, {}, {"lr": float("inf")}),
    ("lr float -> int", O.Adam, {"lr": 1.0}, {"lr": 1}),
    ("beta1 0", O.Adam, {}, {"betas": (0.0, 0.999)}),
    ("lr a tensor", O.Adam, {}, {"lr": torch.tensor(0.001)}),
    ("lr tensor dtype", O.Adam, {"lr": torch.tensor(0.001)}, {"lr": torch.tensor(0.001, dtype=torch.float64)}),
    ("lr tensor shape", O.Adam, {"lr": torch.tensor(0.001)}, {"lr": torch.tensor([0.001])}),
    ("lr tensor device", O.Adam, {"lr": torch.tensor(0.001)}, {"lr": torch.tensor(0.001, device="meta")}),
    ("beta1 a tensor", O.Adam, {}, {"betas": (torch.tensor(0.9), 0.999)}),
    ("beta2 a tensor", O.Adam, {}, {"betas": (0.9, torch.tensor(0.999))}),
    ("betas a list", O.Adam, {}, {"betas": [0.9, 0.999]}),
    ("momentum 0 -> > 0", O.SGD, {"lr": 0.1}, {"momentum": 0.9}),
    ("nesterov", O.SGD, {"lr": 0.1, "momentum": 0.9}, {"nesterov": True}),
    ("dampening 0 -> > 0", O.SGD, {"lr": 0.1, "momentum": 0.9}, {"dampening": 0.1}),
    ("momentum (RMSprop)", O.RMSprop, {}, {"momentum": 0.5}),
    ("centered", O.RMSprop, {}, {"centered": True}),
    ("beta2_decay -> 0", O.Adafactor, {}, {"beta2_decay": 0.0}),
    ("d 1 -> > 1", O.Adafactor, {}, {"d": 1.5}),
    ("eps1 None -> number", O.Adafactor, {}, {"eps": (1e-30, 1e-3)}),
    ("max_iter (an int: by value)", O.LBFGS, {}, {"max_iter": 1}),
    ("line_search_fn", O.LBFGS, {}, {"line_search_fn": "strong_wolfe"}),
    ("tolerance_change 0", O.LBFGS, {}, {"tolerance_change": 0.0}),
    ("param rank", O.Adam, {}, {"__ndim__": 1}),
    ("a key no fresh group holds", O.Adam, {}, {"extra": 0.5}),
]


@pytest.mark.parametrize("what, cls, base, change", INVALIDATING, ids=[c[0] for c in INVALIDATING])
def test_each_key_component_that_matters_invalidates(what, cls, base, change):
    """Class, flags, bools, ints and strings by value, a float's class against 0 and 1, which entries are tensors
    (and their device, dtype and shape), the param rank: each is in the key. Param ranks above 2 are one rank."""
    change = dict(change)
    other_cls = change.pop("__class__", cls)
    ndim = change.pop("__ndim__", 2)
    assert _key(cls, **base) != _key(other_cls, ndim, **{**base, **change})
    assert _key(cls, 2, **base) == _key(cls, 5, **base)


def test_an_lr_scheduler_changing_lr_runs_no_probe_again(monkeypatch):
    """Issue 18: move, check and load_state_dict, 16 param groups, after each step of a scheduler that changes
    every group's lr (and one cycling betas/momentum, as OneCycleLR does), run no throwaway step again; a change
    of kind (lr reaching 0) runs them once more."""
    from optimshift import _probe

    runs = []
    for name in ("_observe", "_try", "_spec", "_steps_without"):
        real = getattr(_probe, name)
        monkeypatch.setattr(_probe, name, lambda *a, _real=real, _name=name: runs.append(_name) or _real(*a))

    for cls, kwargs in ((O.Adam, {}), (O.SGD, {"momentum": 0.9, "nesterov": True}), (O.Adagrad, {})):
        _probe.clear_cache()
        params = [[torch.nn.Parameter(torch.randn(3, 2)) for _ in range(2)] for _ in range(16)]
        opt = cls([{"params": ps, "lr": 0.01 * (i + 1)} for i, ps in enumerate(params)], **kwargs)
        sched = O.lr_scheduler.ExponentialLR(opt, gamma=0.5)
        for p in (p for ps in params for p in ps):
            p.grad = torch.ones_like(p)
        opt.step()

        def cycle():
            optimshift.move(opt)
            assert optimshift.check(opt).ok
            optimshift.load_state_dict(opt, opt.state_dict())

        cycle()
        assert runs, "the first cycle probes"
        runs.clear()
        for step in range(5):
            sched.step()
            for group in opt.param_groups:
                if "betas" in group:
                    group["betas"] = (0.85 + 0.01 * step, group["betas"][1])
                if group.get("momentum"):
                    group["momentum"] = 0.85 + 0.01 * step
            cycle()
        assert runs == [], (cls.__name__, runs)
        for group in opt.param_groups:
            group["lr"] = 0.0
        cycle()
        assert runs, "lr = 0 is another class of value: probed once more"


def test_a_throwaway_step_is_built_from_the_key_alone():
    """What the throwaway optimizer is given depends only on the key: floats of one class are built as one value
    (the default where it is of that class), tensors as numbers it never reads, and what it is built with passes
    the constructor's checks exactly when the group's values would."""
    from optimshift import _probe

    a = {**_group(O.Adam), "lr": 0.02, "betas": (torch.tensor(0.8), 0.95), "weight_decay": 0.3}
    b = {**_group(O.Adam), "lr": 0.5, "betas": (torch.tensor(0.7), 0.9), "weight_decay": 0.01}
    assert _probe.probe_key(O.Adam, a, 2) == _probe.probe_key(O.Adam, b, 2)
    assert _probe.built_kwargs(O.Adam, a) == _probe.built_kwargs(O.Adam, b)
    built = _probe.built_kwargs(O.Adam, a)
    assert built["lr"] == 1e-3 and built["betas"] == (0.9, 0.999) and built["weight_decay"] == 0.5
    for cls, group in [
        (O.Rprop, {"etas": (0.3, 1.7), "step_sizes": (1e-4, 10.0)}),
        (O.Adafactor, {"d": 3.0, "beta2_decay": -0.3}),
        (O.SGD, {"lr": 0.3, "momentum": 0.3, "nesterov": True}),
        (O.Adadelta, {"rho": 1.0}),
    ]:
        cls([torch.nn.Parameter(torch.zeros(2, 2))], **_probe.built_kwargs(cls, {**_group(cls), **group}))


def test_a_code_path_a_value_selects_is_observed_for_each_class(monkeypatch):
    """SGD keeps a momentum buffer only for momentum != 0: the state spec (what a load checks) differs between
    momentum 0 and 0.9, and momentum 0.5 is served what 0.9 observed, without a run."""
    from optimshift import _probe

    runs = []
    real = _probe._spec
    monkeypatch.setattr(_probe, "_spec", lambda *a: runs.append(a[1]["momentum"]) or real(*a))
    _probe.clear_cache()
    without = _probe.expected_state(O.SGD, _group(O.SGD, lr=0.1, momentum=0), 2)
    with_momentum = _probe.expected_state(O.SGD, _group(O.SGD, lr=0.1, momentum=0.9), 2)
    assert "momentum_buffer" not in without.keys and "momentum_buffer" in with_momentum.shaped
    assert _probe.expected_state(O.SGD, _group(O.SGD, lr=0.2, momentum=0.5), 2) is with_momentum
    assert runs == [0, 0.5]  # (built with the class's value: 0.5 between 0 and 1, SGD's default being 0)


def test_the_one_cache_is_bounded_and_drops_the_least_recently_used(monkeypatch):
    from optimshift import _probe

    runs = []
    real = _probe._observe
    monkeypatch.setattr(_probe, "_observe", lambda *a: runs.append((a[1]["amsgrad"], a[1]["maximize"])) or real(*a))
    monkeypatch.setattr(_probe, "CACHE_SIZE", 3)
    _probe.clear_cache()
    groups = [_group(O.Adam, amsgrad=a, maximize=m) for a in (False, True) for m in (False, True)]
    for g in groups[:3]:
        _probe.probe(O.Adam, g, 2)
    _probe.probe(O.Adam, groups[0], 2)  # used again: now the most recent
    _probe.probe(O.Adam, groups[3], 2)  # a fourth: the least recently used (groups[1]) goes
    assert len(_probe._cache) == 3
    runs.clear()
    _probe.probe(O.Adam, groups[0], 2)
    _probe.probe(O.Adam, groups[1], 2)
    assert runs == [(False, True)]


@pytest.mark.parametrize(
    "cls, kwargs, host_read",
    [
        # Adam's single-tensor capturable path passes 1 - beta2 to addcmul_ as a number; beta1 and lr stay tensors.
        (O.Adam, {"capturable": True, "foreach": False}, {("betas", 1)}),
        (O.Adam, {"capturable": True, "foreach": True}, {("betas", 0), ("betas", 1)}),
        # Adadelta and RMSprop (single tensor) add with alpha=-lr, also when capturable.
        (O.Adadelta, {"capturable": True, "foreach": False}, {("lr", None)}),
        (O.RMSprop, {"capturable": True, "foreach": False}, {("lr", None)}),
        # Their foreach paths and fused kernels keep lr a tensor (a fused kernel reads a host lr with .item()).
        (O.RMSprop, {"capturable": True, "foreach": True}, set()),
        (O.Adam, {"fused": True}, set()),
        # Non-capturable single-tensor Adam divides lr by a Python bias correction and passes it as a number.
        (O.Adam, {"foreach": False}, {("lr", None)}),
    ],
)
def test_probe_observes_which_group_tensors_a_step_reads_on_the_host(cls, kwargs, host_read):
    from optimshift import _probe

    tensors = {"lr": torch.tensor(0.01)}
    if cls is O.Adam and kwargs.get("capturable"):
        tensors["betas"] = (torch.tensor(0.9), torch.tensor(0.99))
    observed = _probe.probe(cls, _group(cls, **tensors, **kwargs), 2)
    assert observed is not None
    assert {path for path, verdict in observed.group.items() if verdict == _probe.HOST_READ} == host_read


def _flaky(where):
    """A third-party class (Counter: a 0-dim host counter) whose probe fails, building it or in its step, with each
    error put in the list returned, once each, then works."""
    from _custom_optimizers import Counter

    pending: list[BaseException] = []

    class Flaky(Counter):
        def __init__(self, params, lr=0.1, momentum=0.9):
            if where == "build" and pending:
                raise pending.pop()
            super().__init__(params, lr, momentum)

        def step(self, closure=None):
            if where == "step" and pending:
                raise pending.pop()
            return super().step(closure)

    return Flaky, pending


_PASSING = [
    MemoryError(),
    torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB"),
    RecursionError("maximum recursion depth exceeded"),
    KeyboardInterrupt(),
]


@pytest.mark.parametrize("error", _PASSING, ids=lambda e: type(e).__name__)
@pytest.mark.parametrize("where", ["build", "step"])
def test_a_probe_that_fails_for_a_reason_not_the_class_s_is_not_remembered(where, error):
    """Out of memory, a stack too deep, an interrupt: the probe cached any failure as the class's answer ("could not
    build", or a step that raised and made no state), so one unlucky moment left the class placed by guesses for the
    rest of the process. Out of memory and an interrupt propagate; a RecursionError is answered as not probed, this
    time only; nothing is cached: the next ask probes."""
    from optimshift import _probe

    cls, pending = _flaky(where)
    group = {"params": [], "lr": 0.1, "momentum": 0.9}
    pending.append(error)
    if isinstance(error, RecursionError):
        assert "RecursionError" in (_probe.unprobed(cls, group, 1) or "")
    else:
        with pytest.raises(type(error)):
            _probe.probe(cls, group, 1)
    assert not pending
    observed = _probe.probe(cls, group, 1)
    assert observed is not None and observed.error is None and observed.state == {"count": False}


@pytest.mark.parametrize("where", ["counted", "added"])
def test_a_ctrl_c_as_a_probe_step_counts_itself_leaves_torchs_foreach_default_as_it_was(where):
    """The count of probe steps that let torch's default foreach take the fake param was raised before the try
    that lowers it: a Ctrl-C landing once its lock was released (``counted``) left it one too high for the rest of
    the process, and ``FakeTensor`` in torch's ``_foreach_supported_types`` (a fake tensor of the user's then taking
    the foreach default); one landing as the type was appended (``added``) did the same."""
    import threading

    import torch.optim.optimizer as _optimizer
    from torch._subclasses.fake_tensor import FakeTensor

    from optimshift import _probe

    class Interrupting:
        """``_foreach_lock``, raising KeyboardInterrupt once as its first hold is released."""

        def __init__(self):
            self.lock, self.exits = threading.Lock(), 0

        def __enter__(self):
            self.lock.acquire()

        def __exit__(self, *exc):
            self.lock.release()
            self.exits += 1
            if self.exits == 1:
                raise KeyboardInterrupt

    class Appending(list):
        def append(self, item):
            super().append(item)
            raise KeyboardInterrupt

    types = _optimizer._foreach_supported_types
    before, holders = list(types), _probe._foreach_holders
    assert FakeTensor not in types and holders == 0
    patch = pytest.MonkeyPatch()
    try:
        if where == "counted":
            patch.setattr(_probe, "_foreach_lock", Interrupting())
        else:
            patch.setattr(_optimizer, "_foreach_supported_types", Appending(types))
        with pytest.raises(KeyboardInterrupt):
            with _probe._fake_param_takes_default_foreach():
                pass
        assert _probe._foreach_holders == 0 and not _probe._foreach_added
        assert FakeTensor not in _optimizer._foreach_supported_types
    finally:
        patch.undo()
        _probe._foreach_holders, _probe._foreach_added = 0, False
        leaked = list(types)
        types[:] = before  # (the next tests see torch's list as it was, whatever this one found)
    assert leaked == before


def test_an_error_of_the_class_s_own_is_remembered():
    """A step that raises on the probe's inputs raises again on them: its error is the class's answer, cached (the
    next ask runs no step)."""
    from optimshift import _probe

    cls, pending = _flaky("step")
    group = {"params": [], "lr": 0.1, "momentum": 0.9}
    pending.append(ValueError("this class needs a closure"))
    assert _probe.probe(cls, group, 1).error == "ValueError: this class needs a closure"
    assert _probe.probe(cls, group, 1).error == "ValueError: this class needs a closure"  # (not stepped again)


def test_a_move_that_met_out_of_memory_in_the_probe_changes_nothing_and_the_next_one_is_probed(sim):
    """The probe's out of memory stops the move that asked, before anything changed (it was taken as the class's
    answer: a step that raised and made no state, cached, and the class placed by guesses from then on); the next
    move asks the probe again and keeps the class's host counter where a fresh optimizer keeps it."""
    cls, pending = _flaky("step")
    params = [torch.nn.Parameter(torch.ones(3, device=sim)), torch.nn.Parameter(torch.ones(2, 2, device=sim))]
    opt = cls(params)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    before = {id(t): t.device for p in params for t in opt.state[p].values()}
    pending.append(torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB"))
    with pytest.raises(torch.cuda.OutOfMemoryError):
        optimshift.move(opt, "cpu")
    assert {id(t): t.device for p in params for t in opt.state[p].values()} == before
    optimshift.move(opt, "cpu")
    optimshift.move(opt, sim)
    assert {id(t): t.device for p in params for t in opt.state[p].values()} == before
    assert all(opt.state[p]["count"].device.type == "cpu" for p in params)
    report = optimshift.check(opt)
    assert report.ok and report.findings == []


class _HostMaster(torch.optim.Optimizer):
    """Keeps master weights on the host and copies them into the params with ``torch._foreach_copy_``, whose
    per-tensor fallback crosses devices (as ``copy_`` does)."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            for p in params:
                if not self.state[p]:
                    self.state[p]["master"] = p.detach().to("cpu", copy=True)
            masters = [self.state[p]["master"] for p in params]
            torch._foreach_add_(masters, [p.grad.to("cpu") for p in params], alpha=-group["lr"])
            torch._foreach_copy_(params, masters)


def test_the_probe_s_foreach_device_check_lets_a_copy_cross_devices():
    """The probe's foreach ops raise for a host tensor beside device ones, as a device's do, but a copy is no mix:
    a step copying host master weights into the params ran on the parent's probe and must still run."""
    from optimshift import _probe

    _probe.clear_cache()
    observed = _probe.probe(_HostMaster, {"lr": 0.1}, 1)
    assert observed is not None and observed.error is None


@pytest.mark.parametrize("flags", [{"foreach": False}, {"foreach": True}, {"capturable": True}])
def test_a_step_lifting_a_number_onto_the_param_s_device_is_probed(flags):
    """ASGD's ``torch.as_tensor(lr, device=p.device)`` (its ``eta``) lifts a number onto the fake device, a constant a
    CPU-only build cannot make there: the probe's step stopped at the state it was making, every time alike."""
    group = O.ASGD([torch.nn.Parameter(torch.zeros(2))], **flags).param_groups[0]
    observed = optimshift._probe.probe(O.ASGD, group, 1)
    assert observed is not None and observed.error is None
    assert observed.state == {"step": True, "eta": True, "mu": True}
