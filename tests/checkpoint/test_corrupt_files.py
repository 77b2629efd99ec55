"""Every unreadable file ends in CheckpointError (or UnsafeCheckpointError, only for a global that is not
allowed): short and missing data records under mmap, malformed pickles, broken zips, refused globals whose
message must never suggest allowing code, and a corpus of single-bit flips of a real checkpoint."""

from __future__ import annotations

import collections
import json
import os
import random
import struct
import sys
import warnings
import zipfile

import pytest
import torch

import optimshift
from _crafted import rewrite_zip
from _matrix import bitwise_equal
from optimshift.checkpoint import CheckpointError, UnsafeCheckpointError
from optimshift.checkpoint._files import find_optimizer_states, runs_code
from optimshift.checkpoint._inspection import describe

O = torch.optim


def _pickled_zip(tmp_path, name, pkl):
    """A torch.save zip file whose data.pkl is ``pkl``."""
    base = tmp_path / "base.pt"
    optimshift.save({}, base)  # written through a file object: its records sit under archive/
    rewrite_zip(base, tmp_path / name, pkl=pkl)
    return tmp_path / name


# --- item 3: a storage must match its record, with mmap too -------------------------------------------------


@pytest.mark.parametrize("mmap", [True, False])
@pytest.mark.parametrize(
    "case, change, drop, match",
    [
        (
            "short",
            {"/data/0": lambda d: d[:8]},
            (),
            r"record archive/data/0 holds 8 bytes but its pickle asks for "
            r"a storage of 256 bytes",
        ),
        ("long", {"/data/0": lambda d: d + bytes(64)}, (), r"record archive/data/0 holds 320 bytes"),
        ("short-last", {"/data/1": lambda d: d[:4]}, (), r"record archive/data/1 holds 4 bytes"),
        ("missing", {}, ("/data/1",), r"data/1"),
    ],
)
def test_a_data_record_of_the_wrong_size_is_refused(tmp_path, mmap, case, change, drop, match):
    good = tmp_path / "good.pt"
    optimshift.save({"a": torch.arange(64.0), "b": torch.ones(8)}, good)
    bad = tmp_path / f"{case}.pt"
    rewrite_zip(good, bad, change, drop)
    with pytest.raises(CheckpointError, match=match if mmap else "corrupt"):
        optimshift.load(bad, mmap=mmap)


def test_records_shared_by_views_and_empty_storages_still_load(tmp_path):
    base = torch.arange(12.0)
    obj = {
        "whole": base,
        "view": base[3:7],
        "empty": torch.empty(0),
        "nested": [torch.zeros(2, 3, dtype=torch.bfloat16), {"u8": torch.arange(5, dtype=torch.uint8)}],
    }
    path = tmp_path / "ok.pt"
    optimshift.save(obj, path)
    loaded = optimshift.load(path)
    assert bitwise_equal(loaded, obj)
    assert loaded["view"].untyped_storage().data_ptr() == loaded["whole"].untyped_storage().data_ptr()


# --- item 4: malformed pickles and broken zips are CheckpointErrors ------------------------------------------

