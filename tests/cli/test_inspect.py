"""``optimshift inspect`` and ``optimshift convert`` on checkpoints that claim to come from ``cuda:0``."""

from __future__ import annotations

import importlib
import io
import json
import sys

import pytest
import torch

import optimshift
from _crafted import save_tagged, trained
from _matrix import bitwise_equal
from optimshift.cli import _convert as convert_cli
from optimshift.cli import main

O = torch.optim


def _lightning(*optimizers):
    return {
        "epoch": 1,
        "global_step": 10,
        "state_dict": {"layer.weight": torch.randn(4, 3)},
        "optimizer_states": [o.state_dict() for o in optimizers],
        "lr_schedulers": [],
    }


def _run(capsys, *argv):
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_inspect_gpu_lightning_checkpoint(tmp_path, capsys):
    path = tmp_path / "gpu.ckpt"
    save_tagged(_lightning(trained(O.Adam), trained(O.NAdam, foreach=False)), path)
    rc, out, err = _run(capsys, "inspect", str(path))
    assert rc == 0, err
    assert "\x1b[" not in out, "no colour when stdout is not a terminal"
    assert "optimizer 1 of 2: ['optimizer_states'][0]  [Lightning checkpoint]" in out
    assert "its param groups look like Adam or AdamW" in out and "look like NAdam" in out
    lines = out.splitlines()
    assert any(line.split()[:3] == ["step", "3", "cuda:0"] for line in lines), out
    assert any(line.split()[:3] == ["mu_product", "3", "cuda:0"] for line in lines), out
    assert (
        "`step` saved on cuda:0 for non-fused Adam (3 params): optimizer.load_state_dict keeps it there, "
        "costing 2 host syncs per param per step; optimshift.load_state_dict places it on the host"
    ) in out
    assert (
        "`mu_product` saved on cuda:0 for NAdam (3 params): optimizer.load_state_dict keeps it there, costing 2 "
        "host syncs per param per step"
    ) in out
    assert (
        "`step` saved on cuda:0 for non-fused NAdam (3 params): optimizer.load_state_dict keeps it there, "
        "costing 1 host sync per param per step"
    ) in out  # foreach=False: the single-tensor implementation
    assert "optimshift convert IN OUT --device cpu" in out
    # Aligned tables: every row of the state table starts its columns where the header does.
    header = next(i for i, line in enumerate(lines) if line.strip().startswith("state key"))
    col = lines[header].index("saved on")
    assert all(lines[i][col - 2 : col] == "  " for i in range(header + 2, header + 5))


def test_inspect_json(tmp_path, capsys):
    path = tmp_path / "opt.pt"
    save_tagged({**trained(O.Adam, capturable=True).state_dict()}, path)
    rc, out, _ = _run(capsys, "inspect", str(path), "--json")
    assert rc == 0
    data = json.loads(out)
    (o,) = data["optimizers"]
    assert o["kind"] == "state_dict" and o["class_guess"] == ["Adam", "AdamW"]
    assert o["groups"][0]["flags"]["capturable"] is True and o["groups"][0]["hyperparameters"]["lr"] == 0.001
    rows = {r["key"]: r for r in o["state"]}
    assert rows["exp_avg"] == {
        "key": "exp_avg",
        "count": 3,
        "saved_on": {"cuda:0": 3},
        "dtypes": {"float32": 3},
        "bytes": 3 * 12 * 4,
        "kinds": {},
    }
    keys = {f["key"] for f in o["findings"]}
    assert keys == {"capturable"}, o["findings"]  # a capturable step on the device is where it belongs


def test_inspect_recorded_class_and_clean_file(tmp_path, capsys):
    path = tmp_path / "cpu.pt"
    optimshift.save(trained(O.SGD, lr=0.1, momentum=0.9), path)
    rc, out, _ = _run(capsys, "inspect", str(path))
    assert rc == 0
    assert "class: SGD (recorded)" not in out and "class: torch.optim.sgd.SGD (recorded)" in out
    assert "findings: none" in out


def test_colour_only_on_a_terminal(tmp_path, capsys, monkeypatch):
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    path = tmp_path / "gpu.pt"
    save_tagged(trained(O.Adam).state_dict(), path)
    for no_color, expected in ((None, True), ("1", False)):
        if no_color is None:
            monkeypatch.delenv("NO_COLOR", raising=False)
        else:
            monkeypatch.setenv("NO_COLOR", no_color)
        monkeypatch.setenv("TERM", "xterm")
        term = Terminal()
        monkeypatch.setattr(sys, "stdout", term)
        assert main(["inspect", str(path)]) == 0
        assert ("\x1b[33mwarning" in term.getvalue()) is expected


