"""save() then load(): a training state comes back type-exact and bit-exact, on every backend."""

from __future__ import annotations

import copy
import math
import random
from collections import OrderedDict

import numpy as np
import pytest
import torch
from torch import nn

import ckptfmt
from ckptfmt import CheckpointExistsError, CheckpointReader, UnsupportedValueError
from ckptfmt.tensors.dtypes import DTYPES
from tests.support.helpers import assert_same, assert_tensor_exact, chunk_keys, tensor_chunk_keys

# -- a real training state -------------------------------------------------------


class TinyBlock(nn.Module):
    """A pre-norm transformer-ish block: attention-free, but with the usual parameter kinds."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)
        self.head = nn.Linear(width, 3)
        self.register_buffer("seen", torch.zeros((), dtype=torch.int64))

    def forward(self, x):
        self.seen += x.shape[0]
        x = x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))
        return self.head(x)


def make_training(seed: int = 0):
    torch.manual_seed(seed)
    model = TinyBlock()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95))
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    return model, optimizer, scheduler


def batches(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(5, 16, generator=g), torch.randint(0, 3, (5,), generator=g)) for _ in range(n)]


def train(model, optimizer, scheduler, data) -> None:
    for x, y in data:
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        scheduler.step()


def training_state(model, optimizer, scheduler, step: int) -> dict:
    return {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "step": step,
        "epoch": 0,
        "tokens_seen": 2**70 + 12345,  # beyond 64 bits
        "best_loss": math.inf,
        "last_grad_norm": math.nan,
    }


def test_training_state_round_trips_and_resumes_identically(repo_url):
    model, optimizer, scheduler = make_training()
    train(model, optimizer, scheduler, batches(3, seed=1))
    state = training_state(model, optimizer, scheduler, step=3)
    url = ckptfmt.save(state, f"{repo_url}/step-3", step=3)
    assert url == f"{repo_url}/step-3"

    loaded = ckptfmt.load(f"{repo_url}/step-3")
    assert_same(state, loaded)
    # What the type-exact comparison above covers, spelled out for the tricky parts:
    assert type(loaded["model"]) is OrderedDict
    assert list(loaded["optimizer"]["state"]) == list(state["optimizer"]["state"])
    assert all(type(k) is int for k in loaded["optimizer"]["state"])
    assert type(loaded["optimizer"]["param_groups"][0]["betas"]) is tuple
    assert loaded["tokens_seen"] == 2**70 + 12345

    # Resuming from the checkpoint continues exactly like the run that never stopped.
    later = batches(3, seed=2)
    train(model, optimizer, scheduler, later)
    model2, optimizer2, scheduler2 = make_training(seed=99)
    model2.load_state_dict(loaded["model"])
    optimizer2.load_state_dict(loaded["optimizer"])
    scheduler2.load_state_dict(loaded["scheduler"])
    train(model2, optimizer2, scheduler2, later)
    for (name, a), (_, b) in zip(model.state_dict().items(), model2.state_dict().items()):
        assert_tensor_exact(a, b, name)
    assert scheduler.get_last_lr() == scheduler2.get_last_lr()


def plain_values() -> dict:
    shared = torch.arange(6, dtype=torch.float32)
    shared_array = np.arange(4, dtype=np.int32)
    base = torch.arange(60, dtype=torch.float64).reshape(6, 10)
    return {
        "none": None,
        "bools": [True, False],
        "ints": [0, -1, 2**63 - 1, -(2**63), 2**64 - 1, 2**64, -(2**63) - 1, 2**200, -(2**100)],
        "floats": [0.1, -0.0, math.inf, -math.inf, math.nan, 5e-324, 1.7976931348623157e308],
        "str": ["", "héllo ✓ \x00"],
        "bytes": [b"", bytes(range(256))],
        "tuple": (1, ("nested", (None,)), []),
        "empty_tuple": (),
        "nested_lists": [[1, [2, [3, []]]], [], [[[]]]],
        "int_keys": {0: "zero", -5: "negative", 2**40: "big", 2**70: "bigger"},
        "mixed_keys": {1: "int", "1": "str", (1, 2): "tuple", 2.5: "float", None: "none", b"k": "bytes",
                       frozenset({3}): "frozenset"},
        "ordered": OrderedDict([("b", 1), ("a", OrderedDict([(2, "x"), (1, "y")]))]),
        "empty_dict": {},
        "set": {1, 2, 3},
        "frozenset": frozenset({"a", "b"}),
        "complex": [1 + 2j, complex(math.inf, -0.0)],
        "size": torch.Size([2, 3, 0]),
        "dtypes": [torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.bool],
        "devices": [torch.device("cpu"), torch.device("cuda", 1), torch.device("meta")],
        "numpy_scalars": [np.float32(1.5), np.float16(np.nan), np.int64(-3), np.uint8(255),
                          np.bool_(True), np.complex64(1 - 2j), np.float64(-0.0)],
        "numpy_arrays": {
            "int16": np.arange(12, dtype=np.int16).reshape(3, 4),
            "fortran": np.asfortranarray(np.arange(12, dtype=np.float32).reshape(3, 4)),
            "strided": np.arange(20, dtype=np.int64)[::3],
            "empty": np.zeros((0, 3), dtype=np.float64),
            "zero_dim": np.array(7.25, dtype=np.float64),
            "bool": np.array([True, False, True]),
            "complex": np.array([1 + 1j, 2 - 2j], dtype=np.complex128),
        },
        "tensors": {
            "zero_dim_float": torch.tensor(3.5),
            "zero_dim_int": torch.tensor(-7, dtype=torch.int64),
            "empty": torch.empty(0, 5),
            "empty_middle": torch.zeros(3, 0, 2, dtype=torch.int16),
            "transposed": base.t(),
            "strided": base[:, ::3],
            "sliced": base[1:4, 2:5],
            "offset_contiguous": base[2:4],
            "expanded": torch.ones(3, 1).expand(3, 4),
            "nan_payloads": torch.tensor([math.nan, -math.nan, math.inf, -0.0], dtype=torch.float32),
            "requires_grad": torch.ones(3, requires_grad=True),
            "bool": torch.tensor([True, False]),
        },
        "parameters": {
            "trainable": nn.Parameter(torch.randn(3, 2)),
            "frozen": nn.Parameter(torch.randn(2), requires_grad=False),
        },
        "shared": {"first": shared, "again": [shared, shared], "array": shared_array, "array_again": shared_array},
    }


def test_plain_values_and_tensor_kinds_round_trip(repo_url):
    values = plain_values()
    ckptfmt.save(values, f"{repo_url}/values")
    loaded = ckptfmt.load(f"{repo_url}/values")
    assert_same(values, loaded)

    params = loaded["parameters"]
    assert type(params["trainable"]) is nn.Parameter and params["trainable"].requires_grad
    assert type(params["frozen"]) is nn.Parameter and not params["frozen"].requires_grad
    assert type(loaded["tensors"]["requires_grad"]) is torch.Tensor
    assert loaded["tensors"]["requires_grad"].requires_grad
    # The same object saved several times comes back as one object.
    shared = loaded["shared"]
    assert shared["again"][0] is shared["first"] and shared["again"][1] is shared["first"]
    assert shared["array_again"] is shared["array"]
    assert isinstance(shared["array"], np.ndarray)
    with ckptfmt.open(f"{repo_url}/values") as reader:
        # Stored once: the repeats point at the first entry.
        assert reader.tensor_info("shared/again/0").same_as == reader.keys().index("shared/first")
    assert loaded["tensors"]["transposed"].is_contiguous()


def test_conjugate_and_negative_views_are_resolved(repo_url):
    z = torch.tensor([1 + 2j, -3 - 4j], dtype=torch.complex64)
    state = {"conj": z.conj(), "neg": z.conj().imag}
    assert state["conj"].is_conj()
    ckptfmt.save(state, f"{repo_url}/views")
    loaded = ckptfmt.load(f"{repo_url}/views")
    assert not loaded["conj"].is_conj()
    assert torch.equal(loaded["conj"], z.conj().resolve_conj())
    assert torch.equal(loaded["neg"], torch.tensor([-2.0, 4.0]))


def random_tensor(dtype: torch.dtype, shape: tuple, generator: torch.Generator) -> torch.Tensor:
    """A tensor of ``dtype`` whose bytes are random (NaNs, odd bools and all)."""
    t = torch.empty(shape, dtype=dtype)
    flat = t.reshape(-1).view(torch.uint8)
    flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8, generator=generator))
    return t


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
def test_every_dtype_round_trips_bit_exact(tmp_path):
    """Local only: every dtype of the table, in every layout, with random bytes."""
    assert {"bfloat16", "float8_e4m3fn", "float8_e5m2", "complex32", "complex64", "complex128",
            "bool", "uint16", "uint32", "uint64"} <= set(DTYPES)
    g = torch.Generator().manual_seed(1234)
    state = {}
    for name, dtype in DTYPES.items():
        t = random_tensor(dtype, (7, 9), g)
        state[name] = {
            "plain": t,
            "transposed": t.t(),
            "sliced": t[1:5, ::2],
            "zero_dim": random_tensor(dtype, (), g),
            "empty": torch.empty((0, 4), dtype=dtype),
            "large": random_tensor(dtype, (300_000 // dtype.itemsize,), g),  # over the pack limit
        }
    ckptfmt.save(state, tmp_path / "repo" / "dtypes", chunk_size=65536)
    loaded = ckptfmt.load(tmp_path / "repo" / "dtypes")
    assert_same(state, loaded)
    with ckptfmt.open(tmp_path / "repo" / "dtypes") as reader:
        for name in DTYPES:
            assert reader.tensor_info(f"{name}/plain").dtype == name
            assert_tensor_exact(state[name]["sliced"], reader.get_tensor(f"{name}/sliced"), name)


def test_unsupported_values_name_their_path(repo_url):
    class Custom:
        pass

    bad = [
        ({"config": {"fn": lambda x: x}}, "state['config']['fn']"),
        ({"items": [1, 2, Custom()]}, "state['items'][2]"),
        ({"model": {"w": torch.ones(2).to_sparse()}}, "state['model']['w']"),
        ({"buffers": (torch.empty(2, device="meta"),)}, "state['buffers'][0]"),
        ({torch.ones(1): "tensor as key"}, "tensors cannot be dict keys"),
        ({"arr": np.array(["a", "b"])}, "state['arr']"),
        ({"big": 10**5000}, "state['big']"),
        ({"deep": torch.zeros([1] * 65)}, "state['deep']: 65 dimensions"),
    ]
    ckptfmt.save({"ok": 1}, f"{repo_url}/good")
    for i, (state, where) in enumerate(bad):
        with pytest.raises(UnsupportedValueError) as info:
            ckptfmt.save(state, f"{repo_url}/bad-{i}")
        assert where in str(info.value)
        assert isinstance(info.value, ckptfmt.CheckpointError)
    assert ckptfmt.Repository.open(repo_url).names() == ["good"]


def test_big_integer_digit_limit(tmp_path):
    """Up to 4300 digits (what every Python reads by default) round trip; more are refused at save,
    even in a process that lifted Python's own limit."""
    import sys

    largest = int("9" * 4300)
    ckptfmt.save({"n": largest, "m": -largest}, tmp_path / "repo" / "ok")
    assert ckptfmt.load(tmp_path / "repo" / "ok") == {"n": largest, "m": -largest}
    previous = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(0)
    try:
        with pytest.raises(UnsupportedValueError, match=r"state\['n'\]"):
            ckptfmt.save({"n": largest * 10 + 9}, tmp_path / "repo" / "too-big")
    finally:
        sys.set_int_max_str_digits(previous)


