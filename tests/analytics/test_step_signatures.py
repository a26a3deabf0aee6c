"""Each step signed with its inputs (spec 9.4, 1.8): every generator's state at the step's start, the
batch (its sample indices, or its tensors' bytes), and the loss's exact bits among the metrics."""

from __future__ import annotations

import random

import blake3
import numpy as np
import pytest
import torch

import ckptfmt
from ckptfmt.metadata.rng_digests import RngDigests
from ckptfmt.metadata.step_timer import decode_steps, encode_steps
from tests.support.helpers import cuda_name


def signed_steps(timer: ckptfmt.StepTimer, steps: range, draw) -> dict:
    """Run ``steps``, calling ``draw(step)`` inside each (the step's randomness); the decoded records."""
    for step in steps:
        with timer.step(step):
            draw(step)
    return decode_steps(timer.snapshot(), "here")


def seed_all(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


@pytest.mark.parametrize("source", ["torch", "numpy", "python"])
def test_a_draw_changes_its_own_generators_digest_and_no_other(source):
    draws = {"torch": lambda: torch.rand(3), "numpy": lambda: np.random.rand(3), "python": random.random}
    seed_all(0)
    records = signed_steps(ckptfmt.StepTimer(system_interval=None), range(3),
                           lambda step: draws[source]() if step == 1 else None)
    assert {name for name in records.rng if not cuda_name(name)} == {"torch", "numpy", "python"}
    for name, digests in records.rng.items():
        changed = [bytes(digests[i]) != bytes(digests[i + 1]) for i in range(2)]
        assert changed == ([False, True] if name == source else [False, False]), name


def test_the_same_seeds_sign_the_same_steps_and_another_seed_differs():
    runs = []
    for seed in (0, 0, 1):
        seed_all(seed)
        runs.append(signed_steps(ckptfmt.StepTimer(system_interval=None), range(4),
                                 lambda step: (torch.rand(2), np.random.rand(2), random.random())))
    for name in ("torch", "numpy", "python"):
        assert np.array_equal(runs[0].rng[name], runs[1].rng[name]), name
        assert not (runs[0].rng[name] == runs[2].rng[name]).all(axis=1).any(), name


def test_digests_are_blake3_of_each_state_as_the_spec_says():
    seed_all(3)
    np.random.rand(5)  # a position inside the state
    digests = RngDigests().digests()
    key, position = np.random.get_state()[1:3]
    numpy_state = np.asarray(key, "<u4").tobytes() + int(position).to_bytes(4, "little", signed=True)
    assert digests["numpy"] == blake3.blake3(numpy_state).digest(16)
    python_words = np.array(random.getstate()[1], dtype="<u4").tobytes()
    assert digests["python"] == blake3.blake3(python_words).digest(16)
    assert digests["torch"] == blake3.blake3(torch.get_rng_state().numpy().tobytes()).digest(16)


def test_tracked_generators_are_digested_over_the_state_bytes_the_spec_names():
    """Spec 9.4, generator state bytes: a torch Generator's get_state(), a random.Random's 625 words, a numpy
    MT19937's key words and position; another bit generator's state map as sorted text (ckptfmt's form)."""
    made = {"sampler": torch.Generator().manual_seed(1), "random": random.Random(2),
            "mt": np.random.Generator(np.random.MT19937(3)), "legacy": np.random.RandomState(4),
            "pcg": np.random.default_rng(5)}
    made["mt"].random(3)
    digests = RngDigests(made).digests()

    def mt_bytes(bit_generator) -> bytes:
        state = bit_generator.state["state"]
        return np.asarray(state["key"], "<u4").tobytes() + int(state["pos"]).to_bytes(4, "little", signed=True)

    def sorted_text(value):
        if isinstance(value, dict):
            return sorted((str(k), sorted_text(v)) for k, v in value.items())
        return value.tolist() if isinstance(value, np.ndarray) else value

    expected = {"sampler": made["sampler"].get_state().numpy().tobytes(),
                "random": np.array(made["random"].getstate()[1], dtype="<u4").tobytes(),
                "mt": mt_bytes(made["mt"].bit_generator), "legacy": mt_bytes(made["legacy"]._bit_generator),
                "pcg": repr(sorted_text(made["pcg"].bit_generator.state)).encode()}
    assert {name: digests[name] for name in made} == {name: blake3.blake3(data).digest(16)
                                                     for name, data in expected.items()}


def test_a_batch_of_tensors_is_digested_as_the_spec_describes():
    """Spec 9.4, batch_kind 2: depth first (a dict's values in order), each tensor's description (torch dtype
    name or numpy's dtype.str, then the shape as "(32, 128)", "(8,)", "()") then its bytes; strings skipped;
    the batch size is the first non-zero leading dimension."""
    x, y = torch.arange(6, dtype=torch.float32).reshape(2, 3), np.arange(4, dtype="<i8")
    scalar, empty = torch.tensor(5, dtype=torch.int64), torch.zeros(0, 2, dtype=torch.bfloat16)
    timer = ckptfmt.StepTimer(system_interval=None)
    records = signed_steps(timer, range(1), lambda step: timer.batch_tensors(
        {"empty": empty, "x": x, "rest": [y, "a label", (scalar,)]}))
    digest = blake3.blake3()
    for text, data in (("bfloat16(0, 2)", b""), ("float32(2, 3)", x.numpy().tobytes()), ("<i8(4,)", y.tobytes()),
                       ("int64()", scalar.numpy().tobytes())):
        digest.update(text.encode())
        digest.update(data)
    assert (records.batch_kind[0], records.batch_size[0]) == (2, 2)
    assert records.batch[0].tobytes() == digest.digest(16)


def test_a_data_loaders_generator_is_tracked_by_name():
    generator = torch.Generator().manual_seed(5)
    timer = ckptfmt.StepTimer(system_interval=None, generators={"sampler": generator})
    timer.track_generator("augment", random.Random(7))
    records = signed_steps(timer, range(3), lambda step: torch.randperm(4, generator=generator))
    assert {name for name in records.rng if not cuda_name(name)} == {"torch", "numpy", "python", "sampler", "augment"}
    sampler = records.rng["sampler"]
    assert bytes(sampler[0]) != bytes(sampler[1]) and not (records.rng["torch"] != records.rng["torch"][0]).any()
    with pytest.raises(ValueError, match="a name of its own"):
        timer.track_generator("torch", generator)
    with pytest.raises(ValueError, match="cannot digest the generator 'x': a str"):
        timer.track_generator("x", "seed")


def test_a_batch_is_signed_by_its_tensors_where_the_indices_are_not_known():
    timer = ckptfmt.StepTimer(system_interval=None, rng=False)
    batches = [{"x": torch.ones(4, 3), "y": torch.zeros(4, dtype=torch.long)},
               {"x": torch.ones(4, 3), "y": torch.zeros(4, dtype=torch.long)},
               {"x": torch.ones(4, 3), "y": torch.ones(4, dtype=torch.long)},
               (np.ones((4, 3), np.float32), ["ids"])]
    records = signed_steps(timer, range(4), lambda step: timer.batch_tensors(batches[step]))
    digests = [bytes(d) for d in records.batch]
    assert digests[0] == digests[1] != digests[2] != digests[3]
    assert records.batch_kind.tolist() == [2, 2, 2, 2] and records.batch_size.tolist() == [4, 4, 4, 4]
    assert records.rng == {}
    with timer.step(9):
        timer.batch([1, 2])
        with pytest.raises(ValueError, match="recorded sample indices: use one or the other"):
            timer.batch_tensors(torch.ones(2))


def test_records_without_signatures_read_as_before():
    timer = ckptfmt.StepTimer(system_interval=None, rng=False)
    for step in range(2):
        with timer.step(step):
            timer.batch([step])
    record = timer.snapshot()
    assert "rng" not in record and "batch_kind" not in record  # what 1.7 writers wrote
    columns = decode_steps(record, "here")
    assert columns.batch_kind.tolist() == [1, 1] and columns.rng == {}
    with pytest.raises(ckptfmt.ManifestError, match="here: rng.torch is not 32 uint8 values"):
        decode_steps({**record, "rng": {"torch": b"short"}}, "here")
    with pytest.raises(ckptfmt.ManifestError, match="batch_kind holds a value other than"):
        decode_steps({**record, "batch_kind": b"\x01\x07"}, "here")


def test_the_loss_keeps_its_exact_bits():
    timer = ckptfmt.StepTimer(system_interval=None, rng=False)
    loss = torch.tensor(0.1, dtype=torch.float32) * 3
    with timer.step(0):
        timer.metrics(loss=loss, grad_norm=torch.tensor(1e-8, dtype=torch.bfloat16))
    columns = decode_steps(encode_steps(timer._columns), "here")
    assert np.float32(columns.metrics["loss"][0]).tobytes() == loss.numpy().tobytes()
    assert torch.tensor(columns.metrics["grad_norm"][0]).to(torch.bfloat16) == torch.tensor(1e-8, dtype=torch.bfloat16)


def test_the_steps_table_holds_the_signatures(tmp_path):
    from ckptfmt.analytics import tables

    url = str(tmp_path / "run")
    timer = ckptfmt.StepTimer(system_interval=None, generators={"order": torch.Generator().manual_seed(1)})
    for step in range(3):
        with timer.step(step):
            if step == 2:
                timer.batch_tensors(torch.ones(2, 2))
            else:
                timer.batch([step])
            torch.rand(1)
        timer.metrics(loss=0.5)
    ckptfmt.save({"w": torch.ones(1)}, f"{url}/a", step=3, timer=timer)
    steps = tables(url)["steps"]
    assert steps.column("batch_kind").to_pylist() == [1, 1, 2]
    assert {f"rng_{name}" for name in ("torch", "numpy", "python", "order")} <= set(steps.column_names)
    torch_digests = steps.column("rng_torch").to_pylist()
    assert len(set(torch_digests)) == 3 and all(len(d) == 16 for d in torch_digests)  # a draw each step
    assert len(set(steps.column("rng_order").to_pylist())) == 1  # never drawn from