def test_inspect_errors(tmp_path, capsys):
    (tmp_path / "bad.pt").write_bytes(b"hello\n")
    rc, _, err = _run(capsys, "inspect", str(tmp_path / "bad.pt"))
    assert rc == 1 and "optimshift inspect: error:" in err and "not a PyTorch checkpoint" in err
    rc, _, err = _run(capsys, "inspect", str(tmp_path / "missing.pt"))
    assert rc == 1 and "no such checkpoint file" in err


def test_inspect_folder_uses_describe_dcp(tmp_path, capsys, monkeypatch):
    import optimshift.distributed as dist

    info = {
        "path": str(tmp_path),
        "tensors": 3,
        "entries": [{"key": "optim.state.0.step", "shape": []}, {"key": "optim.state.0.exp_avg", "shape": [4, 3]}],
    }
    monkeypatch.setattr(dist, "describe_dcp", lambda p: info, raising=False)
    (tmp_path / ".metadata").write_bytes(b"")  # what makes a folder a DCP checkpoint
    rc, out, _ = _run(capsys, "inspect", str(tmp_path), "--json")
    assert rc == 0 and json.loads(out) == info
    rc, out, _ = _run(capsys, "inspect", str(tmp_path))
    assert rc == 0 and "  tensors: 3" in out and "  entries (2)" in out
    assert any(line.split() == ["optim.state.0.exp_avg", "(4,", "3)"] for line in out.splitlines()), out
    monkeypatch.setitem(sys.modules, "optimshift.distributed", None)  # a build without it
    rc, _, err = _run(capsys, "inspect", str(tmp_path))
    assert rc == 1 and "is a directory" in err and "optimshift.distributed" in err


def test_inspect_a_file_of_a_dcp_folder_shows_the_folder_and_an_incomplete_one_fails(tmp_path, capsys):
    """``inspect ck/.metadata`` (a file optimshift.distributed.save wrote) said its pickle could run code, and a
    healthy shard file was called corrupt: each is part of the folder, which is what is shown. A folder missing
    a shard, or with one cut short, exited 0 without a word; load refuses it, and so does inspect."""
    import os

    from optimshift.distributed import save

    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 3)).sum().backward()
    opt.step()
    save(tmp_path / "ck", model, opt)
    (shard,) = (tmp_path / "ck").glob("*.distcp")
    for part in (tmp_path / "ck" / ".metadata", shard):
        rc, out, err = _run(capsys, "inspect", str(part))
        assert rc == 0 and "(torch.distributed.checkpoint folder)" in out and str(tmp_path / "ck") in out, err
    os.truncate(shard, shard.stat().st_size // 2)
    rc, out, err = _run(capsys, "inspect", str(tmp_path / "ck"))
    assert rc == 1 and f"is incomplete: it lacks {shard.name}" in err, err


def test_inspect_of_dcp_shards_without_their_metadata_says_the_metadata_is_missing(tmp_path, capsys):
    """A shard whose folder lost its ``.metadata`` was called truncated or corrupt (its zip record read as a whole
    torch.save file), and the folder one of no kind inspect reads: each now says the metadata file is missing."""
    from optimshift.distributed import save

    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 3)).sum().backward()
    opt.step()
    save(tmp_path / "ck", model, opt)
    (tmp_path / "ck" / ".metadata").unlink()
    (shard,) = (tmp_path / "ck").glob("*.distcp")
    metadata = tmp_path / "ck" / ".metadata"
    for path, what in [(shard, "is a torch.distributed.checkpoint shard"), (shard.parent, "(1 .distcp file)")]:
        rc, out, err = _run(capsys, "inspect", str(path))
        assert rc == 1 and out == "" and len(err.splitlines()) == 1, err
        assert f"{path} " in err and what in err and f"{metadata} is missing" in err and "corrupt" not in err, err
        rc, out, _ = _run(capsys, "inspect", str(path), "--json")
        assert rc == 1 and f"{metadata} is missing" in json.loads(out)["error"]["message"]


