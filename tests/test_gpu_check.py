"""benchmarks/gpu_check.sh runs offline on the interpreter it is given: on a machine without a GPU it stops at
its "no CUDA device" line (status 2) without creating a .venv or calling pip, and it refuses, in one line
(status 3), a torch outside the range pyproject.toml's dependencies give."""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import stat
import subprocess
import sys

import pytest
import torch

REPO = pathlib.Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def _tree(tmp_path, dependencies=None):
    """A copy of what the script reads (itself, pyproject.toml; src/ linked), with no .venv."""
    root = tmp_path / "repo"
    (root / "benchmarks").mkdir(parents=True)
    shutil.copy(REPO / "benchmarks" / "gpu_check.sh", root / "benchmarks" / "gpu_check.sh")
    text = (REPO / "pyproject.toml").read_text()
    if dependencies is not None:
        text, n = re.subn(r"(?m)^dependencies = \[.*\]$", f"dependencies = {dependencies}", text)
        assert n == 1
    (root / "pyproject.toml").write_text(text)
    (root / "src").symlink_to(REPO / "src")
    return root


def _executable(path, text):
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def _offline_env(tmp_path, **extra):
    """No network (no index, a proxy nobody listens on), and recorders for every way to install something:
    `pip`/`pip3` on PATH write a marker, and pip itself (even as `python -m pip`) would write PIP_LOG."""
    tools = tmp_path / "tools"
    tools.mkdir(exist_ok=True)
    for name in ("pip", "pip3", "uv", "conda"):
        _executable(tools / name, f"#!/bin/sh\necho {name} >> {tmp_path / 'installs'}\nexit 1\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "PYTHON"))}
    env.update(
        PATH=f"{tools}:{env.get('PATH', '/usr/bin:/bin')}",
        PIP_NO_INDEX="1",
        PIP_LOG=str(tmp_path / "pip.log"),
        http_proxy="http://127.0.0.1:9",
        https_proxy="http://127.0.0.1:9",
        HTTP_PROXY="http://127.0.0.1:9",
        HTTPS_PROXY="http://127.0.0.1:9",
    )
    env.update(extra)
    return env


def _run(root, env, *args):
    return subprocess.run(
        ["bash", str(root / "benchmarks" / "gpu_check.sh"), *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=root.parent,
        timeout=300,
    )


def _nothing_installed(tmp_path, root):
    assert not (root / ".venv").exists(), "the script created a .venv"
    assert not (tmp_path / "installs").exists(), (tmp_path / "installs").read_text()
    assert not (tmp_path / "pip.log").exists(), "the script ran pip"
    assert not (root / "benchmarks" / "results").exists(), "results written though nothing ran"


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present: the script would run the check")
def test_without_a_gpu_it_stops_at_no_cuda_device_offline(tmp_path):
    root = _tree(tmp_path)
    # python3 must not be used when PYTHON is given: a python3 that records its calls comes first on PATH
    env = _offline_env(tmp_path, PYTHON=sys.executable)
    _executable(tmp_path / "tools" / "python3", f"#!/bin/sh\necho python3 >> {tmp_path / 'installs'}\nexit 1\n")
    proc = _run(root, env, str(tmp_path / "copy-here"))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stdout.splitlines() == [
        f"gpu_check: no CUDA device: nothing to check (torch {torch.__version__} at {sys.executable})"
    ], proc.stdout + proc.stderr
    assert proc.stderr == ""
    _nothing_installed(tmp_path, root)
    assert not (tmp_path / "copy-here").exists()


def _fake_python3(tmp_path, version):
    """A `python3` on PATH: the real interpreter, whose `import torch` finds a torch reporting ``version``
    (and no CUDA device)."""
    fake = tmp_path / "fake-torch" / "torch"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(
        f"__version__ = {version!r}\n"
        "class cuda:\n    @staticmethod\n    def is_available():\n        return False\n"
        "class version:\n    cuda = None\n"
    )
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _executable(
        bin_dir / "python3",
        f'#!/bin/sh\nPYTHONPATH="{fake.parent}${{PYTHONPATH:+:$PYTHONPATH}}" exec "{sys.executable}" "$@"\n',
    )
    return bin_dir


@pytest.mark.parametrize("version", ["2.3.1", "2.14.0", "2.14.0.dev20260101+cu130", "1.13.1+cu117"])
def test_a_torch_outside_the_supported_range_is_refused_in_one_line(tmp_path, version):
    root = _tree(tmp_path)
    env = _offline_env(tmp_path)
    env["PATH"] = f"{_fake_python3(tmp_path, version)}:{env['PATH']}"
    proc = _run(root, env)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 1 and proc.stderr == "", proc.stdout + proc.stderr
    assert lines[0].startswith(f"gpu_check: torch {version} at ")
    assert "is outside the range optimshift supports, torch>=2.4,<2.14 (pyproject.toml dependencies)" in lines[0]
    _nothing_installed(tmp_path, root)


def test_the_range_is_read_from_pyproject(tmp_path):
    # torch 2.11 (the lent GPU machines'), in range: it goes on to the CUDA check
    root = _tree(tmp_path)
    env = _offline_env(tmp_path)
    env["PATH"] = f"{_fake_python3(tmp_path, '2.11.0+cu130')}:{env['PATH']}"
    proc = _run(root, env)
    assert proc.returncode == 2 and "gpu_check: no CUDA device: nothing to check (torch 2.11.0+cu130" in proc.stdout
    # the same torch, with a pyproject that asks for more
    narrowed = _tree(tmp_path / "narrowed", dependencies='["torch >= 2.12, < 2.14"]')
    proc = _run(narrowed, env)
    assert proc.returncode == 3 and "outside the range optimshift supports, torch>=2.12,<2.14" in proc.stdout
    _nothing_installed(tmp_path, root)