def test_metadata_may_not_hold_tensors(repo_url):
    with pytest.raises(UnsupportedValueError, match="tensors are not allowed"):
        ckptfmt.save({}, f"{repo_url}/x", metadata={"w": torch.ones(1)})


# -- deduplication -------------------------------------------------------------


def test_saving_the_same_state_twice_adds_no_chunks(repo_url):
    model, optimizer, scheduler = make_training()
    train(model, optimizer, scheduler, batches(1, seed=3))
    state = training_state(model, optimizer, scheduler, step=1)
    state["big"] = torch.randn(100_000)  # a chunk of its own besides the packed small tensors
    ckptfmt.save(state, f"{repo_url}/first")
    before = chunk_keys(repo_url)
    assert len(before) >= 2
    ckptfmt.save(state, f"{repo_url}/second")
    assert chunk_keys(repo_url) == before
    with ckptfmt.open(f"{repo_url}/second") as reader:
        assert reader.metadata["stats"]["new_bytes"] == 0
        assert reader.metadata["parent"] == "first"
    assert_same(state, ckptfmt.load(f"{repo_url}/second"))


def test_changing_one_tensor_stores_only_its_chunks(repo_url):
    g = torch.Generator().manual_seed(5)
    state = {f"layer{i}": torch.randn(80_000, generator=g) for i in range(10)}  # 320 KB each
    ckptfmt.save(state, f"{repo_url}/a")
    first = chunk_keys(repo_url)
    assert len(first) == 10

    changed = dict(state, layer3=state["layer3"] + 1)
    ckptfmt.save(changed, f"{repo_url}/b")
    added = chunk_keys(repo_url) - first
    with ckptfmt.open(f"{repo_url}/b") as reader:
        assert added == tensor_chunk_keys(reader, "layer3")
        assert reader.metadata["stats"]["new_bytes"] == 320_000
        for i in range(10):
            if i != 3:
                with ckptfmt.open(f"{repo_url}/a") as old:
                    assert tensor_chunk_keys(reader, f"layer{i}") == tensor_chunk_keys(old, f"layer{i}")
    assert_same(changed, ckptfmt.load(f"{repo_url}/b"))
    assert_same(state, ckptfmt.load(f"{repo_url}/a"))