READS = (
    "pass a torch.save file, a Hugging Face Trainer checkpoint-N folder, an Accelerate save_state folder or a "
    "torch.distributed.checkpoint folder (one with a .metadata file)"
)


def test_a_folder_of_no_known_kind_says_what_inspect_reads(tmp_path, capsys, monkeypatch):
    """``optimshift inspect .`` and a plain folder: one line naming what can be passed (not a ValueError about
    an empty name, nor only that it is no DCP folder)."""
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "notes.txt").write_text("hi")
    monkeypatch.chdir(tmp_path)
    for path in (".", "plain", str(tmp_path / "plain")):
        rc, out, err = _run(capsys, "inspect", path)
        assert rc == 1 and out == "" and len(err.splitlines()) == 1, err
        assert err == f"optimshift inspect: error: {path} is a folder of none of the kinds inspect reads; {READS}\n"
        rc, out, err = _run(capsys, "inspect", path, "--json")
        assert rc == 1 and READS in json.loads(out)["error"]["message"]


def test_describe_dcp_of_the_current_folder(tmp_path, monkeypatch):
    from optimshift.distributed import describe_dcp

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"^\. is not a torch\.distributed\.checkpoint checkpoint"):
        describe_dcp(".")


def test_convert_to_cpu(tmp_path, capsys):
    src, dst = tmp_path / "gpu.ckpt", tmp_path / "cpu.ckpt"
    ckpt = _lightning(trained(O.Adam, foreach=False))
    save_tagged(ckpt, src)
    rc, out, err = _run(capsys, "convert", str(src), str(dst))
    assert rc == 0, err
    assert out.startswith(f"wrote {dst}: 10 tensors on cpu")
    plain = torch.load(dst, weights_only=True)  # opens without map_location now
    assert bitwise_equal(plain["optimizer_states"], ckpt["optimizer_states"])
    rc, out, _ = _run(capsys, "inspect", str(dst), "--json")
    assert json.loads(out)["tensors"]["saved_on"] == {"cpu": 10}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cpu.ckpt", "gpu.ckpt"]


def test_convert_dtype_keeps_optimizer_scalars(tmp_path, capsys):
    src, dst = tmp_path / "a.pt", tmp_path / "b.pt"
    opt = trained(O.NAdam)
    optimshift.save({"model": {"w": torch.randn(3)}, "optimizer": opt}, src)
    rc, out, _ = _run(capsys, "convert", str(src), str(dst), "--dtype", "bfloat16")
    assert rc == 0
    assert "cast 7 floating tensors to bfloat16, kept 6 optimizer scalars (step, …) in their dtype" in out
    back = optimshift.load(dst)
    st = back["optimizer"]["state"][0]
    assert st["exp_avg"].dtype == torch.bfloat16 and back["model"]["w"].dtype == torch.bfloat16
    assert st["step"].dtype == torch.float32 and st["mu_product"].dtype == torch.float32
    assert bitwise_equal(st["mu_product"], opt.state_dict()["state"][0]["mu_product"])


def test_convert_dtype_keeps_tensors_that_share_a_storage_sharing_it(tmp_path, capsys):
    """``convert --dtype`` cast each tensor alone: entries saved as views of one flat buffer (and the buffer) came
    out each on a storage of its own, so a load allocated every one and an update of the buffer no longer showed
    through the views. They are cast as their storage now: views of one cast storage, at their offsets."""
    src, dst = tmp_path / "a.pt", tmp_path / "b.pt"
    sd = trained(O.Adam).state_dict()
    flat = torch.randn(3 * 12)
    for i in range(3):
        sd["state"][i]["exp_avg"] = flat[12 * i : 12 * (i + 1)]
    torch.save({"optimizer": sd, "flat": flat}, src)
    rc, out, err = _run(capsys, "convert", str(src), str(dst), "--dtype", "bfloat16")
    assert rc == 0, err
    back = torch.load(dst)
    views = [back["optimizer"]["state"][i]["exp_avg"] for i in range(3)] + [back["flat"]]
    assert {v.untyped_storage().data_ptr() for v in views} == {back["flat"].untyped_storage().data_ptr()}
    assert [v.storage_offset() for v in views] == [0, 12, 24, 0] and back["flat"].dtype == torch.bfloat16
    assert bitwise_equal(back["flat"], flat.to(torch.bfloat16))
    assert "cast 7 floating tensors" in out  # (the 4 sharing one storage, and each exp_avg_sq)


