"""Every public operation goes the one road (issue 27, item 8): spies on the engine show which of its functions
each operation calls.

- ``move``, ``offload``, ``reload``, ``rebind``, ``stream``, ``unstream``, the layout of the state a streamed
  step made, and the framework patches (verl's, DeepSpeed's and Lightning's patched functions, Accelerate's
  patched optimizer): the plan's ``engine.run`` (copy) and ``engine.commit`` (adopt, all or nothing);
- a streamed step: one ``engine.lend`` per chunk (its window in and out), no copy or commit of its own once the
  state is laid out;
- every operation, ``load_state_dict`` included: the commit's one uninterrupted section
  (``engine.uninterrupted``), where an interrupt waits for the commit to end.

``load_state_dict`` makes its copies and casts through ``engine.run`` of the plan of its copies (the uniform load
of a fresh optimizer's state: a plan of columns, ``Plan.columns``), and installs them through ``engine.commit`` as
every operation does.
"""

from __future__ import annotations

import collections

import pytest
import torch

import optimshift
from optimshift import _engine as engine

O = torch.optim


@pytest.fixture
def calls(monkeypatch):
    seen: collections.Counter[str] = collections.Counter()
    for name in ("run", "commit", "uninterrupted", "lend", "copy_items", "adoptions"):
        real = getattr(engine, name, None)
        if real is None:  # (an engine without it: what it does not have, nothing calls)
            continue

        def spy(*args, _real=real, _name=name, **kwargs):
            seen[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(engine, name, spy)
    return seen


def _trained(device):
    params = [torch.nn.Parameter(torch.randn(4, 3, device=device)) for _ in range(2)]
    opt = O.Adam(params, foreach=False)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    return params, opt


def _ops(sim, tmp_path):
    def move(opt, params):
        optimshift.move(opt, "cpu")

    def offload(opt, params):
        optimshift.offload(opt)

    def reload(opt, params):
        optimshift.offload(opt)
        optimshift.reload(opt)

    def rebind(opt, params):
        optimshift.rebind(opt, [torch.nn.Parameter(p.detach().clone()) for p in params])

    def load(opt, params):
        _, other = _trained(sim)
        optimshift.load_state_dict(opt, other.state_dict())

    def stream(opt, params):
        optimshift.stream(opt)

    def unstream(opt, params):
        optimshift.stream(opt)
        optimshift.unstream(opt)

    return {
        "move": move,
        "offload": offload,
        "reload": reload,
        "rebind": rebind,
        "load_state_dict": load,
        "stream": stream,
        "unstream": unstream,
    }


PLANNED = ("move", "offload", "reload", "rebind", "stream", "unstream")
ALL = PLANNED + ("load_state_dict",)


@pytest.mark.parametrize("op", ALL)
def test_every_operation_commits_through_the_engine(sim, tmp_path, calls, op):
    params, opt = _trained(sim)
    calls.clear()
    _ops(sim, tmp_path)[op](opt, params)
    if op in PLANNED:
        assert calls["run"] >= 1 and calls["commit"] >= 1, f"{op} does not go plan -> engine.run -> engine.commit"
    else:  # (the load: its new dicts, in-place writes and adoptions are one engine.commit)
        assert calls["commit"] == 1, f"{op} installs its state outside engine.commit: {calls}"
    assert calls["uninterrupted"] >= 1, f"{op} commits outside the engine's commit section"
    # (adoptions are decided only inside the engine's commit and lend)
    assert calls["adoptions"] == calls["commit"] + calls["lend"], calls


def test_a_streamed_step_swaps_each_chunk_in_and_out_through_the_engine(sim, calls):
    """Its first step makes the state on the device and lays it out as ``stream`` does (one ``engine.run`` and one
    ``engine.commit`` per part of the params); every step lends each chunk its window once (``engine.lend``: in,
    and back), and nothing else copies or adopts."""
    params = [torch.nn.Parameter(torch.randn(4, 3, device=sim)) for _ in range(3)]
    opt = O.Adam(params, foreach=False)
    handle = optimshift.stream(opt, chunk_bytes=128)  # (no state yet: nothing to lay out)
    for step in range(3):
        for p in params:
            p.grad = torch.full_like(p, 0.5 + step)
        calls.clear()
        opt.step()
        if step == 0:  # (the state the step made, laid out in parts of about chunk_bytes)
            assert calls["run"] == calls["commit"] >= 1 and calls["lend"] == 0, calls
        else:
            assert handle.chunks == 3 and calls["lend"] == 3, calls
            assert calls["run"] == calls["commit"] == 0, calls
        # (the engine's copies only inside run, its adoptions only inside lend and commit)
        assert calls["copy_items"] == calls["run"] and calls["adoptions"] == calls["lend"] + calls["commit"], calls


def test_verls_patched_functions_go_the_one_road(sim, calls):
    pytest.importorskip("verl")
    import optimshift.integrations.verl as osv

    osv.patch()
    try:
        with osv._quiet_verl_import():
            from verl.workers.engine.fsdp import transformer_impl

        params, opt = _trained(sim)
        calls.clear()
        transformer_impl.offload_fsdp_optimizer(opt)
        assert calls["run"] == 1 and calls["commit"] == 1
        transformer_impl.load_fsdp_optimizer(opt, "sim")
        assert calls["run"] == 2 and calls["commit"] == 2
    finally:
        osv.unpatch()


def test_lightnings_patched_helper_goes_the_one_road(sim, calls):
    pytest.importorskip("lightning")
    import optimshift.integrations.lightning as osl

    osl.patch()
    try:
        from lightning.pytorch.strategies import strategy  # (where the patch swapped Lightning's helper)

        params, opt = _trained(sim)
        calls.clear()
        strategy._optimizer_to_device(opt, torch.device("cpu"))  # (a teardown)
        assert calls["run"] == 1 and calls["commit"] == 1
        strategy._optimizer_to_device(opt, sim)  # (a setup: the state follows its params)
        assert calls["run"] == 2 and calls["commit"] == 2
    finally:
        osl.unpatch()


def test_accelerates_patched_optimizer_goes_the_one_road(sim, calls):
    pytest.importorskip("accelerate")
    import optimshift.integrations.accelerate as osa
    from optimshift.testing.accelerate import on_device

    osa.patch()
    try:
        with on_device(sim):
            from accelerate import Accelerator

            accelerator = Accelerator()
            params, opt = _trained(sim)
            calls.clear()
            prepared = accelerator.prepare_optimizer(opt)  # (its existing state placed)
            assert calls["run"] == 1 and calls["commit"] == 1
            _, other = _trained(sim)
            prepared.load_state_dict(other.state_dict())  # (a resume: optimshift's load)
            assert calls["run"] == 1 and calls["commit"] == 2 and calls["uninterrupted"] == 2
    finally:
        osa.unpatch()


def test_deepspeeds_patched_functions_go_the_one_road(sim, calls):
    import os

    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # (read when deepspeed is first imported, as its tests do)
    pytest.importorskip("deepspeed")
    import optimshift.integrations.deepspeed as osd

    osd.patch()
    try:
        from deepspeed.runtime.zero import stage_1_and_2 as zero12  # (the names ZeRO-1/2 calls them by)

        params, opt = _trained(sim)
        calls.clear()
        zero12.offload_optimizer_states(opt, "cpu", pin_memory=True, non_blocking=False)
        assert calls["run"] == 1 and calls["commit"] == 1
        zero12.reload_optimizer_states(opt, sim, non_blocking=False)
        assert calls["run"] == 2 and calls["commit"] == 2
    finally:
        osd.unpatch()


def _interrupt_in_the_commit(monkeypatch):
    """Send a SIGINT from inside the next commit's apply (delivered there, at the next bytecode boundary)."""
    import os
    import signal

    real = engine.adoptions

    def spy(*args, **kwargs):
        replaced, apply, hows = real(*args, **kwargs)

        def apply_interrupted():
            os.kill(os.getpid(), signal.SIGINT)
            return apply()

        return replaced, apply_interrupted, hows

    monkeypatch.setattr(engine, "adoptions", spy)


@pytest.mark.parametrize("non_blocking", [False, True])
def test_a_ctrl_c_during_a_commit_waits_for_the_operations_own_records(sim, monkeypatch, non_blocking):
    """The held interrupt is raised when the operation ends, not when its commit does: an offload interrupted
    there still records itself (so reload() brings the state back) and guards its transfer in flight (found by
    review: raised at the commit's end, it left the state on the host with no record, and reload() a no-op)."""
    params, opt = _trained(sim)
    _interrupt_in_the_commit(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        optimshift.offload(opt, non_blocking=non_blocking)
    monkeypatch.undo()
    assert optimshift.is_offloaded(opt)
    assert {t.device.type for st in opt.state.values() for t in st.values()} == {"cpu"}
    optimshift.reload(opt)
    assert [{k: t.device.type for k, t in st.items()} for st in opt.state.values()] == [
        {"step": "cpu", "exp_avg": "sim", "exp_avg_sq": "sim"}
    ] * 2
    optimshift.offload(opt)
    _interrupt_in_the_commit(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        optimshift.reload(opt)
    monkeypatch.undo()
    assert not optimshift.is_offloaded(opt)
    assert {st["exp_avg"].device.type for st in opt.state.values()} == {"sim"}


def test_an_operation_leaves_the_sigint_handler_as_it_found_it(sim):
    import signal

    before = signal.getsignal(signal.SIGINT)
    params, opt = _trained(sim)
    optimshift.offload(opt)
    optimshift.reload(opt)
    optimshift.load_state_dict(opt, opt.state_dict())
    optimshift.stream(opt)
    optimshift.unstream(opt)
    assert signal.getsignal(signal.SIGINT) is before


def test_a_ctrl_c_held_through_a_commit_is_handed_to_the_handler_with_a_frame(sim, monkeypatch):
    """A held Ctrl-C was handed to the SIGINT handler with None for its frame (the frame it landed in is not kept):
    a handler of the user's that reads it (``frame.f_lineno``, as Python always gives one) raised AttributeError
    from the operation, not its own KeyboardInterrupt. It is given the frame it is handed over in."""
    import signal

    seen = []

    def handler(signum, frame):
        seen.append((signum, frame.f_lineno > 0))
        raise KeyboardInterrupt

    params, opt = _trained(sim)
    before = signal.signal(signal.SIGINT, handler)
    try:
        _interrupt_in_the_commit(monkeypatch)
        with pytest.raises(KeyboardInterrupt):
            optimshift.offload(opt)
        assert signal.getsignal(signal.SIGINT) is handler
    finally:
        signal.signal(signal.SIGINT, before)
    monkeypatch.undo()
    assert seen == [(signal.SIGINT, True)] and optimshift.is_offloaded(opt)


def test_a_ctrl_c_as_an_operation_begins_leaves_no_operation_behind(sim, monkeypatch):
    """A Ctrl-C right after operation() recorded itself (before its try) left its frame there for good: every
    later operation took itself for a nested one, and the first commit's section replaced the SIGINT handler
    and never put it back, so that each later Ctrl-C was swallowed."""
    import os
    import signal

    class Interrupting(list):
        def append(self, item):
            super().append(item)
            os.kill(os.getpid(), signal.SIGINT)  # (delivered here, as it is once list.append returns)

    before = signal.getsignal(signal.SIGINT)
    params, opt = _trained(sim)
    monkeypatch.setattr(engine, "_operations", Interrupting())
    with pytest.raises(KeyboardInterrupt):
        optimshift.offload(opt)
    assert not engine._operations
    monkeypatch.undo()
    assert not optimshift.is_offloaded(opt)
    optimshift.offload(opt)
    optimshift.reload(opt)
    assert signal.getsignal(signal.SIGINT) is before
    _interrupt_in_the_commit(monkeypatch)
    with pytest.raises(KeyboardInterrupt):  # (a Ctrl-C is still raised, once the operation is done)
        optimshift.offload(opt)
    assert optimshift.is_offloaded(opt)


def _spy_on_the_copies(monkeypatch):
    """ids of every copy ``engine.run`` makes from here on, and the plans it was given."""
    made: list[int] = []
    plans: list = []
    real_run = engine.run

    def run(plan, *args, **kwargs):
        plans.append(plan)
        out = real_run(plan, *args, **kwargs)
        made.extend(id(t) for t in out.batch.copies if t is not None)
        return out

    monkeypatch.setattr(engine, "run", run)
    return made, plans


@pytest.mark.parametrize("uniform", [False, True])
def test_every_copy_a_load_installs_is_the_engines(sim, monkeypatch, uniform):
    """Every tensor a load into a fresh optimizer installs is a copy the engine made: by ``engine.run`` of the plan
    of its copies on the general path, of a plan of columns on the uniform one, the common entry copied where it is
    included: neither has inline clones of its own."""
    from optimshift.checkpoint import _uniform

    made, plans = _spy_on_the_copies(monkeypatch)
    if not uniform:
        monkeypatch.setattr(_uniform, "TensorGuards", None)
    _, source = _trained(sim)
    saved = source.state_dict()
    for on_host in (False, True):  # (the checkpoint where it belongs: copied where it is; on the host: moved)
        sd = {
            "state": {i: {k: v.cpu() if on_host else v for k, v in st.items()} for i, st in saved["state"].items()},
            "param_groups": saved["param_groups"],
        }
        made.clear()
        plans.clear()
        fresh = O.Adam([torch.nn.Parameter(torch.randn(4, 3, device=sim)) for _ in range(2)], foreach=False)
        optimshift.load_state_dict(fresh, sd)
        assert {t.device.type for st in fresh.state.values() for k, t in st.items() if k != "step"} == {sim.type}
        assert [bool(plan.columns) for plan in plans] == [uniform], "the load did not take the path this case names"
        installed = [id(t) for st in fresh.state.values() for t in st.values()]
        assert installed and set(installed) <= set(made), "a load installed a copy the engine did not make"


def test_a_uniform_load_into_a_fresh_optimizer_is_one_engine_run(sim, monkeypatch):
    """The common resume, a host checkpoint of an Adam over 8 params into a fresh optimizer on the accelerator,
    staged by the uniform load: its copies (the moments moved, each ``step`` copied where it is) are one
    ``engine.run`` of a plan, and every tensor it installs is one of them (issue 27: no copy road of its own)."""
    from optimshift.checkpoint import _staging

    made, plans = _spy_on_the_copies(monkeypatch)
    staged: list = []
    real = _staging.build_uniform
    monkeypatch.setattr(_staging, "build_uniform", lambda *a: staged.append(real(*a)) or staged[-1])
    source = O.Adam([torch.nn.Parameter(torch.randn(4, 3)) for _ in range(8)], foreach=False)
    for p in source.param_groups[0]["params"]:
        p.grad = torch.ones_like(p)
    source.step()
    fresh = O.Adam([torch.nn.Parameter(torch.randn(4, 3, device=sim)) for _ in range(8)], foreach=False)
    optimshift.load_state_dict(fresh, source.state_dict())
    assert len(staged) == 1 and staged[0] is not None, "the load did not take the uniform path"
    assert len(plans) == 1, f"the uniform load copied through {len(plans)} engine.run calls, not one"
    installed = [id(t) for st in fresh.state.values() for t in st.values()]
    assert len(installed) == 24 and set(installed) <= set(made), "a load installed a copy the engine did not make"
    assert {(k, t.device.type) for st in fresh.state.values() for k, t in st.items()} == {
        ("step", "cpu"),
        ("exp_avg", sim.type),
        ("exp_avg_sq", sim.type),
    }


@pytest.mark.parametrize("into", ["fresh", "existing"])
def test_a_loads_casts_and_copies_into_existing_state_are_engine_runs(sim, monkeypatch, into):
    """A cast (``cast='param'``, bf16 params) is made by ``engine.run``, its plan carrying the dtype; and a load into
    existing state whose live tensors cannot take the values (one live tensor in two places) copies through
    ``engine.run`` too, on the uniform path."""
    made, plans = _spy_on_the_copies(monkeypatch)
    _, source = _trained(sim)
    sd = source.state_dict()
    if into == "fresh":
        target = O.Adam([torch.nn.Parameter(torch.randn(4, 3, device=sim, dtype=torch.bfloat16)) for _ in range(2)])
        optimshift.load_state_dict(target, sd, cast="param")
        assert [plan.casts for plan in plans] == [True]
        assert {t.dtype for st in target.state.values() for k, t in st.items() if k != "step"} == {torch.bfloat16}
        installed = [id(t) for st in target.state.values() for t in st.values()]
        assert set(installed) <= set(made), "a load installed a copy the engine did not make"
    else:  # (the live tensors adopt the copies' contents, keeping their objects)
        params, target = _trained(sim)
        first = target.state[params[0]]
        first["exp_avg_sq"] = first["exp_avg"]  # (one live tensor in two places: it must stop being shared)
        optimshift.load_state_dict(target, sd)
        assert len(plans) == 1 and not plans[0].casts and plans[0].transfers
        assert all(
            torch.equal(target.state[p][k].cpu(), source.state[q][k].cpu())
            for p, q in zip(target.param_groups[0]["params"], source.param_groups[0]["params"])
            for k in ("exp_avg", "exp_avg_sq")
        )
