"""optimshift.distributed.save/load, single process: param-group membership, partial optimizer state, one
temporary directory per save and a best-effort cleanup after the commit, gradients left as they were."""

from __future__ import annotations

import fcntl
import os
import shutil

import pytest
import torch
import torch.nn as nn
from _dist_workers import bitwise_equal

from optimshift.checkpoint import _atomic
from optimshift.distributed import _checkpoint, load, save


def _two_layers() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))


def _grouped(model: nn.Module, split: int) -> torch.optim.Optimizer:
    params = list(model.parameters())
    return torch.optim.Adam([{"params": params[:split]}, {"params": params[split:], "lr": 0.5}], lr=1e-3)


def _step(model: nn.Module, opt: torch.optim.Optimizer, seed: int = 1) -> None:
    x = torch.randn(2, 3, generator=torch.Generator().manual_seed(seed))
    model(x).sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _copy(model: nn.Module, opt: torch.optim.Optimizer) -> list[tuple[str, torch.Tensor]]:
    out = [(n, p.detach().clone()) for n, p in model.named_parameters()]
    for n, p in model.named_parameters():
        for key, value in opt.state.get(p, {}).items():
            out.append((f"{n}.{key}", value.detach().clone()))
    return out


def _same(a: list, b: list) -> bool:
    return [k for k, _ in a] == [k for k, _ in b] and all(bitwise_equal(x, y) for (_, x), (_, y) in zip(a, b))


# --- 1: which params each group holds ---------------------------------------------------------------------


def test_param_groups_holding_other_params_are_a_mismatch(tmp_path):
    model = _two_layers()
    opt = _grouped(model, 1)  # [0.weight @ 1e-3], [0.bias, 1.weight, 1.bias @ 0.5]
    _step(model, opt)
    save(tmp_path / "ck", model, opt)

    live = _two_layers()
    live_opt = _grouped(live, 3)  # same group count and hyperparameter keys, other members
    _step(live, live_opt)
    before = _copy(live, live_opt)
    with pytest.raises(
        ValueError,
        match=r"param group 0 holds other params in the checkpoint than in the optimizer "
        r"\(1 there, 3 here\): \['0.bias', '1.weight'\] are in this group only "
        r"in the optimizer",
    ) as info:
        load(tmp_path / "ck", live, live_opt)
    assert "param group 1 holds other params" in str(info.value)
    assert _same(before, _copy(live, live_opt))  # nothing was loaded
    assert [g["lr"] for g in live_opt.param_groups] == [1e-3, 0.5]

    same = _two_layers()
    same_opt = _grouped(same, 1)
    load(tmp_path / "ck", same, same_opt)  # the same grouping loads
    assert _same(_copy(same, same_opt), _copy(model, opt))


# --- 3: params without state in the checkpoint ------------------------------------------------------------


class _WithUnused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(3, 3)
        self.unused = nn.Linear(3, 3)  # never gets a gradient: Adam keeps no state for it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x)


def _stateless_after(model: _WithUnused, opt: torch.optim.Optimizer) -> bool:
    return all(p not in opt.state for p in model.unused.parameters())


def test_a_checkpoint_with_state_for_some_params_loads_into_a_fresh_optimizer(tmp_path):
    model = _WithUnused()
    opt = torch.optim.Adam(model.parameters())
    _step(model, opt)
    assert len(opt.state) == 2
    save(tmp_path / "ck", model, opt)

    fresh = _WithUnused()
    with torch.no_grad():
        for p in fresh.parameters():
            p.add_(1.0)
    fresh_opt = torch.optim.Adam(fresh.parameters())
    load(tmp_path / "ck", fresh, fresh_opt)
    assert _same(_copy(fresh, fresh_opt), _copy(model, opt))
    assert _stateless_after(fresh, fresh_opt) and len(fresh_opt.state) == 2
    assert all(p.grad is None for p in fresh.parameters())
    _step(model, opt, 2)
    _step(fresh, fresh_opt, 2)
    assert _same(_copy(fresh, fresh_opt), _copy(model, opt))  # training continues identically


def test_loading_into_the_same_optimizer_restores_the_checkpoint(tmp_path):
    model = _WithUnused()
    opt = torch.optim.Adam(model.parameters())
    _step(model, opt)
    saved = _copy(model, opt)
    save(tmp_path / "ck", model, opt)
    _step(model, opt, 2)
    opt.state[model.unused.weight]["step"] = torch.tensor(5.0)  # state the checkpoint does not have
    load(tmp_path / "ck", model, opt)
    assert _same(_copy(model, opt), saved)
    assert _stateless_after(model, opt)


def test_a_partly_stepped_optimizer_cannot_take_state_it_lacks(tmp_path):
    model = _WithUnused()
    opt = torch.optim.Adam(model.parameters())
    model.unused(model.a(torch.ones(1, 3))).sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    save(tmp_path / "ck", model, opt)  # state for all four params

    live = _WithUnused()
    live_opt = torch.optim.Adam(live.parameters())
    _step(live, live_opt)  # state for a.* only
    before = _copy(live, live_opt)
    with pytest.raises(
        ValueError,
        match=r"optim.state.unused.bias: the checkpoint has state for it, the optimizer "
        r"none",
    ):
        load(tmp_path / "ck", live, live_opt)
    assert _same(before, _copy(live, live_opt))  # refused before DCP wrote anything