def test_in_place_changes_between_saves_are_seen(tmp_path):
    """The in-process hash cache is keyed by address: the same memory with new bytes must be re-hashed."""
    repo = tmp_path / "repo"
    weights = torch.randn(100_000)
    before = weights.clone()
    ckptfmt.save({"w": weights}, repo / "a")
    weights.add_(1.0)  # same tensor, same address, new contents
    ckptfmt.save({"w": weights}, repo / "b")
    assert_tensor_exact(weights, ckptfmt.load(repo / "b")["w"])
    assert_tensor_exact(before, ckptfmt.load(repo / "a")["w"])
    assert len(chunk_keys(str(repo))) == 2


# -- chunking and compression ----------------------------------------------------


def test_tensors_larger_than_a_chunk_split_and_reassemble(repo_url):
    g = torch.Generator().manual_seed(7)
    state = {
        "exact_multiple": torch.randn(65536, generator=g),  # 256 KiB = 4 chunks
        "ragged": torch.randn(3, 100_003, generator=g).t(),  # 1.2 MB, last chunk partial
        "repeated": torch.zeros(16 * 65536, dtype=torch.uint8),  # 16 identical chunks
        "small": torch.arange(10),
    }
    ckptfmt.save(state, f"{repo_url}/split", chunk_size=65536)
    with ckptfmt.open(f"{repo_url}/split") as reader:
        pieces = reader.tensor_info("exact_multiple").shards[0].pieces
        assert [p.length for p in pieces] == [65536] * 4
        ragged = reader.tensor_info("ragged").shards[0].pieces
        assert len(ragged) == math.ceil(3 * 100_003 * 4 / 65536)
        assert sum(p.length for p in ragged) == 3 * 100_003 * 4
        assert max(p.length for p in ragged) == 65536
        repeated = reader.tensor_info("repeated").shards[0].pieces
        assert len(repeated) == 16 and len({p.chunk for p in repeated}) == 1
        assert all(c.size <= 65536 for c in reader.manifest.chunks)
        assert_tensor_exact(state["ragged"], reader.get_tensor("ragged"))
    assert_same(state, ckptfmt.load(f"{repo_url}/split"))


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
@pytest.mark.parametrize("compression", ["zstd", "shuffle-zstd"])
def test_compression_round_trips(repo_url, compression):
    g = torch.Generator().manual_seed(11)
    state = {
        "fp32": torch.randn(70_000, generator=g),
        "bf16": torch.randn(150_000, generator=g).to(torch.bfloat16),
        "int64": torch.arange(40_000),
        "float64": torch.randn(5, 7, generator=g, dtype=torch.float64),
        "zeros": torch.zeros(4 * 65536, dtype=torch.uint8),  # identical chunks, compressed
        "odd": random_tensor(torch.complex32, (33_333,), g),
        "small": torch.tensor([1, 2, 3], dtype=torch.int16),
    }
    url = f"{repo_url}/{compression}"
    ckptfmt.save(state, url, compression=compression, chunk_size=65536)
    assert_same(state, ckptfmt.load(url))
    with ckptfmt.open(url) as reader:
        codecs = {c.codec for c in reader.manifest.chunks}
        if compression == "zstd":
            assert codecs == {"zstd"}
        else:
            assert {"shuffle4-zstd", "shuffle2-zstd", "shuffle8-zstd"} <= codecs
        zeros = reader.manifest.chunks[reader.tensor_info("zeros").shards[0].pieces[0].chunk]
        assert zeros.stored_size < zeros.size // 100
        for key in state:
            assert_tensor_exact(state[key], reader.get_tensor(key), key)
    assert all(k.rsplit(".", 1)[-1] in {"zstd", "shuffle2-zstd", "shuffle4-zstd", "shuffle8-zstd"}
               for k in chunk_keys(repo_url))
    assert ckptfmt.verify(url).ok


