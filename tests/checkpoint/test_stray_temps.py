"""Temporary files of atomic saves: a crashed save or convert leaves at most one per destination, the next save
or convert to that destination removes it, and a temporary another writer is still writing is never touched."""

from __future__ import annotations

import os
import random
import re
import signal
import sys
import threading
import time

import pytest
import torch

import optimshift
from _matrix import bitwise_equal
from optimshift.checkpoint import _files
from optimshift.cli import main

needs_fork = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")


def _temps(folder, name):
    pattern = re.compile(rf"\.{re.escape(name)}\.[0-9a-f]{{12}}\.tmp")
    return sorted(p.name for p in folder.iterdir() if pattern.fullmatch(p.name))


def test_next_save_removes_what_killed_saves_left_and_nothing_else(tmp_path):
    dest = tmp_path / "ck.pt"
    optimshift.save({"v": 0}, dest)
    # What killed saves leave (the name format of this and earlier versions), next to files that are not ours.
    strays = [tmp_path / f".ck.pt.{i:012x}.tmp" for i in (1, 2, 0xABCDEF)]
    keep = [
        tmp_path / n
        for n in (
            ".ck.pt.notes.tmp",
            ".ck.pt.0123456789ab.tmp.bak",
            ".other.pt.000000000001.tmp",
            ".ck.pt.000000000001.tmp.d",
            "ck.pt.000000000002.tmp",
        )
    ]
    for p in strays + keep[:-2]:
        p.write_bytes(b"partial checkpoint")
    keep[-2].mkdir()
    keep[-1].write_bytes(b"x")
    os.symlink(tmp_path / "elsewhere", tmp_path / ".ck.pt.000000000009.tmp")  # a link: not a file we wrote
    optimshift.save({"v": 1}, dest)
    assert not any(p.exists() for p in strays), "the next save removes every abandoned temporary"
    assert all(p.exists() for p in keep), "files of other names and other destinations are left alone"
    assert os.path.islink(tmp_path / ".ck.pt.000000000009.tmp")
    assert optimshift.load(dest)["v"] == 1


class _Blocked:
    """A progress callback that stops its save after the first write, holding the temporary open."""

    def __init__(self):
        self.writing, self.go = threading.Event(), threading.Event()

    def __call__(self, written):
        self.writing.set()
        self.go.wait(30)


def test_a_temporary_still_being_written_by_this_process_is_left_alone(tmp_path):
    dest = tmp_path / "ck.pt"
    blocked, errors = _Blocked(), []

    def slow_save():
        try:
            _files._save({"who": "slow", "t": torch.arange(4.0)}, dest, progress=blocked)
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    thread = threading.Thread(target=slow_save)
    thread.start()
    try:
        assert blocked.writing.wait(30)
        (live,) = _temps(tmp_path, "ck.pt")
        optimshift.save({"who": "fast"}, dest)  # sweeps the folder while the slow save is mid-write
        assert (tmp_path / live).exists(), "a live writer's temporary must not be removed"
    finally:
        blocked.go.set()
        thread.join(30)
    assert not errors, errors
    assert optimshift.load(dest)["who"] == "slow" and _temps(tmp_path, "ck.pt") == []


@needs_fork
def test_a_temporary_another_process_is_writing_is_left_alone(tmp_path):
    dest = tmp_path / "ck.pt"
    started_r, started_w = os.pipe()
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: a save that waits, mid-write, until the parent says go
        code = 1
        try:
            os.close(started_r)
            os.close(go_w)

            def wait_for_parent(written, state={"first": True}):  # noqa: B006  (state kept across calls)
                if state["first"]:
                    state["first"] = False
                    os.write(started_w, b"w")
                    os.read(go_r, 1)

            _files._save({"who": "child"}, str(dest), progress=wait_for_parent)
            code = 0
        finally:
            os._exit(code)
    os.close(started_w)
    os.close(go_r)
    try:
        assert os.read(started_r, 1) == b"w"
        (live,) = _temps(tmp_path, "ck.pt")
        optimshift.save({"who": "parent"}, dest)
        assert (tmp_path / live).exists(), "another process's temporary, locked while it writes, must survive"
    finally:
        os.write(go_w, b"g")
        _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, "the child's save must complete"
    assert optimshift.load(dest)["who"] == "child" and _temps(tmp_path, "ck.pt") == []


def _run_until_killed(write_fd, job):
    os.write(write_fd, b"r")
    i = 0
    while True:
        job(i)
        i += 1


