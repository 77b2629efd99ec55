"""The same guarantees on a real GPU (marked `cuda`: skipped without one; run by benchmarks/gpu_check.sh)."""

import pytest
import torch

import optimshift
from _matrix import CASES, Model, bitwise_equal, state_layout, train
from optimshift import _device_streams
from optimshift.pool import host_pool

pytestmark = pytest.mark.cuda
CUDA = torch.device("cuda", 0)


def _fresh(cls, kwargs, shapes, device, steps=2):
    model = Model(shapes).to(device)
    opt = cls(list(model.parameters()), **kwargs)
    train(model, opt, range(steps))
    return model, opt


@pytest.mark.parametrize("cls, kwargs, shapes", [pytest.param(c, k, s, id=n) for n, c, k, d, s in CASES if "h2d" in d])
def test_host_to_cuda_matches_fresh_placement_and_syncs(cls, kwargs, shapes):
    model, opt = _fresh(cls, kwargs, shapes, torch.device("cpu"))
    model.to(CUDA)
    optimshift.move(opt)
    fresh_model, fresh = _fresh(cls, kwargs, shapes, CUDA)
    assert state_layout(opt) == state_layout(fresh)
    assert optimshift.check(opt).ok
    with optimshift.count_syncs() as moved_syncs:
        train(model, opt, range(2, 4))
    with optimshift.count_syncs() as fresh_syncs:
        train(fresh_model, fresh, range(2, 4))
    assert moved_syncs.total == fresh_syncs.total


@pytest.mark.parametrize("kwargs", [{"foreach": False}, {"fused": True}, {"capturable": True}])
def test_offload_reload_round_trip_is_bitwise_and_returns_memory(kwargs):
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated(CUDA)
    model = Model([(256, 256)] * 4 + [(256,)] * 4).to(CUDA)
    params_bytes = torch.cuda.memory_allocated(CUDA) - base
    opt = torch.optim.Adam(model.parameters(), **kwargs)
    train(model, opt, range(2))
    for p in model.parameters():
        p.grad = None
    layout = state_layout(opt)
    values = {i: {k: v.clone() for k, v in st.items()} for i, st in enumerate(opt.state.values())}
    optimshift.offload(opt)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated(CUDA) - base == params_bytes, "the state's device memory is returned"
    assert all(v.is_pinned() for st in opt.state.values() for v in st.values() if v.dim() > 0)
    optimshift.reload(opt)
    assert state_layout(opt) == layout
    for i, st in enumerate(opt.state.values()):
        assert bitwise_equal(dict(st), values[i])


def test_non_blocking_handles_and_prefetch_before_forward():
    model = Model([(1024, 1024)] * 8).to(CUDA)
    opt = torch.optim.AdamW(model.parameters(), fused=True)
    train(model, opt, range(1))
    ref_model = Model([(1024, 1024)] * 8).to(CUDA)
    ref = torch.optim.AdamW(ref_model.parameters(), fused=True)
    train(ref_model, ref, range(1))
    handle = optimshift.offload(opt, non_blocking=True)
    assert isinstance(handle, optimshift.PendingTransfer)
    handle.wait()
    assert handle.done() and optimshift.is_offloaded(opt)
    reload = optimshift.reload(opt, non_blocking=True)  # issued before the forward pass: overlaps it
    x = torch.randn(4096, 1024, device=CUDA)
    for part in model.parts:
        x = torch.tanh(x @ part.weight.T)
    train(model, opt, range(1, 3))  # the step pre-hook makes the step wait for the reload on the device
    train(ref_model, ref, range(1, 3))
    reload.wait()
    for a, b in zip(model.parameters(), ref_model.parameters()):
        assert bitwise_equal(a, b)


def test_cuda_transfers_go_through_the_device_generic_streams():
    """The one async path: torch.Stream/torch.Event/torch.accelerator where torch has them (torch.cuda's before),
    probed once; a non-blocking round trip through it is bitwise and leaves the step waiting on the device."""
    streams = _device_streams.of(CUDA)
    generic = _device_streams._generic_api() and _device_streams.current_accelerator() == "cuda"
    expected = _device_streams._AcceleratorStreams if generic else _device_streams._ModuleStreams
    assert type(streams) is expected and _device_streams.pins_host_for(CUDA)
    model = Model([(256, 256)] * 4).to(CUDA)
    opt = torch.optim.Adam(model.parameters(), foreach=True)
    train(model, opt, range(2))
    values = {i: {k: v.clone() for k, v in st.items()} for i, st in enumerate(opt.state.values())}
    handle = optimshift.offload(opt, non_blocking=True)
    assert handle.device == CUDA
    handle.wait()
    for i, st in enumerate(opt.state.values()):
        assert bitwise_equal(dict(st), values[i])
    handle = optimshift.reload(opt, non_blocking=True)
    train(model, opt, range(2, 3))  # the step pre-hook: the default stream waits for the reload's event
    torch.cuda.synchronize()
    assert handle.done()


