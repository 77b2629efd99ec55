"""A class torch.optim does not define, with no registered policy (issue 30, item 7): the probe runs a throwaway
step of the class itself, as of torch's, and counts what each host scalar would cost on the device."""

from __future__ import annotations

import torch

from optimshift import _probe


class Counter(torch.optim.Optimizer):
    """SGD with momentum whose step size shrinks with a 0-dim host counter, read with ``.item()`` each step."""

    def __init__(self, params, lr=0.1, momentum=0.9):
        super().__init__(params, {"lr": lr, "momentum": momentum})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                if not state:
                    state["count"] = torch.tensor(0.0)  # on the host, as a fresh optimizer keeps it
                    state["buf"] = torch.zeros_like(p)
                state["count"] += 1
                scale = 1.0 / state["count"].item()  # on the device: one host sync per param per step
                state["buf"].mul_(group["momentum"]).add_(p.grad)
                p.add_(state["buf"], alpha=-group["lr"] * scale)


def test_the_probe_counts_the_device_reads_of_each_host_scalar():
    group = {"lr": 0.1, "momentum": 0.9}
    observed = _probe.probe(Counter, group, 1)
    assert observed is not None and observed.state == {"count": False}
    assert dict(observed.reads) == {"count": 1}
    assert _probe.unprobed(Counter, group, 1) is None


class Converging(torch.optim.Optimizer):
    """Iterates until a device value converges: on the probe's stand-ins (no values) it never would."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                if not state:
                    state["count"] = torch.tensor(0.0)
                state["count"] += 1
                while (p.grad * p.grad).sum().item() > 0.1:
                    p.grad.mul_(0.5)


def test_a_probe_step_that_would_never_end_is_stopped(monkeypatch):
    monkeypatch.setattr(_probe, "MAX_READS", 50)
    _probe.clear_cache()
    observed = _probe.probe(Converging, {"lr": 0.1}, 1)
    assert observed is not None and observed.state == {"count": False}
    assert observed.error is not None and "host reads" in observed.error


def test_the_throwaway_is_given_no_mutable_value_of_the_users_group():
    class Configured(torch.optim.Optimizer):
        def __init__(self, params, lr=0.1, config=None, betas=(0.9, 0.99)):
            super().__init__(params, {"lr": lr, "config": config, "betas": betas})

    config = {"warmup": 3}
    built = _probe.built_kwargs(Configured, {"lr": 0.2, "config": config, "betas": [0.8, 0.9], "params": []})
    assert built == {"lr": 0.1, "betas": [0.9, 0.99]}  # (the dict: the constructor's default stands in)
