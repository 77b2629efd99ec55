"""What ``inspect`` states about fused and capturable kernels comes from the installed torch, and reading a
small host checkpoint does not pay for probes it does not need."""

from __future__ import annotations

import collections
import json
import subprocess
import sys

import pytest
import torch
from torch.optim import optimizer as torch_optimizer

from _crafted import trained
from optimshift.checkpoint import _checks, _inspection
from optimshift.cli import main


def _flag_findings(path, capsys) -> dict[str, dict]:
    assert main(["inspect", str(path), "--json"]) == 0
    (o,) = json.loads(capsys.readouterr().out)["optimizers"]
    return {f["key"]: f for f in o["findings"] if f["key"] in ("fused", "capturable")}


@pytest.mark.parametrize(
    "flag, supported",
    [
        ("fused", torch_optimizer._get_fused_kernels_supported_devices),
        ("capturable", torch_optimizer._get_capturable_supported_devices),
    ],
)
def test_flag_statements_follow_the_installed_torch(tmp_path, capsys, flag, supported):
    # The Hugging Face Trainer's default (adamw_torch_fused) and a capturable Adam, saved on the host.
    path = tmp_path / "optimizer.pt"
    torch.save(trained(torch.optim.AdamW, **{flag: True}, n=2).state_dict(), path)
    finding = _flag_findings(path, capsys)[flag]
    devices = [d for d in supported() if d != "privateuseone"]
    assert finding["kernel_devices"] == devices
    assert f"this torch runs {flag} kernels on {', '.join(devices)}" in finding["message"]
    says_cpu_fails = "resuming on a CPU" in finding["message"]
    assert says_cpu_fails == ("cpu" not in supported()), finding["message"]
    assert finding["severity"] == ("warning" if says_cpu_fails else "info")


def test_torch_2_13_runs_fused_on_cpu_and_capturable_not(tmp_path, capsys):
    """Pinned for the torch this project is tested with: fused Adam/AdamW/SGD/Adagrad step on a CPU, capturable
    does not. If a torch changes either, the statements above follow it and this test says so."""
    assert "cpu" in torch_optimizer._get_fused_kernels_supported_devices()
    assert "cpu" not in torch_optimizer._get_capturable_supported_devices()
    for cls in (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad):
        param = torch.nn.Parameter(torch.randn(3))
        param.grad = torch.ones(3)
        cls([param], lr=0.1, fused=True).step()  # runs: no "fails at step()" on a CPU
    path = tmp_path / "fused.pt"
    torch.save(trained(torch.optim.AdamW, fused=True, n=2).state_dict(), path)
    assert "a CPU" not in _flag_findings(path, capsys)["fused"]["message"]


def test_a_torch_without_cpu_fused_kernels_gets_the_warning(tmp_path, capsys, monkeypatch):
    path = tmp_path / "fused.pt"
    torch.save(trained(torch.optim.AdamW, fused=True, n=2).state_dict(), path)
    monkeypatch.setattr(torch_optimizer, "_get_fused_kernels_supported_devices", lambda: ["cuda", "privateuseone"])
    finding = _flag_findings(path, capsys)["fused"]
    assert finding["severity"] == "warning" and finding["kernel_devices"] == ["cuda"]
    assert (
        "this torch runs fused kernels on cuda, so resuming on a CPU or any other device outside that list "
        "fails at step()" in finding["message"]
    )


def test_guessing_the_class_builds_no_real_optimizer(monkeypatch):
    """The class guess reads each torch.optim class's param-group keys without torch's add_param_group (which
    imports torch._dynamo, over a second) and caches them per class."""
    calls = []
    real = torch.optim.Optimizer.add_param_group
    monkeypatch.setattr(torch.optim.Optimizer, "add_param_group", lambda self, g: calls.append(g) or real(self, g))
    monkeypatch.setattr(_checks, "_fresh_groups", {})
    groups = [dict(torch.optim.NAdam([torch.nn.Parameter(torch.zeros(1))]).param_groups[0], params=[0])]
    calls.clear()
    assert _inspection.guess_classes(groups) == ["NAdam"]
    assert calls == []
    for name, cls, keys in _inspection._torch_optimizers():  # the same keys as a real optimizer's groups
        real_keys = frozenset(cls([torch.nn.Parameter(torch.zeros(2, 2))]).param_groups[0]) - {"params"}
        assert keys == real_keys, name


