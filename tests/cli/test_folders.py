"""``inspect`` and ``convert`` on the checkpoint folders frameworks write: a Hugging Face Trainer ``checkpoint-N/``
and an Accelerate ``save_state`` folder."""

from __future__ import annotations

import errno
import json
import os
import stat
import sys

import pytest
import torch
import torch.serialization as ser

from optimshift.checkpoint._folders import training_folder
from optimshift.cli import main


def _trained(cls=torch.optim.AdamW, n=2, **kwargs):
    params = [torch.nn.Parameter(torch.randn(4, 3)) for _ in range(n)]
    opt = cls(params, **kwargs)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    return opt


def _save_from_gpu(obj, path):
    """What a single-GPU run saves: buffers tagged cuda:0, Adam's 4-byte ``step`` on the host."""
    real = ser.location_tag
    ser.location_tag = lambda storage: "cpu" if storage.nbytes() == 4 else "cuda:0"
    try:
        torch.save(obj, path)
    finally:
        ser.location_tag = real


def _trainer_folder(root, step=10):
    """A checkpoint-N folder as transformers.Trainer writes it (model and arguments stand-ins)."""
    folder = root / f"checkpoint-{step}"
    folder.mkdir()
    _save_from_gpu(_trained().state_dict(), folder / "optimizer.pt")
    torch.save({"last_epoch": step, "_step_count": step + 1}, folder / "scheduler.pt")
    (folder / "trainer_state.json").write_text(
        json.dumps({"global_step": step, "epoch": 1.5, "max_steps": 20, "log_history": []})
    )
    (folder / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    (folder / "training_args.bin").write_bytes(b"stand-in")
    (folder / "config.json").write_text("{}")
    return folder


def _run(capsys, *argv):
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_inspect_trainer_folder(tmp_path, capsys):
    folder = _trainer_folder(tmp_path)
    rc, out, err = _run(capsys, "inspect", folder)
    assert rc == 0, err
    assert f"{folder}  (Hugging Face Trainer checkpoint folder; global step 10, epoch 1.5)" in out
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines()[2:10] if line.strip()}
    assert rows["optimizer.pt"][0] == "optimizer" and rows["trainer_state.json"][:2] == ["trainer", "state"]
    assert f"{folder / 'optimizer.pt'}  (" in out and "its param groups look like Adam or AdamW" in out
    assert "exp_avg     2      cuda:0 ×2" in out
    assert "the Trainer resumes this file with torch.load(map_location=its device)" in out
    assert "optimshift.integrations.accelerate.patch()" in out
    rc, out, _ = _run(capsys, "inspect", folder, "--json")
    info = json.loads(out)
    assert info["folder"] == "hf_trainer" and info["trainer_state"] == {
        "global_step": 10,
        "epoch": 1.5,
        "max_steps": 20,
    }
    (opt_file,) = info["optimizer_files"]
    assert opt_file["optimizers"][0]["kind"] == "state_dict"
    assert opt_file["tensors"]["saved_on"] == {"cpu": 2, "cuda:0": 4}


@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_inspect_json_of_a_trainer_folder_with_a_non_finite_epoch_is_valid_json(tmp_path, capsys, value):
    """``trainer_state.json`` may hold ``NaN`` (Python's json writes it; a diverged run): ``inspect --json``
    passed it through as the bare ``NaN`` token, which is no JSON. Now as the text a float of that value gives,
    as inspect says a non-finite hyperparameter."""
    folder = _trainer_folder(tmp_path)
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": 10, "epoch": value, "log_history": []}))
    rc, out, err = _run(capsys, "inspect", folder, "--json")
    assert rc == 0, err

    def refuse(token):
        raise AssertionError(f"not JSON: {token}")

    assert json.loads(out, parse_constant=refuse)["trainer_state"] == {"global_step": 10, "epoch": str(value)}
    rc, out, err = _run(capsys, "inspect", folder)
    assert rc == 0, err
    assert f"(Hugging Face Trainer checkpoint folder; global step 10, epoch {value})" in out


