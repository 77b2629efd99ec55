"""The `optimshift` command: demo and bench (on small sizes), and help texts."""

import json
import os
import stat

import pytest
import torch

from optimshift import cli
from optimshift.cli import _bench as bench


def test_help_explains_every_command(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = capsys.readouterr().out
    for command in ("demo", "inspect", "convert", "bench"):
        assert command in out
    with pytest.raises(SystemExit):
        cli.main(["demo", "--help"])
    assert "Lightning issue #19955" in " ".join(capsys.readouterr().out.split())


def test_demo_shows_the_bug_and_the_fix(sim, capsys):
    assert cli.main(["demo", "--json", "--device", str(sim)]) == 0
    rows = {(r["method"], r["optimizer"]): r for r in json.loads(capsys.readouterr().out)}
    naive = rows[("naive: every tensor to the device", "Adam")]
    ours = rows[("optimshift.move(opt)", "Adam")]
    lightning = rows[("Lightning today: all but 'step'", "Adam fused")]
    ours_fused = rows[("optimshift.move(opt)", "Adam fused")]
    assert naive["step_device"] == str(sim) and naive["syncs_per_step"] > 0
    assert ours["step_device"] == "cpu" and ours["syncs_per_step"] == 0 and ours["max_param_diff"] == 0
    assert lightning["step_ran"].startswith("no") and lightning["step_device"] == "cpu"
    assert ours_fused["step_device"] == str(sim) and ours_fused["step_ran"] == "yes"
    assert ours_fused["max_param_diff"] == 0


def test_bench_cases_report_what_they_measure(sim):
    case = bench._throughput_case("small", [(4,)] * 50 + [(64, 64)], sim, reps=1)
    methods = case["methods"]
    assert set(methods) >= {"flat copy (limit)", "naive .to() loop", "optimshift offload/reload"}
    assert methods["naive .to() loop"]["syncs_per_step_after"] > 0
    assert methods["optimshift offload/reload"]["syncs_per_step_after"] == 0
    assert case["bytes"] == 2 * (50 * 4 + 64 * 64) * 4 and case["ratios"]["offload_vs_flat"] > 0
    assert bench._pool_case(sim, [(8, 8)] * 10, cycles=3)["new_allocations_per_cycle"] == 0
    steps = bench._step_time_case(sim, [(8, 8)] * 4, reps=1)
    assert steps["syncs_per_step"]["optimshift.move"] == steps["syncs_per_step"]["fresh"] == 0
    assert steps["syncs_per_step"]["naive"] > 0
    overhead = bench._overhead_case(200, reps=1)
    assert overhead["tensors"] == 200 and overhead["move_vs_bare"] > 0
    result = {
        "device": str(sim),
        "device_name": "simulated accelerator",
        "torch": torch.__version__,
        "throughput": [case],
        "pool": {"pinned": False, "new_allocations_per_cycle": 0, "cycles": 3},
        "step_after_move": steps,
        "overhead_meta": overhead,
    }
    # On the simulator the times measure the simulator: only the counts are shown, and said why.
    text = bench.render(result)
    assert "times on the simulated accelerator measure the simulator" in text.splitlines()[1]
    assert "new allocations per offload/reload cycle" in text and "after a move: host syncs per step" in text
    assert "syncs/step after" in text and "GB/s" not in text and "faster" not in text and "slower" not in text
    assert "optimshift vs flat copy" not in text and "step time after move" not in text
    # On a device, the times and their ratios.
    text = bench.render({**result, "device": "cuda:0", "device_name": "a GPU"})
    assert "optimshift vs flat copy" in text and "offload GB/s" in text and "step time after move" in text
    assert "measure the simulator" not in text


def test_bench_streamed_case(sim):
    case = bench._stream_case(sim, [(8, 8)] * 4 + [(64,)], reps=1)
    assert case["state_bytes"] == 2 * (4 * 64 + 64) * 4 + 5 * 4  # exp_avg, exp_avg_sq; fused: step on the device
    assert case["chunks"] == 1 and case["syncs_per_step"] == {"all on device": 0, "streamed": 0}
    assert 0 < case["extra_device_bytes_streamed_step"] <= case["extra_device_bytes_bound"]
    assert case["goals"]["host syncs per step equal"] and case["note"]
    assert case["cpu_step_s"]["torch CPU AdamW"] > 0 and case["cpu_step_s"]["torchao CPUOffloadOptimizer"] is None
    result = {
        "device": str(sim),
        "device_name": "simulated accelerator",
        "torch": torch.__version__,
        "throughput": [],
        "pool": {"pinned": False, "new_allocations_per_cycle": 0, "cycles": 3},
        "step_after_move": {"moved_vs_fresh": 1.0, "naive_vs_fresh": 1.0, "syncs_per_step": {}},
        "overhead_meta": {"tensors": 1, "move_us_per_tensor": 1.0, "bare_us_per_tensor": 1.0, "move_vs_bare": 1.0},
        "streamed": case,
    }
    text = bench.render(result)
    (goals,) = [line for line in text.splitlines() if line.startswith("goals:")]
    assert "streamed step, fused AdamW" in text and " ms" not in text.split("streamed step", 1)[1]
    assert "host syncs per step equal: met" in goals and "extra device memory" in goals
    assert "1.2 x link" not in goals and "CPU AdamW" not in goals and "not checked on the simulator" in goals
    text = bench.render({**result, "device": "xpu:0", "device_name": "another accelerator"})
    (goals,) = [line for line in text.splitlines() if line.startswith("goals:")]
    assert "1.2 x link" in goals and "CPU AdamW" in goals and "not a GPU" in text  # (the case's own note)


def _bench_stub(monkeypatch, runs):
    """``bench`` with its run replaced by a recorded, instant one (what --out does is what is tested)."""

    def run(device, quick=False):
        runs.append(1)
        return {"case": "stub", "value": 1}

    monkeypatch.setattr(bench, "run_bench", run)
    monkeypatch.setattr(bench, "render", lambda result: f"stub {result['value']}")


@pytest.mark.parametrize("where", ["a directory", "a missing folder", "a FIFO"])
def test_bench_out_that_cannot_be_written_fails_before_the_run(tmp_path, capsys, monkeypatch, where):
    """``--out`` is checked before the run (minutes), in one line: before, the run went first and its results
    were lost in a traceback. A FIFO (or a device node) is not replaced by the results' file."""
    runs = []
    _bench_stub(monkeypatch, runs)
    out = tmp_path if where == "a directory" else tmp_path / "missing" / "r.json"
    if where == "a FIFO":
        out = tmp_path / "pipe"
        os.mkfifo(out)
    rc = cli.main(["bench", "--device", "sim", "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 1 and runs == [] and len(err.strip().splitlines()) == 1 and str(out) in err


@pytest.mark.parametrize("device", ["cuda:7", "sim:5", "nonsense", "cpu", "meta"])
def test_bench_on_a_device_it_cannot_use_fails_in_one_line(capsys, monkeypatch, device):
    """A device this machine lacks (or torch does not know) printed a traceback; cpu ran and died dividing by
    zero. One line (one JSON document with --json), before the run."""
    runs = []
    _bench_stub(monkeypatch, runs)
    assert cli.main(["bench", "--device", device]) == 1
    err = capsys.readouterr().err
    assert runs == [] and len(err.strip().splitlines()) == 1 and f"--device {device}" in err
    assert cli.main(["bench", "--device", device, "--json"]) == 1
    assert f"--device {device}" in json.loads(capsys.readouterr().out)["error"]["message"]


def test_demo_on_the_host_says_nothing_of_a_simulated_accelerator(capsys):
    """``demo --device cpu`` ended with "(simulated accelerator: real values computed on the host; ...)": the note
    is the simulator's, and it is not a real accelerator's (or the host's) either."""
    assert cli.main(["demo", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "resumed on cpu" in out and "simulated" not in out, out


@pytest.mark.parametrize("device", ["cuda:7", "sim:5", "nonsense", "meta"])
def test_demo_on_a_device_it_cannot_use_fails_in_one_line(capsys, device):
    """``demo --device cuda`` on a machine without CUDA (or a name torch does not know) printed a traceback, where
    ``bench`` says what is wrong in one line (one JSON document with --json)."""
    assert cli.main(["demo", "--device", device]) == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and f"--device {device}" in err, err
    assert cli.main(["demo", "--device", device, "--json"]) == 1
    assert f"--device {device}" in json.loads(capsys.readouterr().out)["error"]["message"]


def test_bench_out_is_written_atomically_and_leaves_other_files_alone(tmp_path, capsys, monkeypatch):
    """The results go through a hidden temporary of their own: a file named like the old fixed temporary
    (``OUT.tmp``, which a run used to overwrite and delete) is left alone, and nothing else is left behind."""
    _bench_stub(monkeypatch, [])
    out = tmp_path / "res.json"
    (tmp_path / "res.json.tmp").write_text("mine")
    assert cli.main(["bench", "--device", "sim", "--out", str(out)]) == 0
    assert "stub 1" in capsys.readouterr().out
    assert json.loads(out.read_text()) == {"case": "stub", "value": 1}
    assert (tmp_path / "res.json.tmp").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["res.json", "res.json.tmp"]


def test_bench_out_through_a_link_writes_the_file_it_points_at_and_json_is_one_document(tmp_path, capsys, monkeypatch):
    """``--out`` a link: the file it points at is written and the link stays (it was replaced by a file); with
    ``--json``, a write that fails leaves one JSON document on stdout, the error (the results came first, then
    the error: two documents)."""
    _bench_stub(monkeypatch, [])
    real = tmp_path / "real.json"
    real.write_text("{}")
    link = tmp_path / "link.json"
    link.symlink_to(real)
    assert cli.main(["bench", "--device", "sim", "--out", str(link), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"case": "stub", "value": 1}
    assert link.is_symlink() and json.loads(real.read_text()) == {"case": "stub", "value": 1}

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(bench, "_write_out", full)
    assert cli.main(["bench", "--device", "sim", "--out", str(link), "--json"]) == 1
    assert "No space left" in json.loads(capsys.readouterr().out)["error"]["message"]


def test_bench_out_keeps_the_replaced_file_s_permissions(tmp_path, capsys, monkeypatch):
    """Replacing a private results file keeps it private, as ``save`` does (a 0600 file became 0644)."""
    _bench_stub(monkeypatch, [])
    out = tmp_path / "res.json"
    out.write_text("{}")
    os.chmod(out, 0o600)
    assert cli.main(["bench", "--device", "sim", "--out", str(out)]) == 0
    assert json.loads(out.read_text()) == {"case": "stub", "value": 1}
    assert stat.S_IMODE(os.stat(out).st_mode) == 0o600 and [p.name for p in tmp_path.iterdir()] == ["res.json"]


@pytest.mark.parametrize("when", ["before the run", "during the run"])
def test_bench_out_refuses_a_read_only_file_in_one_line(tmp_path, capsys, monkeypatch, when):
    """A read-only results file is refused, as ``save`` refuses one, in one line (before the run where it is
    read-only then): a rename replaced it. Nothing is written and no temporary is left."""
    runs = []
    _bench_stub(monkeypatch, runs)
    out = tmp_path / "res.json"
    out.write_text("mine")
    if when == "before the run":
        os.chmod(out, 0o444)
    else:
        run = bench.run_bench
        monkeypatch.setattr(bench, "run_bench", lambda device, quick=False: (os.chmod(out, 0o444), run(device))[1])
    assert cli.main(["bench", "--device", "sim", "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and f"{out} is read-only (mode 444)" in err, err
    assert runs == ([] if when == "before the run" else [1])
    assert out.read_text() == "mine" and [p.name for p in tmp_path.iterdir()] == ["res.json"]
