"""Every configuration PyTorch tests its optimizers with (``optim_db``), run through optimshift on the simulated
accelerator: the cases of ``test_optim_db.py``.

One scenario per configuration, sharing two optimizers across its checks (few steps, small params):

- ``ref``: built over ``sim:0`` params and stepped there, never moved. It is both the fresh optimizer (where its
  state sits, how many host syncs a step costs) and the optimizer that never moved (its params' bits).
- ``opt``: built over host params, then (1) moved to ``sim:0``; (2) moved back to the host and to ``sim:0``
  again; (3) offloaded and reloaded; (4) its state dict, saved and loaded with ``map_location="cpu"``, is loaded
  with ``optimshift.load_state_dict`` into a fresh optimizer over ``sim:0`` params, which takes over.

After each operation the placement of every tensor (state and param groups: device, dtype, and which entries
share one tensor) equals ``ref``'s; after each step the params and state equal ``ref``'s bit for bit and the
step cost as many host syncs as ``ref``'s.

Run as a script (``python _optim_db_cases.py IDS_FILE OUT_FILE``) it runs the named cases and writes one JSON
line per case as it goes, so that a case that kills the process is named by the last line it started.
"""

from __future__ import annotations

import copy
import io
import json
import sys
import types
import unittest
from dataclasses import dataclass
from typing import Any

import torch

import optimshift
from _matrix import bitwise_equal, grad_for

# The torch test whose subject is ours (a state dict from host params loaded onto an accelerator and stepped):
# optim_db's skips for it are honoured.
ANALOGUE = ("TestOptimRenewed", "test_state_dict_with_cuda_params")
DEVICE_TYPES = ("cpu", "cuda")
# What cannot run here, by the OptimizerInfo flag that says so, with the reason (test_optim_db lists them).
SPARSE_ONLY = (
    "only_supports_sparse_grads: the simulated accelerator has no sparse tensors (test_matrix covers "
    "SparseAdam's int step and dense state on the host)"
)


def common_optimizers() -> types.ModuleType:
    """torch's ``common_optimizers``. Its imports need ``expecttest`` (a torch test dependency) only for a
    ``TestCase`` base class that nothing here uses: without it, a stand-in with that one name is installed."""
    try:
        import expecttest  # noqa: F401
    except ImportError:
        stand_in = types.ModuleType("expecttest")
        stand_in.TestCase = type("TestCase", (unittest.TestCase,), {})  # type: ignore[attr-defined]
        sys.modules["expecttest"] = stand_in
    from torch.testing._internal import common_optimizers as co

    return co


@dataclass
class Case:
    ident: str
    info: Any  # OptimizerInfo
    kwargs: dict
    device_types: tuple[str, ...]

    @property
    def subprocess(self) -> bool:
        """Differentiable configurations once killed the process in optimshift's placement probe (SIGABRT,
        issue 13): they run in a child process, so that a regression fails their tests instead of the run."""
        return bool(self.kwargs.get("differentiable"))


def _canonical(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return ("tensor", str(value.dtype), tuple(value.shape), tuple(value.reshape(-1).tolist()))
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_canonical(v) for v in value))
    if isinstance(value, dict):
        return tuple(sorted((k, _canonical(v)) for k, v in value.items()))
    return value


def _skipped(info: Any, device_type: str) -> str | None:
    """The reason optim_db skips ``ANALOGUE`` for this class on this device type, if it does (each active
    decorator is applied to a no-op and called: ``unittest.skip`` and ``skipIf*`` raise SkipTest)."""
    for decorator in info.get_decorators(*ANALOGUE, device_type, torch.float32, {}):
        try:
            decorator(lambda *a, **k: None)()
        except unittest.SkipTest as e:
            return str(e) or "skipped by optim_db"
        except Exception:
            continue  # a decorator that needs a real test (toleranceOverride): not a skip
    return None