def test_convert_progress_bar_on_a_terminal(tmp_path, capsys, monkeypatch):
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    term = Terminal()
    monkeypatch.setattr(convert_cli, "_LARGE", 1)
    monkeypatch.setattr(sys, "stderr", term)
    src = tmp_path / "a.pt"
    torch.save({"w": torch.randn(1000)}, src)
    assert main(["convert", str(src), str(tmp_path / "b.pt")]) == 0
    assert "writing b.pt [" in term.getvalue() and "100%" in term.getvalue()


def test_convert_errors(tmp_path, capsys):
    src = tmp_path / "a.pt"
    save_tagged({"w": torch.randn(3)}, src)
    rc, _, err = _run(capsys, "convert", str(src), str(tmp_path / "b.pt"), "--device", "cuda:3")
    assert rc == 1 and "--device cuda:3 is not available" in err
    assert "Convert to the CPU here instead (--device cpu, the default)" in err  # what to do instead
    assert not (tmp_path / "b.pt").exists()
    rc, _, err = _run(capsys, "convert", str(src), str(tmp_path / "b.pt"), "--device", "warp-drive")
    assert rc == 1 and "not a device PyTorch knows" in err
    # meta: no machine has one to run on, and a file written there would hold no values
    rc, _, err = _run(capsys, "convert", str(src), str(tmp_path / "b.pt"), "--device", "meta")
    assert rc == 1 and "--device meta holds no data" in err and "a machine that has the device" not in err, err
    assert not (tmp_path / "b.pt").exists()


def test_convert_to_a_cpu_index_writes_to_the_host(tmp_path, capsys):
    """``--device cpu:1`` (and ``cpu:0``) failed with "not a device this machine can hold tensors on": torch.load's
    map_location refuses a cpu index, where torch puts a tensor asked for on ``cpu:1`` on its one host device. Both
    are the host now, as for every optimshift device argument."""
    src = tmp_path / "gpu.pt"
    save_tagged({"w": torch.randn(3)}, src)
    for device in ("cpu:0", "cpu:1"):
        dst = tmp_path / f"{device.replace(':', '_')}.pt"
        rc, out, err = _run(capsys, "convert", str(src), str(dst), "--device", device)
        assert rc == 0 and out.startswith(f"wrote {dst}: 1 tensors on cpu, "), err
        rc, out, _ = _run(capsys, "inspect", str(dst), "--json")
        assert json.loads(out)["tensors"]["saved_on"] == {"cpu": 1}


class Config:
    """A class a training script pickles into its checkpoint (weights_only refuses it unless allowed)."""

    def __init__(self):
        self.lr = 0.1


class Schedule:
    """A second class in the same checkpoint."""


def test_allow_global_hint_names_every_class(tmp_path, capsys):
    zipped, legacy = tmp_path / "zip.pt", tmp_path / "legacy.pt"
    obj = {"config": Config(), "schedule": [Schedule()], "optimizer": trained(O.SGD, lr=0.1).state_dict()}
    torch.save(obj, zipped)
    torch.save(obj, legacy, _use_new_zipfile_serialization=False)
    both = f"--allow-global {__name__}.Config --allow-global {__name__}.Schedule"
    for path in (zipped, legacy):
        out = tmp_path / "out.pt"
        rc, _, err = _run(capsys, "convert", str(path), str(out))
        assert rc == 1 and both in err, err
        assert f"safe_globals([{__name__}.Config, {__name__}.Schedule])" in err
        rc, _, err = _run(capsys, "convert", str(path), str(out), *both.split())
        assert rc == 0, err
        rc, _, err = _run(capsys, "convert", str(path), str(out), "--allow-global", f"{__name__}.Config")
        assert rc == 1 and f"inspect/convert --allow-global {__name__}.Schedule`" in err  # only what is still missing


