"""load_state_dict with optimizer-wide state keys, and through Lightning's optimizer wrapper."""

import torch

import optimshift


def _madgrad_like(device):
    p = torch.nn.Parameter(torch.randn(4, 3, device=device))
    opt = torch.optim.SGD([p], lr=0.1, momentum=0.9)
    p.grad = torch.ones_like(p)
    opt.step()
    opt.state["k"] = torch.tensor([3])  # optimizer-wide, kept on the host (a registered policy says so)
    opt.state["ema"] = {"loss": torch.ones(2, device=device), "n": 5}
    return p, opt


def test_optimizer_wide_keys_load_like_pytorch_and_are_placed(sim):
    from torch.optim import SGD

    def host_k(key, value, param, group, device):
        return torch.device("cpu") if param is None and key == "k" else None

    class Madgradish(SGD):
        pass

    optimshift.register_policy(Madgradish, host_k)
    try:
        p, src = _madgrad_like("cpu")
        sd = src.state_dict()
        q = torch.nn.Parameter(torch.zeros(4, 3, device=sim))
        opt = Madgradish([q], lr=0.1, momentum=0.9)
        optimshift.load_state_dict(opt, sd)
        assert torch.equal(opt.state["k"], torch.tensor([3])) and opt.state["k"].device.type == "cpu"
        assert opt.state["ema"]["loss"].device == sim and opt.state["ema"]["n"] == 5
        assert opt.state["ema"] is not sd["state"]["ema"], "copy=True never aliases the caller's containers"
        assert opt.state[q]["momentum_buffer"].device == sim
        assert optimshift.check(opt).ok
    finally:
        optimshift.unregister_policy(Madgradish)


def test_an_error_about_an_optimizer_wide_entry_names_it_so_not_as_a_param_group_key(monkeypatch):
    import pytest

    class Madgradish(torch.optim.SGD):
        pass

    _, src = _madgrad_like("cpu")
    sd = src.state_dict()
    sd["state"]["ema"]["hist"] = [torch.zeros(2), torch.zeros(3, device="meta")]
    opt = Madgradish([torch.nn.Parameter(torch.zeros(4, 3))], lr=0.1, momentum=0.9)
    with pytest.raises(ValueError, match=r"load_state_dict: optimizer-wide entry 'ema'\['hist'\]\[1\]: a meta"):
        optimshift.load_state_dict(opt, sd)
    del sd["state"]["ema"]["hist"]
    real_clone = torch.Tensor.clone

    def no_room_for_k(t):  # (the copy of state["k"], an int64 tensor, fails)
        if t.dtype == torch.int64:
            raise torch.OutOfMemoryError("out of memory")
        return real_clone(t)

    monkeypatch.setattr(torch.Tensor, "clone", no_room_for_k)
    with pytest.raises(torch.OutOfMemoryError) as e:
        optimshift.load_state_dict(opt, sd)
    assert "Madgradish: load_state_dict: optimizer-wide entry 'k' ((1,), torch.int64)" in e.value.__notes__[0]
    assert opt.state == {}


class _Uncopyable:
    def __deepcopy__(self, memo):
        raise RuntimeError("no copies")


def test_an_uncopyable_optimizer_wide_entry_is_refused_by_name_as_a_per_param_one_is():
    """An optimizer-wide entry that cannot be copied raised the copy's own error (RuntimeError: no copies), naming
    nothing; it is a TypeError naming the entry now, as a per-param entry's is, and the optimizer is unchanged."""
    import pytest

    class Madgradish(torch.optim.SGD):
        pass

    _, src = _madgrad_like("cpu")
    sd = src.state_dict()
    opt = Madgradish([torch.nn.Parameter(torch.zeros(4, 3))], lr=0.1, momentum=0.9)
    sd["state"][0]["odd"] = {"x": _Uncopyable()}
    with pytest.raises(TypeError, match=r"load_state_dict: group 0, param 0, state key 'odd': cannot copy its dict"):
        optimshift.load_state_dict(opt, sd)
    del sd["state"][0]["odd"]
    sd["state"]["ema"]["odd"] = _Uncopyable()
    with pytest.raises(
        TypeError, match=r"^Madgradish: load_state_dict: optimizer-wide entry 'ema': cannot copy its dict "
        r"\(RuntimeError: no copies\)$"
    ):  # fmt: skip
        optimshift.load_state_dict(opt, sd)
    assert opt.state == {}


