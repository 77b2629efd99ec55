"""Checkpoint files: atomic saves, loads that never run code from the file, clear errors for truncated and
foreign files, and the optimizer state found inside the files users have. (SIGKILLs mid-save and the
temporaries they leave: test_stray_temps.py.)"""

from __future__ import annotations

import collections
import errno
import importlib
import io
import os
import pickle
import re
import stat
import subprocess
import sys
import textwrap

import pytest
import torch

import optimshift
from _crafted import save_tagged
from _matrix import bitwise_equal
from optimshift.checkpoint import _atomic, _files
from optimshift.checkpoint._files import (
    META_KEY,
    CheckpointError,
    UnsafeCheckpointError,
    find_optimizer_states,
    verify_checksums,
)

O = torch.optim


def _adam(n=2):
    params = [torch.nn.Parameter(torch.randn(4, 3)) for _ in range(n)]
    opt = O.Adam(params, foreach=False)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    return opt


# --- save / load round trips --------------------------------------------------------------------------------


def test_save_records_the_class_and_opens_with_plain_torch(tmp_path):
    opt = _adam()
    path = tmp_path / "opt.pt"
    optimshift.save(opt, path)
    raw = torch.load(path, weights_only=True)
    assert raw[META_KEY]["class"] == "Adam" and raw[META_KEY]["module"] == "torch.optim.adam"
    plain = _adam()
    plain.load_state_dict(raw)  # PyTorch ignores the extra key
    loaded = optimshift.load(path)
    assert bitwise_equal(loaded["state"], opt.state_dict()["state"])
    assert [f.kind for f in find_optimizer_states(loaded)] == ["optimshift"]
    assert list(tmp_path.iterdir()) == [path], "no temporary file may be left behind"


def test_save_wraps_optimizers_inside_a_dict(tmp_path):
    opt = _adam()
    weights = {"w": torch.randn(3)}
    optimshift.save({"model": weights, "optimizer": opt, "epoch": 3}, tmp_path / "ck.pt")
    loaded = optimshift.load(tmp_path / "ck.pt")
    assert loaded["epoch"] == 3 and bitwise_equal(loaded["model"]["w"], weights["w"])
    (found,) = find_optimizer_states(loaded)
    assert found.where == "['optimizer']" and found.class_name == "torch.optim.adam.Adam"
    target = _adam()
    optimshift.load_state_dict(target, loaded)  # the whole checkpoint: its one optimizer state is used
    assert bitwise_equal(target.state_dict()["state"], opt.state_dict()["state"])


_Run = collections.namedtuple("_Run", "optimizer epoch")


@pytest.mark.parametrize("holder", ["OrderedDict", "namedtuple", "deep"])
def test_save_wraps_optimizers_in_dict_and_tuple_subclasses_and_deep_nesting(tmp_path, holder):
    """An optimizer inside an ``OrderedDict``, a namedtuple, or five levels down is saved as its state dict too, its
    container's class kept. Before, only exact dicts, lists and tuples four levels deep were looked into: the
    whole Optimizer object was pickled (the params with it, and an offloaded one's pool buffers), and the file
    then refused to load."""
    opt = _adam()
    pair = _Run
    obj = {
        "OrderedDict": lambda: collections.OrderedDict(optimizer=opt, epoch=3),
        "namedtuple": lambda: {"run": pair(opt, 3)},
        "deep": lambda: {"a": [{"b": ({"c": {"optimizer": opt}},)}]},
    }[holder]()
    optimshift.save(obj, tmp_path / "ck.pt")
    with torch.serialization.safe_globals([pair]):  # (a namedtuple's class is a global: allowed by name)
        loaded = optimshift.load(tmp_path / "ck.pt")
    (found,) = find_optimizer_states(loaded)
    assert found.class_name == "torch.optim.adam.Adam"
    if holder == "OrderedDict":
        assert type(loaded) is collections.OrderedDict and list(loaded) == ["optimizer", "epoch"]
    target = _adam()
    optimshift.load_state_dict(target, loaded)
    assert bitwise_equal(target.state_dict()["state"], opt.state_dict()["state"])


def test_permissions_follow_the_umask_or_the_replaced_file(tmp_path):
    old = os.umask(0o022)
    try:
        optimshift.save({"a": 1}, tmp_path / "f.pt")
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "f.pt").st_mode) == 0o644
    os.chmod(tmp_path / "f.pt", 0o600)
    optimshift.save({"a": 2}, tmp_path / "f.pt")  # replacing a private checkpoint keeps it private
    assert stat.S_IMODE(os.stat(tmp_path / "f.pt").st_mode) == 0o600


def test_load_maps_gpu_checkpoints_to_the_host_and_mmaps(tmp_path):
    sd = _adam().state_dict()
    save_tagged(sd, tmp_path / "gpu.pt")
    with pytest.raises(RuntimeError):
        torch.load(tmp_path / "gpu.pt", weights_only=True)  # plain torch.load wants the GPU it was saved on
    loaded = optimshift.load(tmp_path / "gpu.pt")
    assert bitwise_equal(loaded["state"], sd["state"])
    assert all(t.device.type == "cpu" for st in loaded["state"].values() for t in st.values())


