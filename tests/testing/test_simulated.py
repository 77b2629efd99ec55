"""Tests for the simulated "sim" accelerator (optimshift.testing.simulated)."""

from __future__ import annotations

import copy
import gc
import io
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import optimshift.testing as ost
from optimshift.testing import SIM_DEVICE_TYPE, simulated_accelerator, simulated_memory_allocated

_SRC_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(ost.__file__))))

# Same-size integer dtypes, to compare floating point tensors bit for bit (NaN, -0.0 included).
_BITS = {
    torch.float64: torch.int64,
    torch.float32: torch.int32,
    torch.bfloat16: torch.int16,
    torch.float16: torch.int16,
}


def assert_bitwise(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.device.type == "cpu" and expected.device.type == "cpu"
    assert actual.dtype == expected.dtype
    assert actual.shape == expected.shape
    if actual.dtype in _BITS:
        actual, expected = actual.view(_BITS[actual.dtype]), expected.view(_BITS[actual.dtype])
    assert torch.equal(actual, expected)


@pytest.fixture(scope="module")
def sim0() -> torch.device:
    return simulated_accelerator(0)


@pytest.fixture(scope="module")
def sim1() -> torch.device:
    return simulated_accelerator(1)


class CountSyncs(TorchDispatchMode):
    """Counts aten._local_scalar_dense calls (host syncs), per device type of the tensor read."""

    def __init__(self) -> None:
        super().__init__()
        self.by_device: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            dev = args[0].device.type
            self.by_device[dev] = self.by_device.get(dev, 0) + 1
        return func(*args, **(kwargs or {}))


def _run_python(code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=_SRC_DIR + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


# ------------------------------------------------------------------------------------------
# Setup and API
# ------------------------------------------------------------------------------------------


def test_import_sets_nothing_up_and_rename_conflict_raises():
    proc = _run_python(
        """
        import json, torch
        import optimshift.testing as ost
        out = {
            "name_after_import": torch._C._get_privateuse1_backend_name(),
            "swap_after_import": torch.__future__.get_swap_module_params_on_conversion(),
            "has_torch_sim": hasattr(torch, "sim"),
            "allocated": ost.simulated_memory_allocated(0),
        }
        torch.utils.rename_privateuse1_backend("foo")
        try:
            ost.simulated_accelerator(0)
        except RuntimeError as exc:
            out["error"] = str(exc)
        print(json.dumps(out))
        """
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["name_after_import"] == "privateuseone"
    assert out["swap_after_import"] is False
    assert out["has_torch_sim"] is False
    assert out["allocated"] == 0
    assert "'foo'" in out["error"] and "already renamed" in out["error"]


def test_second_copy_of_the_module_shares_the_live_state():
    proc = _run_python(
        """
        import importlib, importlib.util, json, torch
        import optimshift.testing.simulated as first
        dev = first.simulated_accelerator(0)
        t = torch.ones(100, device=dev)  # 400 bytes
        spec = importlib.util.spec_from_file_location("sim_copy", first.__file__)
        second = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(second)
        assert second.simulated_accelerator(1) == torch.device("sim", 1)
        reloaded = importlib.reload(first)
        u = (t[:10] + 1).cpu()
        print(json.dumps({
            "second": second.simulated_memory_allocated(0),
            "reloaded": reloaded.simulated_memory_allocated(0),
            "sum": u.sum().item(),
        }))
        """
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out == {"second": 400, "reloaded": 400, "sum": 20.0}


def test_setup_is_idempotent_and_global_effects(sim0, sim1):
    assert SIM_DEVICE_TYPE == "sim"
    assert sim0 == torch.device("sim", 0) and sim1 == torch.device("sim", 1)
    assert simulated_accelerator() == sim0
    assert simulated_accelerator(1) == sim1
    assert torch._C._get_privateuse1_backend_name() == "sim"
    assert torch.__future__.get_swap_module_params_on_conversion() is True
    assert torch.sim.device_count() == 2
    assert torch.sim.is_available()
    torch.sim.synchronize()
    assert ost.SIM_DEVICE_TYPE is SIM_DEVICE_TYPE


def test_accelerator_allocator_queries_answer_for_the_sim():
    # torch.accelerator.empty_cache() is what Accelerate's free_memory() calls (the Transformers Trainer, at the
    # start of train()); without the simulator's answer PyTorch fails an internal assert, and empty_host_cache()
    # segfaults: a child process, so that a regression fails this test and not the whole run.
    proc = _run_python(
        """
        import json, torch
        import optimshift.testing as ost
        ost.simulated_accelerator(0)
        x = torch.ones(1024, device="sim:0")
        assert torch.accelerator.current_accelerator().type == "sim"
        torch.accelerator.empty_cache()
        torch.accelerator.empty_host_cache()
        torch.accelerator.reset_peak_memory_stats()
        print(json.dumps({
            "stats": dict(torch.accelerator.memory_stats()),
            "allocated": torch.accelerator.memory_allocated(),
            "sim_allocated": ost.simulated_memory_allocated(0),
            "value": float(x.sum().item()),
        }))
        """
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["stats"] == {} and out["allocated"] == 0  # no C++ caching allocator to report on
    assert out["sim_allocated"] >= 4096 and out["value"] == 1024.0  # the tensor was untouched


@pytest.mark.parametrize("bad", [2, -1, 7])
def test_index_out_of_range(bad):
    with pytest.raises(ValueError, match="out of range"):
        simulated_accelerator(bad)
    with pytest.raises(ValueError, match="out of range"):
        simulated_memory_allocated(bad)


def test_optim_device_lists_include_sim(sim0):
    from torch.optim.optimizer import _get_capturable_supported_devices
    from torch.utils._foreach_utils import (
        _get_foreach_kernels_supported_devices,
        _get_fused_kernels_supported_devices,
    )

    assert "sim" in _get_capturable_supported_devices()
    assert "sim" in _get_foreach_kernels_supported_devices()
    assert "sim" in _get_fused_kernels_supported_devices()


# ------------------------------------------------------------------------------------------
# Values and layouts
# ------------------------------------------------------------------------------------------


def _sample(dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1234)
    base = torch.randn(6, 10, generator=g, dtype=torch.float64) * 1000
    if dtype == torch.bool:
        return base > 0
    t = base.to(dtype)
    if dtype.is_floating_point:
        t[0, 0], t[0, 1], t[0, 2], t[0, 3] = float("nan"), -0.0, float("inf"), -float("inf")
    return t


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float64, torch.int64, torch.bool, torch.float16]
)
def test_roundtrip_values_bitwise(sim0, sim1, dtype):
    cpu = _sample(dtype)
    s = cpu.to(sim0)
    assert s.device == sim0 and s.dtype == dtype
    assert_bitwise(s.cpu(), cpu)
    assert_bitwise(s.to("cpu"), cpu)
    assert_bitwise(s.to(sim1).cpu(), cpu)
    assert_bitwise(s.clone().cpu(), cpu)
    # Non-contiguous / transposed / offset views, from the CPU side and from the sim side.
    views = [
        lambda t: t.t(),
        lambda t: t[1:, 3:7],
        lambda t: t[::2, 1::3],
        lambda t: t[2],
        lambda t: t.t()[4:, 1:],
        lambda t: t.unsqueeze(0).expand(3, 6, 10),
    ]
    for view in views:
        assert_bitwise(view(cpu).to(sim0).cpu(), view(cpu))
        sv = view(s)
        cv = view(cpu)
        assert sv.device == sim0
        assert sv.stride() == cv.stride() and sv.storage_offset() == cv.storage_offset()
        assert_bitwise(sv.cpu(), cv)
        assert_bitwise(sv.contiguous().cpu(), cv.contiguous())
    assert torch.equal(s[1:], s[1:].clone())  # row 0 holds the NaN


def test_inplace_on_view_writes_through(sim0):
    cpu = torch.arange(48, dtype=torch.float32).reshape(6, 8)
    s = cpu.to(sim0)
    s[::2, 1::3].mul_(-2)
    s.t()[0].add_(100)
    cpu[::2, 1::3].mul_(-2)
    cpu.t()[0].add_(100)
    assert_bitwise(s.cpu(), cpu)
    # Reinterpreting views share the backing bytes too.
    assert_bitwise(s.view(torch.int32).cpu(), cpu.view(torch.int32))


def test_dtype_conversion_and_misc_ops(sim0):
    cpu = torch.randn(5, 4)
    s = cpu.to(sim0)
    assert_bitwise(s.to(torch.bfloat16).cpu(), cpu.to(torch.bfloat16))
    assert_bitwise(s.to(torch.float64).cpu(), cpu.to(torch.float64))
    assert_bitwise(s.to(sim0, torch.float16).cpu(), cpu.half())
    assert_bitwise(torch.where(s > 0, s, torch.tensor(0.0)).cpu(), cpu.clamp_min(0))
    assert_bitwise(torch.cat([s, s]).cpu(), torch.cat([cpu, cpu]))
    assert_bitwise(s[s > 0].cpu(), cpu[cpu > 0])
    assert_bitwise(s[torch.tensor([0, 3])].cpu(), cpu[torch.tensor([0, 3])])  # CPU index ok
    assert s.tolist() == cpu.tolist()
    assert "device='sim:0'" in repr(s)
    # copy.deepcopy goes through storage construction on the device.
    d = copy.deepcopy(s)
    assert d.device == sim0 and d.untyped_storage().data_ptr() != s.untyped_storage().data_ptr()
    assert_bitwise(d.cpu(), cpu)
    # non_blocking copies are accepted (synchronous, never pinned).
    h = s.to("cpu", non_blocking=True)
    assert not h.is_pinned()
    assert_bitwise(h, cpu)


def test_factories_land_on_the_requested_index(sim0, sim1):
    for dev in (sim0, sim1):
        assert_bitwise(torch.zeros(2, 3, device=dev).cpu(), torch.zeros(2, 3))
        ones = torch.ones(4, device=dev, dtype=torch.int64)
        assert_bitwise(ones.cpu(), torch.ones(4, dtype=torch.int64))
        assert_bitwise(torch.full((2,), 3.5, device=dev).cpu(), torch.full((2,), 3.5))
        assert_bitwise(torch.arange(5, device=dev).cpu(), torch.arange(5))
        assert_bitwise(torch.tensor([1.5, 2.5], device=dev).cpu(), torch.tensor([1.5, 2.5]))
        assert_bitwise(torch.scalar_tensor(2.0, device=dev).cpu(), torch.scalar_tensor(2.0))
        for made in (
            torch.empty(3, device=dev),
            torch.zeros_like(torch.zeros(2, device=dev)),
            torch.zeros(2, device=dev).new_empty(4),
        ):
            assert made.device == dev
        torch.manual_seed(7)
        r = torch.randn(3, 4, device=dev)
        torch.manual_seed(7)
        assert_bitwise(r.cpu(), torch.randn(3, 4))  # RNG is the CPU's


def test_new_tensor_lands_on_its_tensors_device(sim0, sim1):
    """``x.new_tensor(data)`` is on ``x``'s device, as on CUDA (it was on ``sim:0`` for an ``x`` on ``sim:1``,
    which the next op mixing the two refused); a device given still wins."""
    x = torch.zeros(2, device=sim1)
    made = x.new_tensor([1.5, 2.5])
    assert made.device == sim1
    assert_bitwise((x + made).cpu(), torch.tensor([1.5, 2.5]))
    assert x.new_tensor(torch.ones(2), dtype=torch.float64).device == sim1
    assert x.new_tensor([1.0], device="cpu").device.type == "cpu"
    assert torch.zeros(1).new_tensor([1.0]).device.type == "cpu"


def test_new_tensor_of_another_device_is_what_a_torch_function_handler_saw_before_setup(sim0):
    """Setup's ``new_tensor`` wrapper leaves other tensors' ``__torch_function__`` as torch's: one call, named
    ``new_tensor`` (it made a ``Tensor.device.__get__`` call first, then one named ``_new_tensor``)."""
    from torch.overrides import TorchFunctionMode

    seen: list[str] = []

    class Names(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(func.__name__)
            return func(*args, **(kwargs or {}))

    x = torch.zeros(1, dtype=torch.float16)
    with Names():
        made = x.new_tensor([1.0])
    assert seen == ["new_tensor"] and made.dtype == torch.float16 and made.device.type == "cpu"


def test_a_storage_resizes_frees_and_allocates_again_as_on_cuda(sim0):
    """``untyped_storage().resize_(0)`` frees a sim tensor's memory and ``resize_(n)`` allocates it again, the
    same storage object, the bytes that fit kept (it raised a NotImplementedError naming a PrivateUse1 hook);
    a tensor over a storage resized to 0 is refused as on CUDA, not read from freed memory."""
    x = torch.arange(4.0, device=sim0)
    storage = x.untyped_storage()
    before = simulated_memory_allocated(0)
    storage.resize_(0)
    assert simulated_memory_allocated(0) == before - 16 and x.untyped_storage().nbytes() == 0
    with pytest.raises(RuntimeError, match="data is not allocated yet"):
        x + 1
    storage.resize_(16)
    assert simulated_memory_allocated(0) == before
    x.copy_(torch.tensor([1.0, 2.0, 3.0, 4.0]))
    storage.resize_(32)
    assert_bitwise(x.cpu(), torch.tensor([1.0, 2.0, 3.0, 4.0]))
    assert simulated_memory_allocated(0) == before + 16
    del x, storage
    assert simulated_memory_allocated(0) == before - 16


def test_empty_factories_allocate_on_the_sim_as_requested(sim0, sim1):
    # torch.empty and empty_strided have kernels of their own (the copies allocate with them): each result is
    # a fresh sim storage of exactly its bytes, counted and freed, on the index asked for (the current one
    # when none is), with the strides asked for; pinning is refused as for every sim factory.
    gc.collect()
    base0, base1 = simulated_memory_allocated(0), simulated_memory_allocated(1)
    a = torch.empty(2, 3, device=sim1, dtype=torch.float64)
    b = torch.empty_strided((2, 3), (1, 2), device=sim0)
    c = torch.empty_like(b)  # keeps b's strides: empty_strided
    with torch.sim.device(1):
        d = torch.empty(5, device=SIM_DEVICE_TYPE, dtype=torch.int16)
    assert (a.device, a.shape, a.dtype, a.is_contiguous()) == (sim1, (2, 3), torch.float64, True)
    assert (b.device, b.stride(), c.device, c.stride()) == (sim0, (1, 2), sim0, (1, 2))
    assert d.device == sim1
    assert len({t.untyped_storage().data_ptr() for t in (a, b, c, d)}) == 4
    assert simulated_memory_allocated(0) == base0 + 24 + 24
    assert simulated_memory_allocated(1) == base1 + 48 + 10
    b.copy_(torch.arange(6.0).view(2, 3))
    assert_bitwise(b.cpu(), torch.arange(6.0).view(2, 3))
    for pinned in (
        lambda: torch.empty(3, device=sim0, pin_memory=True),
        lambda: torch.empty_strided((3,), (1,), device=sim0, pin_memory=True),
    ):
        with pytest.raises(RuntimeError, match="Only dense CPU tensors can be pinned"):
            pinned()
    del a, b, c, d
    gc.collect()
    assert (simulated_memory_allocated(0), simulated_memory_allocated(1)) == (base0, base1)


def test_out_arguments_and_resize(sim0):
    gc.collect()
    base = simulated_memory_allocated(0)
    t = torch.arange(10.0, device=sim0)
    out = torch.empty(0, device=sim0)
    assert torch.add(t, t, out=out) is out  # out= returns the caller's tensor, resized
    assert out.shape == (10,)
    assert_bitwise(out.cpu(), torch.arange(10.0) * 2)
    e = torch.empty(0, device=sim0)
    e.resize_(5).fill_(3.0)
    assert_bitwise(e.cpu(), torch.full((5,), 3.0))
    e.resize_(2)
    assert_bitwise(e.cpu(), torch.full((2,), 3.0))
    assert simulated_memory_allocated(0) == base + 40 + 40 + 20
    del t, out, e
    gc.collect()
    assert simulated_memory_allocated(0) == base


def test_autocast_on_sim_is_accepted_and_casts_nothing(sim0):
    a = torch.randn(3, 3, device=sim0)
    with torch.autocast(SIM_DEVICE_TYPE, dtype=torch.bfloat16):
        out = a @ a
    assert out.dtype == torch.float32
    assert_bitwise(out.cpu(), a.cpu() @ a.cpu())


def test_copy_between_sim_devices(sim0, sim1):
    cpu = torch.randn(3, 5)
    a = cpu.to(sim0)
    b = a.to(sim1)
    assert a.device == sim0 and b.device == sim1
    assert_bitwise(b.cpu(), cpu)
    c = torch.zeros(5, 3, device=sim1)
    c.copy_(a.t())
    assert c.device == sim1
    assert_bitwise(c.cpu(), cpu.t().contiguous())
    # Writes to the copy do not touch the source.
    b.add_(1)
    assert_bitwise(a.cpu(), cpu)


def test_copies_of_conjugate_and_negative_views():
    # (in a subprocess: they recursed without end inside PyTorch, a segfault of the whole process)
    proc = _run_python(
        """
        import json, torch
        from optimshift.testing import simulated_accelerator
        s0, s1 = simulated_accelerator(0), simulated_accelerator(1)
        z, r = torch.randn(2, 3, dtype=torch.complex64), torch.randn(2, 3)
        out = {}
        for name, view, ref in [
            ("conj", lambda t: t.conj(), z.conj()),
            ("conj of a transpose", lambda t: t.t().conj(), z.t().conj()),
            ("neg", lambda t: torch._neg_view(t), torch._neg_view(r)),
        ]:
            src = z if ref.is_complex() else r
            want = ref.resolve_conj().resolve_neg()
            v = view(src.to(s1))
            into = torch.zeros_like(want).to(s0)
            (into.conj() if want.is_complex() else torch._neg_view(into)).copy_(view(src))  # into a view
            got = {
                "to sim:0": v.to(s0), "to cpu": v.cpu(), "copy_": torch.empty_like(want, device=s0).copy_(v),
                "clone": v.clone(), "add": v + 1, "into a view": into.conj() if want.is_complex() else -into,
            }
            out[name] = {k: torch.equal(g.cpu().resolve_conj().resolve_neg(), want + (k == "add"))
                         for k, g in got.items()}
        try:
            z.to(s0).conj() @ z.to(s0).t()  # (mm takes the view as it is: refused, as before)
        except NotImplementedError as exc:
            out["mm"] = str(exc)
        print(json.dumps(out))
        """
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for name in ("conj", "conj of a transpose", "neg"):
        assert out[name] == dict.fromkeys(("to sim:0", "to cpu", "copy_", "clone", "add", "into a view"), True), name
    assert "conj_physical" in out["mm"]


# ------------------------------------------------------------------------------------------
# Strictness
# ------------------------------------------------------------------------------------------


def test_rule1_sim_with_non_scalar_cpu_tensor_raises(sim0):
    s = torch.ones(3, device=sim0)
    cpu = torch.ones(3)
    match = "Expected all tensors to be on the same device.*sim:0 and cpu"
    with pytest.raises(RuntimeError, match=match):
        s + cpu
    with pytest.raises(RuntimeError, match=match):
        s.mul_(cpu)
    with pytest.raises(RuntimeError, match=match):
        torch._foreach_add_([s], [cpu])
    with pytest.raises(RuntimeError, match=match):
        torch.ones(2, 3, device=sim0) @ torch.ones(3, 2)
    with pytest.raises(RuntimeError, match=match):
        torch.where(s > 0, s, cpu)
    with pytest.raises(RuntimeError, match=match):
        torch.cat([s, cpu])
    # A device op may not write into a CPU tensor, even a 0-dim one.
    with pytest.raises(RuntimeError, match=match):
        torch.zeros(()).add_(torch.ones((), device=sim0))
    # 0-dim CPU tensors mix with device tensors, as on CUDA; copies cross devices.
    assert_bitwise((s * torch.tensor(2.0)).cpu(), torch.full((3,), 2.0))
    torch._foreach_mul_([s], torch.tensor(3.0))
    assert_bitwise(s.cpu(), torch.full((3,), 3.0))
    s.copy_(cpu)
    cpu.copy_(s)


def test_a_fill_from_a_device_value_reads_it_on_the_host_as_aten_does(sim0, sim1):
    """ATen's ``fill_(Tensor)`` takes a 0-dim value on another device as ``value.item()`` (CUDA's too): an LR
    scheduler that fills a host tensor ``lr`` from the device ``base_lrs`` it cloned at construction (LambdaLR,
    CosineAnnealingWarmRestarts, stepping while the lr is on the host: offloaded, moved, streamed) was refused as
    a device op writing into a CPU tensor."""
    host = torch.zeros(())
    host.fill_(torch.tensor(2.5, device=sim0))
    assert host.item() == 2.5
    other = torch.zeros((), device=sim1)
    other.fill_(torch.tensor(1.5, device=sim0))  # (another device: its value on the host first, as ATen does)
    assert other.device == sim1 and other.item() == 1.5
    # still refused: a device op writing into a CPU tensor, and a value that is not 0-dim
    with pytest.raises(RuntimeError, match="sim:0 and cpu"):
        torch.zeros(()).add_(torch.ones((), device=sim0))
    with pytest.raises(RuntimeError):
        torch.zeros(2).fill_(torch.ones(2, device=sim0))
    # the value is read as .item() reads it: after the work that writes it, or a race
    with ost.deferred_streams(seed=0, progress=0.0):
        side, value = torch.sim.Stream(), torch.zeros((), device=sim0)
        side.wait_stream(torch.sim.current_stream())
        with torch.sim.stream(side):
            value.add_(7.0)
            host.fill_(value)  # (on the side stream: after the add)
        assert host.item() == 7.0
        with torch.sim.stream(side):
            value.add_(1.0)
        with pytest.raises(ost.StreamRaceError):
            host.fill_(value)  # (on the default stream, nothing ordering it after the add)
        torch.sim.synchronize(0)


def test_an_lr_scheduler_fills_a_host_lr_from_device_base_lrs(sim0):
    """LambdaLR's values are its ``base_lrs`` (clones of a device ``lr``) times a factor: device tensors, which
    it fills the host ``lr`` with."""
    p = nn.Parameter(torch.ones(3, device=sim0))
    opt = torch.optim.Adam([p], lr=torch.tensor(0.5, device=sim0), capturable=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 0.5**epoch)
    opt.param_groups[0]["lr"] = opt.param_groups[0]["lr"].cpu()  # (what an offload does with it)
    p.grad = torch.ones_like(p)
    opt.step()
    sched.step()
    assert opt.param_groups[0]["lr"].is_cpu and opt.param_groups[0]["lr"].item() == 0.25


def test_rule2_fused_kernels_reject_cpu_tensors(sim0):
    p = torch.zeros(3, device=sim0)
    g = torch.ones(3, device=sim0)
    m, v = torch.zeros(3, device=sim0), torch.zeros(3, device=sim0)
    hyper = dict(lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=0.0, eps=1e-8, amsgrad=False, maximize=False)
    with pytest.raises(RuntimeError, match="_fused_adam_.*CPU tensor"):
        torch._fused_adam_([p], [g], [m], [v], [], [torch.tensor(0.0)], **hyper)
    with pytest.raises(RuntimeError, match="_fused_adamw_.*CPU tensor"):
        torch._fused_adamw_([p], [g], [m], [v], [], [torch.tensor(0.0)], **hyper)
    with pytest.raises(RuntimeError, match="_fused_sgd_.*CPU tensor"):
        torch._fused_sgd_(
            [p],
            [g],
            [torch.zeros(3)],
            weight_decay=0.0,
            momentum=0.9,
            lr=0.1,
            dampening=0.0,
            nesterov=False,
            maximize=False,
            is_first_step=True,
        )
    # With the step on the device, the same call runs.
    torch._fused_adam_([p], [g], [m], [v], [], [torch.tensor(1.0, device=sim0)], **hyper)
    assert torch.all(p.cpu() < 0)


def test_rule2_fused_kernels_take_a_host_lr_as_cuda_does(sim0, sim1):
    """CUDA's (XPU's, MPS's) fused kernels accept a one-element host `lr` tensor and read it with .item(); every
    other tensor must be on the params' device. Results equal the host's fused kernel bit for bit."""
    hyper = dict(beta1=0.9, beta2=0.999, weight_decay=0.0, eps=1e-8, amsgrad=False, maximize=False)

    def adam(device, lr, step_device=None):
        p, g = torch.full((3,), 0.5, device=device), torch.full((3,), 0.25, device=device)
        m, v = torch.zeros(3, device=device), torch.zeros(3, device=device)
        step = torch.tensor(1.0, device=step_device or device)
        torch._fused_adam_([p], [g], [m], [v], [], [step], lr=lr, **hyper)
        return p.cpu(), m.cpu()

    for lr in (torch.tensor(1e-2), torch.tensor([1e-2])):
        got, want = adam(sim0, lr), adam(torch.device("cpu"), torch.tensor(1e-2))
        assert_bitwise(got[0], want[0])
        assert_bitwise(got[1], want[1])
    with pytest.raises(RuntimeError, match="_fused_adam_.*CPU tensor"):
        adam(sim0, torch.tensor(1e-2), step_device=torch.device("cpu"))  # a host step: still refused
    with pytest.raises(RuntimeError, match="_fused_adam_.*CPU tensor"):
        adam(sim0, torch.tensor([1e-2, 1e-2]))  # not one element: not an lr CUDA could read
    with pytest.raises(RuntimeError, match="two devices"):
        adam(sim0, torch.tensor(1e-2, device=sim1))  # lr on another device of the kind
    p, g, buf = torch.ones(3, device=sim0), torch.ones(3, device=sim0), torch.zeros(3, device=sim0)
    torch._fused_sgd_(
        [p],
        [g],
        [buf],
        weight_decay=0.0,
        momentum=0.9,
        lr=torch.tensor(0.5),
        dampening=0.0,
        nesterov=False,
        maximize=False,
        is_first_step=True,
    )
    assert_bitwise(p.cpu(), torch.full((3,), 0.5))
    for cls in (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad):
        model = nn.Linear(4, 2).to(sim0)
        opt = cls(model.parameters(), lr=torch.tensor(1e-2), fused=True)
        model(torch.randn(3, 4, device=sim0)).sum().backward()
        opt.step()
        assert opt.param_groups[0]["lr"].device.type == "cpu"


def test_rule2_fused_adam_with_cpu_step_raises_through_optimizer(sim0):
    model = nn.Linear(4, 2).to(sim0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, fused=True)
    model(torch.randn(3, 4, device=sim0)).sum().backward()
    opt.step()
    state = opt.state[model.weight]
    assert state["step"].device == sim0  # fused keeps the step on the device
    state["step"] = state["step"].cpu()  # the bug a naive state move makes
    with pytest.raises(RuntimeError, match="_fused_adam_.*CPU tensor"):
        opt.step()


def test_rule3_mixing_sim0_and_sim1_raises(sim0, sim1):
    a = torch.ones(3, device=sim0)
    b = torch.ones(3, device=sim1)
    match = "Expected all tensors to be on the same device.*sim:0 and sim:1"
    with pytest.raises(RuntimeError, match=match):
        a + b
    with pytest.raises(RuntimeError, match=match):
        a.add_(torch.ones((), device=sim1))  # 0-dim device tensors are not exempt
    with pytest.raises(RuntimeError, match=match):
        torch._foreach_add_([a], [b])
    with pytest.raises(RuntimeError, match=match):
        torch.stack([a, b])
    a.copy_(b)  # copies are fine
    torch._foreach_copy_([a], [b])


# ------------------------------------------------------------------------------------------
# Host syncs, modules, autograd
# ------------------------------------------------------------------------------------------


def test_item_is_a_counted_host_sync(sim0):
    s = torch.tensor([2.5, 4.0], device=sim0)
    with CountSyncs() as mode:
        assert s[0].item() == 2.5
        assert s.sum().item() == 6.5
        assert bool(s[1] > 3)
        total = s.sum()  # no host read
    assert mode.by_device == {"sim": 3}
    assert total.device == sim0


def test_module_to_keeps_parameter_identity(sim0, sim1):
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    params = list(model.parameters())
    values = [p.detach().clone() for p in params]
    model.to(sim0)
    assert all(a is b for a, b in zip(params, model.parameters()))
    assert all(p.device == sim0 and isinstance(p, nn.Parameter) for p in params)
    model.to(sim1)
    assert all(a is b for a, b in zip(params, model.parameters()))
    for p, v in zip(params, values):
        assert p.device == sim1
        assert_bitwise(p.detach().cpu(), v)


def test_gradients_through_transposes_match_cpu(sim0):
    torch.manual_seed(0)
    x_cpu = torch.randn(5, 3)
    w_cpu = torch.randn(4, 3, requires_grad=True)
    x = x_cpu.to(sim0)
    w = w_cpu.detach().to(sim0).requires_grad_()

    (x_cpu @ w_cpu.t()).square().sum().backward()
    (x @ w.t()).square().sum().backward()
    torch.testing.assert_close(w.grad.cpu(), w_cpu.grad)

    assert_bitwise(w.detach().t().contiguous().cpu(), w_cpu.detach().t().contiguous())

    lin_cpu = nn.Linear(3, 4)
    lin = copy.deepcopy(lin_cpu).to(sim0)
    F.mse_loss(lin_cpu(x_cpu), torch.ones(5, 4)).backward()
    F.mse_loss(lin(x), torch.ones(5, 4, device=sim0)).backward()
    torch.testing.assert_close(lin.weight.grad.cpu(), lin_cpu.weight.grad)
    torch.testing.assert_close(lin.bias.grad.cpu(), lin_cpu.bias.grad)
    # A non-trivial gradient through a transposed view of a parameter.
    m_cpu = torch.randn(3, 3, requires_grad=True)
    m = m_cpu.detach().to(sim0).requires_grad_()
    (m_cpu.t() * torch.arange(9.0).reshape(3, 3)).sum().backward()
    (m.t() * torch.arange(9.0).reshape(3, 3).to(sim0)).sum().backward()
    assert_bitwise(m.grad.cpu(), m_cpu.grad)


def test_backward_on_sim1(sim1):
    torch.manual_seed(0)
    lin_cpu = nn.Linear(3, 2)
    lin = copy.deepcopy(lin_cpu).to(sim1)
    x = torch.randn(4, 3)
    F.mse_loss(lin_cpu(x), torch.zeros(4, 2)).backward()
    F.mse_loss(lin(x.to(sim1)), torch.zeros(4, 2, device=sim1)).backward()
    assert lin.weight.grad.device == sim1
    torch.testing.assert_close(lin.weight.grad.cpu(), lin_cpu.weight.grad)


# ------------------------------------------------------------------------------------------
# Optimizers
# ------------------------------------------------------------------------------------------


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))


# name -> (factory(params, on_sim), where state["step"] lives on sim: "sim", "cpu" or None)
_OPTIMIZERS = {
    "adam_foreach_default": (lambda p, on_sim: torch.optim.Adam(p, lr=1e-2), "cpu"),
    "adam_fused": (lambda p, on_sim: torch.optim.Adam(p, lr=1e-2, fused=True), "sim"),
    # capturable is not supported on the CPU: the CPU reference runs the plain algorithm.
    "adam_capturable": (lambda p, on_sim: torch.optim.Adam(p, lr=1e-2, capturable=on_sim), "sim"),
    "sgd_momentum": (lambda p, on_sim: torch.optim.SGD(p, lr=1e-2, momentum=0.9), None),
    "adamw": (lambda p, on_sim: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1), "cpu"),
}


@pytest.mark.parametrize("name", list(_OPTIMIZERS))
def test_training_matches_cpu(sim0, name):
    make_opt, step_device = _OPTIMIZERS[name]
    torch.manual_seed(0)
    ref = _mlp()
    model = copy.deepcopy(ref).to(sim0)
    opt_ref = make_opt(list(ref.parameters()), False)
    opt = make_opt(list(model.parameters()), True)
    xs = [torch.randn(5, 6) for _ in range(3)]
    ys = [torch.randn(5, 3) for _ in range(3)]
    for x, y in zip(xs, ys):
        for m, o, dev in ((ref, opt_ref, "cpu"), (model, opt, sim0)):
            o.zero_grad()
            F.mse_loss(m(x.to(dev)), y.to(dev)).backward()
            o.step()
    for p_ref, p in zip(ref.parameters(), model.parameters()):
        assert p.device == sim0
        torch.testing.assert_close(p.detach().cpu(), p_ref.detach(), rtol=1e-5, atol=1e-6)
    state = opt.state[next(model.parameters())]
    for key, value in state.items():
        if key == "step":
            assert value.device.type == step_device
        elif torch.is_tensor(value):
            assert value.device == sim0, key


# Pure elementwise updates: from identical grads, sim and CPU must agree bit for bit.
_BITWISE = {
    "adam_foreach": lambda p: torch.optim.Adam(p, lr=1e-2, foreach=True),
    "adam_single_tensor": lambda p: torch.optim.Adam(p, lr=1e-2, foreach=False),
    "adam_fused": lambda p: torch.optim.Adam(p, lr=1e-2, fused=True),
    "adamw_foreach_amsgrad": lambda p: torch.optim.AdamW(p, lr=1e-2, amsgrad=True, foreach=True),
    "sgd_momentum_foreach": lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9, foreach=True),
    "sgd_fused": lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9, fused=True),
}