def test_loads_into_the_optimizer_inside_a_lightning_wrapper():
    from lightning.pytorch.core.optimizer import LightningOptimizer

    p, src = _madgrad_like("cpu")
    del src.state["k"], src.state["ema"]
    sd = src.state_dict()
    inner = torch.optim.SGD([torch.nn.Parameter(torch.zeros(4, 3))], lr=0.1, momentum=0.9)
    wrapper = LightningOptimizer(inner)
    optimshift.load_state_dict(wrapper, sd)
    (state,) = inner.state.values()
    assert torch.equal(state["momentum_buffer"], src.state[p]["momentum_buffer"])
    assert wrapper.state is inner.state


def test_save_through_a_symlink_updates_the_file_it_points_at(tmp_path):
    real = tmp_path / "epoch=3.ckpt"
    link = tmp_path / "last.ckpt"
    optimshift.save({"x": torch.zeros(2)}, real)
    link.symlink_to(real.name)
    optimshift.save({"x": torch.ones(2)}, link)
    assert link.is_symlink(), "the link stays a link"
    assert torch.equal(optimshift.load(real)["x"], torch.ones(2))


def test_convert_dtype_casts_ordered_dict_model_weights_too(tmp_path):
    from optimshift import cli

    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    src, out = tmp_path / "in.pt", tmp_path / "out.pt"
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, src)
    assert cli.main(["convert", str(src), str(out), "--dtype", "bfloat16"]) == 0
    converted = torch.load(out, weights_only=True)
    assert type(converted["model"]) is type(model.state_dict())
    assert {v.dtype for v in converted["model"].values()} == {torch.bfloat16}
    assert converted["optimizer"]["state"][0]["exp_avg"].dtype == torch.bfloat16


def test_save_refuses_to_replace_a_read_only_file(tmp_path):
    import os

    import pytest

    target = tmp_path / "frozen.pt"
    optimshift.save({"x": torch.zeros(1)}, target)
    os.chmod(target, 0o444)
    with pytest.raises(PermissionError, match="read-only"):
        optimshift.save({"x": torch.ones(1)}, target)
    assert torch.equal(optimshift.load(target)["x"], torch.zeros(1))


def test_inspect_lists_optimizer_wide_entries(tmp_path, capsys):
    import json

    from optimshift import cli

    p, opt = _madgrad_like("cpu")
    path = tmp_path / "madgrad.pt"
    torch.save(opt.state_dict(), path)
    assert cli.main(["inspect", str(path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    rows = {row["key"]: row for row in report["optimizers"][0]["state"]}
    assert rows["state['k']"]["dtypes"] == {"int64": 1} and rows["momentum_buffer"]["count"] == 1
    assert "state['ema']" in rows


def test_legacy_files_in_any_pickle_protocol_are_named_as_such(tmp_path):
    import warnings

    from optimshift.checkpoint._files import CheckpointError, _sniff

    old = tmp_path / "legacy2.pt"
    torch.save({"x": torch.ones(2)}, old, _use_new_zipfile_serialization=False)
    assert _sniff(str(old)) == "legacy" and torch.equal(optimshift.load(old)["x"], torch.ones(2))
    proto4 = tmp_path / "legacy4.pt"
    torch.save({"x": torch.ones(2)}, proto4, _use_new_zipfile_serialization=False, pickle_protocol=4)
    assert _sniff(str(proto4)) == "legacy"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            loaded = optimshift.load(proto4)
        except CheckpointError as e:
            assert "legacy-format torch.save file" in str(e) and "pickle.dump" not in str(e)
        else:  # a torch whose weights-only unpickler reads protocol 4
            assert torch.equal(loaded["x"], torch.ones(2))