def test_convert_trainer_folder_in_place(tmp_path, capsys):
    folder = _trainer_folder(tmp_path)
    with pytest.raises(RuntimeError):
        torch.load(folder / "optimizer.pt", weights_only=True)  # a CPU machine cannot open it as saved
    others = {p.name: p.read_bytes() for p in folder.iterdir() if p.name != "optimizer.pt"}
    rc, out, err = _run(capsys, "convert", folder, folder)
    assert rc == 0, err
    (line,) = out.splitlines()  # in place: the optimizer file is rewritten, nothing copied
    assert line.startswith(f"wrote {folder / 'optimizer.pt'}: 6 tensors on cpu, ")
    torch.load(folder / "optimizer.pt", weights_only=True)  # opens now
    assert {p.name: p.read_bytes() for p in folder.iterdir() if p.name != "optimizer.pt"} == others
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-10"]


def _accelerate_folder(directory):
    accelerate = pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    try:
        accelerator = accelerate.Accelerator(cpu=True)
        model = torch.nn.Linear(3, 2)
        first = torch.optim.Adam(model.parameters())
        second = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        model, first, second = accelerator.prepare(model, first, second)
        for opt in (first, second):
            model(torch.randn(4, 3)).sum().backward()
            opt.step()
            opt.zero_grad()
        accelerator.save_state(str(directory))
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
    return directory


def test_inspect_and_convert_accelerate_folder(tmp_path, capsys):
    src = _accelerate_folder(tmp_path / "state")
    folder = training_folder(str(src))
    assert folder is not None and folder.kind == "accelerate"
    assert folder.optimizer_files == ["optimizer.bin", "optimizer_1.bin"]
    rc, out, err = _run(capsys, "inspect", src)
    assert rc == 0, err
    assert f"{src}  (Accelerate save_state folder)" in out
    assert "look like Adam or AdamW" in out and "look like SGD" in out
    assert "not a DCP checkpoint" not in out + err and "the Trainer resumes" not in out

    dst = tmp_path / "bf16"
    rc, out, err = _run(capsys, "convert", src, dst, "--dtype", "bfloat16")
    assert rc == 0, err
    assert out.splitlines()[0].startswith(f"wrote {dst / 'optimizer.bin'}: ")
    assert out.splitlines()[1].startswith(f"wrote {dst / 'optimizer_1.bin'}: ")
    assert out.splitlines()[2] == f"copied 2 other entries of {src} unchanged into {dst}"
    assert sorted(os.listdir(dst)) == sorted(os.listdir(src))
    assert sorted(os.listdir(tmp_path)) == ["bf16", "state"], "no temporary folder is left behind"
    for name in os.listdir(src):
        if not name.startswith("optimizer"):
            assert (dst / name).read_bytes() == (src / name).read_bytes()
    adam = torch.load(dst / "optimizer.bin", weights_only=True)["state"][0]
    assert adam["exp_avg"].dtype == torch.bfloat16 and adam["step"].dtype == torch.float32


def test_convert_folder_in_place_changes_no_file_unless_every_one_converts(tmp_path, capsys):
    """In place, with the second optimizer file corrupt: exit 1, and the first is as it was (it used to be
    rewritten already, leaving a folder of two dtypes); no temporary is left beside the folder."""
    src = _accelerate_folder(tmp_path / "state")
    (src / "optimizer_1.bin").write_bytes(b"not a checkpoint")
    before = {p.name: p.read_bytes() for p in src.iterdir()}
    rc, out, err = _run(capsys, "convert", src, src, "--dtype", "bfloat16")
    assert rc == 1 and "optimizer_1.bin" in err
    assert {p.name: p.read_bytes() for p in src.iterdir()} == before
    assert sorted(os.listdir(tmp_path)) == ["state"]


