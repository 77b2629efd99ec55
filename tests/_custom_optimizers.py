"""Third-party optimizer classes the tests share: classes torch.optim does not define, with no registered policy,
whose 0-dim state the probe places (issue 30, item 7)."""

from __future__ import annotations

import torch


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


class Placed(torch.optim.Optimizer):
    """Its counter lives on the param's device for matrices, or where ``device_counter`` says, else on the host."""

    def __init__(self, params, lr=0.1, device_counter=False):
        super().__init__(params, {"lr": lr, "device_counter": device_counter})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                if not state:
                    on_device = group["device_counter"] or p.dim() >= 2
                    state["count"] = torch.zeros((), device=p.device) if on_device else torch.zeros(())
                state["count"] += 1
                p.add_(p.grad, alpha=-group["lr"])


class Fp32Moments(torch.optim.Adam):
    """An Adam subclass with a step of its own that keeps float32 moments for params of any dtype."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                st = self.state[p]
                if not st:
                    st["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                st["exp_avg"].mul_(0.9).add_(p.grad.float(), alpha=0.1)
                p.add_(st["exp_avg"].to(p.dtype), alpha=-group["lr"])


class CountedSGD(torch.optim.SGD):
    """SGD with a step of its own: a 0-dim host counter per param, read with ``.item()``, then SGD's own step."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                if "count" not in state:
                    state["count"] = torch.zeros(())  # on the host, as a fresh optimizer keeps it
                state["count"] += 1
                group.setdefault("seen", 0.0)
                group["seen"] = max(group["seen"], state["count"].item())  # a host sync per param on a device
        return super().step(closure)


class WideCounter(torch.optim.Optimizer):
    """MADGRAD's shape: an optimizer-wide counter ``state["k"]`` (one element, on the host from ``__init__``) read
    with ``.item()`` each step."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, {"lr": lr})
        self.state["k"] = torch.tensor([0])

    @torch.no_grad()
    def step(self, closure=None):
        k = self.state["k"]
        k += 1
        scale = 1.0 / k.item()  # on the device: one host sync per step
        for group in self.param_groups:
            for p in group["params"]:
                p.add_(p.grad, alpha=-group["lr"] * scale)


class CountedAdam(torch.optim.Adam):
    """A subclass stepping with Adam's own step, keeping an optimizer-wide host counter ``state["n"]`` (one element,
    made in ``__init__``) that a step post-hook counts steps in."""

    def __init__(self, params, **kwargs):
        super().__init__(params, **kwargs)
        self.state["n"] = torch.tensor([0])
        self.register_step_post_hook(lambda opt, args, kwargs: opt.state["n"].add_(1))


class WideScale(torch.optim.Optimizer):
    """TRAC's shape: an optimizer-wide one-element tensor ``state["s"]`` made on the params' device, used on it."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        params = [p for group in self.param_groups for p in group["params"]]
        if "s" not in self.state:
            self.state["s"] = torch.ones(1, device=params[0].device)
        self.state["s"].mul_(0.5)
        for p in params:
            p.sub_(p.grad * self.state["s"])  # (a one-element host tensor here mixes devices)


class ScaledByLr(torch.optim.Optimizer):
    """A third-party class that takes a tensor ``lr`` and uses it as a tensor on the params' device."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                p.sub_(p.grad * group["lr"])


class Averaged(torch.optim.SGD):
    """SGD that keeps a running average of each param in optimizer-wide mappings keyed by the params, made at its
    first step and looked up by param after: a flat ``state["ema"] = {param: tensor}``, and TRAC's shape
    (``state["_trac"]``: plain keys and param keys in one dict, ``{param: {"ref": tensor}}``)."""

    def __init__(self, params, lr=0.1, kind=dict, **flags):
        super().__init__(params, lr=lr, momentum=0.9, **flags)
        self.kind = kind

    @torch.no_grad()
    def step(self, closure=None):
        params = [p for group in self.param_groups for p in group["params"]]
        if "ema" not in self.state:
            self.state["ema"] = self.kind((p, p.detach().clone()) for p in params)
            self.state["_trac"] = {"s": torch.zeros(1, device=params[0].device)}
            self.state["_trac"].update((p, {"ref": p.detach().clone()}) for p in params)
        for p in params:
            self.state["ema"][p].lerp_(p, 0.1)  # (a KeyError for a param the mapping does not know)
            self.state["_trac"]["s"].add_((p - self.state["_trac"][p]["ref"]).sum())
        return super().step(closure)


class CopiesByKeyword(torch.optim.Optimizer):
    """Keeps each param's previous value, copied in by ``copy_(other=...)`` (Tensor.copy_'s keyword), then steps
    by ``alpha=-lr``: a device lr is read as a number once a param."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                prev = self.state[p].setdefault("prev", torch.zeros_like(p))
                prev.copy_(other=p)
                p.add_(p.grad, alpha=-group["lr"])