def _kill_at_random_moments(tmp_path, job, one_run, kills, check, rng):
    for _ in range(kills):
        read_fd, write_fd = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                os.close(read_fd)
                sys.stdout = sys.stderr = open(os.devnull, "w")
                _run_until_killed(write_fd, job)
            finally:
                os._exit(0)
        os.close(write_fd)
        os.read(read_fd, 1)
        os.close(read_fd)
        time.sleep(rng.uniform(0, 3 * one_run))
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        check()


@needs_fork
def test_sigkill_during_save_and_convert_leaves_one_stray_at_most(tmp_path):
    """Kill processes that save (and convert) A and B over one destination in a loop, 20 times each, at random
    moments: the destination always loads as A or B, at most one temporary of it is left, and the next
    successful save (or convert) removes that one."""
    rng = random.Random(20240611)
    versions = [{"version": v, "blob": torch.full((256 * 1024,), float(v))} for v in (1, 2)]  # 1 MiB each
    strays_seen = []

    # save
    dest = tmp_path / "ck.pt"
    optimshift.save(versions[0], dest)
    start = time.perf_counter()
    optimshift.save(versions[1], dest)
    one_save = time.perf_counter() - start

    def check_save():
        loaded = optimshift.load(dest, mmap=False)
        assert loaded["version"] in (1, 2)
        assert bitwise_equal(loaded["blob"], versions[loaded["version"] - 1]["blob"])
        strays = _temps(tmp_path, "ck.pt")
        strays_seen.append(len(strays))
        assert len(strays) <= 1, strays

    _kill_at_random_moments(
        tmp_path, lambda i: optimshift.save(versions[i % 2], str(dest)), one_save, 20, check_save, rng
    )
    optimshift.save(versions[0], dest)
    assert _temps(tmp_path, "ck.pt") == [], "the next successful save removes the stray"

    # convert
    sources = [tmp_path / f"in{v}.pt" for v in (1, 2)]
    for src, version in zip(sources, versions):
        torch.save(version, src)
    out = tmp_path / "out.pt"
    start = time.perf_counter()
    assert main(["convert", str(sources[0]), str(out)]) == 0
    one_convert = time.perf_counter() - start

    def check_convert():
        loaded = optimshift.load(out, mmap=False)
        assert bitwise_equal(loaded["blob"], versions[loaded["version"] - 1]["blob"])
        strays = _temps(tmp_path, "out.pt")
        strays_seen.append(len(strays))
        assert len(strays) <= 1, strays

    _kill_at_random_moments(
        tmp_path, lambda i: main(["convert", str(sources[i % 2]), str(out)]), one_convert, 20, check_convert, rng
    )
    assert main(["convert", str(sources[1]), str(out)]) == 0
    assert _temps(tmp_path, "out.pt") == [], "the next successful convert removes the stray"
    print(
        f"one save {one_save * 1e3:.1f} ms, one convert {one_convert * 1e3:.1f} ms; strays after each of "
        f"{len(strays_seen)} kills: {strays_seen}",
        file=sys.stderr,
    )


def test_a_temporary_folder_swept_before_its_lock_is_made_again(tmp_path, monkeypatch):
    """A sweep (another writer's) may remove a new temporary folder between its mkdir and its writer's lock;
    make_folder then makes it again, so the writer never writes into a folder that is gone."""
    import shutil

    from optimshift.checkpoint import _atomic

    real, calls = _atomic.lock_folder, []

    def swept_first(folder):
        calls.append(1)
        fd = real(folder)
        if len(calls) == 1:
            shutil.rmtree(folder)  # (what sweep_folders does to a folder no one has locked yet)
        return fd

    monkeypatch.setattr(_atomic, "lock_folder", swept_first)
    folder = tmp_path / ".out.0123456789ab.tmp"
    fd = _atomic.make_folder(folder)
    try:
        assert len(calls) == 2 and folder.is_dir()
        assert os.path.samestat(os.fstat(fd), os.stat(folder))
        assert _atomic.sweep_folders(tmp_path, lambda name: name.endswith(".tmp")) == 0  # (locked: left alone)
    finally:
        os.close(fd)
    assert _atomic.sweep_folders(tmp_path, lambda name: name.endswith(".tmp")) == 1  # (its writer gone)