P2 = b"\x80\x02"
MALFORMED = {
    # what each raised before: the error contract was broken by all of these
    "pop-from-empty-stack": P2 + b"a.",  # IndexError
    "memo-miss": P2 + b"h\x05.",  # KeyError
    "bad-utf8": P2 + b"X\x02\x00\x00\x00\xff\xfe.",  # UnicodeDecodeError
    "short-int": P2 + b"J\x01",  # struct.error
    "unhashable-key": P2 + b"}}}s.",  # TypeError
    "persistent-id-int": P2 + b"K\x05Q.",  # AssertionError
    "persistent-id-short": P2 + b"(X\x07\x00\x00\x00storageK\x01K\x02tQ.",  # ValueError
    "persistent-id-str-type": P2 + b"(X\x07\x00\x00\x00storageX\x01\x00\x00\x00xX\x01\x00\x00\x000"
    b"X\x03\x00\x00\x00cpuK\x01tQ.",  # AttributeError
    "bad-opcode": P2 + b"\xff.",  # an UnsafeCheckpointError that suggested --allow-global
    "truncated-stream": P2 + b"}q\x00(X\x01\x00\x00\x00a",  # EOFError
    "empty-pickle": b"",
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_a_malformed_pickle_is_a_checkpoint_error(tmp_path, case):
    path = _pickled_zip(tmp_path, f"{case}.pt", MALFORMED[case])
    with pytest.raises(CheckpointError) as info:
        optimshift.load(path)
    assert type(info.value) is CheckpointError, "a corrupt opcode stream is not an attack"
    message = str(info.value)
    assert str(path) in message and "\n" not in message and "allow-global" not in message


def test_broken_zips_are_checkpoint_errors(tmp_path):
    good = tmp_path / "good.pt"
    optimshift.save({"a": torch.arange(64.0)}, good)
    data = good.read_bytes()
    end = data.rindex(b"PK\x05\x06")
    directory = struct.unpack("<I", data[end + 16 : end + 20])[0]
    cases = {
        "no-data-pkl": None,
        "garbled-directory": data[:directory] + bytes(46) + data[directory + 46 :],
        "only-the-end-record": b"PK\x03\x04" + bytes(60) + data[end:],
    }
    rewrite_zip(good, tmp_path / "no-data-pkl.pt", drop=("/data.pkl",))
    for name, content in cases.items():
        path = tmp_path / f"{name}.pt"
        if content is not None:
            path.write_bytes(content)
        with pytest.raises(CheckpointError) as info:
            optimshift.load(path)
            pytest.fail(f"{name} loaded")
        assert type(info.value) is CheckpointError, name


# --- item 4: refused globals -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "module, name",
    [
        ("os", "system"),
        ("posix", "system"),
        ("nt", "system"),
        ("subprocess", "Popen"),
        ("builtins", "eval"),
        ("builtins", "exec"),
        ("builtins", "getattr"),
        ("__builtin__", "eval"),
        ("importlib", "import_module"),
        ("runpy", "run_path"),
        ("shutil", "rmtree"),
    ],
)
def test_a_global_that_runs_code_is_refused_without_suggesting_to_allow_it(tmp_path, module, name):
    pkl = P2 + f"c{module}\n{name}\nX\x04\x00\x00\x00true\x85R.".encode()
    path = _pickled_zip(tmp_path, "evil.pt", pkl)
    with pytest.raises(UnsafeCheckpointError) as info:
        optimshift.load(path)
    message = str(info.value)
    assert name in message and "nothing was executed" in message and "can run code" in message
    for advice in ("allow-global", "safe_globals", "add_safe_globals", "trust"):
        assert advice not in message, f"{module}.{name}: the message must not suggest allowing it"
    assert info.value.globals and name in info.value.globals[0]


def test_a_global_nothing_provides_is_refused_as_corrupt_not_suggested(tmp_path):
    # A bit flip turned torch._utils into uorch._utils: allowing it would not help.
    pkl = P2 + b"cuorch._utils\n_rebuild_tensor_v2\n)R."
    path = _pickled_zip(tmp_path, "flipped.pt", pkl)
    with pytest.raises(
        UnsafeCheckpointError,
        match="no installed package provides uorch._utils._rebuild_tensor_v2: the file is corrupt",
    ) as info:
        optimshift.load(path)
    assert "allow-global" not in str(info.value)


# --- the bit-flip corpus ---------------------------------------------------------------------------------------


def _data_start(path, name):
    with zipfile.ZipFile(path) as z:
        info = z.getinfo(name)
    with open(path, "rb") as f:
        f.seek(info.header_offset)
        header = f.read(30)
    n, m = struct.unpack("<HH", header[26:30])
    return info.header_offset + 30 + n + m, info.file_size


def _snapshot(opt):
    state = {
        i: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in st.items()}
        for i, st in enumerate(opt.state.values())
    }
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    return id(opt.state), [id(st) for st in opt.state.values()], state, groups


def _unchanged(opt, snap):
    ident, ids, state, groups = snap
    now = _snapshot(opt)
    return ident == now[0] and ids == now[1] and bitwise_equal(state, now[2]) and groups == now[3]


def _target():
    params = [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(3))]
    opt = O.Adam(params, lr=0.01, foreach=False)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    return opt