def test_inspect_shows_a_file_with_classes_it_does_not_rebuild(tmp_path, capsys):
    """inspect imports no class a file names: it reads the optimizer state, names the objects it left opaque, and
    exits 0; --allow-global rebuilds one."""
    zipped, legacy = tmp_path / "zip.pt", tmp_path / "legacy.pt"
    obj = {"config": Config(), "schedule": [Schedule()], "optimizer": trained(O.SGD, lr=0.1).state_dict()}
    torch.save(obj, zipped)
    torch.save(obj, legacy, _use_new_zipfile_serialization=False)
    names = [f"{__name__}.Config", f"{__name__}.Schedule"]
    for path in (zipped, legacy):
        rc, out, err = _run(capsys, "inspect", str(path))
        assert rc == 0, err
        assert "optimizer 1 of 1: ['optimizer']" in out and "params: 3 in 1 group" in out
        assert f"not rebuilt: {', '.join(names)}. inspect imports no class" in out
        rc, out, _ = _run(capsys, "inspect", str(path), "--json")
        desc = json.loads(out)
        assert rc == 0 and desc["not_rebuilt"] == names and desc["optimizers"][0]["params"] == 3
        rc, out, _ = _run(capsys, "inspect", str(path), "--json", "--allow-global", names[0])
        assert rc == 0 and json.loads(out)["not_rebuilt"] == names[1:]


def test_a_path_in_a_checkpoint_is_a_class_to_allow_not_code(tmp_path, capsys):
    """A Lightning checkpoint whose hparams hold a ``pathlib.PosixPath`` (a ``data_dir``): inspect refused the
    file as "malicious or broken" (every pathlib global counted as code) and ``--allow-global pathlib.PosixPath``
    was refused. A path class holds a path and touches no file: inspect shows the file with the path opaque,
    convert takes it once allowed; pathlib's methods stay refused."""
    import pathlib

    from optimshift.checkpoint._files import runs_code

    path = tmp_path / "last.ckpt"
    hparams = {"data_dir": pathlib.PosixPath("/data/train")}
    torch.save({"optimizer_states": [trained(O.Adam).state_dict()], "hyper_parameters": hparams}, path)
    rc, out, err = _run(capsys, "inspect", str(path))
    assert rc == 0 and "not rebuilt: pathlib.PosixPath." in out, err
    rc, out, err = _run(capsys, "convert", str(path), str(tmp_path / "out.ckpt"))
    assert rc == 1 and "--allow-global pathlib.PosixPath" in err and "malicious" not in err, err
    rc, out, err = _run(capsys, "convert", str(path), str(tmp_path / "out.ckpt"), "--allow-global", "pathlib.PosixPath")
    assert rc == 0, err
    with torch.serialization.safe_globals([pathlib.PosixPath]):
        assert torch.load(tmp_path / "out.ckpt")["hyper_parameters"] == hparams
    assert runs_code("pathlib.Path.write_text") and runs_code("pathlib.os.system")


def test_a_class_of_the_saving_script_is_not_called_corrupt(tmp_path, capsys):
    """The common file: a training script pickles its own ``Config`` (``__main__.Config``) next to the optimizer
    state. inspect reads it; load and convert refuse it saying which class it is and why the file is not
    corrupt."""
    import subprocess

    path = tmp_path / "ckpt.pt"
    script = (
        "import dataclasses, torch\n"
        "@dataclasses.dataclass\nclass Config:\n    lr: float = 0.1\n"
        "p = torch.nn.Parameter(torch.ones(3)); opt = torch.optim.AdamW([p]); p.grad = torch.ones(3); opt.step()\n"
        f"torch.save({{'config': Config(), 'optimizer': opt.state_dict()}}, {str(path)!r})\n"
    )
    saved = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert saved.returncode == 0, saved.stderr
    rc, out, err = _run(capsys, "inspect", str(path))
    assert rc == 0 and "corrupt" not in out, err
    assert "not rebuilt: __main__.Config (__main__: the script that saved the file)" in out
    assert "  step        1      cpu ×1    float32" in out
    with pytest.raises(optimshift.UnsafeCheckpointError) as info:
        optimshift.load(path)
    message = str(info.value)
    assert "corrupt" not in message.replace("not corrupt", "") and "the file is not corrupt" in message
    assert "__main__.Config is a class of the script that saved it" in message
    assert "safe_globals([Config])" in message
    rc, _, err = _run(capsys, "inspect", str(path), "--allow-global", "__main__.Config")
    assert rc == 1 and "Config is a class of the script that saved the file" in err and "has no Config" not in err
    rc, _, err = _run(capsys, "convert", str(path), str(tmp_path / "out.pt"))
    assert rc == 1 and "the file is not corrupt" in err