def test_unknown_compression_is_refused_before_writing(tmp_path):
    with pytest.raises(ValueError, match="compression"):
        ckptfmt.save({"w": torch.ones(2)}, tmp_path / "repo" / "x", compression="lz4")
    assert not (tmp_path / "repo").exists()


# -- RNG, names, latest ------------------------------------------------------------


def test_restore_rng_restores_every_stream(repo_url):
    torch.manual_seed(3)
    np.random.seed(4)
    random.seed(5)
    torch.rand(10)
    np.random.standard_normal()  # leaves a cached gaussian in numpy's legacy state
    random.gauss(0, 1)  # and one in Python's
    ckptfmt.save({"x": 1}, f"{repo_url}/rng")

    def draw():
        return (torch.rand(5).tolist(), torch.randn(3).tolist(), np.random.standard_normal(3).tolist(),
                np.random.randint(0, 2**30, 4).tolist(), random.random(), random.gauss(0, 1))

    expected = draw()
    draw()  # move every generator further on
    ckptfmt.restore_rng(f"{repo_url}/rng")
    assert draw() == expected
    with ckptfmt.open(f"{repo_url}/rng") as reader:
        ckptfmt.restore_rng(reader)
    assert draw() == expected


def test_pythons_generator_state_restores_and_compares_from_either_form(tmp_path):
    """Format 1.13 keeps Python's 625 state words as one bin; a 1.12 manifest's array of ints restores the
    same generator, and the resume check and diff call the two forms' states equal."""
    from ckptfmt.format.rng_states import python_words
    from ckptfmt.loading.resume_check import check_generators
    from ckptfmt.storage.factory import open_storage
    from ckptfmt.tools.diff import metadata_difference
    from tests.support.helpers import rewrite_manifest

    random.seed(11)
    random.random()
    for name in ("bin", "ints"):
        ckptfmt.save({"x": 1}, tmp_path / "repo" / name)
    with ckptfmt.open(tmp_path / "repo" / "bin") as reader:
        state = reader.metadata["rng"][0]["python"]["state"]
        assert type(state) is bytes and len(state) == 2500 and python_words(state) == random.getstate()[1]
    rewrite_manifest(open_storage(tmp_path / "repo"), "ints", lambda doc: doc["rng"][0]["python"].update(
        state=list(python_words(doc["rng"][0]["python"]["state"]))))
    expected = [random.random() for _ in range(3)]
    for name in ("bin", "ints"):
        random.seed(99)
        with ckptfmt.open(tmp_path / "repo" / name) as reader:
            assert (type(reader.metadata["rng"][0]["python"]["state"]) is list) == (name == "ints")
            ckptfmt.restore_rng(reader)
            assert check_generators(reader).verdict == "equal"
            assert [random.random() for _ in range(3)] == expected
    with ckptfmt.open(tmp_path / "repo" / "bin") as a, ckptfmt.open(tmp_path / "repo" / "ints") as b:
        assert not [field for field, _, _ in metadata_difference(a, b) if field.startswith("rng.")]


