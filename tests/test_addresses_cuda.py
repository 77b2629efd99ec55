"""keep_addresses on a real GPU (marked cuda: skipped without one; benchmarks/gpu_check.sh runs them): the CUDA
driver through ctypes, 10 cycles bitwise at the same addresses, the memory free while offloaded (as the device
sees it), a view held outside, non-blocking cycles. The compiled, CUDA-graphed step is gpu_keep_addresses.py's."""

from __future__ import annotations

import warnings

import pytest
import torch

import optimshift
from optimshift import _vmm

pytestmark = pytest.mark.cuda


def _opt(n=4, size=512):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(size, size) for _ in range(n)]).cuda()
    opt = torch.optim.Adam(model.parameters(), capturable=True)
    for _ in range(2):
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        opt.step()
    return model, opt


def _where(opt):
    return {(i, k): (id(v), v.data_ptr()) for i, st in enumerate(opt.state.values()) for k, v in st.items()}


def _values(opt):
    return {(i, k): v.clone() for i, st in enumerate(opt.state.values()) for k, v in st.items()}


def test_the_cuda_driver_is_found_and_supports_vmm():
    assert isinstance(_vmm.driver_for(torch.device("cuda", 0)), _vmm.CudaDriver)
    assert _vmm.unsupported(torch.device("cuda", 0)) is None


@pytest.mark.parametrize("non_blocking", [False, True])
def test_ten_cycles_on_a_gpu(non_blocking):
    model, opt = _opt()
    optimshift.keep_addresses(opt)
    kept, values = _where(opt), _values(opt)
    state = sum(v.numel() * v.element_size() for v in values.values())
    for _ in range(10):
        torch.cuda.synchronize()
        free = torch.cuda.mem_get_info()[0]
        handle = optimshift.offload(opt, keep_addresses=True, non_blocking=non_blocking)
        if non_blocking:
            handle.wait()
        torch.cuda.synchronize()
        assert torch.cuda.mem_get_info()[0] - free >= 0.9 * state
        optimshift.reload(opt, non_blocking=non_blocking)
        torch.cuda.synchronize()
        assert _where(opt) == kept
        assert all(torch.equal(v, values[k]) for k, v in _values(opt).items())


def test_a_view_held_outside_stays_mapped_on_a_gpu():
    model, opt = _opt()
    optimshift.keep_addresses(opt)
    held = next(iter(opt.state.values()))["exp_avg"][:2]
    expected = held.clone()
    with pytest.warns(UserWarning, match="still viewed"):
        optimshift.offload(opt, keep_addresses=True)
    assert torch.equal(held, expected)  # readable: not unmapped under it
    optimshift.reload(opt)
    del held
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        optimshift.offload(opt, keep_addresses=True)
    optimshift.reload(opt)


@pytest.mark.parametrize("where", ["device", "host"])
def test_a_load_writes_kept_state_in_place_on_a_gpu(where):
    """A kept slot's tensor is all that uses its storage, so a load writes the values in place, from a checkpoint
    on the device or on the host (staged in pinned memory): same objects, same addresses, the range still mapped
    (``tests/test_addresses.py`` has the same tests on the simulator)."""
    model, opt = _opt()
    optimshift.keep_addresses(opt)
    kept = _where(opt)
    sd = opt.state_dict()
    on_device = {
        "state": {
            i: {k: (v.clone() + 1).cpu() if where == "host" else v.clone() + 1 for k, v in st.items()}
            for i, st in sd["state"].items()
        }
    }
    on_device["param_groups"] = sd["param_groups"]
    mapped = optimshift._addresses.mapped_bytes(opt)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        optimshift.load_state_dict(opt, on_device)
    torch.cuda.synchronize()
    assert _where(opt) == kept and optimshift._addresses.mapped_bytes(opt) == mapped > 0
    for i, st in enumerate(opt.state.values()):
        assert all(torch.equal(v.cpu(), on_device["state"][i][k].cpu()) for k, v in st.items())
