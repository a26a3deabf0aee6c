"""The tensor table's usual rows are checked by a short path (``_usual_row``): it must accept exactly what
the full parse accepts, with the same entry, and leave every other row to the full parse (which then
names what is wrong). Rows of saved checkpoints, and thousands of mutations of them, each one leaf
replaced by a value of another type or range."""

from __future__ import annotations

import copy
import json
import random

import msgpack
import pytest
import torch

import ckptfmt
from ckptfmt.errors import CheckpointError
from ckptfmt.format.manifest import _Budget, _parse_tensor, _Sizes, _usual_row
from tests.support.spec_reader import chunk_rows, tensor_rows

#: Values a mutation puts in place of a leaf: other types, signs, bounds and shapes.
REPLACEMENTS = [None, True, False, 0, 1, -1, 2, 3, 7, 2**63, 2**64, 1.0, -0.0, float("nan"), "", "x",
                "float32", "tensor", [], [0], [1], [2, 3], [[0, 0, 4]], {}, {"count": 1}, b"\x00"]


def leaves(node, path=()):
    """Every place in a row a value sits: (path, value), maps and lists included."""
    yield path, node
    if isinstance(node, dict):
        for key, value in node.items():
            yield from leaves(value, (*path, key))
    elif isinstance(node, list):
        for index, value in enumerate(node):
            yield from leaves(value, (*path, index))


def replaced(row, path, value):
    row = copy.deepcopy(row)
    if not path:
        return value
    target = row
    for step in path[:-1]:
        target = target[step]
    target[path[-1]] = value
    return row


def outcome(parse, row):
    try:
        return parse(row)
    except (CheckpointError, KeyError, TypeError, ValueError, AttributeError, OverflowError):
        return "refused"


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    folder = tmp_path_factory.mktemp("rows")
    state = {"w": torch.randn(3, 4), "b": torch.ones(5, dtype=torch.bfloat16), "i": torch.arange(6),
             "flag": torch.tensor([True, False]), "c": torch.ones(2, dtype=torch.complex64), "s": torch.tensor(2.5)}
    ckptfmt.save(state, str(folder / "repo" / "a"))
    commit = json.loads((folder / "repo" / "a" / "COMMIT").read_bytes())
    data = (folder / "repo" / "a" / f"manifest-{commit['manifest']}.msgpack").read_bytes()
    doc = msgpack.unpackb(data, raw=False, strict_map_key=False)
    return tensor_rows(doc["tensors"]), _Sizes(chunk["size"] for chunk in chunk_rows(doc["chunks"]))


def test_saved_rows_take_the_short_path_and_give_the_full_parses_entries(rows):
    tensors, sizes = rows
    for index, row in enumerate(tensors):
        usual = _usual_row(row, sizes)
        assert usual is not None, row
        assert usual == _parse_tensor(row, index, sizes, _Budget())


def test_every_mutation_is_accepted_by_the_short_path_only_as_the_full_parse_accepts_it(rows):
    tensors, sizes = rows
    generator = random.Random(7)
    short_accepted = 0
    for row in tensors:
        places = [path for path, _ in leaves(row)]
        for path in places:
            for value in REPLACEMENTS:
                mutated = replaced(row, path, value)
                usual = _usual_row(mutated, sizes)
                if usual is not None:
                    short_accepted += 1
                    assert usual == outcome(lambda r: _parse_tensor(r, 0, sizes, _Budget()), mutated), \
                        (path, value)
        for _ in range(300):  # two leaves at once
            mutated = row
            for _ in range(2):
                mutated = replaced(mutated, generator.choice([p for p, _ in leaves(mutated)]),
                                   generator.choice(REPLACEMENTS))
            usual = _usual_row(mutated, sizes)
            if usual is not None:
                assert usual == outcome(lambda r: _parse_tensor(r, 0, sizes, _Budget()), mutated), mutated
    assert short_accepted  # some mutations keep a valid usual row (a rank, a stat's value, requires_grad)
