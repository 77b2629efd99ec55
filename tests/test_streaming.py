"""Streamed optimizers in a training loop, on the simulated accelerator: device memory, GradScaler, LR schedulers,
clipping, hooks, closures, checkpoints, params that move, refusals, and the copy-stream protocol under copies
that run late (a copy stream that defers every copy until something waits for it)."""

from __future__ import annotations

import copy
import gc
import io
import warnings

import pytest
import torch

import optimshift
from _matrix import (
    Delegating,
    Model,
    as_it_is,
    assert_as_it_was,
    bitwise_equal,
    grad_for,
    state_layout,
    tensor_ids,
    train,
)
from optimshift import _device_streams, _engine, _streaming
from optimshift.testing import deferred_streams, simulated_memory_allocated


def _params(model):
    return [h.weight for h in model.parts]


def _pair(shapes, sim, cls=torch.optim.AdamW, **kwargs):
    """Two identical models on the device with the same optimizer: (model, opt) to stream and a reference."""
    out = []
    for _ in range(2):
        model = Model(shapes).to(sim)
        out.append((model, cls(_params(model), **kwargs)))
    return out


def _assert_same(model, opt, ref_model, ref):
    if optimshift.is_streamed(opt):
        _streaming._mode_of(opt).wait()  # reading state tensors directly: the write-backs must have landed
    for a, b in zip(model.parameters(), ref_model.parameters()):
        assert bitwise_equal(a, b)
        assert bitwise_equal(dict(opt.state[a]), dict(ref.state[b]))


# --- device memory ------------------------------------------------------------------------------------------


def test_peak_device_state_is_two_chunks_plus_the_largest_param(sim, monkeypatch):
    # Synchronous copies (a device without streams), the device's allocated bytes sampled at every copy the step
    # queues (its loads and write-backs, and the engine's copies of the state a first step made into its chunks):
    # windows are allocated before their copies; a chunk's state is resident from its load to its write-back.
    monkeypatch.setitem(_device_streams._chosen, sim.type, None)
    samples = []
    queue, copy_into = _streaming._queue, _engine.copy_into

    def sampling(side, dsts, srcs, **kwargs):
        assert side is None, "no streams: each copy is complete when it returns"
        samples.append(simulated_memory_allocated(0))
        queue(side, dsts, srcs, **kwargs)

    def sampling_into(pairs, side=None, **kwargs):
        assert side is None, "no streams: each copy is complete when it returns"
        samples.append(simulated_memory_allocated(0))
        return copy_into(pairs, side=side, **kwargs)

    monkeypatch.setattr(_streaming, "_queue", sampling)
    monkeypatch.setattr(_engine, "copy_into", sampling_into)
    small, big = (64,), (64, 64)  # AdamW state: 512 bytes per small param, 32 KiB per big one
    shapes = [small] * 20 + [big, big] + [small] * 20
    chunk = 2048  # four small params per chunk; each big param is a chunk of its own, larger than a chunk
    state_total = 40 * 512 + 2 * 32768
    bound = 2 * chunk + 32768

    (model, opt), (ref_model, ref) = _pair(shapes, sim, foreach=True)
    handle = optimshift.stream(opt, chunk_bytes=chunk)
    for step in range(3):
        for i, p in enumerate(_params(model)):
            p.grad = grad_for(step, i, p.shape).to(sim)
        gc.collect()
        base = simulated_memory_allocated(0)  # params and grads: no state lives on the device between steps
        samples.clear()
        opt.step()
        peak = max(samples) - base
        assert 0 < peak <= bound, f"step {step}: {peak} bytes of state on the device, bound {bound}"
        gc.collect()
        assert simulated_memory_allocated(0) == base, "nothing stays on the device after a step"
    assert handle.chunks == 12 and handle.state_bytes == state_total

    gc.collect()
    before = simulated_memory_allocated(0)
    train(ref_model, ref, range(3))
    for p in _params(ref_model):
        p.grad = None
    gc.collect()
    assert simulated_memory_allocated(0) - before == state_total > bound, "an ordinary step: all of it on the device"
    _assert_same(model, opt, ref_model, ref)


# --- a training loop's tools --------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs", [{"foreach": False}, {"fused": True}], ids=["single", "fused"])
def test_grad_scaler_skips_steps_like_an_ordinary_optimizer(sim, kwargs):
    runs = []
    for streamed in (True, False):
        model = Model([(4, 3), (3,), (2, 3)]).to(sim)
        opt = torch.optim.Adam(_params(model), **kwargs)
        if streamed:
            optimshift.stream(opt, chunk_bytes=128)
        scaler = torch.amp.GradScaler("sim", init_scale=2.0**8, growth_interval=2)
        stepped = []
        opt.register_step_post_hook(lambda *_: stepped.append(1))
        for step in range(6):
            scaler.scale(torch.ones((), device=sim))  # (what scaler.scale(loss) does first: makes its scale)
            for i, p in enumerate(_params(model)):
                g = grad_for(step, i, p.shape) * scaler.get_scale()
                if step in (1, 4) and i == 1:
                    g[0] = float("inf")  # an overflow: GradScaler skips this step
                p.grad = g.to(sim)
            scaler.step(opt)
            scaler.update()
        runs.append((model, opt, len(stepped), scaler.get_scale()))
    (model, opt, n, scale), (ref_model, ref, ref_n, ref_scale) = runs
    # Unfused: GradScaler skips step() on an overflow; fused: step() runs and the kernel skips the update.
    assert n == ref_n == (6 if kwargs.get("fused") else 4) and scale == ref_scale
    _assert_same(model, opt, ref_model, ref)


def test_lr_schedulers_clipping_hooks_and_closure(sim):
    from torch.optim import optimizer as _optimizer

    runs = []
    for streamed in (True, False):
        model = Model([(4, 3), (3,), (2, 3), (5,)]).to(sim)
        params = _params(model)
        opt = torch.optim.AdamW(params, lr=0.1)
        counts = {"pre": 0, "post": 0, "global": 0, "closure": 0}
        group_sizes = []

        def pre(o, args, kwargs):
            counts["pre"] += 1
            group_sizes.append(len(o.param_groups[0]["params"]))  # hooks see the real groups

        opt.register_step_pre_hook(pre)
        opt.register_step_post_hook(lambda *_: counts.__setitem__("post", counts["post"] + 1))
        handle = _optimizer.register_optimizer_step_post_hook(
            lambda o, *_: counts.__setitem__("global", counts["global"] + (o is opt))
        )
        before = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.5, total_steps=10)  # also changes betas
        if streamed:
            optimshift.stream(opt, chunk_bytes=128)
        after = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.9)
        losses = []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in range(5):

                def closure():
                    counts["closure"] += 1
                    for i, p in enumerate(params):
                        p.grad = grad_for(step, i, p.shape).to(sim)
                    torch.nn.utils.clip_grad_norm_(params, max_norm=0.5)
                    return torch.tensor(float(step))

                losses.append(opt.step(closure))
                before.step()
                after.step()
        handle.remove()
        assert not [w for w in caught if "lr_scheduler" in str(w.message) or "optimizer.step()" in str(w.message)]
        assert counts == {"pre": 5, "post": 5, "global": 5, "closure": 5}
        assert group_sizes == [4] * 5 and [float(x) for x in losses] == [0.0, 1.0, 2.0, 3.0, 4.0]
        runs.append((model, opt, [g["lr"] for g in opt.param_groups], [g["betas"] for g in opt.param_groups]))
    (model, opt, lrs, betas), (ref_model, ref, ref_lrs, ref_betas) = runs
    assert lrs == ref_lrs and betas == ref_betas
    _assert_same(model, opt, ref_model, ref)


def test_a_scheduler_made_while_streamed_does_not_warn_after_unstream(sim):
    """An LR scheduler made while streamed leaves the streamed step as it is (marked as wrapped); unstream()
    puts the class's step back, which the scheduler then wraps no more: its first step() after that must not
    warn that optimizer.step() was overridden, and a step counts as one for it."""
    model = Model([(4, 3), (3,)]).to(sim)
    opt = torch.optim.Adam(_params(model), foreach=True)
    with optimshift.streamed(opt, chunk_bytes=128):
        sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.9)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(model, opt, range(1))
        sched.step()
    assert not [str(w.message) for w in caught if "lr_scheduler" in str(w.message) or "overridden" in str(w.message)]
    assert opt.param_groups[0]["lr"] == pytest.approx(0.001 * 0.9)


# --- checkpoints --------------------------------------------------------------------------------------------


class _Peak(torch.utils._python_dispatch.TorchDispatchMode):
    """The device's allocated bytes after every op."""

    def __init__(self):
        super().__init__()
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.peak = max(self.peak, simulated_memory_allocated(0))
        return out