def test_allow_global(tmp_path, capsys):
    path = tmp_path / "with_config.pt"
    torch.save({"config": Config(), "optimizer": trained(O.SGD, lr=0.1).state_dict()}, path)
    rc, _, err = _run(capsys, "convert", str(path), str(tmp_path / "out.pt"))
    assert rc == 1 and "refused to load" in err and f"--allow-global {__name__}.Config" in err
    rc, out, err = _run(capsys, "inspect", str(path), "--allow-global", f"{__name__}.Config")
    assert rc == 0, err
    assert "optimizer 1 of 1: ['optimizer']" in out and "not rebuilt" not in out


def test_inspect_asks_a_policy_that_follows_its_param_about_stand_ins_on_meta(tmp_path, capsys):
    """``inspect`` asks a registered policy about stand-in params on meta: a policy that follows its param
    answers meta there, which is no loss of values (``move`` and the load refuse that answer for real params)."""
    path = tmp_path / "gpu.ckpt"
    save_tagged(_lightning(trained(O.Adam)), path)
    asked = []

    def follow(key, value, param, group, device):
        asked.append(param.device.type)
        return param.device

    optimshift.register_policy(O.Adam, follow)
    try:
        rc, out, err = _run(capsys, "inspect", str(path))
    finally:
        optimshift.unregister_policy(O.Adam)
    assert rc == 0, err
    assert asked and set(asked) == {"meta"}
    assert "`step` saved on cuda:0" in out  # (what the fresh optimizer keeps: on meta, the policy's answer)


def _flipped(tmp_path):
    """A torch.save file of an optimizer with one bit of a tensor's bytes flipped after it was written: every size
    and the pickle intact, the record's CRC-32 no longer matching."""
    import struct
    import zipfile

    path = tmp_path / "flipped.pt"
    torch.save(trained(O.Adam).state_dict(), path)
    with zipfile.ZipFile(path) as zf:
        info = next(i for i in zf.infolist() if "/data/" in i.filename and i.file_size >= 8)
    raw = bytearray(path.read_bytes())
    name_len, extra_len = struct.unpack("<HH", raw[info.header_offset + 26 : info.header_offset + 30])
    raw[info.header_offset + 30 + name_len + extra_len + 3] ^= 0x40
    path.write_bytes(bytes(raw))
    return path, info.filename


def test_inspect_and_convert_refuse_a_file_whose_bytes_fail_their_checksum(tmp_path, capsys):
    """A bit flipped in a tensor's record: torch's reader takes it (a value changes), so did inspect ("findings:
    none") and convert, which wrote the damage out under new, valid checksums. Both now fail naming the record."""
    path, record = _flipped(tmp_path)
    rc, out, err = _run(capsys, "inspect", str(path))
    assert rc == 1 and f"record {record} fails its CRC-32 check" in err, (out, err)
    rc, out, err = _run(capsys, "convert", str(path), str(tmp_path / "out.pt"))
    assert rc == 1 and f"record {record} fails its CRC-32 check" in err, (out, err)
    assert not (tmp_path / "out.pt").exists()


def test_inspect_takes_a_file_written_without_checksums(tmp_path, capsys):
    """``torch.serialization.set_crc32_options(False)`` writes a CRC-32 of 0 for every record: no checksum to
    check, not a corrupt file (torch reads it)."""
    path = tmp_path / "nocrc.pt"
    torch.serialization.set_crc32_options(False)
    try:
        torch.save(trained(O.Adam).state_dict(), path)
    finally:
        torch.serialization.set_crc32_options(True)
    rc, out, err = _run(capsys, "inspect", str(path))
    assert rc == 0 and "corrupt" not in err, (out, err)


_DTENSOR_FILE = """
import os, sys, torch, torch.distributed as dist
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2])
dist.init_process_group("gloo", rank=0, world_size=1)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
mesh = init_device_mesh("cpu", (1,))
w = torch.nn.Parameter(distribute_tensor(torch.randn(8, 6), mesh, [Shard(0)]))
opt = torch.optim.AdamW([w])
w.grad = distribute_tensor(torch.ones(8, 6), mesh, [Shard(0)])
opt.step()
torch.save(opt.state_dict(), sys.argv[1])
dist.destroy_process_group()
"""