@pytest.mark.skipif(sys.platform == "win32", reason="flock: POSIX")
def test_a_ctrl_c_while_a_save_locks_its_temporary_leaves_nothing(tmp_path, monkeypatch):
    """A Ctrl-C landing while save locked its new temporary left the file locked and open: no later save in this
    process could sweep it (a live writer holds it), one more per interrupt."""
    import fcntl

    from optimshift.checkpoint import _atomic

    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([p], lr=0.1)
    real = fcntl.flock

    def interrupted(fd, op):
        real(fd, op)
        raise KeyboardInterrupt

    monkeypatch.setattr(_atomic.fcntl, "flock", interrupted)
    with pytest.raises(KeyboardInterrupt):
        optimshift.save(opt, tmp_path / "opt.pt")
    monkeypatch.undo()
    assert os.listdir(tmp_path) == []
    optimshift.save(opt, tmp_path / "opt.pt")
    assert os.listdir(tmp_path) == ["opt.pt"]


def _interrupt_after_creating_a_temporary(monkeypatch, where):
    """A Ctrl-C that lands in ``where``: as ``os.open`` of the temporary returns (before ``create_temp`` keeps
    its descriptor), once it is marked live, or as ``create_temp`` returns (before the caller's ``try``)."""
    from optimshift.checkpoint import _atomic

    if where == "open":
        real_open = os.open

        def opened(path, *args, **kwargs):
            fd = real_open(path, *args, **kwargs)
            if str(path).endswith(".tmp"):
                raise KeyboardInterrupt
            return fd

        monkeypatch.setattr(_atomic.os, "open", opened)
    elif where == "live":

        class Interrupting(set):
            def add(self, item):
                super().add(item)
                raise KeyboardInterrupt

        monkeypatch.setattr(_atomic, "_live", Interrupting())
    else:
        real_create = _atomic.create_temp

        def created(*args):
            real_create(*args)
            raise KeyboardInterrupt

        monkeypatch.setattr(_atomic, "create_temp", created)


@pytest.mark.parametrize("where", ["open", "live", "returned"])
def test_a_ctrl_c_as_a_save_creates_its_temporary_leaves_nothing(tmp_path, monkeypatch, where):
    """A Ctrl-C landing between ``create_temp``'s ``os.open`` and the ``try`` that removes its file, or after
    it returned and before ``save``'s ``try``, left the temporary behind (locked, and marked live: no save in
    this process swept it)."""
    from optimshift.checkpoint import _atomic

    dest = tmp_path / "opt.pt"
    optimshift.save({"a": torch.ones(2)}, dest)
    before = dest.read_bytes()
    _interrupt_after_creating_a_temporary(monkeypatch, where)
    with pytest.raises(KeyboardInterrupt):
        optimshift.save({"a": torch.zeros(2)}, dest)
    monkeypatch.undo()
    assert os.listdir(tmp_path) == ["opt.pt"] and dest.read_bytes() == before
    assert not [p for p in _atomic._live if p.startswith(str(tmp_path))]


@pytest.mark.parametrize("where", ["open", "returned"])
def test_a_ctrl_c_as_bench_creates_its_out_file_temporary_leaves_nothing(tmp_path, monkeypatch, where):
    """``bench --out``'s atomic write takes its temporary as ``save`` does."""
    from optimshift.cli import _bench

    _interrupt_after_creating_a_temporary(monkeypatch, where)
    with pytest.raises(KeyboardInterrupt):
        _bench._write_out(str(tmp_path / "out.json"), {"a": 1})
    monkeypatch.undo()
    assert os.listdir(tmp_path) == []


def _open_descriptors():
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors in /proc")
@pytest.mark.parametrize("how", ["save", "bench"])
def test_a_ctrl_c_as_create_temp_returns_leaves_no_descriptor_open(tmp_path, monkeypatch, how):
    """A Ctrl-C landing as ``create_temp`` returns, before its caller kept the descriptor: the temporary was removed,
    its descriptor (and the lock on the removed file) stayed open, one more with each such Ctrl-C."""
    from optimshift.cli import _bench

    def write():
        if how == "save":
            optimshift.save({"a": torch.zeros(2)}, tmp_path / "opt.pt")
        else:
            _bench._write_out(str(tmp_path / "out.json"), {"a": 1})

    write()  # (whatever a first write opens for good)
    before = _open_descriptors()
    _interrupt_after_creating_a_temporary(monkeypatch, "returned")
    for _ in range(3):
        with pytest.raises(KeyboardInterrupt):
            write()
    monkeypatch.undo()
    assert _open_descriptors() == before
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]


