"""``inspect`` and ``convert`` on files they cannot read: exit 1 with one line on stderr (no traceback), or
with ``--json`` an error object on stdout; a 5,000-deep list in a param group is shown, not a crash; a cast
that would materialise an expanded view is refused."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import optimshift
from _crafted import nest_in_place, pickled_zip, rebuilt_tensor_with_state, rewrite_zip, unicode_op
from optimshift.cli import main


def _run(capsys, *argv):
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def _adam():
    params = [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(3))]
    opt = torch.optim.Adam(params, foreach=False)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    return opt


STACK_GLOBAL_OS_SYSTEM = unicode_op("os") + unicode_op("system") + b"\x93" + unicode_op("true") + b"\x85R."
# a tensor whose attributes (torch._tensor._rebuild_from_type_v2's state) give it a __reduce_ex__ of its own:
# saving it again calls OrderedDict(2), "TypeError: 'int' object is not iterable"
TENSOR_OWN_REDUCE_EX = rebuilt_tensor_with_state(b"}" + unicode_op("__reduce_ex__") + b"ccollections\nOrderedDict\ns")


@pytest.fixture
def bad_files(tmp_path):
    good = tmp_path / "good.pt"
    optimshift.save({"optimizer": _adam(), "w": torch.arange(64.0)}, good)
    files = {}
    files["short-record"] = tmp_path / "short-record.pt"
    rewrite_zip(good, files["short-record"], {"/data/0": lambda d: d[:2]})
    for name, pkl in {
        "stack-underflow": b"\x80\x02a.",
        "bad-opcode": b"\x80\x02\xff.",
        "memo-miss": b"\x80\x02h\x05.",
        "os-system": b"\x80\x02cos\nsystem\nX\x04\x00\x00\x00true\x85R.",
    }.items():
        files[name] = tmp_path / f"{name}.pt"
        rewrite_zip(good, files[name], pkl=pkl)
    files["stack-global-os-system"] = tmp_path / "stack-global-os-system.pt"
    rewrite_zip(good, files["stack-global-os-system"], pkl=b"\x80\x04" + STACK_GLOBAL_OS_SYSTEM)
    files["tensor-own-reduce-ex"] = pickled_zip(tmp_path, "tensor-own-reduce-ex.pt", TENSOR_OWN_REDUCE_EX)
    files["cut"] = tmp_path / "cut.pt"
    files["cut"].write_bytes(good.read_bytes()[:300])
    files["text"] = tmp_path / "text.pt"
    files["text"].write_text("not a checkpoint\n")
    return files


@pytest.mark.parametrize("command", ["inspect", "convert"])
def test_unreadable_files_give_one_line_or_a_json_error(tmp_path, capsys, bad_files, command):
    for name, path in bad_files.items():
        argv = [command, str(path)] + ([str(tmp_path / f"out-{name}.pt")] if command == "convert" else [])
        rc, out, err = _run(capsys, *argv)
        assert rc == 1 and out == "", (name, out)
        lines = err.splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"optimshift {command}: error: "), (name, err)
        assert str(path) in lines[0], (name, err)
        assert "Traceback" not in err
        rc, out, err = _run(capsys, *argv, "--json")
        assert rc == 1 and err == "", (name, err)
        error = json.loads(out)["error"]
        assert error["command"] == command and str(path) in error["message"] and "\n" not in error["message"]
        unsafe = name in ("os-system", "stack-global-os-system")
        assert error["type"] == ("UnsafeCheckpointError" if unsafe else "CheckpointError"), name
        assert not (tmp_path / f"out-{name}.pt").exists()


def test_code_running_globals_are_never_suggested_nor_allowed(capsys, bad_files):
    for name in ("os-system", "stack-global-os-system"):
        rc, _, err = _run(capsys, "inspect", str(bad_files[name]))
        assert rc == 1 and "os.system" in err and "can run code" in err and "--allow-global" not in err, name
        assert "corrupt" not in err, name
    rc, _, err = _run(capsys, "inspect", str(bad_files["os-system"]), "--allow-global", "os.system")
    assert rc == 1 and "--allow-global os.system: refused" in err


def test_convert_of_a_tensor_with_its_own_reduce_ex_exits_1_with_one_line(tmp_path):
    src = pickled_zip(tmp_path, "hostile.pt", TENSOR_OWN_REDUCE_EX)
    dst = tmp_path / "out.pt"
    proc = subprocess.run(
        [sys.executable, "-m", "optimshift", "convert", str(src), str(dst)], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 1 and proc.stdout == "", proc.stderr
    assert proc.stderr.splitlines() == [
        f"optimshift convert: error: {src} is corrupt or hostile: its pickle sets '__reduce_ex__' on the Tensor at "
        "['t'], in place of its class's own (no checkpoint does that); nothing was executed and nothing was returned"
    ]
    assert not dst.exists()


def test_inspect_shows_a_list_nested_5000_deep_in_a_param_group(tmp_path, capsys):
    sd = _adam().state_dict()
    sd["param_groups"][0]["schedule"] = "DEEP-MARKER"
    path = tmp_path / "deep.pt"
    optimshift.save(sd, path)
    nest_in_place(path, "DEEP-MARKER", 5000)
    rc, out, err = _run(capsys, "inspect", str(path))
    assert rc == 0, err
    assert "<list nested deeper than 16 levels>" in out
    rc, out, err = _run(capsys, "inspect", str(path), "--json")
    assert rc == 0, err
    schedule = json.loads(out)["optimizers"][0]["groups"][0]["hyperparameters"]["schedule"]
    for _ in range(15):
        (schedule,) = schedule
    assert schedule == ["<list nested deeper than 16 levels>"]


def test_inspect_flags_state_keyed_by_text(tmp_path, capsys):
    sd = _adam().state_dict()
    sd["state"] = {str(k): v for k, v in sd["state"].items()}  # a JSON round trip's keys
    path = tmp_path / "texted.pt"
    torch.save(sd, path)
    rc, out, err = _run(capsys, "inspect", str(path), "--json")
    assert rc == 0, err
    described = json.loads(out)["optimizers"][0]
    (finding,) = [f for f in described["findings"] if f["severity"] == "error"]
    assert "keys are text ('0', '1')" in finding["message"] and "silently drops" in finding["message"]
    # the state is there, under text keys: described, never called the state of an optimizer that never stepped
    assert described["params_with_state"] == 2
    assert {r["key"]: r["count"] for r in described["state"]} == {"step": 2, "exp_avg": 2, "exp_avg_sq": 2}
    rc, out, err = _run(capsys, "inspect", str(path))
    assert rc == 0 and "never stepped" not in out and "2 with state" in out, err


def test_convert_dtype_refuses_to_materialise_an_expanded_view(tmp_path, capsys):
    sd = _adam().state_dict()
    sd["state"][0]["history"] = torch.zeros(1).expand(4096, 4096)  # 64 MiB once materialised, 4 bytes saved
    src, dst = tmp_path / "in.pt", tmp_path / "out.pt"
    torch.save(sd, src)
    rc, out, err = _run(capsys, "convert", str(src), str(dst), "--dtype", "float16")
    assert rc == 1 and len(err.splitlines()) == 1
    assert "refusing to cast the tensor at ['state'][0]['history']" in err and "storage of 4 bytes" in err
    assert not dst.exists()
    rc, out, err = _run(capsys, "convert", str(src), str(dst), "--json")  # no cast: the view is saved as it is
    assert rc == 0, err
    summary = json.loads(out)
    assert summary["wrote"] == str(dst) and summary["bytes"] == dst.stat().st_size and summary["cast"] == 0