def test_an_error_after_reading_began_says_the_model_may_be_partly_loaded(tmp_path, monkeypatch):
    model = _WithUnused()
    opt = torch.optim.Adam(model.parameters())
    _step(model, opt)
    save(tmp_path / "ck", model, opt)

    def broken(*args, **kwargs):
        raise OSError("disk gone")

    monkeypatch.setattr(_checkpoint, "set_state_dict", broken)
    fresh = _WithUnused()
    with pytest.raises(
        RuntimeError,
        match=r"failed after it began writing the checkpoint into the model and "
        r"optimizer, which may now be partly loaded .*OSError: disk gone",
    ):
        load(tmp_path / "ck", fresh, torch.optim.Adam(fresh.parameters()))
    assert all(p.grad is None for p in fresh.parameters())


# --- 2: the commit ----------------------------------------------------------------------------------------


def _trained() -> tuple[nn.Module, torch.optim.Optimizer]:
    model = _two_layers()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _step(model, opt)
    return model, opt


def test_each_save_has_its_own_temporary_directory(tmp_path, monkeypatch):
    model, opt = _trained()
    target = tmp_path / "ck"
    save(target, model, opt)
    live = tmp_path / "ck.optimshift-tmp-concurrent"  # another process's save in progress: it holds the lock
    live.mkdir()
    (live / "__0_0.distcp").write_bytes(b"being written")
    stale = tmp_path / "ck.optimshift-tmp-crashed"  # a crashed save's: nobody holds its lock
    stale.mkdir()
    legacy = tmp_path / "ck.optimshift-tmp"
    legacy.mkdir()
    used = []
    real_save = _checkpoint.dcp.save

    def record(state, *, storage_writer, **kwargs):
        used.append(os.fspath(storage_writer.path))
        return real_save(state, storage_writer=storage_writer, **kwargs)

    monkeypatch.setattr(_checkpoint.dcp, "save", record)
    fd = os.open(live, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        save(target, model, opt)
        save(target, model, opt)
    finally:
        os.close(fd)
    assert len(used) == 2 and used[0] != used[1]
    assert all(os.path.basename(u).startswith("ck.optimshift-tmp-") for u in used)
    assert (live / "__0_0.distcp").read_bytes() == b"being written"  # left alone
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "ck.optimshift-tmp-concurrent"]


def test_an_interrupt_leaves_no_unlocked_temporary_directory_behind(tmp_path, monkeypatch):
    """Where a folder cannot be opened to lock it (Windows: make_folder hands back no lock), a Ctrl-C while the
    state dicts were built left the save's temporary directory, which no later sweep removes there: only a locked
    one was cleaned up."""
    model, opt = _trained()

    def unlocked(folder):
        os.mkdir(folder)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(_checkpoint, "make_folder", unlocked)
    monkeypatch.setattr(_checkpoint, "get_state_dict", interrupted)
    with pytest.raises(KeyboardInterrupt):
        save(tmp_path / "ck", model, opt)
    assert list(tmp_path.iterdir()) == []


def test_a_temporary_directory_replaced_during_the_save_is_not_committed(tmp_path, monkeypatch):
    model, opt = _trained()
    target = tmp_path / "ck"
    save(target, model, opt, extra={"n": 1})
    real_note = _checkpoint._write_note

    def clobbered(directory, note):  # what a save sharing the directory would do: clear it and start over
        shutil.rmtree(directory)
        directory.mkdir()
        real_note(directory, note)

    monkeypatch.setattr(_checkpoint, "_write_note", clobbered)
    with pytest.raises(RuntimeError, match=r"temporary directory, was removed or replaced .*; not committing"):
        save(target, model, opt, extra={"n": 2})
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]
    fresh, fresh_opt = _trained()
    assert load(target, fresh, fresh_opt) == {"n": 1}


def test_an_incomplete_temporary_directory_is_not_committed(tmp_path, monkeypatch):
    model, opt = _trained()
    target = tmp_path / "ck"
    save(target, model, opt, extra={"n": 1})
    real_note = _checkpoint._write_note

    def lose_a_shard(directory, note):
        for f in directory.glob("*.distcp"):
            f.unlink()
        real_note(directory, note)

    monkeypatch.setattr(_checkpoint, "_write_note", lose_a_shard)
    with pytest.raises(
        RuntimeError, match=r"lacks \['__0_0.distcp'\] \(or holds fewer bytes than its metadata names\); not committing"
    ):
        save(target, model, opt, extra={"n": 2})
    monkeypatch.undo()
    fresh, fresh_opt = _trained()
    assert load(target, fresh, fresh_opt) == {"n": 1}