def test_a_ctrl_c_as_a_save_releases_its_renamed_temporary_leaves_it_unmarked(tmp_path, monkeypatch):
    """A Ctrl-C landing in ``release_temp`` once the file was renamed into place: the file is saved, the interrupt
    raised once that is done, and the temporary's path no longer marked live (it stayed in ``_atomic._live``)."""
    from optimshift.checkpoint import _atomic

    dest, lock, fired = tmp_path / "opt.pt", _atomic._live_lock, []

    class Interrupting:  # (the lock release_temp takes: a real SIGINT as it is taken, once the file is in place)
        def __enter__(self):
            if dest.exists() and not fired:
                fired.append(1)
                signal.raise_signal(signal.SIGINT)
            return lock.__enter__()

        def __exit__(self, *exc):
            return lock.__exit__(*exc)

    monkeypatch.setattr(_atomic, "_live_lock", Interrupting())
    with pytest.raises(KeyboardInterrupt):
        optimshift.save({"a": torch.ones(2)}, dest)
    monkeypatch.undo()
    assert fired and torch.equal(optimshift.load(dest)["a"], torch.ones(2))
    assert not [p for p in _atomic._live if p.startswith(str(tmp_path))] and os.listdir(tmp_path) == ["opt.pt"]


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors in /proc")
@pytest.mark.parametrize("how", ["save", "bench"])
def test_a_ctrl_c_as_the_cleanup_takes_its_hold_leaves_no_descriptor_open(tmp_path, monkeypatch, how):
    """A Ctrl-C landing once the file is in place, as ``drop_temps`` takes its hold (before it held a Ctrl-C): the
    file is saved, the interrupt raised, and the temporary's descriptor (its lock) closed and its path unmarked (both
    stayed, the descriptor open on the saved file for as long as the process lived)."""
    from optimshift import _engine
    from optimshift.checkpoint import _atomic
    from optimshift.cli import _bench

    dest = tmp_path / ("opt.pt" if how == "save" else "out.json")

    def write():
        if how == "save":
            optimshift.save({"a": torch.ones(2)}, dest)
        else:
            _bench._write_out(str(dest), {"a": 1})

    write()  # (whatever a first write opens for good)
    dest.unlink()
    before, fired = _open_descriptors(), []

    class Interrupting:  # (the signal module the hold reads: a real SIGINT as it asks, once the file is in place)
        def __getattr__(self, name):
            if name == "getsignal" and dest.exists() and not fired:
                fired.append(1)
                signal.raise_signal(signal.SIGINT)
            return getattr(signal, name)

    monkeypatch.setattr(_engine, "signal", Interrupting())
    with pytest.raises(KeyboardInterrupt):
        write()
    monkeypatch.undo()
    assert fired and _open_descriptors() == before and os.listdir(tmp_path) == [dest.name]
    assert not [p for p in _atomic._live if p.startswith(str(tmp_path))]


def _half_written(then):
    """A ``torch.save`` that writes a few bytes of the file, then ``then()`` (a kill, a Ctrl-C)."""

    def save(obj, f, *args, **kwargs):
        f.write(b"PK\x03\x04 half a checkpoint")
        f.flush()
        then()

    return save


@needs_fork
def test_a_convert_in_place_killed_or_interrupted_mid_write_leaves_nothing_behind(tmp_path, monkeypatch):
    """In place, convert wrote each file through a second temporary (``..optimizer.pt.<hex>.tmp.<hex>.tmp``), which
    a kill mid-write left and no sweep of ``optimizer.pt`` matches: never removed. It writes its own temporary now,
    which the next convert sweeps; a Ctrl-C mid-write leaves nothing."""
    folder = tmp_path / "checkpoint-1"
    folder.mkdir()
    torch.save(torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1).state_dict(), folder / "optimizer.pt")
    torch.save({"last_epoch": 1}, folder / "scheduler.pt")
    before = (folder / "optimizer.pt").read_bytes()
    pid = os.fork()
    if pid == 0:  # (a convert killed mid-write)
        try:
            sys.stdout = sys.stderr = open(os.devnull, "w")
            torch.save = _half_written(lambda: os.kill(os.getpid(), signal.SIGKILL))
            main(["convert", str(folder), str(folder)])
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    assert (folder / "optimizer.pt").read_bytes() == before

    def interrupt():
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", _half_written(interrupt))
    with pytest.raises(KeyboardInterrupt):
        main(["convert", str(folder), str(folder)])
    monkeypatch.undo()
    assert (folder / "optimizer.pt").read_bytes() == before
    assert main(["convert", str(folder), str(folder)]) == 0
    assert sorted(os.listdir(folder)) == ["optimizer.pt", "scheduler.pt"]
    assert optimshift.load(folder / "optimizer.pt")["param_groups"][0]["lr"] == 0.1