def test_convert_folder_in_place_through_links_keeps_them_and_refuses_a_read_only_file(tmp_path, capsys):
    """In place through a link to the folder (OUT elsewhere, maybe on another filesystem: the temporaries go beside
    the files, not beside OUT's path), with ``optimizer.pt`` itself a link: the file it points at is rewritten,
    the links stay, and nothing is left anywhere. A read-only optimizer file is refused before anything changes,
    as save refuses it (a first version replaced it, writable, and replaced links by files; found by review)."""
    folder = _trainer_folder(tmp_path)
    real = tmp_path / "store" / "optimizer.pt"
    real.parent.mkdir()
    os.replace(folder / "optimizer.pt", real)
    (folder / "optimizer.pt").symlink_to(real)
    (tmp_path / "elsewhere").mkdir()
    link = tmp_path / "elsewhere" / "ck"
    link.symlink_to(folder)
    real.chmod(0o444)
    before = real.read_bytes()
    rc, out, err = _run(capsys, "convert", link, link)
    assert rc == 1 and "read-only" in err and real.read_bytes() == before
    real.chmod(0o640)
    rc, out, err = _run(capsys, "convert", link, link)
    assert rc == 0, err
    assert (folder / "optimizer.pt").is_symlink() and stat.S_IMODE(real.stat().st_mode) == 0o640
    torch.load(real, weights_only=True)  # (rewritten for the host: it opens now)
    assert out.startswith(f"wrote {link / 'optimizer.pt'}: ")
    for where in (folder, real.parent, link.parent, tmp_path):
        assert not [p for p in os.listdir(where) if p.endswith(".tmp")]


def test_convert_folder_in_place_writes_a_private_file_privately(tmp_path, capsys, monkeypatch):
    """In place, a 0600 optimizer file's converted state is written into a 0600 file from its first byte, as save
    writes one (the temporary took the umask's 0644 and got 0600 only at the rename: readable by all meanwhile)."""
    folder = _trainer_folder(tmp_path)
    (folder / "optimizer.pt").chmod(0o600)
    modes = []
    real_save = torch.save

    def watched(obj, f, *args, **kwargs):
        modes.append(stat.S_IMODE(os.fstat(f.fileno()).st_mode))
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", watched)
    old = os.umask(0o022)
    try:
        rc, out, err = _run(capsys, "convert", folder, folder)
    finally:
        os.umask(old)
    assert rc == 0, err
    assert modes == [0o600] and stat.S_IMODE((folder / "optimizer.pt").stat().st_mode) == 0o600
    torch.load(folder / "optimizer.pt", weights_only=True)


def test_convert_folder_in_place_in_a_read_only_folder_names_the_file(tmp_path, capsys):
    """In place, in a folder this process cannot write: one line naming the folder and the optimizer file (it
    named the hidden temporary, twice, once the file was loaded and converted), and nothing changes."""
    folder = _trainer_folder(tmp_path)
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    folder.chmod(0o555)
    try:
        if os.access(folder, os.W_OK):
            pytest.skip("this process writes in read-only folders (root)")
        rc, out, err = _run(capsys, "convert", folder, folder)
    finally:
        folder.chmod(0o755)
    assert rc == 1 and len(err.strip().splitlines()) == 1, err
    assert f"cannot write in folder {folder}" in err and f"{folder / 'optimizer.pt'}" in err and ".tmp" not in err
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before


