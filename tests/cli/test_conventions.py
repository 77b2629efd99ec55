"""What a new user meets first: ``python -m optimshift``, ``--version``, help texts, and no warnings on a clean
install (NumPy absent)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import optimshift
from optimshift import cli
from optimshift.cli import _bench as bench

ROOT = Path(__file__).resolve().parents[2]
COMMANDS = ("demo", "inspect", "convert", "bench")

# Runs the command as `python -m optimshift ARGS` would, in an interpreter where NumPy cannot be imported (what
# `pip install optimshift` gives: torch does not require NumPy).
WITHOUT_NUMPY = (
    "import runpy, sys\n"
    "sys.modules['numpy'] = None\n"
    "sys.argv = ['optimshift'] + sys.argv[1:]\n"
    "runpy.run_module('optimshift', run_name='__main__', alter_sys=True)\n"
)


def _python(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=180, env={**os.environ, **(env or {})}
    )


def test_python_m_optimshift_and_version():
    out = _python("-m", "optimshift", "--version")
    assert out.returncode == 0, out.stderr
    assert (
        out.stdout.strip() == f"optimshift {optimshift.__version__} (torch {torch.__version__}, Python "
        f"{'.'.join(map(str, sys.version_info[:3]))})"
    )
    out = _python("-m", "optimshift", "--help")
    assert out.returncode == 0 and all(c in out.stdout for c in COMMANDS)


def test_version_is_written_once():
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "optimshift._version.__version__"}
    assert re.fullmatch(r"\d+\.\d+\.\d+\S*", optimshift.__version__)
    assert project["project"]["license"] == "Apache-2.0"  # an SPDX expression, not the deprecated table
    assert "Apache License" in (ROOT / "LICENSE").read_text() and "Version 2.0" in (ROOT / "LICENSE").read_text()


def test_no_warning_without_numpy(tmp_path):
    # The check can see the warning: torch itself prints it when NumPy is missing.
    plain = _python("-c", "import sys; sys.modules['numpy'] = None; import torch")
    assert "Failed to initialize NumPy" in plain.stderr
    # Importing optimshift first: nothing on stderr, and only that warning was silenced.
    code = (
        "import sys, warnings; sys.modules['numpy'] = None; import optimshift, torch\n"
        "assert not any(f[1] is not None and 'NumPy' in f[1].pattern for f in warnings.filters), warnings.filters\n"
        "warnings.warn('still shown')\n"
    )
    out = _python("-c", code)
    assert out.returncode == 0, out.stderr
    assert "Failed to initialize NumPy" not in out.stderr and "UserWarning: still shown" in out.stderr
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], fused=True)
    opt.param_groups[0]["params"][0].grad = torch.ones(2)
    opt.step()
    path = tmp_path / "optimizer.pt"
    torch.save(opt.state_dict(), path)
    for args in (
        ["--version"],
        ["--help"],
        ["inspect", str(path)],
        ["inspect", str(path), "--json"],
        ["convert", str(path), str(tmp_path / "out.pt")],
    ):
        out = _python("-c", WITHOUT_NUMPY, *args)
        assert out.returncode == 0, out.stderr
        assert out.stderr == "", f"optimshift {' '.join(args)} printed: {out.stderr}"


def _help(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit):
        argv[0](argv[1:]) if callable(argv[0]) else cli.main(argv)
    return capsys.readouterr().out


@pytest.mark.parametrize(
    "argv",
    [["--help"]] + [[c, "--help"] for c in COMMANDS] + [[bench.main, "--help"]],
    ids=["optimshift"] + list(COMMANDS) + ["python -m optimshift.bench"],
)
def test_help_is_plain_wrapped_text(argv, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    text = _help(argv, capsys)
    assert "`" not in text and ":func:" not in text and ":mod:" not in text, text
    too_long = [line for line in text.splitlines() if len(line) > 80]
    assert not too_long, too_long
    assert "\n\n\n" not in text


def test_bench_says_slower_below_one():
    assert bench._speedup(2.0) == "2.00x faster"
    assert bench._speedup(0.5) == "2.00x slower"
    case = {
        "case": "c",
        "tensors": 1,
        "bytes": 8,
        "methods": {},
        "ratios": {"offload_vs_flat": 0.5, "reload_vs_flat": 0.4, "offload_vs_naive": 0.8, "reload_vs_naive": 3.0},
    }
    text = bench.render(
        {
            "device": "cuda:0",
            "device_name": "a GPU",
            "torch": torch.__version__,
            "throughput": [case],
            "pool": {"pinned": False, "new_allocations_per_cycle": 0, "cycles": 3},
            "step_after_move": {"moved_vs_fresh": 1.0, "naive_vs_fresh": 1.2, "syncs_per_step": {}},
            "overhead_meta": {"tensors": 2, "move_us_per_tensor": 1.0, "bare_us_per_tensor": 1.0, "move_vs_bare": 1.0},
        }
    )
    assert "vs naive loop: offload 1.25x slower, reload 3.00x faster" in text
    assert "0.80x faster" not in text


def test_readme_starts_with_install():
    tomllib = pytest.importorskip("tomllib")
    readme = (ROOT / "README.md").read_text()
    sections = re.findall(r"^## (.+)$", readme, flags=re.M)
    assert sections[0] == "Install", sections
    install = readme.split("## Install", 1)[1].split("\n## ", 1)[0]
    assert "pip install optimshift " in install
    extras = set(re.findall(r'pip install "optimshift\[(\w+)\]"', install))
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras and extras <= set(declared), extras
    commands = re.findall(r"^optimshift (\w+)", install, flags=re.M)
    assert commands == ["demo", "inspect"] and all(c in COMMANDS for c in commands)
    assert install.index("pip install") < install.index("scripts/demo")
    assert (ROOT / "CHANGELOG.md").read_text().startswith("# Changelog")


def test_the_readme_function_table_gives_every_parameter():
    """Each call in the README's table of functions names every parameter the function takes, as it takes it
    (positional, or keyword-only after ``*``), so the table is the signature a reader can rely on."""
    import inspect

    readme = (ROOT / "README.md").read_text()
    table = readme.split("| function | what it does |", 1)[1].split("\n\n", 1)[0]
    cells = re.findall(r"^\| (.+?) \|", table, flags=re.M)
    calls = [c for cell in cells for c in re.findall(r"`([\w.]+)\(([^`]*)\)(?: -> \w+)?`", cell)]
    assert len(calls) >= 12, calls
    for name, args in calls:
        obj = optimshift
        for part in name.removeprefix("optimshift.").split("."):
            obj = getattr(obj, part)
        written, keyword_only = [], False
        for arg in (a.strip() for a in args.split(",") if a.strip()):
            if arg == "*":
                keyword_only = True
                continue
            written.append((arg.split("=", 1)[0].strip(), keyword_only))
        params = list(inspect.signature(obj).parameters.values())
        real = [(p.name, p.kind is inspect.Parameter.KEYWORD_ONLY) for p in params]
        if params and params[0].kind is not inspect.Parameter.KEYWORD_ONLY:  # (the README says opt, cls)
            real[0] = (written[0][0] if written else real[0][0], False)
        assert written == real, f"README's {name}({args}) vs {name}{inspect.signature(obj)}"


def test_numpy_is_a_dependency():
    """torch does not require NumPy but warns at ``import torch`` in every script without it: installing optimshift
    installs it, so a user's own script starts without that warning (the README says why)."""
    tomllib = pytest.importorskip("tomllib")
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {re.split(r"[<>=!~\[; ]", d, maxsplit=1)[0].lower() for d in dependencies}
    assert names == {"torch", "numpy"}, dependencies
    assert "NumPy" in (ROOT / "README.md").read_text().split("## The device rule", 1)[0]