def test_inspect_reads_a_per_rank_dtensor_file_once_its_classes_are_allowed(tmp_path, capsys):
    """FSDP2's per-rank files hold DTensors, which torch rebuilds as wrapper subclasses and which take no callable
    map_location (inspect's, to record where each storage was saved): the file was called truncated or corrupt,
    with every class allowed. Now read, each storage said to be saved where the file's one location tag says."""
    path, names = _dtensor_rank_file(tmp_path)
    allowed = [a for n in names for a in ("--allow-global", n)]
    rc, out, err = _run(capsys, "inspect", str(path), *allowed)
    assert rc == 0, err
    assert "corrupt" not in out + err and "exp_avg" in out and "saved on: cpu ×3" in out


@pytest.mark.parametrize("torch_load", ["torch", "torch < 2.6"])
def test_a_per_rank_dtensor_file_is_read_located_without_a_damaged_file_s_scan(tmp_path, monkeypatch, torch_load):
    """load_located (load_state_dict from a path, inspect) reads a DTensor file again with the tags alone, its
    callable map_location refused: that refusal went through a damaged file's error, which scans the whole pickle
    (a quarter more time for FSDP2's per-rank files) and called the file corrupt to optimshift.load's callers.
    torch < 2.6 raised it as an UnpicklingError (simulated: its weights-only torch.load re-raised a RuntimeError
    so), which b37b8a0's load_located took for a damaged file's."""
    import pickle

    from optimshift.checkpoint import _files, _untrusted

    path, names = _dtensor_rank_file(tmp_path)
    scans = []
    monkeypatch.setattr(_untrusted, "scan", lambda *a, real=_untrusted.scan: scans.append(a) or real(*a))
    classes = [getattr(importlib.import_module(n.rpartition(".")[0]), n.rpartition(".")[2]) for n in names]
    if torch_load == "torch < 2.6":

        def wrapping(*args, real=torch.load, **kwargs):
            try:
                return real(*args, **kwargs)
            except RuntimeError as e:  # (as torch 2.4 and 2.5 did with weights_only=True)
                raise pickle.UnpicklingError(f"Weights only load failed. WeightsUnpickler error: {e}") from None

        monkeypatch.setattr(torch, "load", wrapping)
    with torch.serialization.safe_globals(classes):
        loaded, located = _files.load_located(path)
        assert "exp_avg" in loaded["state"][0] and located.get(0) == "cpu" and not scans
        with pytest.raises(RuntimeError, match="Callable map_location not supported") as raised:
            _files.load(path, map_location=lambda storage, tag: storage)
    assert "corrupt" not in str(raised.value) and not scans


def _dtensor_rank_file(tmp_path):
    """A per-rank file of DTensor state (``_DTENSOR_FILE``, written by a one-rank process group in a subprocess), and
    the classes its pickle names that this torch has (what ``--allow-global`` must allow)."""
    import socket
    import subprocess

    path = tmp_path / "opt_rank0.pt"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    subprocess.run([sys.executable, "-c", _DTENSOR_FILE, str(path), str(port)], check=True, timeout=120)
    names = [
        "torch.distributed.tensor.DTensor",
        "torch.distributed.tensor._dtensor_spec.DTensorSpec",
        "torch.distributed.device_mesh.DeviceMesh",
        "torch.distributed.tensor.placement_types.Shard",
        "torch.distributed.tensor._dtensor_spec.TensorMeta",
        "torch.distributed.tensor._dtensor_spec.ShardOrderEntry",
    ]
    return path, [n for n in names if _has(n)]


def _has(name: str) -> bool:
    """Whether this torch defines ``name`` (a DTensor's pickle names what its torch has)."""
    import importlib

    module, _, attr = name.rpartition(".")
    try:
        return hasattr(importlib.import_module(module), attr)
    except ImportError:
        return False


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
def test_inspect_json_of_a_non_finite_tensor_hyperparameter_is_valid_json(tmp_path, capsys, value):
    """A tensor ``lr`` that went NaN (a diverged run) came out as the bare ``NaN`` token, which is no JSON (a
    Python float did not): now as the text a float of that value gives."""
    sd = trained(O.Adam).state_dict()
    sd["param_groups"][0]["lr"] = torch.tensor(value)
    path = tmp_path / "opt.pt"
    torch.save(sd, path)
    rc, out, err = _run(capsys, "inspect", str(path), "--json")
    assert rc == 0, err

    def refuse(token):
        raise AssertionError(f"not JSON: {token}")

    (o,) = json.loads(out, parse_constant=refuse)["optimizers"]
    assert o["groups"][0]["hyperparameters"]["lr"]["value"] == str(value)