@pytest.mark.skipif(sys.platform == "win32", reason="flock: POSIX")
def test_convert_folder_in_place_keeps_each_converted_file_locked_until_it_replaces_its_original(
    tmp_path, capsys, monkeypatch
):
    """Another process's save of ``optimizer.pt`` while ``optimizer_1.pt`` converts sweeps what no writer locks:
    ``optimizer.pt``'s converted temporary was renamed over the locked one (unlocked), swept, and convert failed."""
    from optimshift.checkpoint import _atomic

    folder = _trainer_folder(tmp_path)
    _save_from_gpu(_trained().state_dict(), folder / "optimizer_1.pt")
    real_save, calls = torch.save, []

    def swept_between(obj, f, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:  # (another process's sweep: this process's live temporaries are not its own)
            with monkeypatch.context() as m:
                m.setattr(_atomic, "_live", set())
                _atomic.sweep(str(folder / "optimizer.pt"))
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", swept_between)
    rc, out, err = _run(capsys, "convert", folder, folder)
    assert rc == 0 and len(calls) == 2, err
    for name in ("optimizer.pt", "optimizer_1.pt"):
        torch.load(folder / name, weights_only=True)  # (rewritten for the host: it opens now)
    assert not [p for p in os.listdir(folder) if p.endswith(".tmp")]


def test_convert_folder_in_place_names_the_file_it_could_not_write(tmp_path, capsys, monkeypatch):
    """A write failing mid-file (a full disk) in place: the error names the optimizer file, not the hidden
    temporary (twice), and the file is as it was."""
    folder = _trainer_folder(tmp_path)
    before = (folder / "optimizer.pt").read_bytes()

    def full(obj, f, *args, **kwargs):
        f.write(b"PK")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", full)
    rc, out, err = _run(capsys, "convert", folder, folder)
    assert rc == 1 and f"cannot write {folder / 'optimizer.pt'}" in err and ".tmp" not in err, err
    assert (folder / "optimizer.pt").read_bytes() == before
    assert not [p for p in os.listdir(folder) if p.endswith(".tmp")]


def test_convert_names_the_file_it_could_not_write_once(tmp_path, capsys, monkeypatch):
    """A full disk, or OUT a folder: convert's one line names the file once and has no "[Errno 28]" (it said
    "cannot write X: [Errno 28] save: cannot write X: ...", and "cannot write X: save: X is a directory")."""
    src = tmp_path / "a.pt"
    torch.save(_trained().state_dict(), src)
    (tmp_path / "out").mkdir()
    rc, out, err = _run(capsys, "convert", src, tmp_path / "out")
    assert rc == 1 and err.count(str(tmp_path / "out")) == 1 and "is a directory" in err, err

    def full(obj, f, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", full)
    rc, out, err = _run(capsys, "convert", src, tmp_path / "b.pt")
    assert rc == 1 and err.count(str(tmp_path / "b.pt")) == 1 and "Errno" not in err, err
    assert f"cannot write {tmp_path / 'b.pt'}: No space left on device" in err


def test_convert_folder_in_place_says_which_files_a_failed_rename_left_replaced(tmp_path, capsys, monkeypatch):
    """Every file converted, the second's rename over its original fails: the line names that file and the one
    replaced already (it said "cannot write DIR: [Errno 16] ...", naming the hidden temporary, and a docstring
    promised all as they were); the second is as it was, and no temporary is left."""
    src = _trainer_folder(tmp_path)
    _save_from_gpu(_trained().state_dict(), src / "optimizer_1.pt")
    before = (src / "optimizer_1.pt").read_bytes()
    real_replace = os.replace

    def busy(a, b, *args, **kwargs):
        if str(b).endswith("optimizer_1.pt"):
            raise OSError(errno.EBUSY, "Device or resource busy", a, None, b)
        return real_replace(a, b, *args, **kwargs)

    monkeypatch.setattr(os, "replace", busy)
    rc, out, err = _run(capsys, "convert", src, src, "--dtype", "bfloat16")
    monkeypatch.undo()
    assert rc == 1 and len(err.strip().splitlines()) == 1 and ".tmp" not in err, err
    assert f"cannot replace {src / 'optimizer_1.pt'}: Device or resource busy; {src / 'optimizer.pt'} replaced" in err
    assert (src / "optimizer_1.pt").read_bytes() == before
    assert torch.load(src / "optimizer.pt", weights_only=True)["state"][0]["exp_avg"].dtype == torch.bfloat16
    assert sorted(os.listdir(tmp_path)) == [src.name] and not [p for p in os.listdir(src) if p.endswith(".tmp")]


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors in /proc")
def test_a_ctrl_c_as_an_in_place_convert_creates_a_temporary_leaves_no_descriptor_open(tmp_path, capsys, monkeypatch):
    """A Ctrl-C landing as ``create_temp`` returns, before convert kept the descriptor: the temporary was removed,
    its descriptor left open."""
    from optimshift.cli import _convert

    folder = _trainer_folder(tmp_path)
    before_bytes = (folder / "optimizer.pt").read_bytes()
    real_create = _convert.create_temp

    def created(*args):
        real_create(*args)
        raise KeyboardInterrupt

    before = len(os.listdir("/proc/self/fd"))
    monkeypatch.setattr(_convert, "create_temp", created)
    with pytest.raises(KeyboardInterrupt):
        _run(capsys, "convert", folder, folder)
    monkeypatch.undo()
    assert len(os.listdir("/proc/self/fd")) == before and (folder / "optimizer.pt").read_bytes() == before_bytes
    assert not [p for p in os.listdir(folder) if p.endswith(".tmp")]


def test_convert_folder_in_place_on_a_read_only_filesystem_names_the_file(tmp_path, capsys, monkeypatch):
    """A folder on a read-only filesystem (EROFS, not a PermissionError): one line naming the folder, the file and
    why, as for a folder without write permission (it named the hidden temporary alone), and nothing changes."""
    from optimshift.checkpoint import _atomic
    from optimshift.cli import _convert

    def refused(target, made):
        raise OSError(errno.EROFS, "Read-only file system", _atomic.temp_name(target))

    folder = _trainer_folder(tmp_path)
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    monkeypatch.setattr(_convert, "create_temp", refused)
    rc, out, err = _run(capsys, "convert", folder, folder)
    assert rc == 1 and len(err.strip().splitlines()) == 1, err
    assert f"cannot write in folder {folder}" in err and f"{folder / 'optimizer.pt'}): Read-only file system" in err
    assert ".tmp" not in err and {p.name: p.read_bytes() for p in folder.iterdir()} == before


def test_convert_folder_in_place_converts_a_file_two_names_link_to_once(tmp_path, capsys):
    """Two optimizer files that are one file (a link to the other): converted once (the second name's sweep
    removed the first's finished temporary, and the convert failed; found by review). A broken link: one line."""
    folder = _trainer_folder(tmp_path)
    (folder / "optimizer_1.pt").symlink_to(folder / "optimizer.pt")
    rc, out, err = _run(capsys, "convert", folder, folder)
    assert rc == 0, err
    assert len(out.splitlines()) == 1 and (folder / "optimizer_1.pt").is_symlink()
    torch.load(folder / "optimizer.pt", weights_only=True)
    (folder / "optimizer_1.pt").unlink()
    (folder / "optimizer_1.pt").symlink_to(tmp_path / "gone.pt")
    rc, out, err = _run(capsys, "convert", folder, folder)
    assert rc == 1 and len(err.strip().splitlines()) == 1 and "optimizer_1.pt" in err


def test_convert_folder_into_a_folder_that_cannot_be_made_says_so_in_one_line(tmp_path, capsys):
    """OUT under a parent that does not exist: one line and exit 1 (a traceback before)."""
    src = _trainer_folder(tmp_path)
    rc, out, err = _run(capsys, "convert", src, tmp_path / "missing" / "out")
    assert rc == 1 and len(err.strip().splitlines()) == 1 and "missing" in err and "Traceback" not in err


def test_folder_inspect_and_convert_answer_in_json_when_asked(tmp_path, capsys):
    """``--json`` on a folder: convert prints one object (each file's summary where it now is, and what was copied
    beside them), and a failure of inspect or convert is a JSON error on stdout; both printed text before."""
    src = _accelerate_folder(tmp_path / "state")
    rc, out, err = _run(capsys, "convert", src, tmp_path / "out", "--json")
    assert rc == 0, err
    info = json.loads(out)
    assert info["wrote"] == str(tmp_path / "out") and info["copied"] == 2
    assert [f["wrote"] for f in info["files"]] == [
        str(tmp_path / "out" / n) for n in ("optimizer.bin", "optimizer_1.bin")
    ]
    (src / "optimizer_1.bin").write_bytes(b"not a checkpoint")
    for argv in (("inspect", src, "--json"), ("convert", src, tmp_path / "again", "--json")):
        rc, out, err = _run(capsys, *argv)
        assert rc == 1 and "optimizer_1.bin" in json.loads(out)["error"]["message"] and err == ""


def test_convert_folder_refuses_a_used_target(tmp_path, capsys):
    src = _trainer_folder(tmp_path)
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "keep.txt").write_text("mine")
    rc, _, err = _run(capsys, "convert", src, taken)
    assert rc == 1 and f"{taken} exists: give a new folder" in err
    assert os.listdir(taken) == ["keep.txt"]
    empty = tmp_path / "empty"
    empty.mkdir()
    rc, _, err = _run(capsys, "convert", src, empty)
    assert rc == 0, err
    assert sorted(os.listdir(empty)) == sorted(os.listdir(src))


def test_other_folders_are_not_training_folders(tmp_path, capsys):
    dcp = tmp_path / "dcp"
    dcp.mkdir()
    (dcp / ".metadata").write_bytes(b"")
    (dcp / "optimizer.pt").write_bytes(b"")
    (dcp / "scheduler.pt").write_bytes(b"")
    assert training_folder(str(dcp)) is None
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "notes.txt").write_text("hi")
    assert training_folder(str(plain)) is None
    assert training_folder(str(plain / "notes.txt")) is None
    rc, _, err = _run(capsys, "convert", plain, tmp_path / "out")
    assert rc == 1 and "not a Hugging Face Trainer checkpoint-N folder or an Accelerate save_state folder" in err