@pytest.mark.parametrize("kwargs", [{"foreach": True}, {"fused": True}], ids=["foreach", "fused"])
def test_save_and_resume_into_a_streamed_optimizer(sim, kwargs, tmp_path):
    shapes = [(8, 4), (4,), (6, 2)]
    (model, opt), (ref_model, ref) = _pair(shapes, sim, torch.optim.Adam, **kwargs)
    optimshift.stream(opt, chunk_bytes=256)
    train(model, opt, range(3))
    train(ref_model, ref, range(3))
    sd = opt.state_dict()
    live = {id(v) for st in opt.state.values() for v in st.values()}
    for st in sd["state"].values():
        for key, v in st.items():
            if v.dim() > 0 or kwargs.get("fused"):
                assert id(v) not in live, f"{key}: state_dict() gives copies of streamed tensors"
                assert v.device.type == "cpu" and v.untyped_storage().nbytes() == v.numel() * v.element_size(), (
                    f"{key}: a compact host tensor, no pool bytes around it"
                )
    assert bitwise_equal(sd["state"], ref.state_dict()["state"])
    buf = io.BytesIO()
    torch.save(sd, buf)
    state_bytes = sum(v.numel() * v.element_size() for st in sd["state"].values() for v in st.values())
    assert buf.tell() < state_bytes + 64 * 1024, "the file holds the state's bytes, not whole pool buffers"

    # Resume: a new model and optimizer on the device, streamed, then torch's own call.
    model2 = Model(shapes).to(sim)
    for a, b in zip(model2.parameters(), model.parameters()):
        a.data.copy_(b.data)
    opt2 = torch.optim.Adam(_params(model2), **kwargs)
    optimshift.stream(opt2, chunk_bytes=256)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    gc.collect()
    before = simulated_memory_allocated(0)
    with _Peak() as peak:
        opt2.load_state_dict(loaded)
    assert peak.peak == before, "no device memory on resume: the state loads into host memory"
    assert set(state_layout(opt2).values()) == {torch.device("cpu")}
    train(model2, opt2, range(3, 5))
    train(ref_model, ref, range(3, 5))
    _assert_same(model2, opt2, ref_model, ref)
    # optimshift's own files and load go to host state as well.
    optimshift.save({"optimizer": opt2}, tmp_path / "ckpt.pt")
    assert (tmp_path / "ckpt.pt").stat().st_size < state_bytes + 64 * 1024
    optimshift.load_state_dict(opt2, optimshift.load(tmp_path / "ckpt.pt"))
    train(model2, opt2, range(5, 6))
    train(ref_model, ref, range(5, 6))
    _assert_same(model2, opt2, ref_model, ref)
    optimshift.load_state_dict(opt2, ref.state_dict())
    assert set(state_layout(opt2).values()) == {torch.device("cpu")}
    with pytest.raises(ValueError, match="streamed"):
        optimshift.load_state_dict(opt2, ref.state_dict(), device=sim)


@pytest.mark.parametrize("mode", ["stream", "offload"])
def test_state_dict_tensors_own_their_bytes_streamed_as_offloaded(sim, mode):
    """One compaction serves both modes (``_offload.compact_state_dict``): every state tensor in the state_dict
    owns exactly its bytes (the live ones are views into pool buffers); a group tensor the user gave as a view
    of a larger tensor is the user's, not a pool's, and stays that view (as in torch's own state_dict, and as
    state tensors that share a storage of their own keep sharing it: optimshift._alias)."""
    lrs = torch.tensor([1e-3, 7.0])  # the group's lr is a view: its storage holds another number too
    model = Model([(4, 3), (3,)]).to(sim)
    opt = torch.optim.Adam(_params(model), lr=lrs[0], foreach=False)
    train(model, opt, range(2))
    optimshift.stream(opt, chunk_bytes=256) if mode == "stream" else optimshift.offload(opt)
    sd = opt.state_dict()
    tensors = {f"{i}.{k}": v for i, st in sd["state"].items() for k, v in st.items()}
    for where, t in tensors.items():
        assert t.untyped_storage().nbytes() == t.numel() * t.element_size(), f"{mode}: {where} holds other bytes"
    assert sd["param_groups"][0]["lr"] is opt.param_groups[0]["lr"] and bitwise_equal(
        sd["param_groups"][0]["lr"], lrs[0]
    )
    assert opt.param_groups[0]["lr"].untyped_storage().nbytes() == 8, "the live group tensor is untouched"
    assert any(v.untyped_storage().nbytes() > 64 for st in opt.state.values() for v in st.values()), (
        "the live state still sits in pool buffers"
    )


@pytest.mark.parametrize("how", ["deepcopy", "torch.save"])
@pytest.mark.parametrize("mode", ["stream", "offload"])
def test_a_copy_of_the_whole_optimizer_holds_only_its_own_bytes_streamed_as_offloaded(sim, mode, how):
    """copy.deepcopy, pickle and torch.save of the optimizer read its state through __getstate__, which the
    state_dict() post-hook does not reach: each view into a pool buffer took the whole buffer with it, another
    optimizer's old bytes included (into a file). They now get the copies state_dict() gives."""
    other = Model([(40, 30)]).to(sim)  # (a larger optimizer's state, offloaded first: its bytes stay in the pool)
    big = torch.optim.Adam(_params(other), foreach=False)
    train(other, big, range(1))
    optimshift.offload(big)
    optimshift.reload(big)
    model = Model([(4, 3), (3,)]).to(sim)
    opt = torch.optim.Adam(_params(model), foreach=False)
    train(model, opt, range(2))
    expected = {n: {k: v.cpu() for k, v in st.items()} for n, st in enumerate(opt.state.values())}
    optimshift.stream(opt, chunk_bytes=256) if mode == "stream" else optimshift.offload(opt)
    if how == "deepcopy":
        copied = copy.deepcopy(opt)
    else:
        buffer = io.BytesIO()
        torch.save(opt, buffer)
        buffer.seek(0)
        copied = torch.load(buffer, weights_only=False)
    assert isinstance(copied.state, type(opt.state)) and "__getstate__" not in copied.__dict__
    for n, st in enumerate(copied.state.values()):
        for k, t in st.items():
            assert t.untyped_storage().nbytes() == t.numel() * t.element_size(), f"{mode}: {k} holds other bytes"
            assert bitwise_equal(t.cpu(), expected[n][k])
    optimshift.unstream(opt) if mode == "stream" else optimshift.reload(opt)
    assert "__getstate__" not in opt.__dict__


@pytest.mark.parametrize("seed,progress", [(0, 0.0), (1, 0.0), (2, 0.25), (3, 0.7)])
def test_the_class_state_dict_of_a_streamed_optimizer_waits_for_the_write_backs(sim, seed, progress):
    """``torch.optim.Optimizer.state_dict(opt)`` (the class's, past the instance's front) finds the last step's
    write-backs landed: optimshift's state_dict pre-hook settles them first."""
    (model, opt), (ref_model, ref) = _pair([(6, 5), (5,), (4, 4)], sim, torch.optim.Adam, foreach=False)
    optimshift.stream(opt, chunk_bytes=128)
    with deferred_streams(seed=seed, progress=progress):
        train(model, opt, range(2))
        train(ref_model, ref, range(2))
        got = torch.optim.Optimizer.state_dict(opt)["state"]
        for n, st in ref.state_dict()["state"].items():
            assert bitwise_equal({k: v.cpu() for k, v in got[n].items()}, {k: v.cpu() for k, v in st.items()})
    optimshift.unstream(opt)


# --- objects, modes, refusals ---------------------------------------------------------------------------------


def test_unstream_restores_the_optimizer_and_the_pool(sim):
    model = Model([(4, 3), (3,)]).to(sim)
    opt = torch.optim.Adam(_params(model), fused=True)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)  # wraps opt.step on the instance
    wrapped = opt.__dict__["step"]
    train(model, opt, range(1))
    layout, ids = state_layout(opt), tensor_ids(opt)
    gc.collect()  # (buffers of optimizers earlier tests dropped, in reference cycles, would go mid-count)
    in_use = optimshift.host_pool.stats().in_use
    with optimshift.streamed(opt, chunk_bytes=64):
        assert optimshift.host_pool.stats().in_use == in_use + 2  # one buffer per chunk (one param each)
        train(model, opt, range(1, 3))
        sched.step()
        for verb in (optimshift.move, optimshift.offload, optimshift.reload):
            with pytest.raises(ValueError, match="unstream"):
                verb(opt)
        with pytest.raises(ValueError, match="unstream"):
            optimshift.rebind(opt, _params(model))
        with pytest.raises(ValueError, match="already streamed"):
            optimshift.stream(opt)
        assert [r.device for r in optimshift.placement(opt)] == ["cpu"] * 6
    assert not optimshift.is_streamed(opt)
    assert opt.__dict__["step"] is wrapped and "load_state_dict" not in opt.__dict__
    assert state_layout(opt) == layout and tensor_ids(opt) == ids
    assert optimshift.host_pool.stats().in_use == in_use
    assert optimshift.unstream(opt) is opt  # a no-op now


def test_streamed_context_unstreams_when_the_body_raises(sim):
    model = Model([(4, 3)]).to(sim)
    opt = torch.optim.SGD(_params(model), momentum=0.9)
    train(model, opt, range(1))
    with pytest.raises(KeyError):
        with optimshift.streamed(opt):
            train(model, opt, range(1, 2))
            raise KeyError("evaluation failed")
    assert not optimshift.is_streamed(opt) and state_layout(opt) == {(0, "momentum_buffer"): sim}


