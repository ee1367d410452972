"""The checkpoint reader never runs code (issue 15 item 1): gadget pickles against the one reader
every entry point uses (durable/safe_load.py: resume auto, --resume PATH, export, generate; the
e2e tests send a sample of these through each entry point).

Each payload would create a sentinel file if anything in it ran; each must be refused with a
UserError (one line) and the file must not exist. Payloads: os.system by __reduce__ under pickle
protocols 0-5 (GLOBAL and STACK_GLOBAL), nested inside allowed containers and DCP classes,
builtins.eval / exec, getattr chains, dotted STACK_GLOBAL names through allowed modules, torch's
tensor rebuilders, INST / OBJ opcodes, extension codes and persistent ids; the non-tensor values
(`torch.load(weights_only=True)`) get torch.save'd gadgets. Real DCP metadata still loads.
"""
from __future__ import annotations

import collections
import copyreg
import io
import os
import pickle
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.metadata import Metadata

from shardtune.errors import UserError
from shardtune.train.durable.ckpt_files import check_metadata_pickle
from shardtune.train.durable.safe_load import SafeLoadPlanner, read_dcp_metadata


def _cmd(marker: Path) -> str:
    return f"touch {marker}"


class _System:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (_cmd(self.marker),))


class _Eval:
    def __init__(self, marker, fn=eval):
        self.marker, self.fn = marker, fn

    def __reduce__(self):
        return (self.fn, (f"__import__('os').system({_cmd(self.marker)!r})",))


def _global(module: str, name: str, proto: int, arg: str) -> bytes:
    """A pickle that looks up module.name (GLOBAL below protocol 4, STACK_GLOBAL from 4: dotted
    names resolved through attributes) and calls it with one string argument."""
    if proto < 4:
        return b"c" + module.encode() + b"\n" + name.encode() + b"\n(V" + arg.encode() + b"\ntR."
    enc = lambda s: pickle.SHORT_BINUNICODE + bytes([len(s.encode())]) + s.encode()  # noqa: E731
    return (pickle.PROTO + bytes([proto]) + enc(module) + enc(name) + pickle.STACK_GLOBAL
            + pickle.MARK + enc(arg) + pickle.TUPLE + pickle.REDUCE + pickle.STOP)


def _payloads(marker: Path) -> dict[str, bytes]:
    cmd = _cmd(marker)
    out = {f"os.system, protocol {p}": pickle.dumps(_System(marker), protocol=p) for p in range(6)}
    out |= {f"eval, protocol {p}": pickle.dumps(_Eval(marker), protocol=p) for p in (0, 2, 5)}
    out["exec"] = pickle.dumps(_Eval(marker, exec))
    out["nested in an OrderedDict"] = pickle.dumps(collections.OrderedDict(a=[{"b": (_System(marker),)}]))
    out["nested in a set"] = pickle.dumps({frozenset([_Eval(marker)])}, protocol=2)
    out["nested in DCP metadata"] = pickle.dumps(Metadata(state_dict_metadata={}, planner_data=_System(marker)))
    # getattr(__import__('os'), 'system')(cmd), protocol 0 by hand
    out["getattr chain"] = (b"c__builtin__\ngetattr\n(c__builtin__\n__import__\n(Vos\ntRVsystem\ntR(V"
                            + cmd.encode() + b"\ntR.")
    for module, name in [("posix", "system"), ("os", "system"), ("builtins", "eval"), ("subprocess", "getoutput"),
                         ("torch.distributed.checkpoint.metadata", "torch.Size.__class__"),  # dotted names
                         ("torch.distributed.checkpoint.metadata", "dataclasses.sys.modules"),
                         ("torch.distributed.checkpoint.filesystem", "os.system"),
                         ("torch.distributed.checkpoint.metadata", "Metadata.__init__.__globals__"),
                         ("torch", "_utils._rebuild_tensor_v2"), ("torch", "load"),  # torch's own callables
                         ("torch._utils", "_rebuild_tensor_v2"), ("torch._utils", "_rebuild_from_type_v2"),
                         ("torch._tensor", "_rebuild_from_type_v2"), ("torch.serialization", "load"),
                         ("collections", "OrderedDict.fromkeys.__self__"), ("pathlib", "Path.write_text"),
                         ("torch.distributed.checkpoint.filesystem", "FileSystemReader")]:
        arg = f"__import__('os').system({cmd!r})" if name.endswith("eval") else cmd
        for proto in (0, 4):
            out[f"by hand: {module} {name}, protocol {proto}"] = _global(module, name, proto, arg)
    out["INST opcode"] = b"(V" + cmd.encode() + b"\nios\nsystem\n."
    out["OBJ opcode"] = b"(cos\nsystem\nV" + cmd.encode() + b"\no."
    out["persistent id"] = pickle.PROTO + bytes([2]) + pickle.BINPERSID.join([b"X\x01\x00\x00\x00a", b""]) + b"."
    out["truncated"] = pickle.dumps(_System(marker))[:10]
    out["garbage"] = b"\x00\xffnot a pickle"
    out["a plain list"] = pickle.dumps([1, 2, 3])  # loads, but is no Metadata
    return out