@pytest.mark.parametrize("where", ["cpu:1", torch.device("cpu", 1), {"cpu": "cpu:1"}], ids=["str", "device", "dict"])
def test_a_map_location_torch_cannot_restore_to_is_not_called_a_corrupt_file(tmp_path, where):
    """``map_location="cpu:1"`` holds tensors (``torch.empty`` takes it) but torch.load restores no storage there:
    a sound file was called "truncated or corrupt". Now the map_location is named, and the file is not blamed."""
    torch.save(_adam().state_dict(), tmp_path / "opt.pt")
    with pytest.raises(RuntimeError, match="map_location .* restore data location") as raised:
        optimshift.load(tmp_path / "opt.pt", map_location=where)
    assert not isinstance(raised.value, CheckpointError) and "corrupt" not in str(raised.value)
    assert optimshift.load(tmp_path / "opt.pt", map_location="meta")["state"][0]["exp_avg"].is_meta  # (still taken)


def test_legacy_format_loads_without_mmap(tmp_path):
    sd = _adam().state_dict()
    torch.save(sd, tmp_path / "old.pt", _use_new_zipfile_serialization=False)
    assert bitwise_equal(optimshift.load(tmp_path / "old.pt")["state"], sd["state"])


def test_save_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="folder .*missing does not exist"):
        optimshift.save({}, tmp_path / "missing" / "f.pt")
    with pytest.raises(IsADirectoryError, match="is a directory"):
        optimshift.save({}, tmp_path)


def test_save_load_and_verify_checksums_name_what_a_path_must_be(tmp_path):
    """None, an int or a file object for the path raised os.fsdecode's bare "expected str, bytes or os.PathLike
    object" from inside, which named no call."""
    torch.save({}, tmp_path / "f.pt")
    for bad, got in [(None, "None"), (5, "an int"), (io.BytesIO(), "a BytesIO")]:
        for name, call in [
            ("save", lambda: optimshift.save({}, bad)),
            ("load", lambda: optimshift.load(bad)),
            ("verify_checksums", lambda: verify_checksums(bad)),
        ]:
            expected = rf"^{name}: path must be a file path \(a str or os.PathLike\), got {got}$"
            with pytest.raises(TypeError, match=expected):
                call()
    assert optimshift.load(os.fsencode(tmp_path / "f.pt")) == {}  # (a bytes path, as open() takes)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.pt"]


def test_save_to_a_path_ending_in_a_separator_writes_nothing(tmp_path):
    """``folder/new.pt/`` names a folder: the resolved path dropped the separator, and a file ``new.pt`` was
    written."""
    for given in [f"{tmp_path / 'new.pt'}{os.sep}", f"{tmp_path}{os.sep}"]:
        with pytest.raises(IsADirectoryError, match=r"ends in a separator, which names a folder; give a file path"):
            optimshift.save({"a": torch.ones(2)}, given)
    assert list(tmp_path.iterdir()) == []


def test_an_empty_path_and_a_file_path_ending_in_a_separator_are_said_so(tmp_path, monkeypatch):
    """``save(obj, "")`` was refused as "<the working folder> is a directory", ``load("")`` as "no such checkpoint
    file: " and ``load("f.pt/")`` of an existing ``f.pt`` as "no such checkpoint file"."""
    monkeypatch.chdir(tmp_path)
    optimshift.save({"a": torch.ones(2)}, "f.pt")
    with pytest.raises(FileNotFoundError, match=r"^save: the path is empty \(''\); give a file path$"):
        optimshift.save({"a": torch.ones(2)}, "")
    with pytest.raises(FileNotFoundError, match=r"^the checkpoint path is empty \(''\); give a file path$"):
        optimshift.load("")
    for given in [f"f.pt{os.sep}", f"{tmp_path / 'f.pt'}{os.sep}"]:
        with pytest.raises(
            NotADirectoryError,
            match=rf"^{re.escape(given)} ends in a separator, which names a folder, but {re.escape(given[:-1])} is a "
            rf"file; give its path without the separator$",
        ):
            optimshift.load(given)
    with pytest.raises(FileNotFoundError, match=r"no such checkpoint file: nope.pt/"):
        optimshift.load("nope.pt/")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.pt"]


def test_save_refuses_a_path_that_is_not_a_file_and_leaves_it_alone(tmp_path):
    """A FIFO, a device node (/dev/null, /dev/full, where a script sends its output): the atomic rename replaced
    it with a regular file (a new-user hunt, run as root, destroyed the container's /dev/full)."""
    import stat

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with pytest.raises(FileExistsError, match="pipe is a FIFO, not a file"):
        optimshift.save({}, fifo)
    link = tmp_path / "link"
    link.symlink_to(fifo)
    with pytest.raises(FileExistsError, match="is a FIFO, not a file"):
        optimshift.save({}, link)
    assert stat.S_ISFIFO(os.stat(fifo).st_mode) and link.is_symlink()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "pipe"]