def test_a_ctrl_c_as_unstream_leaves_the_mode_keeps_the_optimizer_streamed(sim, monkeypatch):
    """unstream() left the mode before its try: a Ctrl-C landing once that returned (CPython checks for signals
    after a call) left the streamed step installed on an optimizer no longer streamed, its state in the chunks:
    a later unstream() was a no-op and the next step failed. It stays streamed, and unstreams after."""
    import os
    import signal

    from optimshift import _mode

    model = Model([(4, 3)]).to(sim)
    opt = torch.optim.Adam(_params(model), foreach=False)
    train(model, opt, range(1))
    optimshift.stream(opt)
    train(model, opt, range(1, 2))
    real = _mode.leave

    def leave(optimizer):
        real(optimizer)
        os.kill(os.getpid(), signal.SIGINT)  # (delivered once the call returns)

    monkeypatch.setattr(_mode, "leave", leave)
    with pytest.raises(KeyboardInterrupt):
        optimshift.unstream(opt)
    monkeypatch.undo()
    assert optimshift.is_streamed(opt)
    train(model, opt, range(2, 3))
    optimshift.unstream(opt)
    assert not optimshift.is_streamed(opt) and "step" not in vars(opt)
    assert state_layout(opt) == {(0, "step"): torch.device("cpu"), (0, "exp_avg"): sim, (0, "exp_avg_sq"): sim}
    train(model, opt, range(3, 4))


class _Counting(torch.optim.Optimizer):
    """A third-party per-param optimizer that adds a state entry at its third step (a chunk laid out again)."""

    def __init__(self, params):
        super().__init__(params, {"lr": 0.1})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["m"] = torch.zeros_like(p)
                    st["n"] = torch.zeros((), device=p.device)
                st["m"].mul_(0.9).add_(p.grad)
                st["n"].add_(1)
                if int(st["n"].item()) == 3:
                    st["extra"] = p.grad.clone()
                p.add_(st["m"] + st.get("extra", 0), alpha=-group["lr"])


def test_third_party_classes_are_refused_unless_declared_separable(sim):
    from optimshift import register_policy, unregister_policy

    def fresh(cls=_Counting):
        model = Model([(4, 3), (3,), (2, 2)]).to(sim)
        return model, cls(_params(model))

    model, opt = fresh()
    with pytest.raises(ValueError, match="separable=True"):
        optimshift.stream(opt)
    assert "step" not in opt.__dict__ and not optimshift.is_streamed(opt)
    register_policy(_Counting, lambda *a: None, separable=True)
    try:
        model, opt = fresh()
        ref_model, ref = fresh()
        optimshift.stream(opt, chunk_bytes=128)
        train(model, opt, range(5))
        train(ref_model, ref, range(5))
        _assert_same(model, opt, ref_model, ref)
        assert set(state_layout(opt).values()) == {torch.device("cpu")}
        assert all(set(st) == {"m", "n", "extra"} for st in opt.state.values())
    finally:
        unregister_policy(_Counting)


def test_refusals_name_the_reason_and_change_nothing(sim):
    model = Model([(4, 3), (3,)]).to(sim)
    lbfgs = torch.optim.LBFGS(_params(model))
    with pytest.raises(ValueError, match="LBFGS.*not a per-param update"):
        optimshift.stream(lbfgs)

    class MyAdam(torch.optim.Adam):
        def step(self, closure=None):
            return super().step(closure)

    with pytest.raises(ValueError, match="MyAdam overrides step"):
        optimshift.stream(MyAdam(_params(model)))

    class Quiet(torch.optim.Adam):  # a subclass that keeps Adam's step is Adam
        pass

    quiet = Quiet(_params(model))  # (the handle refers to it weakly: it is the caller's)
    assert optimshift.stream(quiet).optimizer is quiet
    optimshift.unstream(quiet)

    opt = torch.optim.Adam(_params(model), foreach=False)
    train(model, opt, range(1))
    layout, ids = state_layout(opt), tensor_ids(opt)
    for bad, match in [(0, "positive int"), (1.5, "positive int"), (True, "positive int")]:
        with pytest.raises(ValueError, match=match):
            optimshift.stream(opt, chunk_bytes=bad)
    with pytest.raises(ValueError, match="must be an accelerator"):
        optimshift.stream(opt, device="cpu")
    handle = optimshift.stream(opt, device=sim)  # every param is on it: fine
    assert handle.device == sim and handle.optimizer is opt and repr(handle).startswith("Streamed(Adam")
    optimshift.unstream(opt)
    with pytest.raises(ValueError, match="is on sim:0"):
        optimshift.stream(opt, device=torch.device(sim.type, 1))
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        optimshift.stream(object())
    optimshift.offload(opt)
    with pytest.raises(ValueError, match="reload"):
        optimshift.stream(opt)
    optimshift.reload(opt)
    host = Model([(3,)])
    with pytest.raises(ValueError, match="no param is on an accelerator"):
        optimshift.stream(torch.optim.Adam(_params(host)))
    assert state_layout(opt) == layout and tensor_ids(opt) == ids and "step" not in opt.__dict__


def test_a_differentiable_optimizer_is_refused_before_anything_changes(sim):
    """``differentiable=True`` keeps autograd's graph through the state, which the host chunks cut: stream() went
    through, and the first streamed step failed in torch's step ("a leaf Variable that requires grad is being used
    in an in-place operation"). It is refused at stream(), naming the optimizer, the group and why."""
    scale = torch.tensor(0.5, device=sim, requires_grad=True)
    params = [torch.randn(3, 2, device=sim, requires_grad=True).clone() for _ in range(2)]
    opt = torch.optim.Adam(params, differentiable=True)
    for p in params:
        p.grad = p * scale  # (a grad in the graph: the step's state is too)
    opt.step()
    layout, ids = state_layout(opt), tensor_ids(opt)
    with pytest.raises(ValueError, match=r"Adam: stream: group 0 has differentiable=True: .* streaming cuts"):
        optimshift.stream(opt)
    assert state_layout(opt) == layout and tensor_ids(opt) == ids and not optimshift.is_streamed(opt)
    assert "step" not in opt.__dict__ and all(st["exp_avg"].requires_grad for st in opt.state.values())
    opt.step()


def test_an_optimizer_with_differentiable_defaults_is_refused_whatever_its_groups_say(sim):
    """torch's step keeps the graph where the optimizer's ``defaults`` say differentiable=True (it enables grad by
    them), a group's own ``differentiable=False`` notwithstanding: stream() went through, and the first streamed
    step failed in torch's step ("a leaf Variable that requires grad is being used in an in-place operation")."""
    params = [torch.randn(3, 2, device=sim, requires_grad=True).clone() for _ in range(2)]
    opt = torch.optim.Adam([{"params": params, "differentiable": False}], differentiable=True)
    with pytest.raises(ValueError, match=r"Adam: stream: its defaults have differentiable=True: .* streaming cuts"):
        optimshift.stream(opt)
    assert not optimshift.is_streamed(opt) and "step" not in opt.__dict__ and not opt.state


def test_framework_integrations_leave_a_streamed_optimizer_as_it_is(sim):
    from optimshift.integrations import _common

    model = Model([(4, 3)]).to(sim)
    opt = torch.optim.Adam(_params(model), fused=True)
    optimshift.stream(opt)
    train(model, opt, range(1))
    ids = tensor_ids(opt)
    for place in (_common.follow_params, _common.to_host):  # what Lightning's/Accelerate's patches call
        place(opt)
        assert set(state_layout(opt).values()) == {torch.device("cpu")} and tensor_ids(opt) == ids
    assert _common.placeable(opt) and _common.streamed(opt)
    train(model, opt, range(1, 2))


def test_params_that_move_and_groups_added_while_streamed(sim):
    sim1 = torch.device(sim.type, 1)
    runs = []
    for streamed in (True, False):
        model = Model([(4, 3), (3,), (2, 3)])
        model.parts[0].to(sim)
        model.parts[1].to(sim)  # parts[2] stays on the host: its state stays there, stepped in place
        params = _params(model)
        opt = torch.optim.Adam(params[:2], foreach=True)
        if streamed:
            optimshift.stream(opt, chunk_bytes=128)
        train(model, opt, range(2))
        model.parts[1].to(sim1)  # a param moves: its state streams through its new device
        if not streamed:
            optimshift.move(opt)
        train(model, opt, range(2, 4))
        opt.add_param_group({"params": [params[2]], "lr": 0.01})
        train(model, opt, range(4, 6))
        runs.append((model, opt))
    (model, opt), (ref_model, ref) = runs
    _assert_same(model, opt, ref_model, ref)
    optimshift.unstream(opt)
    assert state_layout(opt) == state_layout(ref)


@pytest.mark.parametrize("seed, progress", [(0, 0.0), (1, 0.5)])
def test_a_users_step_hooks_see_and_keep_the_state_of_a_streamed_step(sim, seed, progress):
    """A user's step pre-hook (the next step's) and post-hook (this step's) read the state and change it in
    place: they ran while the streamed step's write-backs were still in flight (NaN read from the host buffers,
    the changes overwritten when the write-backs landed). They run as on an unstreamed optimizer, bitwise."""
    runs = []
    for streamed in (True, False):
        g = torch.Generator().manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(16, generator=g).to(sim)) for _ in range(4)]
        opt = torch.optim.Adam(params, lr=0.1, foreach=True)
        seen: list[float] = []

        def hook(optimizer, args, kwargs, params=params, seen=seen):
            if params[0] in optimizer.state:
                seen.append(sum(float(optimizer.state[p]["exp_avg"].sum()) for p in params))
                for p in params:
                    optimizer.state[p]["exp_avg"].mul_(0.5)

        opt.register_step_pre_hook(hook)
        with deferred_streams(seed=seed, progress=progress):
            if streamed:
                optimshift.stream(opt, chunk_bytes=128)
            opt.register_step_post_hook(hook)
            for k in range(3):
                for i, p in enumerate(params):
                    p.grad = grad_for(k, i, p.shape).to(sim)
                opt.step()
            if streamed:
                optimshift.unstream(opt)
        runs.append((params, opt, seen))
    (params, opt, seen), (ref_params, ref, ref_seen) = runs
    assert seen == ref_seen and all(s == s for s in seen)  # (NaN != NaN)
    assert bitwise_equal(params, ref_params)
    assert bitwise_equal([dict(st) for st in opt.state.values()], [dict(st) for st in ref.state.values()])