@pytest.fixture(scope="module")
def marker(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("sentinel") / "pwned"


@pytest.mark.parametrize("reader", [read_dcp_metadata, check_metadata_pickle], ids=["reader", "launcher"])
@pytest.mark.parametrize("label", list(_payloads(Path("/x"))))
def test_gadget_metadata_is_refused_and_never_runs(label, reader, marker, tmp_path):
    """Both the ranks' reader and the launcher's torch-free dry run refuse every payload."""
    payload = _payloads(marker)[label]
    (tmp_path / ".metadata").write_bytes(payload)
    with pytest.raises(UserError) as e:
        reader(tmp_path / ".metadata")
    assert "\n" not in str(e.value) and ("refusing" in str(e.value) or "not a readable" in str(e.value))
    assert not marker.exists(), label


def test_an_extension_code_is_refused(marker, tmp_path):
    """EXT1 looks its (module, name) up in copyreg's registry, then through find_class."""
    copyreg.add_extension("posix", "system", 0xF1)
    try:
        payload = b"\x80\x02\x82\xf1(V" + _cmd(marker).encode() + b"\ntR."
        (tmp_path / ".metadata").write_bytes(payload)
        with pytest.raises(UserError):
            read_dcp_metadata(tmp_path / ".metadata")
    finally:
        copyreg.remove_extension("posix", "system", 0xF1)
    assert not marker.exists()


def test_the_python_reference_would_have_run_them(marker, tmp_path):
    """The payloads are live: plain pickle.loads runs one (so a refusal above is the reader's doing)."""
    sentinel = tmp_path / "ran"
    pickle.loads(pickle.dumps(_System(sentinel), protocol=4))
    assert sentinel.exists()


def test_real_dcp_metadata_of_every_dtype_still_loads(tmp_path):
    import torch.distributed.checkpoint as dcp

    sd = {f"t_{dt}".replace("torch.", ""): torch.zeros(3, 2, dtype=dt)
          for dt in (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool)}
    sd["lr"], sd["betas"], sd["name"] = 0.1, (0.9, 0.95), "adamw"
    dcp.save(sd, checkpoint_id=str(tmp_path), no_dist=True)
    md = read_dcp_metadata(tmp_path / ".metadata")
    check_metadata_pickle(tmp_path / ".metadata")  # the launcher's dry run accepts it too
    assert isinstance(md, Metadata) and set(md.state_dict_metadata) == set(sd)
    assert pickle.loads((tmp_path / ".metadata").read_bytes()).state_dict_metadata.keys() == sd.keys()


def _torch_saved(obj) -> io.BytesIO:
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return buf


class _Item:
    class dest_index:  # noqa: N801  (the shape of DCP's ReadItem.dest_index)
        fqn = "optim.param_groups.0.lr"


@pytest.mark.parametrize("make", [lambda m: _System(m), lambda m: _Eval(m),
                                  lambda m: {"lr": [collections.OrderedDict(x=_System(m))]}])
def test_a_gadget_among_the_non_tensor_values_is_refused(make, marker):
    planner = SafeLoadPlanner()
    planner.flatten_state_dict, planner.state_dict = False, {}
    with pytest.raises(UserError, match="not plain data"):
        planner.load_bytes(_Item(), _torch_saved(make(marker)))
    assert not marker.exists()
    planner.load_bytes(_Item(), _torch_saved({"lr": 0.5, "betas": (0.9, 0.99)}))  # plain data loads
    assert planner.state_dict[_Item.dest_index.fqn] == {"lr": 0.5, "betas": (0.9, 0.99)}