def collect() -> tuple[list[Case], list[tuple[str, str]], int]:
    """(the cases to run, [(configuration, why it is excluded)], how many inputs optim_db gave in all).

    Every input of every ``OptimizerInfo`` for the cpu and cuda device types, with the global flags (foreach,
    fused, differentiable) as torch's own tests add them; an input both lists give is one case."""
    co = common_optimizers()
    cases: dict[Any, Case] = {}
    excluded: list[tuple[str, str]] = []
    total = 0
    for info in co.optim_db:
        name = info.optim_cls.__name__
        for device_type in DEVICE_TYPES:
            inputs = co._get_optim_inputs_including_global_cliquey_kwargs(device_type, None, info)
            total += len(inputs)
            why = SPARSE_ONLY if info.only_supports_sparse_grads else _skipped(info, device_type)
            for inp in inputs:
                label = f"{name}: {inp.desc}"
                if why is not None:
                    excluded.append((f"{label} ({device_type})", why))
                    continue
                key = (name, _canonical(inp.kwargs))
                if key in cases:
                    cases[key].device_types += (device_type,)
                    continue
                cases[key] = Case(label, info, inp.kwargs, (device_type,))
    by_label: dict[str, list[Case]] = {}
    for case in cases.values():
        by_label.setdefault(case.ident, []).append(case)
    for same in by_label.values():
        if len(same) > 1:  # one description, different kwargs (in the cpu and cuda lists, or within one)
            for case in same:
                case.ident += f" ({'+'.join(case.device_types)})"
    seen: dict[str, int] = {}
    for case in cases.values():
        seen[case.ident] = seen.get(case.ident, 0) + 1
        if seen[case.ident] > 1:
            case.ident += f" #{seen[case.ident]}"
    return list(cases.values()), excluded, total


# --- the scenario -------------------------------------------------------------------------------------------


def _shapes(case: Case) -> list[tuple[int, ...]]:
    return [(3, 2), (2, 3)] if case.info.optim_cls.__name__ == "Muon" else [(3, 2), (3,)]  # Muon: 2-D only


def _params(case: Case, device: torch.device) -> list[torch.nn.Parameter]:
    # A differentiable step runs in grad mode, where torch refuses in-place updates of leaves that require grad:
    # its params do not require grad (the differentiable code path runs all the same).
    requires_grad = not case.kwargs.get("differentiable")
    return [
        torch.nn.Parameter(
            torch.randn(s, generator=torch.Generator().manual_seed(i)).to(device), requires_grad=requires_grad
        )
        for i, s in enumerate(_shapes(case))
    ]


