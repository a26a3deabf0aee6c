"""Importing torch.save files (zip and legacy) without running their pickles, and exporting back."""

from __future__ import annotations

import os
import pickle
import struct
import zipfile
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
import torch

import ckptfmt
from ckptfmt import CheckpointError, OpaqueObject
from ckptfmt.cli import main
from ckptfmt.converters import export_checkpoint, import_checkpoint
from ckptfmt.converters.importer import detect_kind, read_source
from tests.support.helpers import assert_same
from tests.support.pickle_fixtures import Config, Hostile

FORMATS = ["zip", "legacy"]


def training_state() -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.LayerNorm(6), torch.nn.Linear(6, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(4, 8)).pow(2).mean().backward()
        opt.step()
        sched.step()
    base = torch.arange(48, dtype=torch.float32)
    return {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),      # integer param ids, step tensors, nested param groups
        "scheduler": sched.state_dict(),
        "step": 2,
        "nested": (1, [2.5, (None, b"\x00\xff", "s")], {3: "int key", (1, 2): "tuple key"}),
        "ordered": OrderedDict([("b", 1), ("a", 2)]),
        "size": torch.Size([2, 3]),
        "dtypes": [torch.bfloat16, torch.float16, torch.int8],
        "device": torch.device("cpu"),
        "tensors": {
            "bf16": torch.randn(5, dtype=torch.bfloat16),
            "fp16": torch.tensor([1.0, float("nan"), -0.0, float("inf")], dtype=torch.float16),
            "int": torch.arange(7, dtype=torch.int64),
            "int8": torch.tensor([-1, 2], dtype=torch.int8),
            "bool": torch.tensor([True, False, True]),
            "empty": torch.empty(0, 3),
            "scalar": torch.tensor(3.5),
            "complex": torch.randn(2, dtype=torch.complex64),
        },
        "views": {"a": base[4:20], "b": base.view(6, 8)[1:, ::3], "whole": base},
        "noncontig": torch.randn(3, 5).t(),
        "param": torch.nn.Parameter(torch.randn(3)),
        "frozen": torch.nn.Parameter(torch.randn(2), requires_grad=False),
        "numbers": {"f": 0.1, "big": 2**70, "c": 1 - 2j, "set": {1, 2}, "fs": frozenset({"x"})},
        "numpy": {"arr": np.arange(6, dtype=np.float32).reshape(2, 3), "scalar": np.int64(7)},
    }


def write(state, path, fmt: str) -> str:
    torch.save(state, path, _use_new_zipfile_serialization=(fmt == "zip"))
    return str(path)


@pytest.fixture(params=FORMATS)
def fmt(request) -> str:
    return request.param


def test_training_state_imports_type_exact_and_bit_exact(tmp_path, fmt):
    src = write(training_state(), tmp_path / "state.pt", fmt)
    expected = torch.load(src, weights_only=False)
    result = import_checkpoint(src, tmp_path / "repo" / "imported")
    assert result.kind == "torch" and result.opaque == [] and result.tensors > 20
    assert_same(expected, ckptfmt.load(tmp_path / "repo" / "imported"))
    with ckptfmt.open(tmp_path / "repo" / "imported") as reader:
        assert reader.manifest.step == 2  # from the state's "step"
        provenance = reader.metadata["provenance"]
    assert provenance["source_kind"] == "torch" and provenance["source"] == os.path.abspath(src)
    assert provenance["versions"]["torch.save"] == fmt
    assert provenance["opaque_objects"] == []
    assert [p["name"] for p in provenance["timing"]] == ["read"]
    assert ckptfmt.verify(tmp_path / "repo").ok


def test_views_come_back_sharing_one_mapped_storage(tmp_path, fmt):
    base = torch.arange(40, dtype=torch.float64)
    state = {"a": base[3:9], "b": base.view(5, 8)[:, 1::2], "c": base}
    imported = read_source(write(state, tmp_path / "v.pt", fmt))
    a, b, c = (imported.state[k] for k in "abc")
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() == c.untyped_storage().data_ptr()
    assert (a.storage_offset(), b.stride()) == (3, (8, 2))
    assert torch.equal(b, state["b"]) and torch.equal(a, state["a"])


def test_tensors_map_the_file_copy_on_write(tmp_path):
    src = write({"w": torch.zeros(1000)}, tmp_path / "m.pt", "zip")
    before = Path(src).read_bytes()
    imported = read_source(src)
    imported.state["w"].add_(1.0)  # writable, and the file never changes
    assert Path(src).read_bytes() == before