@pytest.mark.parametrize("what", ["stream", "unstream"])
def test_stream_and_unstream_from_a_step_post_hook_followed_by_another(sim, what):
    """torch iterates the step post-hooks while calling them: stream()/unstream() from one of them must not add
    or remove a post-hook (a review found that a wait registered as a post-hook made this raise "OrderedDict
    mutated during iteration", after the step ran, and the hook after it never ran)."""
    params = [torch.nn.Parameter(torch.randn(8, device=sim)) for _ in range(2)]
    opt = torch.optim.Adam(params, foreach=True)
    if what == "unstream":
        optimshift.stream(opt, chunk_bytes=64)
    done: list[int] = []

    def switch(o, args, kwargs):
        if not done:
            getattr(optimshift, what)(o)
            done.append(1)

    opt.register_step_post_hook(switch)
    opt.register_step_post_hook(lambda o, a, k: done.append(2))
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    assert done == [1, 2] and optimshift.is_streamed(opt) == (what == "stream")


def test_stream_places_group_tensors_as_a_move_does(sim):
    """A tensor lr given on the device, which Adam(foreach=False) reads on the host each step: stream() left it
    there (a host sync per streamed step, and check() said so right after stream()); move() puts it on the host.
    Now stream() places a group's tensors by the same plan, the same objects, and a group added while streamed
    has its own placed at its first step's layout."""
    lr = torch.tensor(0.01, device=sim)
    p = torch.nn.Parameter(torch.randn(4, device=sim))
    opt = torch.optim.Adam([{"params": [p], "lr": lr}], foreach=False)
    p.grad = torch.ones_like(p)
    opt.step()
    optimshift.stream(opt, chunk_bytes=16)
    assert opt.param_groups[0]["lr"] is lr and lr.device.type == "cpu"
    assert not optimshift.check(opt).findings
    with optimshift.count_syncs() as syncs:
        opt.step()
    assert syncs.total == 0
    q = torch.nn.Parameter(torch.randn(4, device=sim))
    betas = (torch.tensor(0.9, device=sim), torch.tensor(0.99, device=sim))
    opt.add_param_group({"params": [q], "lr": torch.tensor(0.02, device=sim), "betas": betas})
    q.grad = torch.ones_like(q)
    opt.step()  # (its first step makes its state, which is laid out after it, with the group's tensors)
    assert [t.device.type for t in (opt.param_groups[1]["lr"], *betas)] == ["cpu"] * 3
    assert opt.param_groups[1]["betas"][0] is betas[0]
    with optimshift.count_syncs() as syncs:
        opt.step()
    assert syncs.total == 0 and not optimshift.check(opt).findings


# --- the copy-stream protocol under the simulator's deferred, race-checked streams -------------------------------
#
# The streamed step's copy stream is a simulated stream (through optimshift._device_streams): its copies are queued and
# run late, in seeded schedules; a missing wait raises StreamRaceError (happens-before, whatever the schedule),
# and a copy's host destination reads as garbage until the copy ran.

SCHEDULES = [(0, 0.0), (1, 0.3), (2, 0.7)]  # (seed, progress): 0.0 runs queued work only when it is ordered


def _scheduled_run(sim, seed, progress, kwargs=None):
    from optimshift.testing import deferred_streams

    with deferred_streams(seed=seed, progress=progress):
        (model, opt), (ref_model, ref) = _pair(
            [(4, 3), (3,), (2, 3), (5,), (16, 16)], sim, torch.optim.Adam, **(kwargs or {"foreach": True})
        )
        handle = optimshift.stream(opt, chunk_bytes=128)  # (16, 16): larger than a chunk
        train(model, opt, range(4))
        train(ref_model, ref, range(4))
        sd = opt.state_dict()  # waits for the last write-backs
        assert bitwise_equal(sd["state"], ref.state_dict()["state"])
        _assert_same(model, opt, ref_model, ref)
        optimshift.unstream(opt)
        _assert_same(model, opt, ref_model, ref)
    return handle


@pytest.mark.parametrize("seed, progress", SCHEDULES)
@pytest.mark.parametrize("kwargs", [{"foreach": True}, {"fused": True}], ids=["foreach", "fused"])
def test_streamed_steps_under_deferred_schedules(sim, seed, progress, kwargs):
    assert isinstance(_scheduled_run(sim, seed, progress, kwargs), optimshift.Streamed)


def test_direct_reads_before_wait_see_the_write_back_in_flight(sim):
    from optimshift.testing import deferred_streams

    with deferred_streams(seed=0, progress=0.0):
        model = Model([(4, 3), (3,)]).to(sim)
        opt = torch.optim.Adam(_params(model), foreach=True)
        with optimshift.streamed(opt, chunk_bytes=128) as handle:
            train(model, opt, range(2))
            p = list(opt.state)[-1]  # in the last chunk: its write-back is still queued
            assert torch.isnan(opt.state[p]["exp_avg"]).all(), "read before wait(): not written yet"
            handle.wait()
            assert not torch.isnan(opt.state[p]["exp_avg"]).any()


def _without(monkeypatch, name):
    """The streamed step's lanes with one of their orderings taken away, what a bug in the pipeline would do
    (the engine's streams keep theirs): a ``Streams`` method, or the host's wait for the events they record."""
    lane = _streaming._lane

    def broken(device):
        side = lane(device)
        side.streams = streams = copy.copy(side.streams)  # the same backend and streams, one method short
        if name == "host_wait":
            new_event = streams.new_event

            def deaf(device):
                event = new_event(device)
                event.synchronize = lambda: None
                return event

            streams.new_event = deaf
        else:
            setattr(streams, name, lambda *args: None)
        return side

    monkeypatch.setattr(_streaming, "_lane", broken)


@pytest.mark.parametrize(
    "name, error",
    [
        ("wait_event", "StreamRaceError"),
        ("wait_stream", "StreamRaceError"),
        ("record_stream", "StreamRaceError"),
        ("record", "StreamRaceError"),
        ("host_wait", "AssertionError"),
    ],
)
def test_a_missing_wait_is_caught(sim, monkeypatch, name, error):
    """Without the compute's wait for its load (``wait_event``), the lane's wait for the compute or for fresh
    memory (``wait_stream``), ``record_stream`` on what it copies, or the events it records, the race detector
    raises; without the host's wait, state_dict() reads write-backs that have not landed (the bitwise comparison
    fails)."""
    from optimshift.testing import StreamRaceError

    _without(monkeypatch, name)
    with pytest.raises(StreamRaceError if error == "StreamRaceError" else AssertionError):
        _scheduled_run(sim, 0, 0.0)
    _drain()


def _drain():
    """What was queued when a race was found runs, or raises, here (not in the next test)."""
    from optimshift.testing import StreamRaceError
    from optimshift.testing._sim_streams import synchronize

    for index in range(2):
        try:
            synchronize(index)
        except StreamRaceError:
            pass


def test_optimshift_wait_waits_for_a_streamed_steps_write_backs(sim):
    """``optimshift.wait(opt)`` (for code that reads the state directly and has no handle at hand) also waits
    for a streamed optimizer's last write-backs, as the handle's ``wait()`` does; it used to wait only for
    offloads and reloads, and the host state read right after a step on the simulator was still unwritten."""
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(4, 3, generator=g).to(sim)) for _ in range(2)]
    opt = torch.optim.Adam(params, foreach=False)
    twin_params = [torch.nn.Parameter(p.detach().cpu().clone()) for p in params]
    twin = torch.optim.Adam(twin_params, foreach=False)
    for step in range(2):
        for p, q in zip(params, twin_params):
            q.grad = torch.full_like(q, 0.5 + step)
            p.grad = q.grad.to(sim)
        if step == 1:
            optimshift.stream(opt, chunk_bytes=256)
        opt.step()
        twin.step()
    optimshift.wait(opt)
    for p, q in zip(params, twin_params):
        assert bitwise_equal(dict(opt.state[p]), dict(twin.state[q]))


# --- the layout: plan, the engine's copies into the chunks, its commit ----------------------------------------


def _snapshot(opt):
    """Where each entry is, its object and its values (a clone of each): what must not change on a refusal."""
    return state_layout(opt), tensor_ids(opt), _values(opt, clone=True)


def _values(opt, clone=False):
    """Each entry's values on the host (a tensor's, or each tensor's in a list), by (param index, key)."""

    def host(v):
        return v.detach().cpu().clone() if clone else v.detach().cpu()

    return {
        (i, k): [host(t) for t in v] if isinstance(v, list) else host(v)
        for i, st in enumerate(opt.state.values())
        for k, v in st.items()
    }


def _unchanged(opt, before):
    layout, ids, values = before
    assert state_layout(opt) == layout and tensor_ids(opt) == ids
    now = _values(opt)
    assert now.keys() == values.keys() and all(bitwise_equal(now[k], values[k]) for k in values)
    assert not optimshift.is_streamed(opt) and "step" not in opt.__dict__


class _Placed(torch.optim.Adam):
    """Adam whose registered policy puts ``exp_avg`` on a second device."""