@pytest.mark.parametrize("name", list(_BITWISE))
def test_optimizer_update_bitwise_equal_given_identical_grads(sim0, name):
    make_opt = _BITWISE[name]
    torch.manual_seed(1)
    ref_params = [torch.randn(7, 5), torch.randn(5), torch.randn(3, 4, 2)]
    params = [p.to(sim0) for p in ref_params]
    for p in ref_params + params:
        p.requires_grad_()
    opt_ref, opt = make_opt(ref_params), make_opt(params)
    for _ in range(3):
        grads = [torch.randn_like(p) for p in ref_params]
        for p_ref, p, g in zip(ref_params, params, grads):
            p_ref.grad = g.clone()
            p.grad = g.to(sim0)
        opt_ref.step()
        opt.step()
    for p_ref, p in zip(ref_params, params):
        assert_bitwise(p.detach().cpu(), p_ref.detach())
    for p_ref, p in zip(ref_params, params):
        for key, v_ref in opt_ref.state[p_ref].items():
            v = opt.state[p][key]
            if torch.is_tensor(v_ref):
                assert_bitwise(v.cpu(), v_ref.cpu())


@pytest.mark.parametrize("kwargs", [{"capturable": True}, {"fused": True}])
def test_capturable_and_fused_steps_do_not_sync(sim0, kwargs):
    model = _mlp().to(sim0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, **kwargs)
    F.mse_loss(model(torch.randn(4, 6, device=sim0)), torch.zeros(4, 3, device=sim0)).backward()
    opt.step()
    with CountSyncs() as mode:
        opt.step()
    assert mode.by_device.get("sim", 0) == 0


