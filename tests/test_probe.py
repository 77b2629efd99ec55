"""The placement probe (optimshift._probe): it can never take the process down, its cache key covers everything
that can change what it observes, and it observes where a step reads a group's tensors."""

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


@pytest.mark.parametrize(
    "cls, changes",
    [
        (O.Adam, {"lr": 0.01, "weight_decay": 0.1, "eps": 1e-6, "betas": (0.8, 0.9), "amsgrad": True}),
        (O.SGD, {"momentum": 0.9, "dampening": 0.1, "weight_decay": 0.1, "lr": torch.tensor(0.5)}),
        (O.Adagrad, {"lr_decay": 0.1, "initial_accumulator_value": 0.5, "weight_decay": 0.1}),
        (O.LBFGS, {"line_search_fn": "strong_wolfe", "history_size": 3, "max_iter": 2}),
    ],
)
def test_probe_key_covers_every_hyperparameter(cls, changes):
    """Not only the boolean flags: a non-boolean hyperparameter (weight_decay decides whether grad.add runs, and
    so whether a differentiable step records an edge) or a tensor's value changes the key."""
    from optimshift import _probe

    base = _group(cls)
    for key, value in changes.items():
        assert _probe.probe_key(cls, base, 2) != _probe.probe_key(cls, {**base, key: value}, 2), key
    lr = _group(O.Adam, lr=torch.tensor(0.01))
    assert _probe.probe_key(O.Adam, lr, 2) != _probe.probe_key(O.Adam, {**lr, "lr": torch.tensor(0.02)}, 2)
    assert _probe.probe_key(cls, base, 2) == _probe.probe_key(cls, dict(base), 2)


def test_probe_runs_once_per_distinct_group(monkeypatch):
    """What one configuration observed is never served to another that differs only in a number."""
    from optimshift import _probe

    runs = []
    real = _probe._observe
    monkeypatch.setattr(_probe, "_observe", lambda *a: runs.append(a[1]["weight_decay"]) or real(*a))
    _probe.clear_cache()
    for wd in (0.0, 0.1, 0.0, 0.1):
        _probe.probe(O.Adagrad, _group(O.Adagrad, weight_decay=wd, differentiable=True), 2)
    assert runs == [0.0, 0.1]


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