@pytest.mark.parametrize("bad", ["nested", "parameter", "another device"])
def test_state_that_cannot_stream_is_refused_naming_the_entry_before_anything_changes(sim, bad):
    """The plan places each entry (the session's Placer); what streaming cannot lay out is refused over the plan,
    before a buffer is taken or a copy made, naming the optimizer, the param and the key."""
    cls = _Placed if bad == "another device" else torch.optim.Adam
    if bad == "another device":
        other = torch.device(sim.type, 1)
        optimshift.register_policy(
            _Placed, lambda key, value, param, group, device: other if key == "exp_avg" else None, separable=True
        )
    try:
        model = Model([(4, 3), (3,)]).to(sim)
        opt = cls(_params(model), foreach=False)
        train(model, opt, range(1))
        p = _params(model)[1]
        if bad == "nested":
            opt.state[p]["history"] = [torch.zeros(3, device=sim)]
        elif bad == "parameter":
            opt.state[p]["frozen"] = torch.nn.Parameter(torch.zeros(3, device=sim))
        before = _snapshot(opt)
        gc.collect()
        in_use = optimshift.host_pool.stats().in_use
        with pytest.raises(ValueError) as info:
            optimshift.stream(opt, chunk_bytes=64, device=sim)
        message = str(info.value)
        expected = {
            "nested": "group 0, param 1: state 'history' holds a tensor inside a list that belongs on sim:0",
            "parameter": "group 0, param 1: state 'frozen' is a Parameter; streaming lays out plain tensors only",
            "another device": "group 0, param 0: state 'exp_avg' belongs on sim:1, but stream(device=sim:0)",
        }[bad]
        assert message.startswith(f"{cls.__name__}: ") and expected in message, message
        _unchanged(opt, before)
        assert optimshift.host_pool.stats().in_use == in_use, "no chunk buffer kept"
    finally:
        optimshift.unregister_policy(_Placed)


@pytest.mark.parametrize("key", ["exp_avg", "step"])
def test_state_on_meta_is_refused_naming_the_entry_before_anything_changes(sim, key):
    """A state entry on meta (no data) raised torch's NotImplementedError "Cannot copy out of meta tensor" from
    the layout's copies: now a ValueError naming the optimizer and the entry, as a move's, with nothing changed."""
    model = Model([(4, 3), (3,)]).to(sim)
    opt = torch.optim.Adam(_params(model), foreach=False)
    train(model, opt, range(1))
    p = _params(model)[1]
    opt.state[p][key] = torch.empty_like(opt.state[p][key], device="meta")
    layout, ids = state_layout(opt), tensor_ids(opt)
    gc.collect()
    in_use = optimshift.host_pool.stats().in_use
    with pytest.raises(ValueError) as info:
        optimshift.stream(opt, chunk_bytes=64)
    message = str(info.value)
    assert message.startswith(f"Adam: stream: group 0, param 1, state['{key}'] is on meta, which holds no data"), (
        message
    )
    assert "nothing was changed" in message, message
    assert state_layout(opt) == layout and tensor_ids(opt) == ids
    assert not optimshift.is_streamed(opt) and "step" not in opt.__dict__
    assert optimshift.host_pool.stats().in_use == in_use, "no chunk buffer kept"


def test_a_tensor_two_entries_hold_is_refused_by_the_engines_sharing_rule(sim):
    """Two entries holding one tensor would each get a place of their own in a chunk: the engine's rule for
    entries given places of their own refuses it (streaming keeps no sharing check), before anything changes."""
    model = Model([(4, 3), (4, 3)]).to(sim)
    opt = torch.optim.Adam(_params(model), foreach=False)
    train(model, opt, range(1))
    p0, p1 = _params(model)
    opt.state[p1]["exp_avg"] = opt.state[p0]["exp_avg"]
    before = _snapshot(opt)
    with pytest.raises(ValueError) as info:
        optimshift.stream(opt, chunk_bytes=64)
    message = str(info.value)
    assert "one tensor is shared by group 0, param 0, state['exp_avg'] and group 0, param 1, state['exp_avg']" in (
        message
    )
    assert "each given a place of their own" in message and "nothing was changed" in message, message
    _unchanged(opt, before)


@pytest.mark.parametrize("where", ["buffer", "copies", "commit"])
def test_a_failure_half_way_in_the_layout_leaves_the_state_as_it_was(sim, monkeypatch, where):
    """An OOM taking the third chunk's host buffer, an error in the engine's copies once every copy into the
    chunks is queued, or in the commit's decisions: stream() raises, every entry is where it was, the same object
    with the same values, and every chunk buffer is back in the pool; the optimizer steps on as before."""
    from optimshift import _chunks

    runs = []
    for _ in range(2):  # (one to stream, a reference)
        model = Model([(4, 3), (3,), (2, 3), (5,)]).to(sim)
        opt = torch.optim.Adam(_params(model), foreach=True)
        train(model, opt, range(2))
        runs.append((model, opt))
    (model, opt), (ref_model, ref) = runs
    before = _snapshot(opt)
    gc.collect()
    in_use = optimshift.host_pool.stats().in_use
    if where == "buffer":
        real, made = _chunks.new_chunk, []

        def failing(part, chunk_bytes):
            if len(made) == 2:
                raise RuntimeError("injected: out of pinned memory")
            made.append(1)
            return real(part, chunk_bytes)

        monkeypatch.setattr(_chunks, "new_chunk", failing)
    elif where == "copies":

        def failing_copies(*args, **kwargs):  # (the engine's own copies, queued after those into the chunks)
            raise RuntimeError("injected: in the engine's copies, after those into the chunks")

        monkeypatch.setattr(_engine, "copy_items", failing_copies)
    else:

        def failing_adoptions(*args, **kwargs):
            raise RuntimeError("injected: deciding the commit")

        monkeypatch.setattr(_engine, "adoptions", failing_adoptions)
    with pytest.raises(RuntimeError, match="injected"):
        optimshift.stream(opt, chunk_bytes=128)
    monkeypatch.undo()
    _unchanged(opt, before)
    gc.collect()
    assert optimshift.host_pool.stats().in_use == in_use, "every chunk buffer back in the pool"
    train(model, opt, range(2, 3))
    train(ref_model, ref, range(2, 3))
    _assert_same(model, opt, ref_model, ref)


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
@pytest.mark.parametrize("where", ["copy", "front", "guards"])
def test_a_stream_that_fails_part_way_leaves_the_optimizer_as_it_was(sim, monkeypatch, where, error):
    """stream() laid the state out on the host, then installed its fronts (step, load_state_dict, state_dict) and
    guards: a failure installing them left the state in host chunks and the fronts in place on an optimizer not
    streamed. Wherever it fails, the optimizer is as it was (objects, devices, values, fronts, hooks, record)."""
    from optimshift import _offload

    (model, opt), (ref_model, ref) = _pair([(4, 3), (3,)], sim, torch.optim.Adam, foreach=False)
    train(model, opt, range(1))
    train(ref_model, ref, range(1))
    before = as_it_is(opt)

    def fail(*args, **kwargs):
        raise error("injected")

    class Failing(_offload.Front):
        def __init__(self, optimizer, name, front):
            if name == "load_state_dict":  # (the step's front is in place)
                fail()
            super().__init__(optimizer, name, front)

    owner, name, value = {
        "copy": (_engine, "copy_into", fail),
        "front": (_offload, "Front", Failing),
        "guards": (_streaming, "install_guards", fail),
    }[where]
    monkeypatch.setattr(owner, name, value)
    with pytest.raises(error, match="injected"):
        optimshift.stream(opt, chunk_bytes=64)
    monkeypatch.undo()
    assert not optimshift.is_streamed(opt)
    assert_as_it_was(opt, before)
    optimshift.stream(opt, chunk_bytes=64)
    train(model, opt, range(1, 3))
    train(ref_model, ref, range(1, 3))
    optimshift.unstream(opt)
    _assert_same(model, opt, ref_model, ref)


@pytest.mark.parametrize("seed, progress", SCHEDULES)
def test_a_failed_commit_laying_out_a_first_steps_state_gives_its_chunks_back(sim, monkeypatch, seed, progress):
    """The first streamed step lays out the state it made without waiting for the copies into the chunks: a
    commit that fails there waits for them, gives each chunk's buffer back to the pool (idle, not freed), and
    leaves the state where the step made it, the same objects, the same values."""
    from optimshift import _chunks
    from optimshift.pool import host_pool

    with deferred_streams(seed=seed, progress=progress):
        model = Model([(4, 3), (3,), (2, 3), (5,)]).to(sim)
        opt = torch.optim.Adam(_params(model), foreach=True)
        optimshift.stream(opt, chunk_bytes=128)  # (no state yet: the first step makes it, then lays it out)
        real_chunk, buffers, seen = _chunks.new_chunk, [], []

        def recorded(part, chunk_bytes):
            chunk = real_chunk(part, chunk_bytes)
            buffers.append(chunk.buffer)
            return chunk

        def failing(*args, **kwargs):
            seen.append(_snapshot(opt))  # (the state as the step made it, before the commit decides)
            raise KeyboardInterrupt("injected: Ctrl-C in the layout's commit")

        monkeypatch.setattr(_chunks, "new_chunk", recorded)
        monkeypatch.setattr(_engine, "adoptions", failing)
        for i, p in enumerate(_params(model)):
            p.grad = grad_for(0, i, p.shape).to(sim)
        with pytest.raises(KeyboardInterrupt, match="injected"):
            opt.step()
        monkeypatch.undo()
        assert buffers and seen
        layout, ids, values = seen[0]
        assert state_layout(opt) == layout and tensor_ids(opt) == ids
        now = _values(opt)
        assert all(bitwise_equal(now[k], values[k]) for k in values)
        with host_pool._locked():
            idle = {id(buf) for buf, _, _ in host_pool._idle}
        assert all(id(buf) in idle for buf in buffers), "every chunk's buffer is back in the pool"
        assert _device_streams.of(sim).side(sim, "stream").query(), "once the copies into them were done"
        optimshift.unstream(opt)


