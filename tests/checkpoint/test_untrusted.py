"""Untrusted pickles judged without running them (checkpoint/_untrusted.py, through optimshift.load): a global
reached by any opcode (GLOBAL, STACK_GLOBAL, INST, EXT1/2/4) is an UnsafeCheckpointError naming it, or saying
the file cannot be read safely when the opcodes do not name it, never "corrupt" and never a suggestion to allow
it; and objects whose own attributes replace their class's methods are refused as a CheckpointError."""

from __future__ import annotations

import collections
import copyreg
import pickle
import re
import warnings

import pytest
import torch

import optimshift
from _crafted import legacy_file, pickled_zip, rebuilt_tensor_with_state, unicode_op
from optimshift.checkpoint import CheckpointError, UnsafeCheckpointError, _untrusted

P2, P4 = b"\x80\x02", b"\x80\x04"
EXT_CODE = 0x5E  # a code this test registers for os.system (and removes again)


def _exploits(command: bytes) -> dict[str, bytes]:
    """Pickles that call ``os.system(command)``, each importing it another way."""
    arg = unicode_op(command.decode()) + b"\x85R."  # TUPLE1 REDUCE STOP
    return {
        "GLOBAL": P2 + b"cos\nsystem\n" + arg,
        "STACK_GLOBAL": P4 + unicode_op("os") + unicode_op("system") + b"\x93" + arg,
        # the two strings reach STACK_GLOBAL through the memo, after a decoy the stack no longer holds
        "STACK_GLOBAL-memo": P4
        + unicode_op("os")
        + b"\x94"
        + unicode_op("decoy")
        + b"0"
        + unicode_op("system")
        + b"q\x07"
        + b"0h\x00h\x07\x93"
        + arg,
        "INST": P2 + b"(" + unicode_op(command.decode()) + b"ios\nsystem\n.",
        "EXT1": P2 + b"\x82" + bytes([EXT_CODE]) + arg,
        "EXT2": P2 + b"\x83" + EXT_CODE.to_bytes(2, "little") + arg,
        "EXT4": P2 + b"\x84" + EXT_CODE.to_bytes(4, "little") + arg,
    }


@pytest.fixture
def os_system_extension():
    """``os.system`` registered as extension code EXT_CODE, as a hostile environment (or pickle) might have it."""
    copyreg.add_extension("os", "system", EXT_CODE)
    yield
    copyreg.remove_extension("os", "system", EXT_CODE)


def _write(tmp_path, fmt, pkl):
    if fmt == "zip":
        return pickled_zip(tmp_path, "evil.pt", pkl)
    if fmt == "legacy":
        return legacy_file(tmp_path / "evil.pt", pkl)
    (tmp_path / "evil.pt").write_bytes(pkl)  # a bare pickle (pickle.dump)
    return tmp_path / "evil.pt"