@pytest.mark.parametrize("exchange", [True, False])
def test_a_failing_cleanup_after_the_commit_is_not_a_failed_save(tmp_path, monkeypatch, exchange):
    if not exchange:
        monkeypatch.setattr(_atomic, "exchange", lambda a, b: False)
    model, opt = _trained()
    target = tmp_path / "ck"
    save(target, model, opt, extra={"n": 1})
    real_rmtree = shutil.rmtree

    def stubborn(path, ignore_errors=False, **kwargs):  # removing the previous checkpoint fails
        if os.path.exists(os.path.join(path, _checkpoint._NOTE)) and "optimshift-" in os.fspath(path):
            if ignore_errors:
                return None
            raise PermissionError(13, "Permission denied", os.fspath(path))
        return real_rmtree(path, ignore_errors=ignore_errors, **kwargs)

    monkeypatch.setattr(_checkpoint.shutil, "rmtree", stubborn)
    save(target, model, opt, extra={"n": 2})  # committed: no error
    monkeypatch.undo()
    fresh, fresh_opt = _trained()
    assert load(target, fresh, fresh_opt) == {"n": 2}


def test_a_stale_previous_checkpoint_is_removed_after_a_commit(tmp_path):
    """A crash between the two renames of a non-atomic commit leaves <path>.optimshift-old; once a later save
    commits, it must go, or deleting <path> would bring it back."""
    model, opt = _trained()
    target = tmp_path / "ck"
    save(target, model, opt, extra={"n": 1})
    os.rename(target, tmp_path / "ck.optimshift-old")  # the crash
    save(target, model, opt, extra={"n": 2})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]
    shutil.rmtree(target)
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        load(target, model, opt)


def test_the_stale_previous_checkpoints_removal_is_made_durable(tmp_path, monkeypatch):
    """Its removal is fsynced in the folder: else a power loss after the save brings it back, and deleting <path>
    then loads it."""
    model, opt = _trained()
    target = tmp_path / "ck"
    save(target, model, opt, extra={"n": 1})
    os.rename(target, tmp_path / "ck.optimshift-old")  # the crash
    folder = os.stat(tmp_path)
    events = []
    real_fsync, real_rmtree = os.fsync, shutil.rmtree

    def fsync(fd):
        if os.path.samestat(os.fstat(fd), folder):
            events.append("fsync")
        return real_fsync(fd)

    def rmtree(path, *args, **kwargs):
        if os.path.basename(path) == "ck.optimshift-old" and os.path.exists(path):
            events.append("removed")
        return real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(shutil, "rmtree", rmtree)
    save(target, model, opt, extra={"n": 2})
    assert "removed" in events and events[-1] == "fsync", events


# --- 4: gradients -----------------------------------------------------------------------------------------


def test_a_failed_save_leaves_no_zero_gradients(tmp_path):
    model = _two_layers()
    opt = torch.optim.SparseAdam(list(model.parameters()))  # DCP's initialization step raises for it
    with pytest.raises(RuntimeError, match="SparseAdam does not support dense gradients"):
        save(tmp_path / "ck", model, opt)
    assert all(p.grad is None for p in model.parameters()) and len(opt.state) == 0
    assert list(tmp_path.iterdir()) == []


def test_a_failed_load_leaves_no_zero_gradients(tmp_path):
    model = _two_layers()
    opt = torch.optim.SparseAdam(list(model.parameters()))
    dense = _two_layers()
    dense_opt = torch.optim.Adam(dense.parameters())
    _step(dense, dense_opt)
    save(tmp_path / "ck", dense, dense_opt)
    with pytest.raises(RuntimeError, match="SparseAdam does not support dense gradients"):
        load(tmp_path / "ck", model, opt)
    assert all(p.grad is None for p in model.parameters()) and len(opt.state) == 0


def test_a_model_with_nested_extra_state_round_trips(tmp_path):
    """get_extra_state returning a dict is flattened by DCP into nested entries: still a loadable checkpoint."""

    class WithExtra(torch.nn.Linear):
        def get_extra_state(self):
            return {"calls": 3, "scale": torch.full((2,), 2.0)}

        def set_extra_state(self, state):
            self.restored = state

    torch.manual_seed(0)
    model = WithExtra(3, 3)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 3)).sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    save(tmp_path / "ck", model, opt)
    other = WithExtra(3, 3)
    other_opt = torch.optim.Adam(other.parameters())
    load(tmp_path / "ck", other, other_opt)
    assert torch.equal(other.weight, model.weight)
    assert other.restored["calls"] == 3 and torch.equal(other.restored["scale"], torch.full((2,), 2.0))


def test_save_and_load_do_not_fire_the_users_global_step_hooks(tmp_path):
    """DCP creates a stateless optimizer's state with one zero-lr step; a user's step counter must not see it."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    model = nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters())
    fired = []
    handle = register_optimizer_step_post_hook(lambda o, args, kwargs: fired.append(1))
    try:
        save(tmp_path / "ck", model, opt)  # never stepped: DCP initialises its state
        load(tmp_path / "ck", model, torch.optim.Adam(model.parameters()))
    finally:
        handle.remove()
    assert fired == []