def _fail_the_first_write_back(sim, monkeypatch, model, opt, ref_model, ref):
    """A streamed step whose first write-back (chunk 0's, param 0 stepped) raises; the reference steps param 0
    alone."""
    real = _streaming._queue

    def failing(side, dst, src, **kwargs):
        if dst.device.type == "cpu":
            raise RuntimeError("injected: the write-back failed")
        return real(side, dst, src, **kwargs)

    monkeypatch.setattr(_streaming, "_queue", failing)
    for i, p in enumerate(_params(model)):
        p.grad = grad_for(2, i, p.shape).to(sim)
    with pytest.raises(RuntimeError, match="injected"):
        opt.step()
    monkeypatch.undo()
    for i, p in enumerate(_params(ref_model)):
        p.grad = grad_for(2, i, p.shape).to(sim) if i == 0 else None
    ref.step()


@pytest.mark.parametrize("seed, progress", SCHEDULES[:2])
def test_a_failing_write_back_keeps_the_stepped_state(sim, monkeypatch, seed, progress):
    """The first chunk's write-back raises once its param was stepped: its new moments, in the device window only,
    stay with its state (on the device) until the next step lays them out in host buffers again; nothing is lost,
    and the steps after it, unstream included, are the ordinary optimizer's."""
    with deferred_streams(seed=seed, progress=progress):
        (model, opt), (ref_model, ref) = _pair([(4, 3), (3,), (2, 3), (5,)], sim, torch.optim.Adam, foreach=True)
        optimshift.stream(opt, chunk_bytes=128)  # one param per chunk
        train(model, opt, range(2))
        train(ref_model, ref, range(2))
        _fail_the_first_write_back(sim, monkeypatch, model, opt, ref_model, ref)
        _assert_same(model, opt, ref_model, ref)
        train(model, opt, range(3, 5))
        train(ref_model, ref, range(3, 5))
        _assert_same(model, opt, ref_model, ref)
        assert set(state_layout(opt).values()) == {torch.device("cpu")}
        optimshift.unstream(opt)
        assert state_layout(opt) == state_layout(ref)
        _assert_same(model, opt, ref_model, ref)


