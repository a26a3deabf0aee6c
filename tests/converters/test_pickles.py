"""The restricted unpickler: nothing in a pickle ever runs; unknown objects are kept, exactly."""

from __future__ import annotations

import argparse
import pickle
import subprocess
import sys
from collections import OrderedDict

import numpy as np
import pytest
import torch

from ckptfmt import CheckpointError, OpaqueObject
from ckptfmt.converters.pickles import BudgetReader, PickleError, RestrictedUnpickler, restricted_loads, to_value_tree
from ckptfmt.converters.torch_format import load_object
from tests.support.pickle_fixtures import Config, Hostile, HostileEval, Registry, Tagged, WithSlots


def convert(data: bytes):
    return to_value_tree(restricted_loads(data, torch_files=load_object)).value


def test_an_embedded_torch_file_needs_a_reader():
    """pickle.dumps of a tensor embeds a whole torch file; the unpickler reads it only through the
    reader it was given (torch_format.load_object), never by importing one itself."""
    data = pickle.dumps({"t": torch.arange(3)})
    with pytest.raises(PickleError, match="embeds a torch file"):
        restricted_loads(data)
    assert torch.equal(convert(data)["t"], torch.arange(3))


class _Popen:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return subprocess.Popen, (["touch", self.marker],)


def hostile_pickles(marker: str) -> dict[str, bytes]:
    m = marker.encode()
    return {
        "os.system p0": pickle.dumps(Hostile(marker), protocol=0),
        "os.system p2": pickle.dumps(Hostile(marker), protocol=2),
        "os.system p4 nested": pickle.dumps({"a": [1, {"b": Hostile(marker)}]}, protocol=4),
        "posix.system by name": b"cposix\nsystem\n(S'touch " + m + b"'\ntR.",
        "eval": pickle.dumps(HostileEval(marker), protocol=2),
        "exec": b"c__builtin__\nexec\n(S\"open('" + m + b"', 'w').close()\"\ntR.",
        "subprocess.Popen": pickle.dumps(_Popen(marker), protocol=2),
        "getattr(__import__('os'), 'system')": (
            b"c__builtin__\ngetattr\n(c__builtin__\n__import__\n(S'os'\ntRS'system'\ntR(S'touch " + m + b"'\ntR."),
        "INST opcode": b"(S'touch " + m + b"'\nios\nsystem\n.",
        "OBJ opcode": b"(cos\nsystem\nS'touch " + m + b"'\no.",
        "NEWOBJ": b"\x80\x02cos\nsystem\nX\x05\x00\x00\x00touch\x85\x81.",
        "BUILD setstate": b"\x80\x02ctests.support.pickle_fixtures\nConfig\n)\x81}X\x01\x00\x00\x00a\x8a\x01\x01sb.",
    }


@pytest.mark.parametrize("name", list(hostile_pickles("x")))
def test_hostile_pickles_never_run(tmp_path, name):
    marker = tmp_path / "pwned"
    data = hostile_pickles(str(marker))[name]
    value = convert(data)
    assert not marker.exists(), f"{name} ran"
    found = []

    def walk(v):
        if isinstance(v, OpaqueObject):
            found.append(v)
        elif isinstance(v, dict):
            for x in v.values():
                walk(x)
        elif isinstance(v, (list, tuple)):
            for x in v:
                walk(x)

    walk(value)
    assert len(found) == 1 and found[0].pickle
    assert not marker.exists()


def test_opaque_names_the_class_and_rebuilds_the_original():
    weights = torch.arange(6, dtype=torch.float16).reshape(2, 3)[:, 1:]  # a non-contiguous view
    obj = {"cfg": Config("run", weights, {"lr": 3e-4, "dims": (1, 2)}), "keep": torch.ones(2)}
    for protocol in (2, 4, 5):
        value = convert(pickle.dumps(obj, protocol=protocol))
        opaque = value["cfg"]
        assert (opaque.module, opaque.qualname) == ("tests.support.pickle_fixtures", "Config")
        assert isinstance(value["keep"], torch.Tensor)
        rebuilt = pickle.loads(opaque.pickle)  # with the class importable: the original object
        assert rebuilt == obj["cfg"]


@pytest.mark.parametrize("obj", [
    Registry(a=1, b=[2, 3]),
    WithSlots(1, (2, "x")),
    argparse.Namespace(lr=0.1, layers=[4, 4], name="run"),
])
def test_other_object_shapes_round_trip(obj):
    if isinstance(obj, Registry):
        obj.tag = "t"
    value = convert(pickle.dumps({"x": obj}, protocol=2))
    assert isinstance(value["x"], OpaqueObject)
    assert value["x"].qualname == type(obj).__qualname__
    assert pickle.loads(value["x"].pickle) == obj


