"""`optimshift bench --case deepspeed`: ZeRO-1/2's shipped optimizer-state offload/reload against the patched ones,
on small sizes, and the skip where deepspeed is not installed."""

import os

import pytest

from optimshift.cli import _bench as bench

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # read when deepspeed is first imported


def test_the_deepspeed_case_reports_syncs_allocations_and_objects(sim):
    pytest.importorskip("deepspeed")
    import optimshift.integrations.deepspeed as osd
    from optimshift.cli._bench_deepspeed import render_deepspeed, run_deepspeed_case

    osd.unpatch()
    result = run_deepspeed_case(sim, quick=True, shapes=[(16, 8), (16,), (8, 16), (8,)])
    assert not osd.is_patched(), "the bench leaves the patch as it found it"
    assert result["deepspeed"] != "?"
    shipped, ours = result["methods"]["DeepSpeed (shipped)"], result["methods"]["optimshift (patched)"]
    assert shipped["syncs_per_step_after"] == 2 * result["params"]  # its reload put every step on the device
    assert ours["syncs_per_step_after"] == 0
    assert shipped["host_allocations_per_cycle"] == result["tensors"]  # a new pinned buffer for every one
    assert ours["host_allocations_per_cycle"] == 0 and ours["pool_allocations_per_cycle"] == 0
    assert (shipped["objects_kept"], ours["objects_kept"]) == (0.0, 1.0)
    assert result["partition"] == {}  # no .data swap between the host and the simulator
    text = render_deepspeed(result)
    assert "DeepSpeed (shipped)" in text and "optimshift (patched)" in text
    assert f"host syncs per step {2 * result['params']} -> 0" in text


def test_bench_takes_case_deepspeed_and_skips_in_one_line_without_it(capsys, monkeypatch, sim):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "deepspeed" else real(name, *a))
    assert bench.main(["--case", "deepspeed", "--quick", "--device", "sim"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and "skipped, deepspeed is not installed" in out[0]