@pytest.mark.parametrize("state", [b"\x00" * 2499, [1] * 624, [1.0] * 625])
def test_a_malformed_python_state_leaves_the_generators_as_they_were(tmp_path, state):
    from ckptfmt.storage.factory import open_storage
    from tests.support.helpers import rewrite_manifest

    ckptfmt.save({"x": 1}, tmp_path / "repo" / "a")
    rewrite_manifest(open_storage(tmp_path / "repo"), "a", lambda doc: doc["rng"][0]["python"].update(state=state))
    random.seed(5)
    torch.manual_seed(5)
    before = (random.getstate(), torch.get_rng_state())
    with pytest.raises(ckptfmt.CheckpointError, match="malformed RNG state .python state must be 625 ints"):
        ckptfmt.restore_rng(tmp_path / "repo" / "a")
    assert random.getstate() == before[0] and torch.equal(torch.get_rng_state(), before[1])


def test_restore_rng_for_a_missing_rank(repo_url):
    ckptfmt.save({}, f"{repo_url}/rng")
    with pytest.raises(ckptfmt.CheckpointNotFoundError, match="rank 5"):
        ckptfmt.restore_rng(f"{repo_url}/rng", rank=5)


def test_saving_an_existing_name_is_refused(repo_url):
    ckptfmt.save({"v": torch.ones(3)}, f"{repo_url}/ckpt", step=1)
    with pytest.raises(CheckpointExistsError) as info:
        ckptfmt.save({"v": torch.zeros(3)}, f"{repo_url}/ckpt", step=2)
    assert isinstance(info.value, FileExistsError)
    assert torch.equal(ckptfmt.load(f"{repo_url}/ckpt")["v"], torch.ones(3))


