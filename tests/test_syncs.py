"""count_syncs: counts device-to-host syncs by op, device and (with trace) source line; zero on the CPU."""

import os

import pytest
import torch

import optimshift


def test_cpu_work_counts_zero():
    x = torch.randn(10)
    with optimshift.count_syncs() as syncs:
        float(x.sum())
        x.nonzero()
        x.cpu()
        x.tolist()
    assert syncs.total == 0


def test_counts_items_copies_and_data_dependent_ops(sim):
    x = torch.arange(6.0, device=sim)
    with optimshift.count_syncs() as syncs:
        x[0].item()
        float(x[1])
        x.cpu()
        x.nonzero()
        torch.masked_select(x, x > 2)
        y = x + 1  # no sync: stays on the device
    assert syncs.by_op == {"item": 2, "copy_to_host": 1, "nonzero": 1, "masked_select": 1}
    assert syncs.total == 5 and syncs.by_device == {"sim:0": 5}
    assert y.device == sim


def test_a_fill_from_a_device_scalar_on_another_device_counts_as_the_item_it_runs(sim):
    """ATen fills a tensor from a 0-dim value on another device with ``value.item()`` inside the op, which no
    dispatch mode sees: an LR scheduler filling a host tensor ``lr`` from the device ``base_lrs`` it cloned
    (LambdaLR while optimshift has the lr on the host) synced at every step, uncounted."""
    value = torch.tensor(0.5, device=sim)
    with optimshift.count_syncs() as syncs:
        torch.zeros(()).fill_(value)
        torch.zeros((), device=torch.device(sim.type, 1)).fill_(value)
        torch.zeros((), device=sim).fill_(value)  # (one device: a device op, no read)
        torch.zeros((), device=sim).fill_(torch.tensor(0.25))  # (a host value: no sync)
    assert syncs.by_op == {"item": 2} and syncs.by_device == {"sim:0": 2}
    p = torch.nn.Parameter(torch.ones(3, device=sim))
    opt = torch.optim.Adam([p], lr=torch.tensor(0.5, device=sim), capturable=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 0.5**epoch)  # (base_lrs: clones, on the device)
    p.grad = torch.ones_like(p)
    opt.step()
    optimshift.offload(opt)  # (the lr to the host)
    with optimshift.count_syncs() as syncs:
        sched.step()
    assert syncs.by_op == {"item": 1} and opt.param_groups[0]["lr"].item() == 0.25


def test_boolean_mask_indexing_counts_as_the_nonzero_it_runs(sim):
    """``x[mask]`` and ``x[mask] = v`` take the mask's nonzero positions (a host sync on CUDA, like
    ``masked_select``); only the outer op reaches a dispatch mode, and it was not counted. Integer and slice
    indexing, ``torch.where``, and one host scalar written through one mask (ATen's ``masked_fill_``) read
    nothing on the host."""
    x = torch.arange(-4.0, 6.0).to(sim)
    mask = x > 0  # (5 of them: a write of several values, never ATen's one-value case)
    with optimshift.count_syncs() as syncs:
        x[mask]
        x[mask] = torch.ones(int(mask.sum().item()), device=sim)  # (the .item(): one more, counted as item)
        x[mask] += 1  # (a read and a write of device values)
        x.index_put_((mask,), torch.tensor(2.0), accumulate=True)
    assert syncs.by_op == {"index": 2, "index_put_": 3, "item": 1}
    with optimshift.count_syncs() as syncs:
        x[torch.tensor([1, 2]).to(sim)] = 1.0
        x[torch.tensor([1, 2]).to(sim)]
        x[1:3]
        torch.where(mask, x, 0.0)
        x[mask] = 0.0  # (masked_fill_, as torch's Rprop writes its grads)
        x[mask.cpu()]  # (a mask on the host: its nonzero runs there; counted once above, as .cpu())
    assert syncs.by_op == {"copy_to_host": 1}


def test_trace_names_the_line_outside_torch_and_the_line_inside_it(sim):
    params = [torch.nn.Parameter(torch.randn(3, device=sim)) for _ in range(2)]
    opt = torch.optim.Adam(params, foreach=False)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    for st in opt.state.values():
        st["step"] = st["step"].to(sim)  # the seed's bug
    with optimshift.count_syncs(trace=True) as syncs:
        opt.step()
    assert syncs.total == 2
    ((site, n),) = syncs.by_site.items()
    assert site.startswith(os.path.join("tests", "test_syncs.py") + ":") and "test_trace" in site and n == 2
    ((origin, _),) = syncs.by_origin.items()
    assert origin.startswith("torch/optim/"), origin


@pytest.mark.parametrize("non_blocking", [False, True])
def test_a_non_blocking_offload_is_no_host_sync(sim, non_blocking):
    """A non-blocking offload's device-to-host copies run on a side stream and the host reads them only once their
    event completed: ``async_copies``, not a sync (it was counted as ``copy_to_host``; found by a new-user hunt).
    The blocking one waits: a sync."""
    model = torch.nn.Linear(64, 64).to(sim)
    opt = torch.optim.Adam(model.parameters())
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    with optimshift.count_syncs() as counted:
        optimshift.offload(opt, non_blocking=non_blocking)
    if non_blocking:
        assert counted.total == 0 and counted.async_copies > 0
    else:
        assert counted.by_op["copy_to_host"] > 0 and counted.async_copies == 0
    optimshift.reload(opt)


def test_the_same_count_syncs_entered_inside_itself_is_refused(sim):
    x = torch.ones(2, device=sim)
    counter = optimshift.count_syncs()
    with counter as syncs:
        with pytest.raises(RuntimeError, match="already counting"):
            with counter:  # (it counted each sync of the inner block twice)
                pass
        x.sum().item()
    assert syncs.total == 1
    with optimshift.count_syncs() as outer, optimshift.count_syncs() as inner:
        x.sum().item()
    assert outer.total == inner.total == 1