def _build(case: Case, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    kwargs = copy.deepcopy(case.kwargs)  # its own tensor lr/betas: nothing shared with another optimizer
    if case.info.supports_param_groups:
        return case.info.optim_cls([{"params": [p]} for p in params], **kwargs)
    return case.info.optim_cls(params, **kwargs)


def _step(case: Case, opt: torch.optim.Optimizer, params: list, step: int) -> int:
    """One step with the grads of ``step``; returns the host syncs it cost."""
    if case.info.step_requires_closure:
        targets = [grad_for(99, i, p.shape).to(p.device) for i, p in enumerate(params)]

        # c * sum((p - target)^2) and its gradient, without autograd (cheaper on the simulator). LBFGS iterates
        # until a tolerance is met (max_iter 20 per step, each re-walking its history): c makes every
        # configuration stop within a few. With lr 1 the quasi-Newton steps solve this quadratic in a few
        # iterations (and fill the history); a smaller lr only shrinks steps, so the loss is made so flat that an
        # iteration changes it by less than tolerance_change, its grads still far above tolerance_grad.
        c = 1.0 if float(opt.param_groups[0]["lr"]) == 1.0 else 5e-5

        def closure():
            with torch.no_grad():
                for p, t in zip(params, targets):
                    p.grad = (p - t) * (2 * c)
                return sum(((p - t) ** 2).sum() * c for p, t in zip(params, targets))

        with optimshift.count_syncs() as syncs:
            opt.step(closure)
        return syncs.total
    for i, p in enumerate(params):
        p.grad = grad_for(step, i, p.shape).to(p.device)
    with optimshift.count_syncs() as syncs:
        opt.step()
    return syncs.total


def _to(params: list[torch.nn.Parameter], device: torch.device) -> None:
    """What ``model.to(device)`` does to the params (same objects, new device), grads dropped."""
    for p in params:
        p.grad = None
        torch.utils.swap_tensors(p, torch.nn.Parameter(p.detach().to(device), requires_grad=p.requires_grad))


def _tensors(opt: torch.optim.Optimizer) -> list[tuple[str, torch.Tensor]]:
    """Every tensor the optimizer holds, with a name that is the same in any optimizer of this case."""
    out: list[tuple[str, torch.Tensor]] = []

    def walk(name: str, value: Any) -> None:
        if isinstance(value, torch.Tensor):
            out.append((name, value))
        elif isinstance(value, (list, tuple)):
            for j, v in enumerate(value):
                walk(f"{name}[{j}]", v)
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(f"{name}[{k!r}]", v)

    for gi, group in enumerate(opt.param_groups):
        for pi, p in enumerate(group["params"]):
            for key, value in opt.state.get(p, {}).items():
                walk(f"group {gi}, param {pi}, state {key!r}", value)
        for key, value in group.items():
            if key not in ("params", "param_names"):
                walk(f"group {gi}, {key!r}", value)
    return out


def layout(opt: torch.optim.Optimizer) -> dict[str, Any]:
    """Where and what every tensor is, which entries share one tensor (or one storage), and the type of every
    non-tensor state value."""
    tensors = _tensors(opt)
    by_id: dict[int, list[str]] = {}
    by_storage: dict[tuple, list[str]] = {}
    for name, t in tensors:
        by_id.setdefault(id(t), []).append(name)
        if t.untyped_storage().nbytes():
            by_storage.setdefault((t.device, t.untyped_storage().data_ptr()), []).append(name)
    plain = {
        f"group {gi}, param {pi}, state {k!r}": type(v).__name__
        for gi, g in enumerate(opt.param_groups)
        for pi, p in enumerate(g["params"])
        for k, v in opt.state.get(p, {}).items()
        if not isinstance(v, (torch.Tensor, list, tuple, dict))
    }
    return {
        "tensors": {name: (str(t.device), t.dtype, tuple(t.shape)) for name, t in tensors},
        "shared": sorted(names for names in by_id.values() if len(names) > 1),
        "shared storage": sorted(names for names in by_storage.values() if len(names) > 1),
        "plain": plain,
    }


def _diff(got: dict, want: dict) -> str:
    lines = []
    for part in want:
        if got[part] == want[part]:
            continue
        if isinstance(want[part], dict):
            for k in sorted(set(got[part]) | set(want[part])):
                if got[part].get(k) != want[part].get(k):
                    lines.append(f"  {part} {k}: {got[part].get(k)} (fresh: {want[part].get(k)})")
        else:
            lines.append(f"  {part}: {got[part]} (fresh: {want[part]})")
    return "\n".join(lines)


class Checker:
    def __init__(self, case: Case, sim: torch.device) -> None:
        self.case, self.sim = case, sim
        self.ref_params = _params(case, sim)
        self.ref = _build(case, self.ref_params)
        self.steps = 0

    def same_placement(self, opt: torch.optim.Optimizer, when: str) -> None:
        got, want = layout(opt), layout(self.ref)
        assert got == want, f"{self.case.ident}: after {when}, placement differs from a fresh optimizer's:\n" + _diff(
            got, want
        )
        report = optimshift.check(opt)
        assert report.ok, f"{self.case.ident}: after {when}, check() is not ok:\n{report}"

    def step_both(self, opt: torch.optim.Optimizer, params: list, when: str) -> None:
        ref_syncs = _step(self.case, self.ref, self.ref_params, self.steps)
        syncs = _step(self.case, opt, params, self.steps)
        self.steps += 1
        assert syncs == ref_syncs, (
            f"{self.case.ident}: the step after {when} cost {syncs} host syncs, a fresh optimizer's {ref_syncs}"
        )
        for i, (p, q) in enumerate(zip(params, self.ref_params)):
            assert bitwise_equal(p, q), f"{self.case.ident}: after {when}, param {i} differs from the unmoved one"
        got, want = dict(_tensors(opt)), dict(_tensors(self.ref))
        assert got.keys() == want.keys(), f"{self.case.ident}: after {when}: {sorted(got)} != {sorted(want)}"
        for name, a in got.items():
            assert bitwise_equal(a, want[name]), f"{self.case.ident}: after {when}, {name} differs from the unmoved one"
        self.same_placement(opt, f"{when} and a step")


def _snapshot(opt: torch.optim.Optimizer) -> list[tuple[str, torch.Tensor]]:
    return [(name, t.detach().to("cpu", copy=True)) for name, t in _tensors(opt)]


def _all_on_host(case: Case, opt: torch.optim.Optimizer, before: dict, values: list, when: str) -> None:
    """After a move to the host: every tensor on the host, dtype, shape, sharing and bits unchanged."""
    now = layout(opt)
    moved = {name: ("cpu",) + rest[1:] for name, rest in before["tensors"].items()}
    assert now["tensors"] == moved, f"{case.ident}: after {when}:\n" + _diff(now, {**now, "tensors": moved})
    assert now["shared"] == before["shared"], f"{case.ident}: {when} changed which entries share a tensor"
    for (name, t), (_, saved) in zip(_tensors(opt), values):
        assert bitwise_equal(t, saved), f"{case.ident}: {when} changed the value of {name}"


def run_case(case: Case, sim: torch.device) -> None:
    check = Checker(case, sim)
    params = _params(case, torch.device("cpu"))
    opt = _build(case, params)

    # 1. built on the host, moved to the device
    _to(params, sim)
    optimshift.move(opt)
    check.same_placement(opt, "move to the device")
    check.step_both(opt, params, "move to the device")

    # 2. moved back to the host, and to the device again
    before, values = layout(opt), _snapshot(opt)
    _to(params, torch.device("cpu"))
    optimshift.move(opt)
    _all_on_host(case, opt, before, values, "move back to the host")
    _to(params, sim)
    optimshift.move(opt, sim)
    check.same_placement(opt, "move back to the host and to the device again")
    check.step_both(opt, params, "move back to the host and to the device again")

    # 3. offloaded and reloaded
    before, values = layout(opt), _snapshot(opt)
    optimshift.offload(opt)
    _all_on_host(case, opt, before, values, "offload")
    optimshift.reload(opt)
    check.same_placement(opt, "offload and reload")
    check.step_both(opt, params, "offload and reload")

    # 4. its state dict saved, loaded on the host, loaded into a fresh optimizer over device params
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    saved = torch.load(buffer, map_location="cpu", weights_only=False)
    new_params = [torch.nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad) for p in params]
    new = _build(case, new_params)
    optimshift.load_state_dict(new, saved)
    check.same_placement(new, "load_state_dict into a fresh optimizer")
    check.step_both(new, new_params, "load_state_dict into a fresh optimizer")


# --- as a child process ---------------------------------------------------------------------------------------


def _main(ids_file: str, out_file: str) -> None:
    from optimshift.testing import simulated_accelerator

    sim = simulated_accelerator()
    wanted = json.loads(open(ids_file).read())
    cases = {c.ident: c for c in collect()[0]}
    with open(out_file, "w") as out:
        for ident in wanted:
            out.write(json.dumps({"start": ident}) + "\n")
            out.flush()
            try:
                run_case(cases[ident], sim)
                result: dict[str, Any] = {"ident": ident, "ok": True}
            except BaseException as e:  # noqa: BLE001 - reported to the parent, which fails the test
                import traceback

                result = {"ident": ident, "ok": False, "error": "".join(traceback.format_exception(e))}
            out.write(json.dumps(result) + "\n")
            out.flush()


if __name__ == "__main__":
    _main(sys.argv[1], sys.argv[2])
