"""check() and placement(): findings name where, what, why, and the host syncs each costs (re-measured here)."""

import pytest
import torch

import optimshift
from optimshift.report import SYNC_COST

O = torch.optim


@pytest.mark.parametrize("foreach", [False, True], ids=["single", "foreach"])
@pytest.mark.parametrize("name, key", sorted(SYNC_COST))
def test_sync_cost_table_matches_this_torch(sim, name, key, foreach):
    """Each figure check() reports is what this torch really costs: measured with count_syncs on the sim."""
    cls = getattr(O, name)
    params = [torch.nn.Parameter(torch.randn(3, 2, device=sim)) for _ in range(4)]
    opt = cls(params, foreach=foreach)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    for st in opt.state.values():
        st[key] = st[key].to(sim)
    report = optimshift.check(opt)
    assert not report.ok and {f.key for f in report.findings} == {key}
    with optimshift.count_syncs() as syncs:
        opt.step()
    assert syncs.total == len(params) * SYNC_COST[(name, key)][int(foreach)]
    assert report.syncs_per_step == syncs.total


def test_report_table_and_placement_rows(sim):
    params = [torch.nn.Parameter(torch.randn(4, 3, device=sim)), torch.nn.Parameter(torch.randn(3, device=sim))]
    opt = O.NAdam(params, foreach=False)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    rows = optimshift.placement(opt)
    assert [(r.param, r.key, r.device, r.dtype, r.shape, r.bytes) for r in rows[:4]] == [
        ("group 0, param 0", "step", "cpu", "float32", (), 4),
        ("group 0, param 0", "mu_product", "cpu", "float32", (), 4),
        ("group 0, param 0", "exp_avg", "sim:0", "float32", (4, 3), 48),
        ("group 0, param 0", "exp_avg_sq", "sim:0", "float32", (4, 3), 48),
    ]
    assert str(optimshift.check(opt)).endswith("every entry is where a fresh optimizer would keep it.")
    opt.state[params[1]]["mu_product"] = opt.state[params[1]]["mu_product"].to(sim)
    report = optimshift.check(opt)
    assert not report.ok
    (finding,) = report.findings
    assert (finding.param, finding.key, finding.device, finding.expected, finding.group, finding.index) == (
        "group 0, param 1", "mu_product", "sim:0", "cpu", 0, 1)
    assert finding.syncs_per_step == 2 and "device-to-host sync" in finding.why
    text = str(report)
    assert "NOT OK" in text and "mu_product" in text and "syncs/step" in text


def test_param_names_label_findings(sim):
    model = torch.nn.Linear(3, 2)
    opt = O.Adam(model.named_parameters(), foreach=False)
    model(torch.randn(5, 3)).sum().backward()
    opt.step()
    model.to(sim)
    report = optimshift.check(opt)
    assert {f.param for f in report.findings} == {"group 0, param 0 (weight)", "group 0, param 1 (bias)"}
    assert all(f.severity == "error" for f in report.findings if f.key != "step")
    optimshift.move(opt)
    assert optimshift.check(opt).ok