def test_inspect_a_meta_tensor_hyperparameter(tmp_path, capsys):
    """A 0-dim tensor ``lr`` on ``meta`` (an optimizer built over a model on the meta device) failed the whole
    description ("please report this": ``.item()`` of a meta tensor); now shown by shape and dtype."""
    sd = trained(O.Adam).state_dict()
    sd["param_groups"][0]["lr"] = torch.tensor(0.001, device="meta")
    path = tmp_path / "opt.pt"
    torch.save(sd, path)
    rc, out, err = _run(capsys, "inspect", str(path), "--json")
    assert rc == 0, err
    (o,) = json.loads(out)["optimizers"]
    assert o["groups"][0]["hyperparameters"]["lr"] == {"tensor": [], "dtype": "float32", "saved_on": "meta"}


def test_inspect_shows_a_tensor_lr_as_a_tensor_and_where_it_was_saved(tmp_path, capsys):
    """A tensor ``lr`` (``torch.tensor(1e-3)``) was shown as the number it holds, as a float ``lr`` is: that it is a
    tensor, its dtype and the device it was saved on (which decide what a load and each step do with it) were
    hidden. Shown now, in the table and in --json, beside a float one."""
    opt = trained(O.Adam, lr=torch.tensor(1e-3))
    opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))], "lr": 0.01})
    path = tmp_path / "opt.pt"
    save_tagged(opt.state_dict(), path)
    rc, out, err = _run(capsys, "inspect", str(path))
    assert rc == 0, err
    rows = [line.split() for line in out.splitlines() if line.split()[:2] in (["0", "3"], ["1", "1"])]
    assert [row[2:5] for row in rows] == [["tensor(0.001,", "float32,", "cuda:0)"], ["0.01", "(0.9,", "0.999)"]]
    rc, out, err = _run(capsys, "inspect", str(path), "--json")
    assert rc == 0, err
    groups = json.loads(out)["optimizers"][0]["groups"]
    lr = groups[0]["hyperparameters"]["lr"]
    assert lr == {"tensor": [], "value": torch.tensor(1e-3).item(), "dtype": "float32", "saved_on": "cuda:0"}
    assert groups[1]["hyperparameters"]["lr"] == 0.01


def test_inspect_a_param_state_that_is_a_tensor_not_a_dict(tmp_path, capsys):
    """A param whose saved state is a tensor (a corrupt or hand-edited file) failed the whole description
    ("please report this": the truth value of a tensor of several elements); now counted as state, and shown."""
    sd = trained(O.Adam).state_dict()
    sd["state"][0] = torch.zeros(3)
    path = tmp_path / "opt.pt"
    torch.save(sd, path)
    rc, out, err = _run(capsys, "inspect", str(path), "--json")
    assert rc == 0, err
    (o,) = json.loads(out)["optimizers"]
    assert o["params"] == 3 and o["params_with_state"] == 3


def test_inspect_counts_the_bytes_a_file_holds_not_the_elements_views_show(tmp_path, capsys):
    """The file's total counted a storage once per view of it (an expanded view, ``torch.zeros(1).expand(1000)``, at
    1000 elements where its storage holds one): it counts each storage once, what the file holds. A state key's row
    counts what its entries hold once loaded (a load copies a lone expanded view whole), as before."""
    sd = trained(O.Adam).state_dict()
    sd["state"][0]["exp_avg"] = torch.zeros(1).expand(1000)
    flat = torch.zeros(24)
    sd["state"][1]["exp_avg"], sd["state"][2]["exp_avg"] = flat[:12], flat[12:]
    path = tmp_path / "opt.pt"
    torch.save({"optimizer": sd, "flat": flat}, path)
    rc, out, err = _run(capsys, "inspect", str(path), "--json")
    assert rc == 0, err
    data = json.loads(out)
    rows = {r["key"]: r for r in data["optimizers"][0]["state"]}
    assert rows["exp_avg"]["bytes"] == 1000 * 4 + 2 * 12 * 4
    loaded = [t for st in torch.load(path)["optimizer"]["state"].values() for t in st.values()]
    held = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in loaded}
    assert data["tensors"]["bytes"] == sum(held.values()) == 4 + 24 * 4 + 3 * 4 + 3 * 12 * 4