# --- the files users have ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("fails", ["a write", "the last flush"])
def test_a_full_disk_names_the_file_and_the_cause_and_leaves_the_old_file(tmp_path, monkeypatch, fails):
    """torch's zip writer reports a failed write (a full disk's ENOSPC) as its own RuntimeError ("unexpected pos
    ..."), the OSError only in its context: save raises that OSError, naming the file, and the old file stays."""
    import errno

    path = tmp_path / "opt.pt"
    optimshift.save({"a": torch.ones(3)}, path)
    before = path.read_bytes()
    real_fdopen = os.fdopen

    class Full:
        """The temporary file on a disk that fills up after its first bytes."""

        def __init__(self, raw):
            self.raw, self.written = raw, 0

        def write(self, data):
            self.written += len(data)
            if fails == "a write" and self.written > 1024:
                raise OSError(errno.ENOSPC, "No space left on device")
            return self.raw.write(data)

        def flush(self):  # (the file's last bytes: its own flush fails where its writes were buffered)
            if fails == "the last flush":
                raise OSError(errno.ENOSPC, "No space left on device")
            return self.raw.flush()

        def __getattr__(self, name):
            return getattr(self.raw, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return self.raw.__exit__(*exc)

    monkeypatch.setattr(os, "fdopen", lambda *args, **kwargs: Full(real_fdopen(*args, **kwargs)))
    with pytest.raises(OSError) as info:
        optimshift.save({"a": torch.ones(1 << 16)}, path)
    monkeypatch.undo()
    assert info.value.errno == errno.ENOSPC and f"save: cannot write {path}: No space left on device" in str(info.value)
    assert path.read_bytes() == before and sorted(os.listdir(tmp_path)) == ["opt.pt"]


def test_a_ctrl_c_during_a_write_stays_an_interrupt_and_leaves_the_old_file(tmp_path, monkeypatch):
    """A Ctrl-C that arrives inside a write of the file: torch's zip writer then fails to close it and raised its
    own RuntimeError ("unexpected pos ..."), the interrupt only in its context, so the Ctrl-C was lost (a
    training loop's `except Exception` around its checkpoint went on)."""
    path = tmp_path / "opt.pt"
    optimshift.save({"a": torch.ones(3)}, path)
    before = path.read_bytes()
    real_fdopen = os.fdopen

    class Interrupted:
        def __init__(self, raw):
            self.raw, self.written = raw, 0

        def write(self, data):
            self.written += len(data)
            if self.written > 1024:
                raise KeyboardInterrupt
            return self.raw.write(data)

        def __getattr__(self, name):
            return getattr(self.raw, name)

    monkeypatch.setattr(os, "fdopen", lambda *args, **kwargs: Interrupted(real_fdopen(*args, **kwargs)))
    with pytest.raises(KeyboardInterrupt):
        optimshift.save({"a": torch.ones(1 << 16)}, path)
    monkeypatch.undo()
    assert path.read_bytes() == before and sorted(os.listdir(tmp_path)) == ["opt.pt"]


def test_a_ctrl_c_before_torch_save_takes_its_zip_writer_leaves_the_process_alive(tmp_path):
    """A Ctrl-C landing once torch.save made its zip writer, before its `with` took it: the writer, kept alive by the
    traceback, writes its end when freed, into the file save had closed, and torch aborted the process ("terminate
    called ... write to closed file"; a notebook's kernel died). Run in a subprocess: the abort would end pytest."""
    code = f"""
        import gc, os, torch, optimshift
        import torch.serialization as ser
        from unittest import mock
        path = {str(tmp_path / "opt.pt")!r}
        optimshift.save({{"a": torch.ones(3)}}, path)
        real = ser._opener.__init__

        def interrupted(self, file_like):
            real(self, file_like)
            if isinstance(file_like, torch._C.PyTorchFileWriter):
                raise KeyboardInterrupt

        with mock.patch.object(ser._opener, "__init__", interrupted):
            try:
                optimshift.save({{"a": torch.zeros(3)}}, path)
            except KeyboardInterrupt:
                pass
        gc.collect()
        print(sorted(os.listdir(os.path.dirname(path))), optimshift.load(path)["a"].tolist())
    """
    src = os.path.dirname(os.path.dirname(optimshift.__file__))
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": src},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "['opt.pt'] [1.0, 1.0, 1.0]"


@pytest.mark.skipif(not hasattr(torch.serialization, "skip_data"), reason="torch.serialization.skip_data: torch >= 2.6")
@pytest.mark.parametrize("progress", [None, [].append], ids=["save", "with progress"])
def test_a_save_under_torch_s_skip_data_writes_the_skeleton(tmp_path, progress):
    """Under torch.serialization.skip_data torch.save's writer seeks past each storage: _Sink (7e7825c) had no seek, and
    the save failed with torch's 'unexpected pos' (the plain file it wrote to before seeks)."""
    path = tmp_path / "opt.pt"
    with torch.serialization.skip_data():
        _files._save({"a": torch.ones(1000)}, path, progress=progress)
        loaded = torch.load(path, weights_only=True)
    assert loaded["a"].shape == (1000,) and sorted(os.listdir(tmp_path)) == ["opt.pt"]


def test_recognised_layouts(tmp_path):
    a, b = _adam().state_dict(), _adam().state_dict()
    layouts = {
        "hf_optimizer.pt": (a, [("", "state_dict")]),
        "lightning.ckpt": (
            {
                "epoch": 1,
                "global_step": 4,
                "pytorch-lightning_version": "2.6.6",
                "state_dict": {"layer.weight": torch.randn(2, 2)},
                "loops": {},
                "callbacks": {},
                "optimizer_states": [a, b],
                "lr_schedulers": [],
                "hparams_name": "kwargs",
                "hyper_parameters": {"lr": 0.1},
            },
            [("['optimizer_states'][0]", "lightning"), ("['optimizer_states'][1]", "lightning")],
        ),
        "optim_key.pt": ({"model": {"w": torch.randn(2)}, "optim": a}, [("['optim']", "nested")]),
        "tutorial.pt": (
            {"epoch": 2, "model_state_dict": {}, "optimizer_state_dict": a},
            [("['optimizer_state_dict']", "nested")],
        ),
        "weights_only.pt": ({"w": torch.randn(2)}, []),
    }
    for name, (obj, expected) in layouts.items():
        torch.save(obj, tmp_path / name)
        found = find_optimizer_states(optimshift.load(tmp_path / name))
        assert [(f.where, f.kind) for f in found] == expected, name
    lightning = optimshift.load(tmp_path / "lightning.ckpt")
    with pytest.raises(ValueError, match="holds 2 optimizer states"):
        optimshift.load_state_dict(_adam(), lightning)
    target = _adam()
    optimshift.load_state_dict(target, lightning["optimizer_states"][1])
    assert bitwise_equal(target.state_dict()["state"], b["state"])
    with pytest.raises(ValueError, match=r"state_dict has no 'state' or 'param_groups' entry \(its keys: 'w'\)"):
        optimshift.load_state_dict(_adam(), optimshift.load(tmp_path / "weights_only.pt"))


# --- security ------------------------------------------------------------------------------------------------


class _CreatesAFile:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))  # unpickling this creates (truncates) the file