def test_gpu_storages_are_imported_to_cpu(tmp_path):
    src = write({"w": torch.arange(4.0)}, tmp_path / "gpu.pt", "zip")
    with zipfile.ZipFile(src) as zf:
        pkl = zf.read("gpu/data.pkl")
    assert pkl.count(b"X\x03\x00\x00\x00cpu") == 1
    pkl = pkl.replace(b"X\x03\x00\x00\x00cpu", b"X\x06\x00\x00\x00cuda:0")
    moved = _rewrite_zip(src, tmp_path / "moved.pt", replace=("data.pkl", pkl))
    imported = read_source(moved)
    assert imported.state["w"].device.type == "cpu" and torch.equal(imported.state["w"], torch.arange(4.0))
    assert any("cuda:0" in note for note in imported.notes)


def test_custom_object_is_kept_opaque_and_exported_back(tmp_path, fmt):
    cfg = Config("run-1", torch.arange(4, dtype=torch.int32), {"lr": 0.1, "dims": (8, 6)})
    state = {"model": {"w": torch.randn(2, 2)}, "hparams": {"config": cfg}, "step": 5}
    src = write(state, tmp_path / "custom.pt", fmt)
    result = import_checkpoint(src, tmp_path / "repo" / "c")
    assert result.opaque == ["hparams/config"]
    assert any("opaque" in note and "hparams/config" in note for note in result.notes)
    loaded = ckptfmt.load(tmp_path / "repo" / "c")
    opaque = loaded["hparams"]["config"]
    assert isinstance(opaque, OpaqueObject) and (opaque.module, opaque.qualname) == (
        "tests.support.pickle_fixtures",
        "Config",
    )
    with ckptfmt.open(tmp_path / "repo" / "c") as reader:
        assert reader.metadata["provenance"]["opaque_objects"] == ["hparams/config"]

    out = tmp_path / "back.pt"
    exported = export_checkpoint(tmp_path / "repo" / "c", out, format="torch")
    assert any("opaque" in note for note in exported.notes)
    back = torch.load(out, weights_only=False)
    assert back["hparams"]["config"] == cfg
    assert torch.equal(back["model"]["w"], state["model"]["w"]) and back["step"] == 5
    # Re-importing the export keeps the object opaque under the same name (never run).
    again = read_source(str(out))
    assert again.opaque == ["hparams/config"]
    assert again.state["hparams"]["config"].qualname == "Config"


def test_plain_import_exports_back_for_weights_only_loads(tmp_path):
    state = training_state()
    src = write(state, tmp_path / "s.pt", "zip")
    import_checkpoint(src, tmp_path / "repo" / "s")
    export_checkpoint(tmp_path / "repo" / "s", tmp_path / "out.pt", format="torch")
    expected = torch.load(src, weights_only=False)
    expected.pop("numpy")  # numpy values need weights_only=False
    back = torch.load(tmp_path / "out.pt", weights_only=False)
    back.pop("numpy")
    assert_same(expected, back)


def test_hostile_object_never_runs(tmp_path, fmt):
    marker = tmp_path / "pwned"
    state = {"model": {"w": torch.ones(2)}, "extra": {"deep": [1, Hostile(str(marker))]}}
    src = write(state, tmp_path / "evil.pt", fmt)
    assert not marker.exists()
    result = import_checkpoint(src, tmp_path / "repo" / "evil")
    assert not marker.exists()
    assert result.opaque == ["extra/deep/1"]
    loaded = ckptfmt.load(tmp_path / "repo" / "evil")
    assert isinstance(loaded["extra"]["deep"][1], OpaqueObject)
    assert loaded["extra"]["deep"][1].qualname == "system"
    assert not marker.exists()


def test_auto_detection_picks_torch(tmp_path, fmt):
    src = write({"w": torch.ones(2)}, tmp_path / "d.pt", fmt)
    assert detect_kind(src) == "torch"
    garbage = tmp_path / "garbage.bin"
    garbage.write_bytes(b"\x00" * 100)
    with pytest.raises(CheckpointError, match="garbage.bin"):
        detect_kind(str(garbage))