def test_loading_a_repository_returns_its_latest_checkpoint(repo_url):
    # Latest means most recently committed, not last in name order.
    for step, name in enumerate(["zz-first", "mm-second", "aa-third"]):
        ckptfmt.save({"step": step, "w": torch.full((4,), float(step))}, f"{repo_url}/{name}", step=step)
    loaded = ckptfmt.load(repo_url)
    assert loaded["step"] == 2 and torch.equal(loaded["w"], torch.full((4,), 2.0))
    assert ckptfmt.load(repo_url + "/")["step"] == 2
    with ckptfmt.open(repo_url) as reader:
        assert reader.name == "aa-third"
        assert reader.metadata["parent"] == "mm-second"
    repo = ckptfmt.Repository.open(repo_url)
    assert repo.names() == ["aa-third", "mm-second", "zz-first"]
    assert repo.latest() == "aa-third"
    assert [r.name for r in repo.commits()] == ["zz-first", "mm-second", "aa-third"]
    assert CheckpointReader.from_parts(repo, "mm-second").load_state()["step"] == 1


def test_loading_an_empty_repository(repo_url):
    ckptfmt.save({}, f"{repo_url}/x")
    repo = ckptfmt.Repository.open(repo_url)
    # An empty repository has no latest checkpoint to load.
    empty = repo_url + "-empty"
    ckptfmt.Repository.open(empty, create=True)
    with pytest.raises(ckptfmt.CheckpointNotFoundError, match="no checkpoints"):
        ckptfmt.load(empty)
    with pytest.raises(ckptfmt.CheckpointNotFoundError):
        ckptfmt.load(f"{repo_url}/missing")
    assert repo.names() == ["x"]


def test_explicit_parent_and_no_parent(repo_url):
    ckptfmt.save({"a": torch.ones(300_000, dtype=torch.uint8)}, f"{repo_url}/a")
    ckptfmt.save({"b": 1}, f"{repo_url}/b", parent=None)
    ckptfmt.save({"c": 1}, f"{repo_url}/c", parent="a")
    with pytest.raises(ckptfmt.CheckpointNotFoundError, match="parent"):
        ckptfmt.save({"d": 1}, f"{repo_url}/d", parent="nope")
    assert ckptfmt.open(f"{repo_url}/b").metadata["parent"] is None
    assert ckptfmt.open(f"{repo_url}/c").metadata["parent"] == "a"
    assert "d" not in ckptfmt.Repository.open(repo_url).names()


def test_state_is_not_modified_by_saving(tmp_path):
    model, optimizer, scheduler = make_training()
    train(model, optimizer, scheduler, batches(2, seed=4))
    state = training_state(model, optimizer, scheduler, step=2)
    snapshot = copy.deepcopy(state)
    ckptfmt.save(state, tmp_path / "repo" / "s")
    assert_same(snapshot, state)