def _load_quietly(path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns about pickle protocol 4
        return optimshift.load(path)


def _never_suggests_allowing(message: str) -> None:
    assert "corrupt" not in message, message
    for advice in ("allow-global", "safe_globals", "add_safe_globals", "trust"):
        assert advice not in message, message
    assert "weights_only=False" not in message.replace("do not load it with weights_only=False", "").replace(
        "Do not load it with weights_only=False", ""
    ), message


@pytest.mark.parametrize("fmt", ["zip", "legacy", "pickle"])
@pytest.mark.parametrize("opcode", sorted(_exploits(b"")))
def test_a_global_reached_by_any_opcode_is_named_and_never_runs(tmp_path, fmt, opcode, os_system_extension):
    marker = tmp_path / "ran"
    pkl = _exploits(f"touch {marker}".encode())[opcode]
    # the control: plain pickle really calls os.system with it
    pickle.loads(pkl)
    assert marker.exists(), f"{opcode}: the crafted pickle does not reach os.system"
    marker.unlink()

    path = _write(tmp_path, fmt, pkl)
    with pytest.raises(UnsafeCheckpointError) as info:
        _load_quietly(path)
    message = str(info.value)
    assert not marker.exists(), "os.system ran"
    assert info.value.globals == ["os.system"], message
    assert str(path) in message and "os.system can run code" in message and "nothing was executed" in message
    assert "\n" not in message
    _never_suggests_allowing(message)


@pytest.mark.parametrize("fmt", ["zip", "legacy"])
@pytest.mark.parametrize("opcode", ["EXT1", "EXT2", "EXT4"])
def test_an_extension_code_nothing_registered_cannot_be_read_safely(tmp_path, fmt, opcode):
    marker = tmp_path / "ran"
    path = _write(tmp_path, fmt, _exploits(f"touch {marker}".encode())[opcode])
    with pytest.raises(UnsafeCheckpointError) as info:
        _load_quietly(path)
    message = str(info.value)
    assert not marker.exists()
    assert info.value.globals == []
    assert re.search(rf"cannot be read safely.*\({opcode} extension code {EXT_CODE}\)", message), message
    assert str(path) in message and "nothing was executed" in message
    _never_suggests_allowing(message)


def test_a_global_whose_name_is_computed_at_run_time_cannot_be_read_safely(tmp_path):
    # STACK_GLOBAL's module comes from a call (OrderedDict()), not from a string in the file
    pkl = P4 + b"ccollections\nOrderedDict\n)R" + unicode_op("system") + b"\x93" + unicode_op("x") + b"\x85R."
    path = pickled_zip(tmp_path, "computed.pt", pkl)
    with pytest.raises(UnsafeCheckpointError, match=r"cannot be read safely.*\(STACK_GLOBAL at byte \d+\)") as info:
        _load_quietly(path)
    assert info.value.globals == []
    _never_suggests_allowing(str(info.value))


def test_a_class_named_through_stack_global_is_unsafe_without_an_allow_hint(tmp_path):
    # a config object of a protocol-4 file: allowing it would not help, weights-only reads no STACK_GLOBAL
    pkl = P4 + unicode_op("argparse") + unicode_op("Namespace") + b"\x93)\x81."
    path = pickled_zip(tmp_path, "config.pt", pkl)
    with pytest.raises(UnsafeCheckpointError, match=r"names argparse\.Namespace through STACK_GLOBAL") as info:
        _load_quietly(path)
    assert info.value.globals == ["argparse.Namespace"]
    assert "allow-global" not in str(info.value) and "default pickle protocol" in str(info.value)


@pytest.mark.parametrize("zipped", [True, False])
def test_a_protocol_4_file_naming_only_allowed_globals_is_not_unsafe(tmp_path, zipped):
    path = tmp_path / "p4.pt"
    torch.save({"x": torch.ones(2), "o": collections.OrderedDict(a=1)}, path, pickle_protocol=4,
               _use_new_zipfile_serialization=zipped)  # fmt: skip
    found = _untrusted.scan(str(path), "zip" if zipped else "legacy")
    assert found.protocol == 4 and _untrusted.refused(found) == []
    assert {"torch._utils._rebuild_tensor_v2", "collections.OrderedDict"} <= {g.name for g in found.globals}
    with pytest.raises(CheckpointError) as info:
        _load_quietly(path)
    assert type(info.value) is CheckpointError and "pickle protocol 4" in str(info.value)
    assert "corrupt" not in str(info.value)


def test_scan_follows_the_stack_and_the_memo():
    import io

    def names(pkl):
        path = io.BytesIO(pkl)
        found: list = []
        _untrusted._scan_one(path, found)
        return [(g.opcode, g.name) for g in found]

    # TUPLE, POP and a MARK between the two strings leave os and system on the stack
    pkl = P4 + unicode_op("os") + b"(" + unicode_op("a") + unicode_op("b") + b"t0" + unicode_op("system") + b"\x93."
    assert names(pkl) == [("STACK_GLOBAL", "os.system")]
    # MEMOIZE numbers entries as the unpickler does; DUP copies the top
    pkl = P4 + unicode_op("posix") + b"\x94" + unicode_op("x") + b"\x94" + b"0h\x00" + unicode_op("system") + b"\x93."
    assert names(pkl) == [("STACK_GLOBAL", "posix.system")]
    assert names(P4 + unicode_op("system") + b"2" + b"\x93.") == [("STACK_GLOBAL", "system.system")]
    # protocol-2 names as Python 3 imports them
    assert names(P2 + b"c__builtin__\neval\n.") == [("GLOBAL", "builtins.eval")]
    # what parsed before a malformed opcode still counts: an unpickler would have run it
    assert names(P2 + b"cos\nsystem\n\xff") == [("GLOBAL", "os.system")]


# --- objects that replace their own methods (issue 17 item 9) ------------------------------------------------------


def _ordered_dict_with(attrs: bytes) -> bytes:
    """A data.pkl holding an OrderedDict whose BUILD state (its ``__dict__``) is the pickled dict ``attrs``."""
    return P2 + b"ccollections\nOrderedDict\n)R" + attrs + b"b."


HOSTILE = {
    # torch.save of the converted object would call OrderedDict(2): "TypeError: 'int' object is not iterable"
    "tensor-reduce_ex-class": rebuilt_tensor_with_state(
        b"}" + unicode_op("__reduce_ex__") + b"ccollections\nOrderedDict\ns"
    ),
    "tensor-reduce_ex-int": rebuilt_tensor_with_state(b"}" + unicode_op("__reduce_ex__") + b"K\x01s"),
    "tensor-to": rebuilt_tensor_with_state(b"}" + unicode_op("to") + b"K\x01s"),
    "ordered-dict-get": _ordered_dict_with(b"}" + unicode_op("get") + b"ccollections\nOrderedDict\ns"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_an_object_that_replaces_its_own_method_is_refused(tmp_path, case):
    path = pickled_zip(tmp_path, f"{case}.pt", HOSTILE[case])
    attribute = {"tensor-to": "'to'", "ordered-dict-get": "'get'"}.get(case, "'__reduce_ex__'")
    with pytest.raises(CheckpointError, match=rf"{re.escape(str(path))} is corrupt or hostile: its pickle sets "
                       rf"{attribute} on the (Tensor|OrderedDict) at ") as info:  # fmt: skip
        optimshift.load(path)
    assert type(info.value) is CheckpointError and "\n" not in str(info.value)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], momentum=0.9)
    with pytest.raises(CheckpointError, match="corrupt or hostile"):
        optimshift.load_state_dict(opt, path)


def test_attributes_a_checkpoint_legitimately_has_still_load(tmp_path):
    model = torch.nn.Linear(2, 2)
    tagged = torch.nn.Parameter(torch.ones(3))
    tagged.shard_info = {"dim": 0}  # what sharding libraries hang on params
    plain = torch.arange(4.0)
    plain.note = "kept"
    path = tmp_path / "ok.pt"
    torch.save({"model": model.state_dict(), "p": tagged, "t": plain}, path)
    loaded = optimshift.load(path)
    assert loaded["model"]._metadata == model.state_dict()._metadata  # an OrderedDict attribute
    assert loaded["p"].shard_info == {"dim": 0} and loaded["t"].note == "kept"


def test_shadowed_attribute_names_where_it_is():
    t = torch.zeros(1)
    t.__dict__["clone"] = 5
    assert _untrusted.shadowed_attribute({"a": [1, {"b": (t,)}]}) == (
        "sets 'clone' on the Tensor at ['a'][1]['b'][0], in place of its class's own"
    )
    cyclic: list = []
    cyclic.append(cyclic)
    assert _untrusted.shadowed_attribute(cyclic) is None
    grad_holder = torch.zeros(1)
    grad_holder.grad = t
    assert "at .grad" in _untrusted.shadowed_attribute(grad_holder)
