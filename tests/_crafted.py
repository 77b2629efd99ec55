"""Crafting checkpoint files torch.save cannot write: records cut short or dropped, a data.pkl of our own, and
containers nested thousands of levels deep (torch.save's pickler stops at the recursion limit)."""

from __future__ import annotations

import pickle
import zipfile

import torch
import torch.serialization as ser


def rewrite_zip(src, dst, change=None, drop=(), pkl=None):
    """Copy the torch.save zip ``src`` to ``dst`` record by record: ``change`` maps a name suffix to a function
    of the record's bytes, ``drop`` lists suffixes to leave out, ``pkl`` replaces data.pkl."""
    change = dict(change or {})
    if pkl is not None:
        change["/data.pkl"] = lambda _: pkl
    with zipfile.ZipFile(src) as zin:
        records = [
            (i.filename, zin.read(i.filename)) for i in zin.infolist() if not any(i.filename.endswith(s) for s in drop)
        ]
    with zipfile.ZipFile(dst, "w", zipfile.ZIP_STORED) as zout:
        for name, data in records:
            for suffix, fn in change.items():
                if name.endswith(suffix):
                    data = fn(data)
            zout.writestr(name, data)


def nest_in_place(path, marker: str, levels: int) -> None:
    """Replace the string ``marker`` (saved once in the torch.save file ``path``) by a list nested ``levels``
    deep: ``levels`` EMPTY_LISTs, then APPENDs folding each into the one below."""
    raw = marker.encode()
    opcode = b"X" + len(raw).to_bytes(4, "little") + raw  # BINUNICODE, as torch.save's protocol 2 writes it
    nested = pickle.EMPTY_LIST * levels + pickle.APPEND * (levels - 1)

    def replace(data):
        assert data.count(opcode) == 1, f"{marker!r} must occur once in data.pkl"
        return data.replace(opcode, nested)

    rewrite_zip(path, path, {"/data.pkl": replace})


def trained(cls, n=3, **kwargs):
    """An optimizer of ``cls`` over ``n`` host params of shape (4, 3), after one step (its state exists even
    where the step itself cannot run on a CPU, as capturable's)."""
    params = [torch.nn.Parameter(torch.randn(4, 3)) for _ in range(n)]
    opt = cls(params, **kwargs)
    for p in params:
        p.grad = torch.randn_like(p)
    try:
        opt.step()
    except (RuntimeError, AssertionError):
        pass  # capturable on a CPU: the state exists, the step itself cannot run here
    return opt


def save_tagged(obj, path, tag="cuda:0"):
    """torch.save, recording every storage as saved on ``tag`` (a GPU checkpoint made on a CPU machine)."""
    real = ser.location_tag
    ser.location_tag = lambda storage: tag
    try:
        torch.save(obj, path)
    finally:
        ser.location_tag = real


# --- pickles of our own -------------------------------------------------------------------------------------------


def unicode_op(text: str) -> bytes:
    """BINUNICODE ``text``: a string pushed on the unpickler's stack."""
    raw = text.encode()
    return b"X" + len(raw).to_bytes(4, "little") + raw


def pickled_zip(folder, name, pkl):
    """A torch.save zip file ``folder / name`` whose data.pkl is ``pkl`` (its records: one of 8 bytes,
    ``archive/data/0``, a 2-float storage)."""
    base = folder / f".base-{name}"
    torch.save({"t": torch.zeros(2)}, base)
    rewrite_zip(base, folder / name, pkl=pkl)
    base.unlink()
    return folder / name


def legacy_file(path, pkl):
    """A legacy-format torch.save file (``_use_new_zipfile_serialization=False``) whose object pickle is ``pkl``:
    the magic number, protocol and system-info pickles torch writes first, ``pkl``, then an empty list of
    storage keys."""
    import io

    out = io.BytesIO()
    pickle.dump(0x1950A86A20F9469CFC6C, out, protocol=2)
    pickle.dump(1001, out, protocol=2)
    pickle.dump(
        {"protocol_version": 1001, "little_endian": True, "type_sizes": {"short": 2, "int": 4, "long": 4}},
        out,
        protocol=2,
    )
    out.write(pkl)
    pickle.dump([], out, protocol=2)
    path.write_bytes(out.getvalue())
    return path


def rebuilt_tensor_with_state(state: bytes) -> bytes:
    """A data.pkl (for :func:`pickled_zip`) holding ``{"t": tensor}``, the tensor built by
    ``torch._tensor._rebuild_from_type_v2`` (how torch.save writes a tensor with attributes) with the pickled
    dict ``state`` as its attributes."""
    pid = b"(" + unicode_op("storage") + b"ctorch\nFloatStorage\n" + unicode_op("0") + unicode_op("cpu") + b"K\x02tQ"
    # _rebuild_tensor_v2's arguments: storage, offset 0, size (2,), stride (1,), requires_grad False, hooks
    args = b"(" + pid + b"K\x00K\x02\x85K\x01\x85\x89ccollections\nOrderedDict\n)Rt"
    rebuild = b"ctorch._tensor\n_rebuild_from_type_v2\n(ctorch._utils\n_rebuild_tensor_v2\nctorch\nTensor\n"
    return b"\x80\x02}" + unicode_op("t") + rebuild + args + state + b"tRs."