def test_inspecting_a_host_checkpoint_imports_no_dynamo(tmp_path):
    """Reading a small host checkpoint costs little more than importing torch: no placement probe runs (a fresh
    optimizer over host params keeps everything on the host) and no class is built through torch's
    add_param_group. Both imported torch._dynamo, 1-1.5 s of a 2.5-3 s run."""
    path = tmp_path / "optimizer.pt"
    torch.save(trained(torch.optim.AdamW, fused=True, n=2).state_dict(), path)
    code = (
        "import sys\nfrom optimshift.cli import main\n"
        f"assert main(['inspect', {str(path)!r}]) == 0\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "class: not recorded; its param groups look like Adam or AdamW" in out.stdout
    assert out.stdout.splitlines()[-1] == "False"


def test_a_device_type_this_process_does_not_know_is_judged_by_its_type(tmp_path, sim, capsys):
    """A file saved with ``step`` on an accelerator, inspected where that device type is not registered (the
    simulator's ``sim`` in a fresh process; a ``cuda`` file on a machine without CUDA): the findings are the ones
    a process that knows the type gives, from the saved type and torch's rules, never from the device being here."""
    import os
    from pathlib import Path

    import optimshift

    params = [torch.nn.Parameter(torch.randn(4, 3, device=sim)) for _ in range(2)]
    opt = torch.optim.Adam(params, foreach=True)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    sd = opt.state_dict()
    for st in sd["state"].values():
        st["step"] = st["step"].to(sim)  # what plain torch.load + opt.load_state_dict leave
    path = tmp_path / "optimizer.pt"
    torch.save(sd, path)
    assert main(["inspect", str(path), "--json"]) == 0
    (here,) = json.loads(capsys.readouterr().out)["optimizers"]
    (step,) = [f for f in here["findings"] if f["key"] == "step"]
    assert step["severity"] == "warning" and step["saved_on"] == str(sim) and step["syncs_per_param_per_step"] == 2
    src = str(Path(optimshift.__file__).resolve().parents[1])
    fresh = subprocess.run(
        [sys.executable, "-m", "optimshift", "inspect", str(path), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": src},
    )
    assert fresh.returncode == 0, fresh.stderr
    (there,) = json.loads(fresh.stdout)["optimizers"]
    assert there["findings"] == here["findings"]


def test_lbfgs_t_is_judged_where_torch_load_leaves_it(tmp_path, sim, capsys):
    """LBFGS's `t` stays on its own side (a fresh one may hold it on either). A file saved on an accelerator with
    a tensor lr holds `t` (that lr) on the host, and torch's load moves it to the param's device: ``inspect``
    judged it by the host copy it read and warned that a fresh LBFGS keeps it on the host, at a host sync per read,
    where ``check`` after that very load finds every entry in place."""
    import optimshift

    def stepped():
        params = [torch.nn.Parameter(torch.randn(4, 3, device=sim)) for _ in range(2)]
        opt = torch.optim.LBFGS(params, lr=torch.tensor(0.5), history_size=3, max_iter=4)

        def closure():
            opt.zero_grad()
            loss = sum((p**2).sum() for p in params)
            loss.backward()
            return loss

        return opt, closure

    opt, closure = stepped()
    opt.step(closure)
    opt.step(closure)
    sd = opt.state_dict()
    assert sd["state"][0]["t"] is sd["param_groups"][0]["lr"] and sd["state"][0]["t"].is_cpu
    path = tmp_path / "lbfgs.pt"
    torch.save(sd, path)
    assert main(["inspect", str(path), "--json"]) == 0
    (o,) = json.loads(capsys.readouterr().out)["optimizers"]
    resumed, _ = stepped()
    resumed.load_state_dict(torch.load(path, weights_only=True))
    assert not optimshift.check(resumed).findings
    assert [f for f in o["findings"] if f["key"] == "t"] == []


def test_a_placement_by_the_default_rule_is_worded_as_check_words_it(tmp_path, sim, capsys):
    """A file that records no class, whose groups match no torch.optim class, placed by the default rule: inspect
    stated that placement as fact; it now says it is assumed, as check() does, and why (a note after it)."""
    import optimshift
    from optimshift.report import assumed

    class Homemade(torch.optim.Optimizer):
        # (``source``, needed and kept in no group: a probe cannot build the class, so check() guesses too; a probe
        # of its step would see the step made on the param's device)
        def __init__(self, params, source, lr=0.1, gamma=0.5, zeta=1):
            self.source = source
            super().__init__(params, {"lr": lr, "gamma": gamma, "zeta": zeta})

        @torch.no_grad()
        def step(self, closure=None):
            for group in self.param_groups:
                for p in group["params"]:
                    st = self.state[p]
                    st["step"] = st.get("step", torch.tensor(0.0, device=p.device)) + 1
                    st["buffer"] = st.get("buffer", torch.zeros_like(p)) + p.grad
                    p.sub_(st["buffer"], alpha=group["lr"])

    params = [torch.nn.Parameter(torch.randn(4, 3, device=sim)) for _ in range(2)]
    opt = Homemade(params, "a loader")
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    checked = [f for f in optimshift.check(opt).findings if f.key == "step"]
    assert checked and all(f.why.startswith(assumed("Homemade")) for f in checked)
    path = tmp_path / "optimizer.pt"
    torch.save(opt.state_dict(), path)
    assert main(["inspect", str(path), "--json"]) == 0
    (o,) = json.loads(capsys.readouterr().out)["optimizers"]
    (step,) = [f for f in o["findings"] if f["key"] == "step"]
    assert step["message"].startswith(assumed("this optimizer") + "`step` saved on sim:0"), step["message"]
    assert step["fresh_optimizer_keeps_it_on"] == "cpu"
    (note,) = [f for f in o["findings"] if f["key"] == "-"]
    assert note["message"].startswith("no placement rule is known for this optimizer: the file records no class")
    assert o["findings"].index(note) > o["findings"].index(step)


def test_entries_torch_load_mangles_are_found_at_the_top_and_one_level_down():
    """A state entry that is, or holds, a namedtuple or a string is one ``optimizer.load_state_dict`` rebuilds
    wrongly: each is reported, per key, and a plain list or number is not."""
    pair = collections.namedtuple("pair", "a b")
    sd = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], momentum=0.9).state_dict()
    sd["state"] = {
        0: {"top": pair(1, 2), "inside": [pair(1, 2)], "text": "x", "texts": ("x",), "plain": [1, (2, 3)], "n": 4}
    }
    found = {f["key"]: f["message"] for f in _inspection.describe(sd, {})["optimizers"][0]["findings"]}
    assert {k: m.split(":")[0] for k, m in found.items()} == {
        "top": "state key `top` holds a namedtuple",
        "inside": "state key `inside` holds a namedtuple",
        "text": "state key `text` holds a string",
        "texts": "state key `texts` holds a string",
    }