def test_optimizer_state_dict_deepcopy_and_save_load(sim0, sim1):
    model = _mlp().to(sim0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, fused=True)
    F.mse_loss(model(torch.randn(4, 6, device=sim0)), torch.zeros(4, 3, device=sim0)).backward()
    opt.step()
    sd = copy.deepcopy(opt.state_dict())
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    loaded = torch.load(buf, map_location=sim1)
    for key, st in opt.state_dict()["state"].items():
        for name, value in st.items():
            assert sd["state"][key][name].device == sim0
            assert loaded["state"][key][name].device == sim1
            assert_bitwise(loaded["state"][key][name].cpu(), value.cpu())


# ------------------------------------------------------------------------------------------
# Memory accounting
# ------------------------------------------------------------------------------------------


def test_memory_counter_tracks_live_storage(sim0, sim1):
    gc.collect()
    base0, base1 = simulated_memory_allocated(0), simulated_memory_allocated(1)
    t = torch.empty(1024, device=sim0)  # 4096 bytes
    assert simulated_memory_allocated(0) == base0 + 4096
    assert simulated_memory_allocated(1) == base1
    view = t[10:20]
    del t
    gc.collect()
    assert simulated_memory_allocated(0) == base0 + 4096  # a view keeps the storage alive
    del view
    gc.collect()
    assert simulated_memory_allocated(0) == base0

    # Offload: moving to the CPU and dropping the device tensor frees the device memory.
    u = torch.ones(256, 4, device=sim1, dtype=torch.float64)
    assert simulated_memory_allocated(1) == base1 + 256 * 4 * 8
    host = u.cpu()
    del u
    gc.collect()
    assert simulated_memory_allocated(1) == base1
    back = host.to(sim1)
    assert simulated_memory_allocated(1) == base1 + 256 * 4 * 8
    del back
    gc.collect()
    assert simulated_memory_allocated(1) == base1
    assert torch.sim.memory_allocated(1) == base1


