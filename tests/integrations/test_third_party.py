"""The core guarantees over every optimizer in ``pytorch_optimizer``'s registry, on the simulated accelerator.

For each class that constructs and steps on the host over a small model:

- after K host steps, ``move`` to the device: placement (state and param-group tensors) equals a fresh
  optimizer of the same class and flags trained on the device from the start, and no dtype changed;
- host syncs over the next step equal the fresh optimizer's;
- host -> device -> host round trip: every value bitwise unchanged, every container of the same type, the
  per-param state dicts the same objects.

The policies of ``optimshift.integrations.third_party`` are registered for the whole module. Classes that
cannot be driven by a plain ``step()`` here are skipped, and classes whose state optimshift cannot reach are
marked ``xfail(strict=True)``, each with its precise reason: a fix in the core makes them fail loudly.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import warnings
from collections import deque
from typing import Any

import pytest
import torch
from _integrations_support import layout

import optimshift

pytorch_optimizer = pytest.importorskip("pytorch_optimizer")

import optimshift.integrations.third_party as third_party  # noqa: E402

K, N = 2, 1  # host steps before the move, device steps counted after it
SHAPES = [(4, 3), (3,), (2, 3)]

# How to build the few classes that need more than ``cls(params)``.
MUON_STYLE = {"adago", "adamuon", "muon", "muonclip", "normuon"}  # groups must say use_muon (2-D params only)
FROM_MODEL = {"adammini"}  # built from the module (named_parameters)
KWARGS: dict[str, dict[str, Any]] = {
    "bsam": {"num_data": 8},
    "ranger21": {"num_iterations": 10},
    "lbfgs": {"max_iter": 2, "history_size": 3},
    "spectralsphere": {"power_iteration_steps": 2, "msign_steps": 2, "solver_max_iterations": 3},
}
SHAPES_FOR = {
    "spectralsphere": [(4, 3), (2, 3)],  # "only supports 2D parameters"
    "lorarite": [(2, 4), (3, 2)],  # one LoRA pair: A (rank 2 x in 4), B (out 3 x rank 2)
}
CLOSURE = {"alig", "bsam", "lbfgs"}  # step(closure) only
HESSIAN = {"adahessian", "sophiah"}  # need backward(create_graph=True)

SKIP = {
    "demo": "DeMo all-gathers momentum over torch.distributed and needs `einops` (not a test dependency); "
    "pytorch_optimizer itself excludes it from coverage",
    "distributedmuon": "DistributedMuon needs an initialized torch.distributed process group whose backend "
    "handles the device; gloo has none for the simulated one ('No backend type associated "
    "with device type sim'): check it on real GPUs with NCCL",
    "lomo": "LOMO updates params inside fused_backward(loss, lr) hooks and step() raises NotImplementedError; "
    "it holds no optimizer state",
    "adalomo": "AdaLOMO updates params inside fused_backward(loss, lr) hooks and step() raises "
    "NotImplementedError; its moments live in attributes (exp_avg_sq*), not in optimizer.state",
}
XFAIL = {
    "magma": (
        RuntimeError,
        "Magma keeps per-param tensors in the private dict `_state`, keyed by id(param), "
        "outside optimizer.state and param_groups: they stay on the host and the next "
        "device step mixes devices",
    ),
    "sara": (
        RuntimeError,
        "SaRA caches index tensors derived from state['mask'] in the private dict "
        "`_mask_indices` (its load_state_dict clears it; a move cannot): the stale host "
        "indices meet device params in index_select",
    ),
}


@pytest.fixture(scope="module", autouse=True)
def _policies():
    third_party.register()
    yield
    third_party.unregister()


class Net(torch.nn.Module):
    def __init__(self, shapes):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.ps = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes)


def _build(name: str, net: Net) -> torch.optim.Optimizer:
    cls = pytorch_optimizer.load_optimizer(name)
    params = list(net.ps)
    if name in MUON_STYLE:
        return cls(
            [
                {"params": [p for p in params if p.ndim == 2], "use_muon": True},
                {"params": [p for p in params if p.ndim != 2], "use_muon": False},
            ]
        )
    if name in FROM_MODEL:
        return cls(net)
    return cls(params, **KWARGS.get(name, {}))


def _train(name: str, net: Net, opt: torch.optim.Optimizer, steps: range) -> None:
    params = list(net.ps)
    for step in steps:

        @torch.enable_grad()
        def closure():
            opt.zero_grad()
            loss = 0
            for i, p in enumerate(params):
                target = torch.randn(p.shape, generator=torch.Generator().manual_seed(100 * step + i)).to(p.device)
                loss = loss + ((p - target) ** 2).sum() * (i + 1)
            loss.backward(create_graph=name in HESSIAN)
            return loss

        closure()  # grads first, as a training loop has them (BSAM creates its state only for params with grads)
        if name in CLOSURE:
            opt.step(closure)
        else:
            opt.step()


def _trained(name: str, device: torch.device, steps: int = K) -> tuple[Net, torch.optim.Optimizer]:
    net = Net(SHAPES_FOR.get(name, SHAPES)).to(device)
    opt = _build(name, net)
    _train(name, net, opt, range(steps))
    return net, opt


def _state_of(opt: torch.optim.Optimizer) -> dict:
    """Everything the optimizer holds, keyed by (group, index) for state and (group, key) for group entries."""
    out: dict = {}
    for gi, group in enumerate(opt.param_groups):
        for pi, p in enumerate(group["params"]):
            if p in opt.state:
                out[("state", gi, pi)] = opt.state[p]
        for key, value in group.items():
            if key not in ("params", "param_names"):
                out[("group", gi, key)] = value
    return out


def _same(a: Any, b: Any, path: str = "") -> None:
    """Assert ``b`` is ``a`` bitwise: same types all the way down, tensors with equal bytes, dtype and device."""
    assert type(a) is type(b), f"{path}: {type(a).__name__} became {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape, a.device) == (b.dtype, b.shape, b.device), f"{path}: tensor changed"
        ab = a.detach().contiguous().reshape(-1).view(torch.uint8)
        bb = b.detach().contiguous().reshape(-1).view(torch.uint8)
        assert torch.equal(ab, bb), f"{path}: values changed"
    elif isinstance(a, dict):
        assert list(a) == list(b), f"{path}: keys changed"
        for k in a:
            _same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple, deque)):
        assert len(a) == len(b), f"{path}: length changed"
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{path}[{i}]")
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b), f"{path}: NaN changed"
    elif dataclasses.is_dataclass(a) or hasattr(a, "__dict__") and not callable(a):
        _same(vars(a), vars(b), f"{path}.")
    else:
        assert a == b, f"{path}: {a!r} became {b!r}"


def _params():
    for name in sorted(pytorch_optimizer.get_supported_optimizers()):
        if name in SKIP:
            yield pytest.param(name, marks=pytest.mark.skip(reason=SKIP[name]), id=name)
        elif name in XFAIL:
            raises, reason = XFAIL[name]
            yield pytest.param(name, marks=pytest.mark.xfail(strict=True, raises=raises, reason=reason), id=name)
        else:
            yield pytest.param(name, id=name)


@pytest.mark.parametrize("name", list(_params()))
def test_core_guarantees(sim, name):
    # Move after K host steps; compare with a fresh optimizer trained on the device from the start.
    net, opt = _trained(name, torch.device("cpu"))
    dtypes = [(row[0], row[1], row[3]) for row in layout(opt)]
    net.to(sim)
    optimshift.move(opt, sim)
    moved = layout(opt)
    assert [(row[0], row[1], row[3]) for row in moved] == dtypes, "a move must never change a dtype"
    with optimshift.count_syncs() as moved_syncs:
        _train(name, net, opt, range(K, K + N))

    fresh_net, fresh = _trained(name, sim)
    assert moved == layout(fresh), "placement after move must equal a fresh optimizer's"
    with optimshift.count_syncs() as fresh_syncs:
        _train(name, fresh_net, fresh, range(K, K + N))
    assert moved_syncs.total == fresh_syncs.total, f"syncs {moved_syncs} != fresh {fresh_syncs}"

    # Round trip host -> device -> host.
    net, opt = _trained(name, torch.device("cpu"))
    before = copy.deepcopy(_state_of(opt))
    dicts = {key: id(value) for key, value in _state_of(opt).items() if key[0] == "state"}
    net.to(sim)
    optimshift.move(opt, sim)
    net.to("cpu")
    optimshift.move(opt, "cpu")
    after = _state_of(opt)
    _same(before, after)
    assert {key: id(value) for key, value in after.items() if key[0] == "state"} == dicts


def test_corpus_is_the_whole_registry():
    """Every name the registry lists is tested, skipped or marked: nothing is silently left out."""
    names = set(pytorch_optimizer.get_supported_optimizers())
    assert len(names) >= 100
    assert set(SKIP) | set(XFAIL) <= names


def test_alig_needs_its_policy(sim):
    """AliG keeps a 0-dim ``step_size`` tensor in its param group, on the params' device: the built-in rule
    would put it on the host; the shipped policy puts it where a fresh AliG keeps it."""
    fresh_net, fresh = _trained("alig", sim)
    reference = layout(fresh)
    assert ("group 0", "step_size", str(sim), "float32", ()) in reference
    placed = {}
    for registered in (False, True):
        (third_party.register if registered else third_party.unregister)()
        net, opt = _trained("alig", torch.device("cpu"))
        net.to(sim)
        optimshift.move(opt, sim)
        placed[registered] = layout(opt)
    assert placed[True] == reference
    assert placed[False] != reference
    assert ("group 0", "step_size", "cpu", "float32", ()) in placed[False]


def test_madgrad_is_placed_with_or_without_its_policy(sim):
    """MADGRAD keeps an optimizer-wide 1-element int64 counter ``state["k"]`` on the host: the built-in rule
    (optimizer-wide tensors follow the first group's params) sent it to the device without the policy
    ``integrations.third_party`` registers; the probe now sees where a fresh MADGRAD keeps it."""
    fresh_net, fresh = _trained("madgrad", sim)
    reference = layout(fresh)
    assert ("optimizer-wide", "k", "cpu", "int64", (1,)) in reference
    placed = {}
    for registered in (False, True):
        (third_party.register if registered else third_party.unregister)()
        net, opt = _trained("madgrad", torch.device("cpu"))
        net.to(sim)
        optimshift.move(opt, sim)
        placed[registered] = layout(opt)
    assert placed[True] == reference == placed[False]


def test_register_is_idempotent_and_unregister_restores():
    from pytorch_optimizer.optimizer.alig import AliG
    from pytorch_optimizer.optimizer.madgrad import MADGRAD

    from optimshift import policy

    third_party.register()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # installed: no warning
        assert third_party.register() == [AliG, MADGRAD]
    assert policy.has_registered_policy(AliG.__new__(AliG))
    third_party.unregister()
    assert not policy.has_registered_policy(AliG.__new__(AliG)) and policy.builtin_base(AliG) is None
    third_party.register()


def test_register_keeps_a_policy_the_user_registered_and_unregister_leaves_it():
    """A user's own policy for MADGRAD (here declaring it separable, so that it may be streamed): ``register()``
    leaves it in place and does not claim the class, and ``unregister()`` does not remove it. Before, register()
    replaced it (separable lost) and unregister() then removed it (found by a new-user hunt)."""
    from pytorch_optimizer.optimizer.alig import AliG
    from pytorch_optimizer.optimizer.madgrad import MADGRAD

    from optimshift import policy

    third_party.unregister()

    def mine(key, value, param, group, device):
        return None

    shipped = next(p for spec, p in third_party.POLICIES.items() if spec.endswith(":MADGRAD"))
    try:
        for own in (mine, shipped):  # (the shipped policy itself, registered by the user as separable: theirs too)
            policy.register_policy(MADGRAD, own, separable=True)
            assert third_party.register() == [AliG]
            assert policy.registered_policy(MADGRAD) is own and policy.separable(MADGRAD) == (True, "registered")
            third_party.unregister()
            assert policy.registered_policy(MADGRAD) is own and policy.registered_policy(AliG) is None
    finally:
        policy.unregister_policy(MADGRAD)
        third_party.register()
