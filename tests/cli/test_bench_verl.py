"""`optimshift bench --case verl`: verl's shipped offload/load against the patched ones, on small sizes."""

import pytest

pytest.importorskip("verl")

import optimshift.integrations.verl as osv  # noqa: E402
from optimshift.cli import _bench as bench  # noqa: E402
from optimshift.cli._bench_verl import render_verl, run_verl_case  # noqa: E402


def test_the_verl_case_reports_syncs_allocations_and_objects(sim):
    osv.unpatch()
    result = run_verl_case(sim, quick=True, shapes=[(16, 8), (16,), (8, 16), (8,)])
    assert not osv.is_patched(), "the bench leaves the patch as it found it"
    assert result["verl"] != "?"
    shipped, ours = result["methods"]["verl (shipped)"], result["methods"]["optimshift (patched)"]
    assert shipped["syncs_per_step_after"] == 2 * result["params"]  # foreach AdamW reads a device step twice
    assert ours["syncs_per_step_after"] == 0
    assert shipped["host_allocations_per_cycle"] == result["tensors"]  # a new host tensor for every one
    assert ours["host_allocations_per_cycle"] == 0 and ours["pool_allocations_per_cycle"] == 0
    assert (shipped["objects_kept"], ours["objects_kept"]) == (0.0, 1.0)
    text = render_verl(result)
    assert "verl (shipped)" in text and "optimshift (patched)" in text
    assert f"host syncs per step {2 * result['params']} -> 0" in text


def test_bench_takes_case_verl(capsys, monkeypatch, sim):
    import optimshift.cli._bench_verl as case

    monkeypatch.setattr(case, "run_verl_case", lambda device, quick: {"called": (str(device), quick)})
    monkeypatch.setattr(case, "render_verl", lambda result: f"rendered {result['called']}")
    assert bench.main(["--case", "verl", "--quick", "--device", "sim"]) == 0
    assert capsys.readouterr().out.strip() == "rendered ('sim:0', True)"
    with pytest.raises(SystemExit):
        bench.main(["--case", "nothing"])


def test_bench_case_verl_skips_in_one_line_without_verl(capsys, monkeypatch, sim):
    """A GPU check's interpreter may have no verl: the case says so in one line and succeeds, as deepspeed's."""
    import importlib.util

    from optimshift.cli import _bench

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "verl" else real(name, *a))
    assert _bench.main(["--case", "verl", "--quick", "--device", "sim"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and "skipped, verl is not installed" in out[0], out