def test_convert_into_a_new_folder_removes_what_a_crashed_convert_left(tmp_path, capsys):
    """A convert killed while building its folder leaves ``.OUT.<hex>.tmp`` beside OUT; the next convert to OUT
    removes it once no process holds its writer's lock, and leaves a live writer's alone (the DCP save's rule,
    one implementation: ``checkpoint._atomic.sweep_folders``)."""
    from optimshift.checkpoint._atomic import lock_folder

    folder = _trainer_folder(tmp_path)
    out = tmp_path / "converted"
    crashed = tmp_path / ".converted.0123456789ab.tmp"
    live = tmp_path / ".converted.ba9876543210.tmp"
    crashed.mkdir()
    (crashed / "optimizer.pt").write_bytes(b"half written")
    live.mkdir()
    held = lock_folder(live)  # (another writer, still at work)
    try:
        rc, _, err = _run(capsys, "convert", folder, out)
        assert rc == 0, err
        assert not crashed.exists() and live.is_dir()
        torch.load(out / "optimizer.pt", weights_only=True)
    finally:
        if held is not None:
            os.close(held)
    assert sorted(os.listdir(tmp_path)) == [".converted.ba9876543210.tmp", "checkpoint-10", "converted"]


def test_inspect_of_a_trainer_folder_checks_its_optimizer_files_checksums(tmp_path, capsys):
    """A bit flipped in a record of a Trainer folder's optimizer.pt: ``inspect FILE`` and ``convert`` refused it,
    but ``inspect FOLDER`` read the damaged value and described it as sound."""
    import struct
    import zipfile

    folder = _trainer_folder(tmp_path)
    path = folder / "optimizer.pt"
    with zipfile.ZipFile(path) as zf:
        info = next(i for i in zf.infolist() if "/data/" in i.filename and i.file_size >= 8)
    raw = bytearray(path.read_bytes())
    name_len, extra_len = struct.unpack("<HH", raw[info.header_offset + 26 : info.header_offset + 30])
    raw[info.header_offset + 30 + name_len + extra_len + 3] ^= 0x40
    path.write_bytes(bytes(raw))
    rc, out, err = _run(capsys, "inspect", folder)
    assert rc == 1 and f"record {info.filename} fails its CRC-32 check" in err, (out, err)
    rc, out, err = _run(capsys, "inspect", folder, "--json")
    assert rc == 1 and "fails its CRC-32 check" in json.loads(out)["error"]["message"]
