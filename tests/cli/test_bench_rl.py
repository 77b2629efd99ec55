"""`optimshift bench --case rl-loop`: an RL pipeline's offload/reload loop around a compiled step, small sizes."""

from optimshift.cli import _bench as bench
from optimshift.cli._bench_rl import render_rl_loop, run_rl_loop_case


def test_the_rl_loop_case_reports_its_goals_per_cycle(sim):
    result = run_rl_loop_case(sim, quick=True)
    assert len(result["rows"]) == result["cycles"] == 4
    warm = result["rows"][1:]
    assert all(r["syncs_per_step"] == 0 for r in warm), "a fresh optimizer's step makes no host sync"
    assert all(r["new_host_allocations"] == 0 for r in warm), "the pool serves every cycle after the first"
    assert all(r["freed_bytes"] >= result["state_bytes"] for r in warm), "the device holds no state offloaded"
    assert result["goals"]["syncs per step 0"] and result["goals"]["all state bytes freed while offloaded"]
    assert "addresses kept after the first cycle" not in result["goals"], "only asked for with keep_addresses"
    assert result["bare_ms"] > 0 and result["overhead_vs_bare"] > 0
    assert all(0 <= r["objects_kept"] <= result["state_tensors"] for r in result["rows"])
    text = render_rl_loop(result)
    assert "rl-loop on sim:0" in text and "goals:" in text and "objects kept" in text
    assert "times on the simulated accelerator measure the simulator" in text, "its times are said to be the sim's"
    assert "only where the caching allocator happened to hand the same memory back" in text, "the column explained"
    on_a_gpu = render_rl_loop({**result, "device": "cuda:0"})
    assert "measure the simulator" not in on_a_gpu, "only the simulator's times get the caveat"
    # the note explains a cycle that replaced state tensors (on the simulator, a compiled step's weak references
    # block the swap and set_data does not apply), and only then
    replaced = any(r["objects_kept"] < result["state_tensors"] for r in result["rows"])
    assert ("a cycle replaced state tensors" in text) == replaced


def test_bench_takes_case_rl_loop(capsys, monkeypatch, sim):
    import optimshift.cli._bench_rl as case

    monkeypatch.setattr(case, "run_rl_loop_case", lambda device, quick: {"called": (str(device), quick)})
    monkeypatch.setattr(case, "render_rl_loop", lambda result: f"rendered {result['called']}")
    assert bench.main(["--case", "rl-loop", "--quick", "--device", "sim"]) == 0
    assert capsys.readouterr().out.strip() == "rendered ('sim:0', True)"


def test_the_rl_loop_case_keeps_addresses_when_asked(sim):
    result = run_rl_loop_case(sim, quick=True, keep_addresses=True)
    warm = result["rows"][1:]
    assert all(r["addresses_kept"] == result["state_tensors"] for r in warm)
    assert result["goals"]["addresses kept after the first cycle"]
    assert all(r["freed_bytes"] >= result["state_bytes"] for r in warm), "the mapped state is released"
    text = render_rl_loop(result)
    assert "addresses kept" in text and "happened to hand the same memory back" not in text


def test_bench_takes_keep_addresses(capsys, monkeypatch, sim):
    import optimshift.cli._bench_rl as case

    monkeypatch.setattr(
        case, "run_rl_loop_case", lambda device, quick, keep_addresses: {"called": (str(device), keep_addresses)}
    )
    monkeypatch.setattr(case, "render_rl_loop", lambda result: f"rendered {result['called']}")
    assert bench.main(["--case", "rl-loop", "--keep-addresses", "--device", "sim"]) == 0
    assert capsys.readouterr().out.strip() == "rendered ('sim:0', 'auto')"


def test_bench_refuses_keep_addresses_for_a_case_that_would_ignore_it(capsys, monkeypatch, sim):
    """``--case verl --keep-addresses`` (deepspeed, all) ran the case without keeping addresses, without a word:
    refused now, in one line, before anything runs."""
    import json

    import optimshift.cli._bench_deepspeed as deepspeed_case
    import optimshift.cli._bench_verl as verl_case

    def ran(*args, **kwargs):
        raise AssertionError("the case ran")

    for module, name in [(bench, "run_bench"), (verl_case, "run_verl_case"), (deepspeed_case, "run_deepspeed_case")]:
        monkeypatch.setattr(module, name, ran)
    for case in ("verl", "deepspeed", "all"):
        assert bench.main(["--case", case, "--keep-addresses", "--device", "sim"]) == 1
        out, err = capsys.readouterr()
        assert out == ""
        assert err == f"optimshift bench: error: --keep-addresses is for --case rl-loop, not --case {case}\n"
        assert bench.main(["--case", case, "--keep-addresses", "--device", "sim", "--json"]) == 1
        assert "--keep-addresses is for --case rl-loop" in json.loads(capsys.readouterr().out)["error"]["message"]