def _rewrite_zip(src: str, dest, drop: str | None = None, replace: tuple[str, bytes] | None = None) -> str:
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dest, "w", zipfile.ZIP_STORED) as zout:
        for info in zin.infolist():
            if drop and info.filename.endswith(drop):
                continue
            data = zin.read(info)
            if replace and info.filename.endswith(replace[0]):
                data = replace[1]
            zout.writestr(info.filename, data)
    return str(dest)


def _data_offset(path, info: zipfile.ZipInfo) -> int:
    """Where a stored member's bytes start (the local header's extra field pads for alignment)."""
    with open(path, "rb") as f:
        f.seek(info.header_offset + 26)
        name_len, extra_len = struct.unpack("<HH", f.read(4))
    return info.header_offset + 30 + name_len + extra_len


def _damage(path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def _damaged_sources(tmp_path) -> dict[str, str]:
    state = {"w": torch.randn(64), "b": torch.arange(16), "meta": {"lr": 0.1}}
    zip_src = write(state, tmp_path / "good.pt", "zip")
    legacy_src = write(state, tmp_path / "good_legacy.pt", "legacy")
    cases = {}
    data = Path(zip_src).read_bytes()
    (tmp_path / "truncated.pt").write_bytes(data[: len(data) // 2])
    cases["truncated zip"] = str(tmp_path / "truncated.pt")
    corrupt = tmp_path / "corrupt_pkl.pt"
    corrupt.write_bytes(data)
    with zipfile.ZipFile(zip_src) as zf:
        info = zf.getinfo("good/data.pkl")
        storage_info = zf.getinfo("good/data/0")
    _damage(corrupt, _data_offset(zip_src, info) + 10, b"\xff\xfe")
    cases["corrupted data.pkl"] = str(corrupt)
    bad_storage = tmp_path / "corrupt_storage.pt"
    bad_storage.write_bytes(data)
    _damage(bad_storage, _data_offset(zip_src, storage_info) + 4, b"\x00\x01\x02")
    cases["corrupted storage"] = str(bad_storage)
    cases["missing storage record"] = _rewrite_zip(zip_src, tmp_path / "missing.pt", drop="data/0")
    cases["unpicklable data.pkl"] = _rewrite_zip(
        zip_src, tmp_path / "badpkl.pt", replace=("data.pkl", b"\x80\x02garbage")
    )
    short = tmp_path / "short_storage.pt"
    _rewrite_zip(zip_src, short, replace=("data/1", b"\x00" * 8))
    cases["storage record of the wrong size"] = str(short)
    legacy = Path(legacy_src).read_bytes()
    (tmp_path / "legacy_truncated.pt").write_bytes(legacy[:-100])
    cases["truncated legacy"] = str(tmp_path / "legacy_truncated.pt")
    (tmp_path / "legacy_head.pt").write_bytes(legacy[:40])
    cases["legacy cut inside a pickle"] = str(tmp_path / "legacy_head.pt")
    (tmp_path / "garbage.pt").write_bytes(os.urandom(300))
    cases["garbage"] = str(tmp_path / "garbage.pt")
    (tmp_path / "empty.pt").write_bytes(b"")
    cases["empty"] = str(tmp_path / "empty.pt")
    cases["plain pickle"] = str(tmp_path / "plain.pkl")
    (tmp_path / "plain.pkl").write_bytes(pickle.dumps({"a": 1}))
    return cases


def test_damaged_sources_fail_naming_the_file_and_commit_nothing(tmp_path):
    for name, path in _damaged_sources(tmp_path).items():
        repo = tmp_path / "repo"
        with pytest.raises(CheckpointError) as info:
            import_checkpoint(path, repo / "x", kind="torch")
        assert os.path.basename(path) in str(info.value), (name, str(info.value))
        assert not repo.exists() or ckptfmt.Repository.open(repo).names() == [], name


def _storage_damaged_late(tmp_path) -> str:
    """A zip torch file whose last storage record fails its CRC-32 (the others are intact)."""
    src = write({f"w{i}": torch.full((4096,), float(i)) for i in range(8)}, tmp_path / "late.pt", "zip")
    with zipfile.ZipFile(src) as zf:
        last = max((i for i in zf.infolist() if "/data/" in i.filename), key=lambda i: i.header_offset)
    _damage(src, _data_offset(src, last) + 100, b"\x01\x02\x03")
    return src


def test_a_damaged_storage_found_while_saving_commits_nothing(tmp_path, monkeypatch):
    """The CRC-32 check overlaps the save: its failure stops the save after the chunks, before the commit."""
    src = _storage_damaged_late(tmp_path)
    calls = []
    real_save = ckptfmt.save

    def spy(*args, before_commit=None, **kwargs):
        calls.append(before_commit)
        return real_save(*args, before_commit=before_commit, **kwargs)

    monkeypatch.setattr(ckptfmt, "save", spy)
    repo = tmp_path / "repo"
    with pytest.raises(CheckpointError, match=r"late\.pt: storage record late/data/\d+ is damaged"):
        import_checkpoint(src, repo / "x")
    assert calls and calls[0] is not None  # the check really ran as the save's hook
    assert any((repo / "chunks").rglob("*"))  # the chunks were written meanwhile ...
    assert ckptfmt.Repository.open(repo).names() == []  # ... but never committed
    with pytest.raises(CheckpointError, match="damaged"):  # read_source (and the readers built on
        read_source(src)                                     # torch_format.read) check before returning


def test_save_commits_only_after_before_commit_returns(tmp_path):
    seen = []

    def refuse():
        seen.append(sorted(p.name for p in (tmp_path / "repo").rglob("*") if p.is_file()))
        raise CheckpointError("refused")

    with pytest.raises(CheckpointError, match="refused"):
        ckptfmt.save({"w": torch.ones(1000)}, tmp_path / "repo" / "a", before_commit=refuse)
    assert seen and seen[0]  # chunks were durable when it ran
    assert ckptfmt.Repository.open(tmp_path / "repo").names() == []
    url = ckptfmt.save({"w": torch.ones(1000)}, tmp_path / "repo" / "a", before_commit=lambda: None)
    assert torch.equal(ckptfmt.load(url)["w"], torch.ones(1000))
    with pytest.raises(TypeError, match="before_commit"):
        ckptfmt.save({"w": torch.ones(1)}, tmp_path / "repo" / "b", before_commit="no")


def test_absurd_storage_sizes_are_refused(tmp_path):
    class Ref:
        def __init__(self, numel):
            self.numel = numel

    class Tensor:
        def __init__(self, ref):
            self.ref = ref

        def __reduce__(self):
            return torch._utils._rebuild_tensor_v2, (self.ref, 0, (4,), (1,), False, OrderedDict())

    for numel in (2**50, 4):
        path = tmp_path / f"absurd_{numel}.pt"
        with zipfile.ZipFile(path, "w") as zf:
            import io
            buf = io.BytesIO()
            pickler = pickle.Pickler(buf, protocol=2)
            pickler.persistent_id = lambda obj: (("storage", torch.FloatStorage, "0", "cpu", obj.numel)
                                                 if isinstance(obj, Ref) else None)
            pickler.dump({"w": Tensor(Ref(numel))})
            zf.writestr("absurd/data.pkl", buf.getvalue())
            zf.writestr("absurd/data/0", b"\x00" * 8)  # 2 floats, not 4
        with pytest.raises(CheckpointError, match="absurd|bytes"):
            read_source(str(path))


def test_cli_import_and_one_line_errors(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    src = write({"w": torch.ones(3), "cfg": Config("x", torch.zeros(1), {})}, tmp_path / "cli.pt", "legacy")
    assert main(["import", src, str(tmp_path / "repo" / "one")]) == 0
    out = capsys.readouterr().out
    assert "(torch)" in out and ": 1 tensor," in out and "1 opaque" in out and "opaque: cfg" in out
    assert main(["import", src, str(tmp_path / "repo" / "two"), "--from", "torch", "--step", "9"]) == 0
    capsys.readouterr()
    assert ckptfmt.open(tmp_path / "repo" / "two").manifest.step == 9
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"not a checkpoint at all")
    assert main(["import", str(garbage), str(tmp_path / "repo" / "three")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "garbage.pt" in err and err.startswith("ckptfmt: error:")
    assert main(["import", str(garbage), str(tmp_path / "repo" / "three"), "--from", "nope"]) == 2
    assert "unknown source kind" in capsys.readouterr().err
    assert ckptfmt.Repository.open(tmp_path / "repo").names() == ["one", "two"]


def test_a_bare_tensor_is_stored_under_a_key(tmp_path):
    tensor = torch.arange(6.0).reshape(2, 3)
    torch.save(tensor, tmp_path / "t.pt")
    result = import_checkpoint(tmp_path / "t.pt", tmp_path / "repo" / "t")
    assert torch.equal(ckptfmt.load(result.url)["tensor"], tensor)
    assert any("bare tensor" in note for note in result.notes)