def test_plain_values_come_back_exactly():
    obj = OrderedDict(a=(1, 2.5, None), b={3: b"\x00\xff", "s": {1, 2}}, c=frozenset({"x"}), d=1 + 2j,
                      e=torch.Size([2, 3]), f=torch.bfloat16, g=torch.device("cpu"), h=[True, 2**70])
    for protocol in (0, 2, 4):
        assert convert(pickle.dumps(obj, protocol=protocol)) == obj


def test_numpy_arrays_and_scalars_are_lifted_object_arrays_stay_opaque():
    obj = {"a": np.arange(6, dtype="<i4").reshape(2, 3), "f": np.asfortranarray(np.ones((2, 3))),
           "s": np.float32(1.5), "b": np.array([True, False]), "o": np.array([{"x": 1}], dtype=object),
           "m": np.arange(3.0).view(Tagged), "be": np.arange(3, dtype=">i4")}
    value = convert(pickle.dumps(obj, protocol=2))
    for key in "afb":
        assert type(value[key]) is np.ndarray and value[key].dtype == obj[key].dtype
        assert np.array_equal(value[key], obj[key])
    assert type(value["s"]) is np.float32 and value["s"] == obj["s"]
    for key in "om":  # object arrays and ndarray subclasses are not plain numeric arrays
        assert isinstance(value[key], OpaqueObject)
        assert type(pickle.loads(value[key].pickle)) is type(obj[key])
    assert isinstance(value["be"], OpaqueObject)  # big-endian: ckptfmt stores little-endian data only


@pytest.mark.parametrize("data", [
    b"]q\x00)R.",                       # REDUCE of a list
    b"\x80\x02]q\x00}q\x01b.",          # BUILD on a list
    b"\x80\x02K\x01]q\x00a.",           # APPEND to an int
    b"\x80\x02",                        # truncated
    b"garbage",
])
def test_malformed_or_forbidden_pickles_raise_checkpoint_errors(data):
    with pytest.raises(CheckpointError):
        convert(data)


def test_self_referencing_containers_are_refused():
    loop = []
    loop.append(loop)
    with pytest.raises(CheckpointError, match="contains itself"):
        convert(pickle.dumps(loop, protocol=2))


def test_reads_past_the_budget_fail_fast():
    data = b"\x80\x04\x8e" + (2**40).to_bytes(8, "little") + b"x" * 200
    with pytest.raises(PickleError, match="budget"):
        RestrictedUnpickler(BudgetReader(data, limit=64)).load_checked()
    with pytest.raises(CheckpointError):
        convert(data)


def test_persistent_ids_are_refused_in_plain_pickles():
    with pytest.raises(CheckpointError, match="persistent"):
        convert(b"\x80\x02X\x01\x00\x00\x00aQ.")


def test_named_modules_are_never_imported():
    assert "antigravity" not in sys.modules
    value = convert(b"cantigravity\nfly\n)R.")
    assert (value.module, value.qualname) == ("antigravity", "fly")
    assert "antigravity" not in sys.modules
    value = convert(b"cno_such_module_xyz\nThing\n.")  # a class used as a value, not called
    assert isinstance(value, OpaqueObject) and value.qualname == "Thing"


def test_tensors_with_attributes_are_opaque_unless_dropped(tmp_path):
    """DeepSpeed pickles tensors with attributes (ds_id, ...): kept opaque by default; plain on request."""
    from ckptfmt.converters import torch_format

    tensor, param = torch.arange(6.0).reshape(2, 3), torch.nn.Parameter(torch.ones(4))
    tensor.ds_id, param.ds_shape = 7, (4,)
    path = tmp_path / "attributed.pt"
    torch.save({"t": tensor, "p": param, "plain": torch.zeros(2)}, path)

    kept = torch_format.read(str(path))
    assert sorted(kept.opaque) == ["p", "t"] and isinstance(kept.state["t"], OpaqueObject)

    dropped = torch_format.read(str(path), drop_tensor_attributes=True)
    assert dropped.opaque == []
    assert torch.equal(dropped.state["t"], tensor) and not hasattr(dropped.state["t"], "ds_id")
    assert isinstance(dropped.state["p"], torch.nn.Parameter) and torch.equal(dropped.state["p"], param)
    assert any("tensor attributes dropped (ds_id)" in note for note in dropped.notes)
    assert any("tensor attributes dropped (ds_shape)" in note for note in dropped.notes)