def test_no_pinned_growth_over_ten_cycles():
    model = Model([(512, 512)] * 6).to(CUDA)
    opt = torch.optim.Adam(model.parameters(), fused=True)
    train(model, opt, range(1))
    optimshift.offload(opt)
    optimshift.reload(opt)
    before = host_pool.stats().allocations
    for step in range(10):
        optimshift.offload(opt)
        optimshift.reload(opt)
        train(model, opt, range(step + 1, step + 2))
    assert host_pool.stats().allocations == before


def test_seed_regression_on_cuda():
    """Lightning #19955: Adam's step moved to the GPU costs host syncs every step; optimshift's move costs none."""
    model, opt = _fresh(torch.optim.Adam, {}, [(64, 64)] * 8, torch.device("cpu"))
    model.to(CUDA)
    for st in opt.state.values():
        for k, v in list(st.items()):
            st[k] = v.to(CUDA)
    with optimshift.count_syncs() as naive:
        train(model, opt, range(2, 3))
    optimshift.move(opt)
    with optimshift.count_syncs() as ours:
        train(model, opt, range(3, 4))
    assert naive.total >= 8 and ours.total == 0


@pytest.mark.parametrize(
    "cls, kwargs",
    [
        pytest.param(torch.optim.Adam, {"foreach": False}, id="Adam"),
        pytest.param(torch.optim.AdamW, {"foreach": True}, id="AdamW-foreach"),
        pytest.param(torch.optim.Adam, {"fused": True}, id="Adam-fused"),
        pytest.param(torch.optim.SGD, {"momentum": 0.9}, id="SGD-momentum"),
    ],
)
def test_compiled_step_survives_offload_reload_cycles(cls, kwargs):
    """20 offload/reload cycles on cuda:0 keep every tensor object: 0 recompiles of a compiled step, and the
    params end bitwise equal to the same compiled run that never offloaded."""

    def run(cycles: bool):
        torch._dynamo.reset()
        graphs = [0]

        def backend(gm, example_inputs):
            graphs[0] += 1
            return gm.forward

        model = Model([(64, 32), (32,)]).to(CUDA)
        params = list(model.parameters())
        opt = cls(params, **kwargs)

        @torch.compile(backend=backend)
        def step():
            opt.step()

        for i in range(22):
            for j, p in enumerate(params):
                p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(100 * i + j)).to(CUDA)
            step()
            if i == 1:
                warm = graphs[0]
                objects = [id(v) for st in opt.state.values() for v in st.values()]
            if cycles and i >= 1:
                optimshift.offload(opt)
                optimshift.reload(opt)
        assert [id(v) for st in opt.state.values() for v in st.values()] == objects
        return params, graphs[0] - warm

    cycled, recompiles = run(True)
    plain, _ = run(False)
    assert recompiles == 0, f"{recompiles} recompiles over 20 offload/reload cycles"
    for a, b in zip(cycled, plain):
        assert bitwise_equal(a, b)


@pytest.mark.parametrize("non_blocking", [False, True])
def test_offloaded_grads_keep_their_objects_and_free_device_memory(non_blocking):
    """On CUDA an offloaded grad keeps its object by set_data (the simulator's test covers swap): while
    offloaded ``.grad`` is None and the grad, on the host, holds no device memory."""
    model, opt = _fresh(torch.optim.Adam, {"fused": True}, [(256, 256)] * 4, CUDA, steps=1)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    grads = [p.grad for p in model.parameters()]
    values = [g.cpu() for g in grads]
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated(CUDA)
    handle = optimshift.offload(opt, include=("grads",), non_blocking=non_blocking)
    if non_blocking:
        handle.wait()
    assert all(p.grad is None for p in model.parameters()) and all(g.device.type == "cpu" for g in grads)
    assert torch.cuda.memory_allocated(CUDA) < base - sum(g.numel() * g.element_size() for g in grads)
    handle = optimshift.reload(opt, non_blocking=non_blocking)
    if non_blocking:
        handle.wait()
    for p, g, v in zip(model.parameters(), grads, values):
        assert p.grad is g and g.device == CUDA and bitwise_equal(g.cpu(), v)
    train(model, opt, range(1, 2))
