"""All or nothing: a failure in the middle of a move leaves the optimizer exactly as it was."""

import pytest
import torch

import optimshift
from optimshift import _copy as batch
from optimshift.pool import host_pool


class Boom(RuntimeError):
    pass


def _adam(device, n=30):
    params = [torch.nn.Parameter(torch.randn(3, 2, device=device)) for _ in range(n)]
    opt = torch.optim.Adam(params, fused=True)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    return params, opt


def _fingerprint(opt):
    return [(id(p), [(k, id(v), v.device) for k, v in st.items()]) for p, st in opt.state.items()], [
        [id(p) for p in g["params"]] for g in opt.param_groups
    ]


@pytest.fixture
def fail_on_50th(monkeypatch):
    """Every copy path (tensor by tensor, and grouped chunks cut to one tensor each) fails on its 50th call
    (a copy may count twice: copy_tensor calls Tensor.to; it still fails on the 50th)."""
    calls = {"n": 0}

    def flaky(real):
        def wrapper(*args, **kwargs):
            calls["n"] += 1
            if calls["n"] == 50:
                raise Boom("injected failure on the 50th copy (think: an OOM on the 900th tensor)")
            return real(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(batch, "copy_tensor", flaky(batch.copy_tensor))
    monkeypatch.setattr(torch.Tensor, "to", flaky(torch.Tensor.to))  # (copy_many copies a plain tensor inline)
    monkeypatch.setattr(batch, "_to_host", flaky(batch._to_host))
    monkeypatch.setattr(batch, "_to_device", flaky(batch._to_device))
    monkeypatch.setattr(batch, "CHUNK_BYTES", 1)
    return calls


@pytest.mark.parametrize("operation", ["move", "offload", "reload_to", "rebind"])
def test_failure_mid_transfer_leaves_optimizer_untouched(sim, fail_on_50th, operation):
    params, opt = _adam(sim)
    before = _fingerprint(opt)
    values = [{k: v.cpu() for k, v in st.items()} for st in opt.state.values()]
    with pytest.raises(Boom):
        if operation == "move":
            optimshift.move(opt, torch.device(sim.type, 1))
        elif operation == "offload":
            optimshift.offload(opt)
        elif operation == "reload_to":
            optimshift.reload(opt, "cpu")
        else:
            optimshift.rebind(opt, [torch.nn.Parameter(p.detach().cpu()) for p in params])
    assert fail_on_50th["n"] == 50
    assert _fingerprint(opt) == before
    assert host_pool.stats().in_use == 0, "buffers of a failed transfer go back to the pool"
    assert not optimshift.is_offloaded(opt)
    for st, vals in zip(opt.state.values(), values):
        for k, v in st.items():
            assert torch.equal(v.cpu(), vals[k])
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()  # still a working optimizer


def test_a_failure_splitting_staged_host_copies_gives_the_staging_buffer_back(sim, monkeypatch):
    """A move to the host stages grouped copies through a pool buffer, split into their own tensors once the
    copies are complete: a failure there (an interrupt) left that buffer in use while anything held the error,
    then freed instead of reused."""
    params, opt = _adam(sim, n=4)
    before = _fingerprint(opt)
    real = torch._foreach_copy_

    def split_fails(*args, **kwargs):
        monkeypatch.setattr(torch, "_foreach_copy_", real)
        raise Boom("injected failure while splitting the staged copies")

    monkeypatch.setattr(torch, "_foreach_copy_", split_fails)
    stats = host_pool.stats()
    with pytest.raises(Boom) as failure:
        optimshift.move(opt, "cpu")
    # (the error's frames still hold the buffer: it is given back, not left in use until they go)
    assert failure.value is not None and host_pool.stats().in_use == stats.in_use, "the staging buffer goes back"
    assert _fingerprint(opt) == before