def test_temporaries_are_freed_without_a_gc_pass(sim0):
    # The simulator itself must not create reference cycles around tensors: device memory
    # is released by reference counting alone, as on CUDA.
    model = _mlp().to(sim0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, fused=True)
    x, y = torch.randn(4, 6, device=sim0), torch.randn(4, 3, device=sim0)
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        readings = []
        for _ in range(3):
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            opt.step()
            readings.append(simulated_memory_allocated(0))
        assert readings[0] == readings[1] == readings[2]
    finally:
        if was_enabled:
            gc.enable()


def test_simulated_memory_allocated_takes_the_device_as_torch_cuda_memory_allocated_does(sim):
    """An index, ``torch.device("sim", i)`` or ``"sim:i"`` (a device raised TypeError); another device type is
    refused by name."""
    from optimshift.testing import simulated_memory_allocated

    x = torch.zeros(1024, device=torch.device(sim.type, 1))
    by_index = simulated_memory_allocated(1)
    assert by_index >= x.numel() * 4
    assert (
        simulated_memory_allocated(torch.device(sim.type, 1)) == by_index == simulated_memory_allocated(f"{sim.type}:1")
    )
    assert simulated_memory_allocated(torch.device(sim.type)) == simulated_memory_allocated(0)
    backend = getattr(torch, sim.type)
    backend.set_device(1)
    try:
        assert simulated_memory_allocated(sim.type) == by_index  # (no index: the current device)
    finally:
        backend.set_device(0)
    with pytest.raises(ValueError, match="cpu is not a simulated device"):
        simulated_memory_allocated(torch.device("cpu"))


def test_the_current_device_is_per_thread_as_cudas(sim):
    """``torch.sim.set_device`` in one thread leaves another's current device, and where its factories put
    tensors, unchanged (``cudaSetDevice`` is per host thread; it was one setting for the whole process)."""
    import threading

    seen = {}

    def worker():
        torch.sim.set_device(1)
        seen["worker"] = torch.sim.current_device(), torch.zeros(1, device=sim.type).device

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert seen["worker"] == (1, torch.device(sim.type, 1))
    assert torch.sim.current_device() == 0
    assert torch.zeros(1, device=sim.type).device == torch.device(sim.type, 0)