def test_single_bit_flips_of_a_real_checkpoint(tmp_path):
    """Every single-bit flip of the first 300 bytes of data.pkl, and of a sample of bytes in each data record:
    each is a documented error with the optimizer unchanged, or a load whose state is the file's, bit for bit."""
    source = _target()
    good = tmp_path / "good.pt"
    optimshift.save({"epoch": 3, "optimizer": source}, good)
    data = good.read_bytes()
    with zipfile.ZipFile(good) as z:
        names = z.namelist()
    pkl = next(n for n in names if n.endswith("/data.pkl"))
    start, size = _data_start(good, pkl)
    positions = list(range(start, start + min(size, 300)))
    rng = random.Random(7)
    for record in sorted(n for n in names if "/data/" in n):
        rstart, rsize = _data_start(good, record)
        positions += rng.sample(range(rstart, rstart + rsize), min(rsize, 12))

    counts: collections.Counter = collections.Counter()
    unexpected = []
    target, snap = _target(), None
    snap = _snapshot(target)
    path, scratch = tmp_path / "flipped.pt", tmp_path / "scratch.pt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for pos in positions:
            for bit in range(8):
                flipped = bytearray(data)
                flipped[pos] ^= 1 << bit
                scratch.write_bytes(flipped)
                os.replace(scratch, path)  # a new file each time: earlier mmaps keep the old one
                case = f"byte {pos} bit {bit}"
                try:
                    optimshift.load_state_dict(target, path)
                except UnsafeCheckpointError as e:
                    counts["UnsafeCheckpointError"] += 1
                    assert "allow-global" not in str(e) or not any(runs_code(g) for g in e.globals), case
                except CheckpointError:
                    counts["CheckpointError"] += 1
                except (ValueError, TypeError) as e:
                    counts[f"load_state_dict {type(e).__name__}"] += 1
                    assert "load_state_dict" in str(e) and str(path) in str(e), (case, e)
                except Exception as e:  # noqa: BLE001 - the contract: nothing else
                    unexpected.append(f"{case}: {type(e).__name__}: {e}")
                    continue
                else:
                    counts["loaded"] += 1
                    (found,) = find_optimizer_states(torch.load(path, "cpu", weights_only=True, mmap=False))
                    reference = found.state_dict
                    loaded = target.state_dict()
                    assert bitwise_equal(loaded["state"], reference["state"]), case
                    desc = describe(optimshift.load(path), {}, path=str(path))
                    json.dumps(desc, default=str)
                    target = _target()
                    snap = _snapshot(target)
                    continue
                if not _unchanged(target, snap):
                    unexpected.append(f"{case}: the optimizer changed although the load failed")
                    target = _target()
                    snap = _snapshot(target)
    total = sum(counts.values()) + len(unexpected)
    print(f"bit-flip corpus: {total} cases over {len(positions)} bytes: {dict(counts)}", file=sys.stderr)
    assert not unexpected, "\n".join(unexpected[:20])
    assert counts["loaded"] and counts["CheckpointError"] and total == 8 * len(positions)


@pytest.mark.parametrize("items", [1, 3])
def test_a_deque_in_the_state_is_named_not_called_corrupt(tmp_path, items):
    """optimshift.save writes a deque kept in state (it keeps its type); weights-only loading cannot rebuild one
    (it appends only to lists), and load called the sound file corrupt; with two or more items (AdaShift's grads)
    the pickle extends instead of appending, which it still called corrupt."""
    import collections

    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([p], lr=0.1)
    opt.state[p]["history"] = collections.deque([torch.ones(2)] * items, maxlen=4)
    path = tmp_path / "opt.pt"
    optimshift.save(opt, path)
    with torch.serialization.safe_globals([collections.deque]):
        with pytest.raises(optimshift.CheckpointError, match=r"holds a collections\.deque .* cannot rebuild") as caught:
            optimshift.load(path)
    assert "corrupt" not in str(caught.value)


def test_running_out_of_memory_while_loading_is_not_called_corrupt(tmp_path, monkeypatch):
    """torch's out of memory on the host is a RuntimeError, which load called a truncated or corrupt file: a user
    could throw away a sound checkpoint. It is raised as it is, naming the file."""
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([p], lr=0.1)
    path = tmp_path / "opt.pt"
    optimshift.save(opt, path)

    asked = [16]

    def out_of_memory(*args, **kwargs):
        raise RuntimeError(f"DefaultCPUAllocator: can't allocate memory: you tried to allocate {asked[0]} bytes")

    monkeypatch.setattr(torch, "load", out_of_memory)
    with pytest.raises(RuntimeError, match="can't allocate memory") as caught:
        optimshift.load(path)
    assert not isinstance(caught.value, optimshift.CheckpointError)
    assert "out of memory while loading" in "".join(getattr(caught.value, "__notes__", []))
    asked[0] = 2**50  # (a storage the file declares larger than itself: the file is damaged)
    with pytest.raises(optimshift.CheckpointError, match="corrupt"):
        optimshift.load(path)