SRC = Path(optimshift.__file__).resolve().parents[1]  # this checkout's code, whatever folder a command runs in


def _command(args: list[str], cwd: Path, *, stdout: int | None = subprocess.PIPE) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args],
        cwd=cwd,
        stdout=stdout,
        stderr=subprocess.PIPE,
        text=True,
        timeout=180,
        env={**os.environ, "PYTHONPATH": str(SRC)},
    )


def test_python_m_optimshift_resolves_globals_as_the_command_does(tmp_path):
    """``python -m`` puts the current folder first on sys.path; the installed ``optimshift`` script does not. A
    module in the current folder (a training script's) is imported by neither, so both say the same, and neither
    runs that module's code."""
    work, bin_dir = tmp_path / "work", tmp_path / "bin"
    work.mkdir()
    bin_dir.mkdir()
    (work / "trainconfig.py").write_text(
        "import pathlib\npathlib.Path(__file__).with_name('imported').touch()\nclass Config:\n    lr = 0.1\n"
    )
    # What pip writes for the [project.scripts] entry point.
    (bin_dir / "optimshift").write_text(
        "import sys\nfrom optimshift.cli import main\nif __name__ == '__main__':\n    sys.exit(main())\n"
    )
    saving = "import sys, torch; sys.path[:0] = ['.']; import trainconfig as t; torch.save({'c': t.Config()}, 'c.pt')"
    assert _command(["-c", saving], work).returncode == 0
    (work / "imported").unlink()
    argv = ["convert", "c.pt", "out.pt", "--allow-global", "trainconfig.Config"]
    script = _command([str(bin_dir / "optimshift"), *argv], work)
    module = _command(["-m", "optimshift", *argv], work)
    assert script.returncode == 1 and "cannot import trainconfig" in script.stderr, script.stderr
    assert (module.returncode, module.stdout, module.stderr) == (script.returncode, script.stdout, script.stderr)
    assert not (work / "imported").exists() and not (work / "out.pt").exists()


def test_a_closed_pipe_ends_quietly(tmp_path):
    """``optimshift inspect ckpt.pt | head``: once the reader is gone the command ends without a traceback."""
    opt = torch.optim.Adam([torch.nn.Parameter(torch.zeros(2))])
    path = tmp_path / "optimizer.pt"
    torch.save(opt.state_dict(), path)
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the command writes
    try:
        out = _command(["-m", "optimshift", "inspect", str(path)], tmp_path, stdout=write)
        assert out.stderr == "" and out.returncode == 141, (out.returncode, out.stderr)  # 141: as killed by SIGPIPE
        out = _command(["-m", "optimshift", "inspect", str(path), "--json"], tmp_path, stdout=write)
        assert out.stderr == "" and out.returncode == 141, (out.returncode, out.stderr)
    finally:
        os.close(write)


def test_python_m_optimshift_bench_ends_quietly_on_a_closed_pipe(monkeypatch):
    """``python -m optimshift.bench | head`` ends as ``optimshift bench | head`` does: the reader gone while the
    results are written, the status is 141 and no traceback (both entry points run through ``run_command``)."""
    from optimshift.cli import _bench, _help

    def reader_gone(args):
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(_bench, "_main", reader_gone)
    monkeypatch.setattr(_help, "_discard_stdout", lambda: None)  # (pytest's captured stdout has no descriptor)
    assert _bench.main(["--quick"]) == 141