@pytest.mark.parametrize("fmt", ["zip", "plain-pickle"])
def test_code_executing_pickle_is_refused(tmp_path, fmt):
    victim = tmp_path / "created-by-the-checkpoint"
    path = tmp_path / "evil.pt"
    payload = {"state": {}, "param_groups": [], "x": _CreatesAFile(str(victim))}
    if fmt == "zip":
        torch.save(payload, path)
    else:
        with open(path, "wb") as f:
            pickle.dump(payload, f, protocol=2)
    with pytest.raises(UnsafeCheckpointError) as info:
        optimshift.load(path)
    assert not victim.exists(), "nothing from the file may run"
    message = str(info.value)
    assert "open" in message and "nothing was executed" in message and "can run code" in message
    assert "allow-global" not in message and "safe_globals" not in message, "never suggest allowing open()"
    assert any("open" in g for g in info.value.globals)


def test_the_errors_load_raises_are_importable_from_optimshift(tmp_path):
    """What the README says ``load`` raises can be caught by the names it gives: ``optimshift.CheckpointError``."""
    assert optimshift.CheckpointError is CheckpointError and optimshift.UnsafeCheckpointError is UnsafeCheckpointError
    assert {"CheckpointError", "UnsafeCheckpointError"} <= set(optimshift.__all__)
    (tmp_path / "bad.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(optimshift.CheckpointError, match="not a PyTorch checkpoint"):
        optimshift.load(tmp_path / "bad.pt")


# --- faults ---------------------------------------------------------------------------------------------------


def test_truncated_and_foreign_files(tmp_path):
    good = tmp_path / "good.pt"
    optimshift.save(_adam(), good)
    data = good.read_bytes()
    cases = {
        "empty.pt": (b"", "is empty"),
        "head.pt": (data[:100], "truncated"),
        "half.pt": (data[: len(data) // 2], "truncated"),
        "almost.pt": (data[:-5], "truncated"),
        "text.pt": (b"just some text\n" * 4, "not a PyTorch checkpoint"),
        "st.safetensors": ((16).to_bytes(8, "little") + b'{"a":{}}' + b" " * 8, "safetensors"),
        "plain.pkl": (pickle.dumps({"a": 1}, protocol=2), "a plain pickle"),
    }
    legacy = tmp_path / "legacy.pt"
    torch.save({"a": torch.randn(100)}, legacy, _use_new_zipfile_serialization=False)
    cases["legacy-cut.pt"] = (legacy.read_bytes()[:-40], "truncated or corrupt")
    for name, (content, match) in cases.items():
        (tmp_path / name).write_bytes(content)
        with pytest.raises(CheckpointError, match=match):
            optimshift.load(tmp_path / name)
    with pytest.raises(FileNotFoundError, match="no such checkpoint file"):
        optimshift.load(tmp_path / "nope.pt")
    with pytest.raises(IsADirectoryError, match="is a directory"):
        optimshift.load(tmp_path)


@pytest.mark.parametrize("fmt, start", [("zip", 4), ("legacy-2", 14), ("legacy-4", 23)])
def test_a_torch_save_file_cut_within_its_first_bytes_is_truncated_not_another_format(tmp_path, fmt, start):
    """A file cut before the end of torch.save's first bytes (a legacy file's pickled magic number, a zip's
    signature) was called "a plain pickle (written by pickle.dump)" or "not a PyTorch checkpoint"."""
    whole = tmp_path / "whole.pt"
    kind, _, protocol = fmt.partition("-")
    options = {"_use_new_zipfile_serialization": False, "pickle_protocol": int(protocol)} if protocol else {}
    torch.save({"a": torch.ones(2)}, whole, **options)
    data = whole.read_bytes()
    for size in range(1, start):  # (the bytes before the pickle's or the zip's first record)
        cut = tmp_path / f"cut{size}.pt"
        cut.write_bytes(data[:size])
        with pytest.raises(CheckpointError, match=rf"cut{size}\.pt is truncated \({size} bytes\)"):
            optimshift.load(cut)


def test_links_leading_nowhere_are_named_on_load_and_refused_before_a_save_writes(tmp_path, monkeypatch):
    """A dangling link, or links in a loop, was "no such checkpoint file" (the link is there); a save through looping
    links wrote a temporary before failing with the system's bare ELOOP error."""
    (tmp_path / "dangling.pt").symlink_to(tmp_path / "gone.pt")
    (tmp_path / "a.pt").symlink_to(tmp_path / "b.pt")
    (tmp_path / "b.pt").symlink_to(tmp_path / "a.pt")
    for name, target in (("dangling.pt", "gone.pt"), ("a.pt", "b.pt")):
        with pytest.raises(FileNotFoundError, match=rf"{name} is a symbolic link to .*{target}, which leads to no"):
            optimshift.load(tmp_path / name)
    monkeypatch.setattr(_atomic, "create_temp", lambda *a: pytest.fail("a temporary was made"))
    with pytest.raises(OSError, match=r"save: cannot replace .*\.pt: Too many levels of symbolic links") as info:
        optimshift.save({}, tmp_path / "a.pt")
    assert info.value.errno == errno.ELOOP
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.pt", "b.pt", "dangling.pt"]


@pytest.mark.parametrize("where", ["locked", "locked/sub"])
def test_save_in_a_folder_that_cannot_be_searched_names_the_folder(tmp_path, monkeypatch, where):
    """A folder on the way that cannot be searched (its stat's EACCES, simulated: root searches any folder) is said
    as a folder that cannot be written, naming it; 3e4ee90's check for looping links said "cannot replace" the file,
    which may not exist, and no folder."""
    (tmp_path / where).mkdir(parents=True)
    locked, real = str(tmp_path / "locked") + os.sep, os.stat

    def stat(path, *args, **kwargs):
        if not isinstance(path, int) and os.fsdecode(os.fspath(path)).startswith(locked):
            raise PermissionError(errno.EACCES, "Permission denied", path)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(os, "stat", stat)
    monkeypatch.setattr(_atomic, "create_temp", lambda *a: pytest.fail("a temporary was made"))
    folder = re.escape(str(tmp_path / where))
    with pytest.raises(PermissionError, match=rf"save: cannot write in folder {folder} \(a new .*: Permission denied"):
        optimshift.save({}, tmp_path / where / "opt.pt")


def test_load_state_dict_of_a_path_it_cannot_read_names_the_optimizer_and_the_file(tmp_path, monkeypatch):
    """A path load_state_dict cannot read was refused with load's error alone, which names the file but not the
    optimizer; each now says both, its type (and a system error's errno) kept, and the optimizer is unchanged."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty.pt").write_bytes(b"")
    (tmp_path / "text.pt").write_bytes(b"just some text\n" * 4)
    opt = _adam()
    before = opt.state_dict()["state"]
    cases = {
        "": (FileNotFoundError, r"the checkpoint path is empty \(''\)"),
        "nope.pt": (FileNotFoundError, r"no such checkpoint file: nope\.pt$"),
        str(tmp_path): (IsADirectoryError, rf"{re.escape(str(tmp_path))} is a directory, not a checkpoint file"),
        f"empty.pt{os.sep}": (NotADirectoryError, r"empty\.pt/ ends in a separator"),
        "empty.pt": (CheckpointError, r"empty\.pt is empty \(0 bytes\)"),
        "text.pt": (CheckpointError, r"text\.pt is not a PyTorch checkpoint"),
    }
    for path, (kind, match) in cases.items():
        with pytest.raises(kind, match=rf"^Adam: load_state_dict: {match}") as info:
            optimshift.load_state_dict(opt, path)
        assert type(info.value) is kind, path
    assert bitwise_equal(opt.state_dict()["state"], before)

    def denied(path):
        raise PermissionError(13, "Permission denied", path)

    monkeypatch.setattr("optimshift.checkpoint._files._sniff", denied)
    with pytest.raises(PermissionError, match=r"Adam: load_state_dict: Permission denied: 'text\.pt'") as info:
        optimshift.load_state_dict(opt, "text.pt")
    assert info.value.errno == 13 and info.value.filename == "text.pt"


def test_a_refused_checkpoint_s_error_survives_a_pickle_round_trip(tmp_path):
    """multiprocessing, DataLoader workers and torch.distributed re-raise an error by pickling it: an
    UnsafeCheckpointError could not be unpickled (its class took ``globals`` as a required argument)."""
    path = tmp_path / "evil.pt"
    torch.save({"x": _CreatesAFile(str(tmp_path / "victim"))}, path)
    opt = _adam()
    for load in (optimshift.load, lambda p: optimshift.load_state_dict(opt, p)):
        with pytest.raises(UnsafeCheckpointError) as info:
            load(path)
        back = pickle.loads(pickle.dumps(info.value))
        assert type(back) is UnsafeCheckpointError and str(back) == str(info.value)
        assert back.globals == info.value.globals and any("open" in g for g in back.globals)


def test_a_system_error_reading_a_load_state_dict_path_keeps_the_optimizer_in_its_args(monkeypatch):
    """load_state_dict named the optimizer in a system error's ``strerror`` only: ``args`` (what a pickle of it
    keeps, a worker's error re-raised) lacked it. Both say it now, errno and filename kept."""

    def denied(path):
        raise PermissionError(13, "Permission denied", path)

    monkeypatch.setattr("optimshift.checkpoint._files._sniff", denied)
    with pytest.raises(PermissionError) as info:
        optimshift.load_state_dict(_adam(), "text.pt")
    said = "[Errno 13] Adam: load_state_dict: Permission denied: 'text.pt'"
    assert str(info.value) == said and info.value.args == (13, "Adam: load_state_dict: Permission denied")
    back = pickle.loads(pickle.dumps(info.value))
    assert type(back) is PermissionError and str(back) == said
    assert back.errno == 13 and back.filename == "text.pt"


def test_a_system_error_s_further_args_survive_the_optimizer_s_name(monkeypatch):
    """Naming the optimizer in ``args`` kept only errno and strerror: a BlockingIOError's ``characters_written``
    (its third arg) was lost, and a pickled copy of it had none."""

    def blocked(path):
        raise BlockingIOError(11, "Resource temporarily unavailable", 7)

    monkeypatch.setattr("optimshift.checkpoint._files._sniff", blocked)
    with pytest.raises(BlockingIOError) as info:
        optimshift.load_state_dict(_adam(), "text.pt")
    back = pickle.loads(pickle.dumps(info.value))
    assert info.value.characters_written == back.characters_written == 7
    assert str(back) == "[Errno 11] Adam: load_state_dict: Resource temporarily unavailable"


def test_load_state_dict_takes_a_bytes_path_as_load_and_save_do(tmp_path):
    """:func:`optimshift.load` and :func:`optimshift.save` take a bytes path; load_state_dict refused one
    ("state_dict must be a dict (or a path), got bytes")."""
    saved, opt = _adam(), _adam()
    path = os.fsencode(tmp_path / "opt.pt")
    optimshift.save(saved, path)
    optimshift.load_state_dict(opt, path)
    assert bitwise_equal(opt.state_dict()["state"], saved.state_dict()["state"])
    with pytest.raises(FileNotFoundError, match=r"^Adam: load_state_dict: no such checkpoint file: .*nope\.pt$"):
        optimshift.load_state_dict(opt, os.fsencode(tmp_path / "nope.pt"))


def test_a_checkpoint_s_bytes_in_memory_are_refused_as_no_path(tmp_path, monkeypatch):
    """Bytes with a NUL are a file's contents, not its path (none has a NUL): load_state_dict, once it took bytes
    paths, raised a FileNotFoundError holding every byte of them as the name, where it refused bytes before."""
    monkeypatch.chdir(tmp_path)  # (where a save would write a file named by them)
    opt, buf = _adam(), io.BytesIO()
    torch.save(opt.state_dict(), buf)
    data, before = buf.getvalue(), [t.clone() for t in opt.state_dict()["state"][0].values()]
    for call, what in (
        (lambda: optimshift.load_state_dict(opt, data), "Adam: load_state_dict"),
        (lambda: optimshift.load(data), "load"),
        (lambda: optimshift.save(opt, data), "save"),
    ):
        with pytest.raises(TypeError, match=rf"^{what}: path must be a file path, got {len(data)} bytes with a NUL"):
            call()
    assert bitwise_equal(list(opt.state_dict()["state"][0].values()), before) and os.listdir(tmp_path) == []


def test_a_class_weights_only_meets_as_an_objects_class_is_named_to_allow(tmp_path):
    """numpy scalars: once the globals their pickle names are allowed, torch's refusal is of a class it met as an
    object's class (``numpy.dtypes.Float64DType``), not by name. It is named to allow, as a refused global: the
    file was called corrupt before (found by a new-user hunt)."""
    np = pytest.importorskip("numpy")
    path = tmp_path / "np.pt"
    torch.save({"optimizer": _adam().state_dict(), "best": np.float64(0.5)}, path)
    with pytest.raises(UnsafeCheckpointError) as first:
        optimshift.load(path)
    named = str(first.value).split("safe_globals([")[1].split("])")[0].split(", ")
    allowed = [getattr(importlib.import_module(n.rpartition(".")[0]), n.rpartition(".")[2]) for n in named]
    with torch.serialization.safe_globals(allowed), pytest.raises(UnsafeCheckpointError, match=r"Float64DType"):
        optimshift.load(path)
    dtype_class = type(np.dtype(np.float64))
    with torch.serialization.safe_globals([*allowed, dtype_class]):
        assert optimshift.load(path)["best"] == 0.5


def test_a_file_name_as_long_as_the_filesystem_takes_saves_and_converts(tmp_path, capsys):
    """A 250-byte name, which torch.save writes: the temporary's name (18 bytes longer) was too long for the
    filesystem, so optimshift.save and convert failed (ENAMETOOLONG; found by a new-user hunt). A long name's
    temporaries are named after its start and a digest; the next save sweeps what a crashed one left."""
    from optimshift.checkpoint import _atomic
    from optimshift.cli import main

    path = tmp_path / ("o" * 247 + ".pt")
    opt = _adam()
    optimshift.save(opt, path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]
    stray = _atomic.temp_name(str(path))
    open(stray, "wb").close()  # (what a killed save leaves: no process holds its lock)
    assert _atomic.temp_pattern(str(path)).fullmatch(os.path.basename(stray))
    assert main(["convert", str(path), str(path)]) == 0, capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]
    assert bitwise_equal(optimshift.load(path)["state"], opt.state_dict()["state"])


def test_save_names_the_folder_it_cannot_write_in_and_takes_bytes_paths(tmp_path, monkeypatch):
    """A read-only folder: the error names the folder (it named the hidden temporary); a path under a file says the
    file is not a folder (it said the folder did not exist); a bytes path is a path, as open() takes it (a
    TypeError from a regular expression). Found by a new-user hunt."""
    opt = _adam()
    optimshift.save(opt, os.fsencode(tmp_path / "b.pt"))
    assert bitwise_equal(optimshift.load(tmp_path / "b.pt")["state"], opt.state_dict()["state"])
    with pytest.raises(NotADirectoryError, match=r"b\.pt is a file, not a folder"):
        optimshift.save(opt, tmp_path / "b.pt" / "x.pt")
    from optimshift.checkpoint import _atomic

    def refused(target, made):  # (what creating the temporary in a read-only folder raises; root may write anywhere)
        raise PermissionError(13, "Permission denied", _atomic.temp_name(target))

    monkeypatch.setattr(_atomic, "create_temp", refused)
    with pytest.raises(PermissionError, match=rf"cannot write in folder {tmp_path}") as caught:
        optimshift.save(opt, tmp_path / "o.pt")
    assert ".tmp" not in str(caught.value)


def test_save_names_the_folder_on_a_read_only_filesystem_too(tmp_path, monkeypatch):
    """A folder on a read-only (or full) filesystem: the error names the folder and the file, and says why (only
    a PermissionError did; EROFS named the hidden temporary alone)."""
    from optimshift.checkpoint import _atomic

    def refused(target, made):
        raise OSError(errno.EROFS, "Read-only file system", _atomic.temp_name(target))

    monkeypatch.setattr(_atomic, "create_temp", refused)
    with pytest.raises(OSError, match=rf"cannot write in folder {tmp_path} .*o\.pt.*: Read-only file system") as caught:
        optimshift.save(_adam(), tmp_path / "o.pt")
    assert ".tmp" not in str(caught.value) and caught.value.errno == errno.EROFS


def test_errors_without_an_errno_read_without_errno_none(tmp_path, monkeypatch):
    """An OSError with no errno (a hundred temporary names taken; a writer's own error): the message read "[Errno
    None] save: ...", and a write error's reason "None"."""
    from optimshift.checkpoint import _atomic

    monkeypatch.setattr(_atomic, "_locked", lambda fd, path: False)  # (a sweep took every name first)
    with pytest.raises(OSError) as caught:
        optimshift.save(_adam(), tmp_path / "o.pt")
    said = str(caught.value)
    assert said.startswith(f"save: cannot write in folder {tmp_path} ") and "could not create a temporary" in said
    assert "Errno" not in said and os.listdir(tmp_path) == []
    monkeypatch.undo()

    def failing(obj, f, *args, **kwargs):
        raise OSError("the share went away")

    monkeypatch.setattr(torch, "save", failing)
    with pytest.raises(OSError) as caught:
        optimshift.save(_adam(), tmp_path / "o.pt")
    assert str(caught.value).startswith(f"save: cannot write {tmp_path / 'o.pt'}: the share went away; ")
    assert os.listdir(tmp_path) == []


def test_a_container_held_in_many_places_is_walked_once(tmp_path, monkeypatch):
    """Lists that each hold the one before twice (16 levels: 65,536 paths to the innermost, a few hundred bytes in
    a file): saving and finding the optimizer state walk each container once (both walked every path, so 40
    levels never finished; found by review), and a container held in two places stays one object."""
    calls = []
    real = _files.is_optimizer_state_dict
    monkeypatch.setattr(_files, "is_optimizer_state_dict", lambda value: calls.append(1) or real(value))
    opt = _adam()
    x: list = [opt]
    for _ in range(16):
        x = [x, x]
    optimshift.save({"a": x}, tmp_path / "ck.pt")
    loaded = optimshift.load(tmp_path / "ck.pt")
    calls.clear()
    (found,) = find_optimizer_states(loaded)
    assert len(calls) < 100 and found.class_name == "torch.optim.adam.Adam"
    inner = loaded["a"]
    for _ in range(16):
        assert inner[0] is inner[1]
        inner = inner[0]


def test_a_container_holding_itself_and_an_optimizer_is_refused_before_anything_is_written(tmp_path):
    """Its copy, with the optimizer's state dict in place, cannot hold itself: refused, naming it (the copy held
    the original, live optimizer and all, so the file refused to load). Without an optimizer in it, saved."""
    opt = _adam()
    looped = {"optimizer": opt}
    looped["self"] = looped
    with pytest.raises(ValueError, match="a dict in the object holds itself"):
        optimshift.save(looped, tmp_path / "ck.pt")
    assert list(tmp_path.iterdir()) == []
    plain: dict = {"epoch": 1}
    plain["self"] = plain
    optimshift.save({"optimizer": opt, "run": plain}, tmp_path / "ck.pt")
    loaded = optimshift.load(tmp_path / "ck.pt")
    assert loaded["run"]["self"] is loaded["run"]


def test_an_optimizer_in_a_container_that_cannot_be_rebuilt_is_refused_by_name(tmp_path):
    """A tuple subclass whose constructor takes other arguments, a dict subclass whose copy is itself: refused,
    naming the class, before anything is written (a raw TypeError, or the user's own dict changed in place)."""

    class Pair(tuple):
        def __new__(cls, a, b):
            return super().__new__(cls, (a, b))

    class Same(dict):
        def __copy__(self):
            return self

    opt = _adam()
    for holder, name in ((Pair(opt, 1), "Pair"), (Same(optimizer=opt), "Same")):
        with pytest.raises(ValueError, match=rf"inside a {name} is saved as its state dict"):
            optimshift.save({"run": holder}, tmp_path / "ck.pt")
        assert list(tmp_path.iterdir()) == []
    assert holder["optimizer"] is opt


def test_a_corrupt_pickle_whose_message_names_a_class_is_corrupt_not_unsafe(tmp_path):
    """torch's refusal "Can only append to lists, but got <class 'dict'>" (a damaged pickle) is no class to allow:
    the file is corrupt. The rule that names a class met as an object's class reads only torch's refusal of a
    class not allowed (a first version read any "but got <class ...>"; found by review)."""
    from _crafted import pickled_zip

    path = pickled_zip(tmp_path, "bad.pt", b"\x80\x02}K\x01a.")
    with pytest.raises(CheckpointError, match="is corrupt") as caught:
        optimshift.load(path)
    assert not isinstance(caught.value, UnsafeCheckpointError)


def test_a_name_that_is_not_utf8_saves(tmp_path):
    """A name from a Latin-1 folder listing (bytes, or str with surrogates, as os.fsdecode gives): measured for its
    temporary as the filesystem sees it (it raised UnicodeEncodeError before anything was written; found by
    review), and loaded from its open file (torch's zip reader takes UTF-8 names only: "truncated or corrupt")."""
    opt = _adam()
    name = os.fsdecode(b"\xe9t\xe9.pt")
    optimshift.save(opt, os.path.join(tmp_path, name))
    optimshift.save(opt, os.path.join(os.fsencode(tmp_path), b"\xff.pt"))
    assert sorted(os.listdir(os.fsencode(tmp_path))) == [b"\xe9t\xe9.pt", b"\xff.pt"]
    assert bitwise_equal(optimshift.load(os.path.join(tmp_path, name))["state"], opt.state_dict()["state"])


def test_one_optimizer_held_twice_is_saved_once_and_a_dict_met_deep_first_is_still_found(tmp_path):
    """The same optimizer in two places: one state dict in the file, held in both (two before: a load of the file
    refused, "holds 2 optimizer states"). A state dict met first past the walk's depth is still found by a
    shallower path (it was marked seen unwalked; found by review)."""
    opt = _adam()
    optimshift.save({"optimizer": opt, "history": [opt]}, tmp_path / "ck.pt")
    loaded = optimshift.load(tmp_path / "ck.pt")
    assert loaded["history"][0] is loaded["optimizer"]
    target = _adam()
    optimshift.load_state_dict(target, tmp_path / "ck.pt")
    assert bitwise_equal(target.state_dict()["state"], opt.state_dict()["state"])
    sd = opt.state_dict()
    inner = [sd]
    deep = inner
    for _ in range(63):
        deep = [deep]
    (found,) = find_optimizer_states({"a": deep, "b": inner})
    assert found.where == "['b'][0]"


def test_a_checkpoint_that_is_a_list_loads_as_inspect_finds_it(tmp_path):
    """A file holding ``[state_dict]`` (inspect finds the state at ``[0]``): load_state_dict finds it too (it
    refused any list: "state_dict must be a dict"), and a list holding none is refused as before."""
    params = [torch.nn.Parameter(torch.randn(3)) for _ in range(2)]
    opt = torch.optim.Adam(params)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    path = tmp_path / "list.pt"
    torch.save([opt.state_dict()], path)
    fresh = torch.optim.Adam(params)
    optimshift.load_state_dict(fresh, path)
    assert bitwise_equal(fresh.state_dict()["state"], opt.state_dict()["state"])
    with pytest.raises(TypeError, match="must be a dict"):
        optimshift.load_state_dict(torch.optim.Adam(params), [1, 2])


def test_entries_viewing_one_storage_in_two_dtypes_are_named_and_the_old_file_stays(tmp_path):
    """torch.save refuses tensors that view one storage in two dtypes (a complex entry and its view_as_real, an
    entry and its .view(torch.int32)) with a message naming none of them: the entries and the file are named."""
    p = torch.nn.Parameter(torch.randn(4))
    opt = torch.optim.SGD([p], lr=0.1)
    x = torch.randn(4)
    opt.state[p] = {"x": x, "bits": x.view(torch.int32)}
    path = tmp_path / "opt.pt"
    path.write_bytes(b"old")
    with pytest.raises(
        ValueError, match=re.escape(f"save: {path}: ['state'][0]['x'] (float32) and ['state'][0]['bits'] (int32)")
    ):
        optimshift.save(opt, path)
    assert path.read_bytes() == b"old" and os.listdir(tmp_path) == ["opt.pt"]