@pytest.mark.parametrize("seed, progress", SCHEDULES[:2])
def test_unstream_after_a_failing_write_back_gives_each_entry_its_own_storage(sim, monkeypatch, seed, progress):
    """unstream() right after a failed write-back left that chunk's entries as views of the device window the step
    ran in: one storage (the window's, a chunk's capacity) shared by every entry of the chunk, for good, where a
    fresh optimizer keeps each entry in storage of its own (a later move of one of those params to another device
    was then refused as a split of shared storage). The chunk is laid out first, as the next step would."""
    with deferred_streams(seed=seed, progress=progress):
        (model, opt), (ref_model, ref) = _pair([(4, 3), (3,), (2, 3), (5,)], sim, torch.optim.Adam, foreach=True)
        optimshift.stream(opt, chunk_bytes=128)  # one param per chunk
        train(model, opt, range(2))
        train(ref_model, ref, range(2))
        _fail_the_first_write_back(sim, monkeypatch, model, opt, ref_model, ref)
        optimshift.unstream(opt)
        assert state_layout(opt) == state_layout(ref)
        _assert_same(model, opt, ref_model, ref)
        tensors = [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
        storages = {(t.device, t.untyped_storage().data_ptr()) for t in tensors}
        assert len(storages) == len(tensors)
        assert all(t.untyped_storage().nbytes() == t.numel() * t.element_size() for t in tensors)
        train(model, opt, range(3, 5))
        train(ref_model, ref, range(3, 5))
        _assert_same(model, opt, ref_model, ref)


@pytest.mark.parametrize("seed, progress", SCHEDULES[:2])
@pytest.mark.parametrize("how", ["state_dict", "deepcopy"])
def test_a_state_dict_after_a_failing_write_back_holds_compact_host_copies(sim, monkeypatch, seed, progress, how):
    """state_dict() (so optimshift.save) or a copy of the optimizer right after a failed write-back held that
    chunk's entries as the device window's views (on the device, the window's whole storage): they hold compact
    host copies of the stepped values, as after any streamed step; the live objects are kept."""
    with deferred_streams(seed=seed, progress=progress):
        (model, opt), (ref_model, ref) = _pair([(4, 3), (3,), (2, 3), (5,)], sim, torch.optim.Adam, foreach=True)
        optimshift.stream(opt, chunk_bytes=128)  # one param per chunk
        train(model, opt, range(2))
        train(ref_model, ref, range(2))
        _fail_the_first_write_back(sim, monkeypatch, model, opt, ref_model, ref)
        ids = tensor_ids(opt)
        if how == "state_dict":
            states = opt.state_dict()["state"].values()
        else:
            twin = copy.deepcopy(opt)  # (its params are copies: by position)
            states = [twin.state[p] for g in twin.param_groups for p in g["params"]]
        ref_states = [ref.state[p] for p in _params(ref_model)]
        for st, ref_st in zip(states, ref_states):
            for k, v in st.items():
                assert v.device.type == "cpu", k
                assert v.untyped_storage().nbytes() == v.numel() * v.element_size(), k
                assert bitwise_equal(v, ref_st[k].cpu()), k
        assert tensor_ids(opt) == ids
        train(model, opt, range(3, 5))
        train(ref_model, ref, range(3, 5))
        _assert_same(model, opt, ref_model, ref)


@pytest.mark.parametrize("seed, progress", SCHEDULES[:2])
def test_a_ctrl_c_while_a_state_dict_lays_out_a_failed_write_back_keeps_one_chunk_per_param(
    sim, monkeypatch, seed, progress
):
    """state_dict() lays out a chunk whose write-back failed (no operation around it): a Ctrl-C its commit held was
    raised once that layout was in place, and the relay took it for a failure, keeping the old chunk too: the param
    in two chunks, the new one's pinned buffer held until unstream(). The layout stands, one chunk per param."""
    import signal

    with deferred_streams(seed=seed, progress=progress):
        (model, opt), (ref_model, ref) = _pair([(4, 3), (3,), (2, 3), (5,)], sim, torch.optim.Adam, foreach=True)
        optimshift.stream(opt, chunk_bytes=128)  # one param per chunk
        train(model, opt, range(2))
        train(ref_model, ref, range(2))
        _fail_the_first_write_back(sim, monkeypatch, model, opt, ref_model, ref)
        mode, adopt = _streaming._mode_of(opt), _engine.adopt

        def interrupted(*args, **kwargs):
            signal.raise_signal(signal.SIGINT)  # (a real Ctrl-C, inside the commit: held until it is applied)
            return adopt(*args, **kwargs)

        monkeypatch.setattr(_engine, "adopt", interrupted)
        with pytest.raises(KeyboardInterrupt):
            opt.state_dict()
        monkeypatch.undo()
        chunks = list(mode._chunks.values())
        assert sorted(id(p) for c in chunks for p in c.params) == sorted(map(id, _params(model)))
        assert all(mode._chunk_of[id(p)] is c for c in chunks for p in c.params) and not mode._unwritten
        train(model, opt, range(3, 5))
        train(ref_model, ref, range(3, 5))
        assert mode.chunks == len(_params(model))
        _assert_same(model, opt, ref_model, ref)


def _careless_layout(monkeypatch, name):
    """The layout's copies (the engine's, into the chunks' host views) with one ordering taken away: their
    ``record_stream`` or their wait for the current stream, or queued on the engine's lane, not the step's."""
    if name == "lane":
        monkeypatch.setattr(_streaming, "_LAYOUT", optimshift._copy.Options(non_blocking=True, lane="engine"))
        return
    real = _engine.copy_into

    def careless(pairs, side=None, **kwargs):
        if side is not None:
            side = copy.copy(side)
            side.streams = copy.copy(side.streams)
            setattr(side.streams, name, lambda *args: None)
        return real(pairs, side=side, **kwargs)

    monkeypatch.setattr(_engine, "copy_into", careless)


@pytest.mark.parametrize("seed, progress", SCHEDULES)
@pytest.mark.parametrize("broken", [None, "record_stream", "wait_stream", "lane"])
def test_the_state_a_first_step_makes_is_laid_out_without_a_host_wait(sim, monkeypatch, seed, progress, broken):
    """Streamed before any step, the first step makes the state on the device and lays it out in its chunks
    through the engine, non-blocking on the step's lane: no host wait (a write-back event is pending), and the
    next step's loads come after those copies. Without the layout's ``record_stream`` (the state it reads is
    adopted away and freed), its wait for the step that wrote the state, or on another lane than the loads', the
    race detector raises."""
    from optimshift.testing import StreamRaceError, deferred_streams

    if broken is not None:
        _careless_layout(monkeypatch, broken)
    try:
        with deferred_streams(seed=seed, progress=progress):
            (model, opt), (ref_model, ref) = _pair([(4, 3), (3,), (2, 3), (5,), (16, 16)], sim, torch.optim.Adam)
            handle = optimshift.stream(opt, chunk_bytes=128)
            train(model, opt, range(1))
            assert handle._pending and handle.chunks == 5, "laid out on the lane, the host did not wait"
            train(model, opt, range(1, 3))
            train(ref_model, ref, range(3))
            assert bitwise_equal(opt.state_dict()["state"], ref.state_dict()["state"])
            _assert_same(model, opt, ref_model, ref)
        assert broken is None, f"without {broken} the race detector should have raised"
    except StreamRaceError:
        assert broken is not None
        _drain()


def test_a_grad_kept_as_state_stays_the_params(sim):
    """The layout commits through the engine, which never changes a param's grad in place: a state entry that is
    the grad (a third-party optimizer keeping it) gets its host copy in its place, and the param keeps its grad
    on the device. (On the simulator no mechanism keeps a tensor another holds anyway; where ``set_data`` applies,
    streaming's own commit moved the grad itself: ``tests/test_stream_cuda.py``.)"""
    model = Model([(4, 3), (3,)]).to(sim)
    opt = torch.optim.Adam(_params(model), foreach=False)
    train(model, opt, range(1))
    p = _params(model)[0]
    grad = p.grad
    values = grad.detach().cpu().clone()
    opt.state[p]["kept_grad"] = grad
    optimshift.stream(opt, chunk_bytes=256)
    assert p.grad is grad and grad.device == sim and bitwise_equal(grad.cpu(), values)
    kept = opt.state[p]["kept_grad"]
    assert kept is not grad and kept.device.type == "cpu" and bitwise_equal(kept, values)


def test_a_step_kept_from_before_stream_is_refused_and_steps_nothing(sim):
    # A bound step saved before stream() (Accelerate keeps one under a GradScaler) is the class's own step: run
    # while streamed, it would step the host state in place of the streamed step. Before: it ran over host state and
    # stopped on torch's device mismatch ("sim:0 and cpu"), after a foreach step had counted its host `step`s.
    # A pre-hook registered before stream() (one that changes the grads) runs only once the step may run.
    model = Model([(4, 3), (3,)]).to(sim)
    opt = torch.optim.Adam(_params(model), foreach=True)
    fired = []

    def halve_grads(optimizer, args, kwargs):
        fired.append(1)
        for p in _params(model):
            p.grad.mul_(0.5)

    opt.register_step_pre_hook(halve_grads)
    kept = opt.step
    optimshift.stream(opt)
    train(model, opt, range(1))  # the streamed step runs, its hooks once
    assert len(fired) == 1
    _streaming._mode_of(opt).wait()
    params = [p.detach().clone() for p in _params(model)]
    values = {i: {k: v.clone() for k, v in st.items()} for i, st in enumerate(opt.state.values())}
    ids = tensor_ids(opt)
    for i, p in enumerate(_params(model)):
        p.grad = grad_for(1, i, p.shape).to(sim)
    grads = [p.grad.clone() for p in _params(model)]
    with pytest.raises(RuntimeError, match=r"Adam is streamed .* kept from before stream\(\).*nothing was stepped"):
        kept()
    assert len(fired) == 1 and all(bitwise_equal(p.grad, g) for p, g in zip(_params(model), grads))
    assert tensor_ids(opt) == ids
    assert all(bitwise_equal(a, b) for a, b in zip(_params(model), params))
    assert all(bitwise_equal(dict(st), values[i]) for i, st in enumerate(opt.state.values()))
    opt.step()  # the streamed step still runs
    assert len(fired) == 2
    optimshift.unstream(opt)
    kept()  # unstreamed: the kept step is the optimizer's own again
    assert len(fired) == 3


def test_a_kept_step_in_another_thread_is_refused_while_one_thread_steps(sim):
    # Inside the streamed step of one thread (its closure), a kept step called by another thread is still refused.
    import threading

    model = Model([(3,)]).to(sim)
    opt = torch.optim.Adam(_params(model))
    kept = opt.step
    optimshift.stream(opt)
    train(model, opt, range(1))
    inside, release, outcome = threading.Event(), threading.Event(), []

    def closure():
        inside.set()
        release.wait(30)
        return None

    def other():
        inside.wait(30)
        try:
            kept()
            outcome.append("ran")
        except RuntimeError as e:
            outcome.append(str(e))
        finally:
            release.set()

    thread = threading.Thread(target=other)
    thread.start()
    opt.step(closure)
    thread.join(30)
    assert len(outcome) == 1 and "kept from before stream()" in outcome[0], outcome


def test_streaming_a_wrapper_streams_the_optimizer_it_wraps(sim):
    # Before: stream(wrapper) refused it as not an Optimizer, and is_streamed(wrapper) was False for a streamed one.
    (model, opt), (ref_model, ref) = _pair([(4, 3), (3,)], sim)
    wrapper = Delegating(opt)
    handle = optimshift.stream(wrapper)
    assert handle.optimizer is opt and optimshift.is_streamed(opt) and optimshift.is_streamed(wrapper)
    train(model, opt, range(2))
    train(ref_model, ref, range(2))
    assert optimshift.unstream(wrapper) is wrapper and not optimshift.is_streamed(opt)
    assert "step" not in opt.__dict__
    _assert_same(model, opt, ref_model, ref)
    with optimshift.streamed(wrapper) as handle:
        assert handle.optimizer is opt
    assert not optimshift.is_streamed(opt)


def test_a_compiled_step_runs_the_streamed_step_as_it_is(sim):
    # torch.compile of the streamed step (directly, or of a function that calls it) runs it eagerly, chunk by chunk,
    # as the ordinary streamed step. Before: dynamo traced into its copies and events and failed (compiling the
    # disabled step itself compiled the function it wraps); compiled (and run) before stream(), the class's step is
    # refused.
    torch._dynamo.reset()
    try:
        (model, opt), (ref_model, ref) = _pair([(4, 3), (3,)], sim, foreach=True)
        (model2, opt2), _ = _pair([(4, 3), (3,)], sim, foreach=True)
        optimshift.stream(opt, chunk_bytes=64)
        optimshift.stream(opt2, chunk_bytes=64)
        direct = torch.compile(opt.step, backend="eager")

        @torch.compile(backend="eager")
        def calls_it():
            opt2.step()

        for step in range(2):
            for m in (model, model2, ref_model):
                for i, p in enumerate(_params(m)):
                    p.grad = grad_for(step, i, p.shape).to(sim)
            direct()
            calls_it()
            ref.step()
        _assert_same(model, opt, ref_model, ref)
        _assert_same(model2, opt2, ref_model, ref)
        assert optimshift.check(opt).ok and optimshift.check(opt2).ok

        model3, opt3 = _pair([(3,)], sim)[0]
        kept = torch.compile(opt3.step, backend="eager")
        for i, p in enumerate(_params(model3)):
            p.grad = grad_for(0, i, p.shape).to(sim)
        kept()  # (compiled and run on the device state, as a loop does before it is streamed)
        optimshift.stream(opt3)
        _streaming._mode_of(opt3).wait()
        before = tensor_ids(opt3)
        values = {i: {k: v.clone() for k, v in st.items()} for i, st in enumerate(opt3.state.values())}
        params = [p.detach().clone() for p in _params(model3)]
        for i, p in enumerate(_params(model3)):
            p.grad = grad_for(1, i, p.shape).to(sim)
        with pytest.raises(RuntimeError, match="kept from before stream"):
            kept()
        assert tensor_ids(opt3) == before
        assert all(bitwise_equal(dict(st), values[i]) for i, st in enumerate(opt3.state.values()))
        assert all(bitwise_equal(a, b) for a, b in zip(_params(model3), params))
    finally:
        torch._dynamo.reset()  # (the compiled frames hold the optimizers)


@pytest.mark.parametrize("reset", ["clear", "del"])
def test_state_built_anew_while_streamed_goes_back_to_the_host(sim, reset):
    """``opt.state.clear()`` (the usual optimizer reset) or ``del opt.state[p]`` while streamed: the next step
    builds that state anew on the device, and it goes back to the host with the rest, as streamed state lives.
    Before, the chunks still held the old dicts, whose tensors had not changed, so the new state stayed on the
    device for good (the streaming's memory saving lost, ``check()`` not OK); values were right."""
    shapes = [(64, 64)] * 4
    (model, opt), (ref_model, ref) = _pair(shapes, sim)
    optimshift.stream(opt, chunk_bytes=40_000)
    train(model, opt, range(2))
    train(ref_model, ref, range(2))
    for o in (opt, ref):
        if reset == "clear":
            o.state.clear()
        else:
            del o.state[o.param_groups[0]["params"][1]]
    train(model, opt, range(2, 4))
    train(ref_model, ref, range(2, 4))
    _streaming._mode_of(opt).wait()
    assert [st[k].device.type for st in opt.state.values() for k in st] == ["cpu"] * 12
    assert optimshift.check(opt).ok
    _assert_same(model, opt, ref_model, ref)


def test_a_copy_of_a_streamed_optimizer_is_an_ordinary_one_that_move_places(sim):
    """What the README says of ``copy.deepcopy`` of a streamed optimizer: an ordinary optimizer (not streamed) with
    the state on the host, which ``check()`` reports and ``move`` puts where a fresh one keeps it; it then steps."""
    (model, opt), _ = _pair([(8, 4), (4,)], sim)
    optimshift.stream(opt)
    train(model, opt, range(2))
    twin = copy.deepcopy(opt)
    assert not optimshift.is_streamed(twin) and not optimshift.check(twin).ok
    optimshift.move(twin)
    assert optimshift.check(twin).ok
    for p in twin.param_groups[0]["params"]:
        p.grad = torch.ones_like(p)
    twin.step()


def test_a_state_dict_set_from_outside_while_streamed_is_laid_out_before_the_step(sim):
    """``opt.state[p] = {...}`` between streamed steps (host tensors, as a manual edit or a partial restore leaves):
    laid out before the step reads it, so the step runs and matches a reference given the same state. Before, the
    chunk still held the old dict, and the step failed half-way ("Expected all tensors to be on the same device"),
    after the earlier chunks had stepped (found by review)."""
    shapes = [(64, 64)] * 4
    (model, opt), (ref_model, ref) = _pair(shapes, sim)
    optimshift.stream(opt, chunk_bytes=40_000)
    train(model, opt, range(2))
    train(ref_model, ref, range(2))
    _streaming._mode_of(opt).wait()
    p, q = opt.param_groups[0]["params"][2], ref.param_groups[0]["params"][2]
    opt.state[p] = {k: v.clone() for k, v in opt.state[p].items()}  # (on the host, where streamed state lives)
    ref.state[q] = {k: v.clone() for k, v in ref.state[q].items()}
    train(model, opt, range(2, 4))
    train(ref_model, ref, range(2, 4))
    _assert_same(model, opt, ref_model, ref)
    assert optimshift.check(opt).ok


def test_a_load_while_streamed_puts_a_device_lr_where_stream_lays_it_out(sim):
    """A load into a streamed optimizer placed everything on the host, its groups' tensors too: a device lr (a
    capturable step's) stayed on the host after unstream(), where a load alone, or a stream/unstream round trip,
    keeps it on the device. The state loads into host memory, the groups' tensors where stream() puts them."""
    import copy

    p = torch.nn.Parameter(torch.ones(4, device=sim))
    opt = torch.optim.Adam([p], lr=torch.tensor(0.01, device=sim), capturable=True)
    p.grad = torch.ones_like(p)
    opt.step()
    saved = copy.deepcopy(opt.state_dict())
    optimshift.stream(opt)
    opt.load_state_dict(saved)
    assert opt.param_groups[0]["lr"].device == sim and opt.state[p]["exp_avg"].device.type == "cpu"
    optimshift.unstream(opt)
    assert opt.param_groups[0]["lr"].device == sim and opt.state[p]["exp_avg"].device == sim
    assert optimshift.check(opt).ok and not optimshift.check(opt).findings
    opt.step()


def test_a_load_while_streamed_puts_optimizer_wide_entries_where_stream_lays_them_out(sim):
    """A one-element tensor under a plain state key (TRAC's shape), made with the params: stream() keeps it on the
    device, a load while streamed put it on the host and the next step mixed devices."""
    import copy

    from _custom_optimizers import WideScale

    optimshift.register_policy(WideScale, lambda *args: None, separable=True)
    try:
        p = torch.nn.Parameter(torch.ones(4, device=sim))
        opt = WideScale([p])
        p.grad = torch.ones_like(p)
        opt.step()
        saved = copy.deepcopy(opt.state_dict())
        optimshift.stream(opt)
        assert opt.state["s"].device == sim
        opt.load_state_dict(saved)
        assert opt.state["s"].device == sim
        opt.step()
        optimshift.unstream(opt)
    finally:
        optimshift.unregister_policy(WideScale)


def test_a_state_dict_pre_hook_registered_with_prepend_sees_the_written_back_state(sim):
    """A user's ``state_dict`` pre-hook registered with ``prepend=True`` after ``stream()`` ran before optimshift's
    own pre-hook, the one that waited for the last step's write-backs: it read host state the copies had not
    written yet (garbage under the strict schedule). ``state_dict()`` now waits before any hook runs."""
    from optimshift.testing import deferred_streams

    def snap(o):
        return [t.clone() for st in o.state.values() for t in st.values()]

    with deferred_streams(seed=0, progress=0.0):
        (model, opt), (ref_model, ref) = _pair([(4, 3), (3,), (16, 16)], sim, torch.optim.Adam, foreach=True)
        optimshift.stream(opt, chunk_bytes=128)
        seen, ref_seen = [], []
        opt.register_state_dict_pre_hook(lambda o: seen.append(snap(o)), prepend=True)
        ref.register_state_dict_pre_hook(lambda o: ref_seen.append(snap(o)), prepend=True)
        train(model, opt, range(2))
        train(ref_model, ref, range(2))
        opt.state_dict()
        ref.state_dict()
        assert len(seen) == 1 and bitwise_equal(seen, ref_seen)
        optimshift.unstream(opt)


def test_a_host_param_that_moves_to_the_device_while_streamed_is_picked_up(sim):
    """A param on the host (its state on the host too, nothing streamed) moved to the device while streamed
    (``model.to``): its state was never laid out again, as a streamed param's is when it moves, so the next step
    ran the class's step over a device param with host state ("Expected all tensors to be on the same
    device"). Its state now goes into a chunk, as stream() would have put it, and the step matches a reference
    whose state moved with the param."""
    (model, opt), (ref_model, ref) = _pair([(4, 3), (3,), (2, 3)], sim, torch.optim.Adam, foreach=False)
    for m in (model, ref_model):
        m.parts[1].to("cpu")
    optimshift.stream(opt, chunk_bytes=128)
    train(model, opt, range(2))
    train(ref_model, ref, range(2))
    for m in (model, ref_model):
        m.parts[1].to(sim)
    q = _params(ref_model)[1]
    ref.state[q] = {k: v if k == "step" else v.to(sim) for k, v in ref.state[q].items()}
    train(model, opt, range(2, 4))
    train(ref_model, ref, range(2, 4))
    _assert_same(model, opt, ref_model, ref)
    assert {k: v.device.type for k, v in opt.state[_params(model)[1]].items()} == {
        "step": "cpu",
        "exp_avg": "cpu",
        "exp_avg_sq": "cpu",
    }
    optimshift.unstream(opt)
    assert opt.state[_params(model)[1]]["exp_avg"].device == sim
    assert optimshift.check(opt).ok


@pytest.mark.parametrize("edit", ["removed", "to another group"])
def test_a_param_taken_out_of_its_chunks_group_is_stepped_as_the_groups_say(sim, edit):
    """A param taken out of its group while streamed (``group["params"].pop(i)``), or moved to another group:
    its chunk, found in place through the params before it, was stepped whole, so the param was still updated
    with the old group's hyperparameters (removed: stepped at all; moved: with the old group's lr, and not with
    the new one's). A chunk is now stepped only when every param of it is still in its group, where it was laid
    out; else its params are laid out again first."""
    (model, opt), (ref_model, ref) = _pair([(4, 3), (3,), (2, 3), (5,)], sim, torch.optim.Adam, foreach=True)
    for m, o in ((model, opt), (ref_model, ref)):
        o.param_groups[0]["params"] = _params(m)[:3]
        o.add_param_group({"params": _params(m)[3:], "lr": 0.1})
    optimshift.stream(opt, chunk_bytes=1 << 20)  # (one chunk per group)
    train(model, opt, range(2))
    train(ref_model, ref, range(2))
    for o in (opt, ref):
        p = o.param_groups[0]["params"].pop(1)
        if edit != "removed":
            o.param_groups[1]["params"].append(p)
    train(model, opt, range(2, 4))
    train(ref_model, ref, range(2, 4))
    _assert_same(model, opt, ref_model, ref)
    if edit != "removed":
        optimshift.unstream(opt)
        _assert_same(model, opt, ref_model, ref)


def test_a_load_whose_layout_failed_is_laid_out_by_the_next_step_which_then_steps(sim, monkeypatch, caplog):
    """A load while streamed whose layout in host buffers fails (an OOM pinning memory) leaves the loaded state
    valid and says the next step retries. The retry laid the state out, but the flag saying it was still to do
    stayed set: that step, and every step after it, raised "could not be laid out ... nothing was stepped" until
    unstream(). Now the step after the failed layout lays it out and steps, as a reference does."""
    from optimshift import _chunks

    (model, opt), (ref_model, ref) = _pair([(4, 3), (3,), (2, 3), (5,)], sim, torch.optim.Adam, foreach=True)
    optimshift.stream(opt, chunk_bytes=128)
    train(model, opt, range(2))
    train(ref_model, ref, range(2))
    saved = copy.deepcopy(ref.state_dict())
    real, made = _chunks.new_chunk, []

    def failing(part, chunk_bytes):
        made.append(1)
        if len(made) == 2:
            raise RuntimeError("injected: out of pinned memory")
        return real(part, chunk_bytes)

    monkeypatch.setattr(_chunks, "new_chunk", failing)
    with caplog.at_level("WARNING", logger="optimshift"):
        opt.load_state_dict(saved)
    assert "the next step retries" in caplog.text
    monkeypatch.undo()
    ref.load_state_dict(copy.deepcopy(saved))
    train(model, opt, range(2, 4))
    train(ref_model, ref, range(2, 4))
    _assert_same(model, opt, ref_model, ref)
    assert set(state_layout(opt).values()) == {torch.device("cpu")}
    optimshift.unstream(opt)
    _assert_same(model, opt, ref_model, ref)
