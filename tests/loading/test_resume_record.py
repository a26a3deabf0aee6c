"""Every resume on record with what it restored (issue 29, part 3): ``record_resume`` compares the live
objects with the checkpoint part by part, and the next checkpoint holds the record (spec 9.4 ``resumes``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import ckptfmt
from ckptfmt import CheckpointManager
from ckptfmt.lifecycle.gc import remove
from ckptfmt.metadata.resumes import pending_resumes
from ckptfmt.repository.history import read_histories, removed_histories
from ckptfmt.repository.progress import read_progress
from tests.support.helpers import require_module


def make(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 2, 0.5)
    return model, optimizer, scheduler


def train(model, optimizer, scheduler, steps: int) -> None:
    for _ in range(steps):
        loss = model(torch.randn(4, 6)).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()


def state_of(model, optimizer, scheduler) -> dict:
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
            "step": 5}


@pytest.fixture(autouse=True)
def no_pending():
    """Each test starts and ends with no resume waiting for a save (they are per process)."""
    from ckptfmt.loading import loaded_fingerprints
    from ckptfmt.metadata import resumes

    resumes._PENDING.clear()
    loaded_fingerprints._LOADED.clear()
    yield
    resumes._PENDING.clear()
    loaded_fingerprints._LOADED.clear()


@pytest.fixture
def checkpoint(tmp_path) -> str:
    model, optimizer, scheduler = make()
    train(model, optimizer, scheduler, 5)
    url = f"{tmp_path}/run/step-5"
    ckptfmt.save(state_of(model, optimizer, scheduler), url, step=5)
    return url


def verdicts(record) -> dict[str, str]:
    return {part.part: part.verdict for part in record.parts}


def test_a_clean_resume_is_equal_part_by_part_and_goes_into_the_next_checkpoint(checkpoint, tmp_path):
    model, optimizer, scheduler = make(seed=1)
    state = ckptfmt.load(checkpoint)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    record = ckptfmt.record_resume(checkpoint, {"model": model, "optimizer": optimizer, "scheduler": scheduler,
                                                "step": 5})
    assert verdicts(record) == {"model": "equal", "optimizer": "equal", "scheduler": "equal", "step": "equal"}
    assert record.restored and (record.name, record.step, record.world_size_then, record.world_size_now) == (
        "step-5", 5, 1, 1)
    # 4 parameters' step, exp_avg and exp_avg_sq, and each of the param group's settings
    assert record.parts[1].stored == 4 * 3 + len(optimizer.state_dict()["param_groups"][0])
    train(model, optimizer, scheduler, 1)
    ckptfmt.save(state_of(model, optimizer, scheduler), f"{tmp_path}/run/step-6", step=6)
    with ckptfmt.open(f"{tmp_path}/run/step-6") as reader:
        (entry,) = reader.metadata["timing"]["ranks"]
    (stored,) = entry["resumes"]
    assert stored["from"] == {"repository": f"{tmp_path}/run", "name": "step-5", "manifest": record.manifest,
                              "step": 5, "created_ns": record.created_ns}
    assert [p["verdict"] for p in stored["parts"]] == ["equal"] * 4 and stored["world_size"] == [1, 1]
    assert pending_resumes() == []  # on record once committed: the next save holds none
    ckptfmt.save({"x": torch.ones(1)}, f"{tmp_path}/run/step-7", step=7)
    with ckptfmt.open(f"{tmp_path}/run/step-7") as reader:
        assert "resumes" not in reader.metadata["timing"]["ranks"][0]


def test_a_dropped_optimizer_state_and_an_unloaded_scheduler_are_named(checkpoint):
    model, optimizer, scheduler = make(seed=1)
    state = ckptfmt.load(checkpoint)
    model.load_state_dict(state["model"])  # the optimizer and the scheduler are left as they were made
    record = ckptfmt.record_resume(checkpoint, {"model": model, "optimizer": optimizer, "scheduler": scheduler})
    assert verdicts(record) == {"model": "equal", "optimizer": "missing", "scheduler": "different"}
    optimizer_check, scheduler_check = record.parts[1], record.parts[2]
    assert optimizer_check.missing == 12 and "optimizer/state/0/exp_avg" in optimizer_check.keys
    assert "scheduler/last_epoch" in scheduler_check.keys and not record.restored


def test_a_model_of_other_weights_is_different_and_a_part_never_saved_is_said_so(checkpoint):
    model, optimizer, _ = make(seed=2)
    record = ckptfmt.record_resume(checkpoint, {"model": model, "scaler": {"scale": 1.0}})
    assert verdicts(record) == {"model": "different", "scaler": "not stored"}
    assert record.parts[0].different == 4


def test_the_manager_records_its_restores_and_a_failed_save_keeps_the_record(tmp_path, monkeypatch):
    url = str(tmp_path / "run")
    model, optimizer, scheduler = make()
    with CheckpointManager(url) as manager:
        manager.save(1, state_of(model, optimizer, scheduler), force=True)
    fresh = make(seed=3)
    with CheckpointManager(url) as manager:
        into = {"model": fresh[0].state_dict(), "optimizer": fresh[1].state_dict()}
        manager.restore(into=into, strict=False, rng=True)
        (pending,) = pending_resumes()
        assert {p["part"]: p["verdict"] for p in pending["parts"]} == {  # what the state did not take too
            "model": "equal", "optimizer": "equal", "rng": "equal", "scheduler": "missing", "step": "missing"}
        from ckptfmt.saving import pipeline

        def broken(*args, **kwargs):
            raise ckptfmt.StorageError("disk gone")
        monkeypatch.setattr(pipeline, "_manifest", broken)
        with pytest.raises(ckptfmt.StorageError):
            manager.save(2, {"w": torch.ones(2)}, force=True)
        monkeypatch.undo()
        assert len(pending_resumes()) == 1  # still waiting for a checkpoint that holds it
        manager.save(3, {"w": torch.ones(2)}, force=True)
    with ckptfmt.open(f"{url}/step-000000003") as reader:
        assert len(reader.metadata["timing"]["ranks"][0]["resumes"]) == 1


def test_a_removed_checkpoints_history_keeps_its_resumes(checkpoint, tmp_path):
    model, optimizer, scheduler = make(seed=1)
    ckptfmt.record_resume(checkpoint, {"model": model})
    ckptfmt.save({"x": torch.ones(1)}, f"{tmp_path}/run/step-6", step=6)
    ckptfmt.save({"x": torch.ones(1)}, f"{tmp_path}/run/step-7", step=7)
    repo = ckptfmt.Repository.open(f"{tmp_path}/run")
    remove(repo, ["step-6"])
    (history,) = read_histories(repo, removed_histories(repo, repo.commits()))
    (resume,) = history.timing["ranks"][0]["resumes"]
    assert resume["from"]["name"] == "step-5" and resume["parts"][0]["verdict"] == "different"


def test_a_data_loader_position_saved_per_rank_is_compared_with_this_ranks(tmp_path):
    url = f"{tmp_path}/run/a"
    ckptfmt.save({"dataloader": ckptfmt.PerRank({"position": 12, "epoch": 1})}, url)
    assert verdicts(ckptfmt.record_resume(url, {"dataloader": {"position": 12, "epoch": 1}})) == {
        "dataloader": "equal"}
    reset = ckptfmt.record_resume(url, {"dataloader": {"position": 0, "epoch": 1}})
    assert verdicts(reset) == {"dataloader": "different"} and reset.parts[0].keys == ["dataloader/0/position"]


def test_a_data_loader_that_misreports_its_restored_position_is_found(tmp_path):
    """torchdata's StatefulDataLoader resumed by fast-forwarding an IterableDataset without a state_dict
    reports twice the batches it skipped: on record at once as ``different``, where a second resume
    would skip batches (shown here: it yields batch 6 where batch 4 is due)."""
    stateful = require_module("torchdata.stateful_dataloader", "torchdata comes with torchtitan, a test dependency")

    class Numbers(torch.utils.data.IterableDataset):
        def __iter__(self):
            generator = torch.Generator().manual_seed(100)
            while True:
                yield torch.randn(4, generator=generator)

    def loader():
        return stateful.StatefulDataLoader(Numbers(), batch_size=2)
    reference = iter(loader())
    batches = [next(reference) for _ in range(6)]
    first = loader()
    iterator = iter(first)
    next(iterator), next(iterator)
    url = f"{tmp_path}/run/a"
    with pytest.warns(UserWarning):  # torchdata's own note that it fast-forwards
        ckptfmt.save({"loader": first.state_dict()}, url)
        resumed = loader()
        resumed.load_state_dict(ckptfmt.load(url)["loader"])
        record = ckptfmt.record_resume(url, {"loader": resumed})
        assert verdicts(record) == {"loader": "different"} and "loader/_num_yielded" in record.parts[0].keys
        assert torch.equal(next(iter(resumed)), batches[2])  # this resume goes on right...
        again = loader()
        again.load_state_dict(resumed.state_dict())
        assert torch.equal(next(iter(again)), batches[5])  # ...a second one skips two batches


def test_a_resume_right_after_its_load_compares_fingerprints_and_finds_a_change(tmp_path):
    """What this process has just loaded is compared by sampled fingerprints where tensors are large (no
    hashing of the whole state), exactly where they are small: a change after the load is found."""
    from ckptfmt.loading import loaded_fingerprints

    url = f"{tmp_path}/run/a"
    big = torch.nn.Linear(256, 256)  # a 256 KiB weight: fingerprinted when loaded; its 1 KiB bias: exact
    ckptfmt.save({"model": big.state_dict()}, url)
    state = ckptfmt.load(url)
    (_, fingerprints), = loaded_fingerprints._LOADED.values()
    assert set(fingerprints) == {"model/weight"}
    live = torch.nn.Linear(256, 256)
    live.load_state_dict(state["model"])
    assert verdicts(ckptfmt.record_resume(url, {"model": live})) == {"model": "equal"}
    with torch.no_grad():
        live.weight[0, 0] += 1.0  # the first bytes: in the first window
        live.bias[7] += 1.0
    record = ckptfmt.record_resume(url, {"model": live})
    assert verdicts(record) == {"model": "different"} and record.parts[0].keys == ["model/weight", "model/bias"]


def test_a_process_remembers_only_its_last_few_loads(tmp_path):
    """Each load keeps its manifest and fingerprints for a resume's check: a process that loads many
    checkpoints (an evaluation sweep) keeps the last few, not all of them."""
    from ckptfmt.loading import loaded_fingerprints

    urls = [ckptfmt.save({"w": torch.full((32_768,), float(i))}, f"{tmp_path}/run/s{i}") for i in range(7)]
    for url in urls:
        ckptfmt.load(url)
    kept = loaded_fingerprints._LOADED
    assert len(kept) == loaded_fingerprints.LOADS_REMEMBERED
    assert verdicts(ckptfmt.record_resume(urls[-1], {"w": torch.full((32_768,), 6.0)})) == {"w": "equal"}


def test_a_fingerprint_is_of_values_whatever_the_layout():
    """Contiguous CPU tensors are sampled at their address, others through torch views: both give the
    same fingerprint for the same values; a conjugate view is taken by its values (it raised before)."""
    from ckptfmt.loading.loaded_fingerprints import fingerprint

    torch.manual_seed(0)
    for wide in (torch.randn(300, 300).t(), torch.randn(40, 30).t(), torch.randn(2, 4000)[:, ::2]):
        assert not wide.is_contiguous()
        assert fingerprint(wide) == fingerprint(wide.contiguous())
    z = torch.randn(64, 64, dtype=torch.complex64)
    assert fingerprint(z.conj()) == fingerprint(z.conj().resolve_conj()) != fingerprint(z)
    a = torch.randn(2048)  # 8 KiB: sampled, first and last bytes included
    for at in (0, 2047):
        b = a.clone()
        b[at] += 1
        assert fingerprint(b) != fingerprint(a) == fingerprint(a.clone())


@pytest.mark.parametrize(("verify", "compression"), [(False, None), ("once", None), (True, None),
                                                     (False, "shuffle-zstd")])
def test_a_whole_load_keeps_the_fingerprints_of_its_large_tensors(tmp_path, verify, compression):
    """The fingerprints a whole load keeps for a resume's check are those of the state it gave, by key (a
    shared tensor's second key too): taken as each tensor is read (no walk of the state after), a view of
    an unhashed map's from its chunk file (sampling it would read 16 of its pages in). A resume's check
    after such a load still finds a change."""
    from ckptfmt.loading.loaded_fingerprints import EXACT_BYTES, fingerprint, fingerprint_value

    torch.manual_seed(0)
    shared = torch.randn(100_000)
    url = ckptfmt.save({"a": torch.randn(256, 256), "b": shared, "c": shared, "small": torch.randn(8)},
                       f"{tmp_path}/run/a", compression=compression)
    with ckptfmt.open(url, verify=verify) as reader:
        state = reader.load_state(remember=True)
        assert {key: fingerprint_value(kept) for key, kept in reader.fingerprints.items()} == \
            {key: fingerprint(value) for key, value in state.items() if value.nbytes > EXACT_BYTES}
        assert set(reader.fingerprints) == {"a", "b", "c"}
    with ckptfmt.open(url, verify=verify) as reader:
        reader.get_tensor("a")
        assert reader.fingerprints == {}  # only a whole load_state(remember=True)'s are kept
    live = ckptfmt.load(url, verify=verify)
    assert verdicts(ckptfmt.record_resume(url, live)) == {"a": "equal", "b": "equal", "c": "equal", "small": "equal"}
    live["a"][-1, -1] += 1.0
    assert verdicts(ckptfmt.record_resume(url, live))["a"] == "different"



@pytest.mark.parametrize("verify", [True, False])
def test_numpy_arrays_saved_as_tensors_are_checked_as_tensors(tmp_path, verify):
    """A numpy array is stored as a tensor of kind "numpy" and loads as an array: a resume's check
    compares the live array with it exactly (it was "missing" before), and keeps no fingerprint of it
    (the loaded view is no tensor)."""
    arrays = {"large": np.arange(100_000, dtype=np.float32), "small": np.arange(10, dtype=np.int64)[::-1],
              "tensor": torch.randn(300, 300)}
    url = ckptfmt.save(arrays, f"{tmp_path}/run/a")
    with ckptfmt.open(url, verify=verify) as reader:
        reader.load_state(remember=True)
        assert set(reader.fingerprints) == {"tensor"}
    live = ckptfmt.load(url, verify=verify)
    assert verdicts(ckptfmt.record_resume(url, live)) == {"large": "equal", "small": "equal", "tensor": "equal"}
    live["large"][-1] += 1.0
    live["small"][0] += 1
    assert verdicts(ckptfmt.record_resume(url, live)) == {"large": "different", "small": "different",
                                                          "tensor": "equal"}

_NO_ADDRESS_OF_THEIR_OWN = '''
import torch
from ckptfmt.loading.loaded_fingerprints import fingerprint

class Wrapped(torch.Tensor):  # torchao's and NF4's pattern: no storage of its own, data_ptr() is 0
    @staticmethod
    def __new__(cls, inner):
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype, device=inner.device)

    def __init__(self, inner):
        self.inner = inner

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        unwrap = lambda x: x.inner if isinstance(x, Wrapped) else x
        return func(*map(unwrap, args), **{k: unwrap(v) for k, v in (kwargs or {}).items()})

inner = torch.randn(100_000)
assert fingerprint(Wrapped(inner)) == fingerprint(inner)
freed = torch.randn(100_000)
freed.untyped_storage().resize_(0)  # as FSDP frees a parameter's storage in place
assert freed.data_ptr() == 0
fingerprint(freed)
print("fingerprinted")
'''


def test_a_tensor_without_an_address_of_its_own_is_fingerprinted_through_torch():
    """A wrapper subclass or a storage freed in place reports address 0: read there, the process died
    (a segmentation fault, so the check runs in a process of its own)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _NO_ADDRESS_OF_THEIR_OWN], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and "fingerprinted" in done.stdout, done.stderr[-2000:]


def test_loads_remembered_from_several_threads_at_once():
    """Two threads' loads evicted the same oldest entry: one of them raised after its load had worked
    (this test failed 2 runs of 4 before)."""
    import sys
    import threading

    from ckptfmt.loading import loaded_fingerprints

    errors: list[BaseException] = []

    def remember(thread: int) -> None:
        for i in range(2000):
            try:
                loaded_fingerprints.remember_load(f"{thread}-{i}", None, {})  # type: ignore[arg-type]
            except Exception as exc:  # counted: the test's subject
                errors.append(exc)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=remember, args=(n,)) for n in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
    finally:
        sys.setswitchinterval(interval)
    assert errors == [] and len(loaded_fingerprints._LOADED) == loaded_fingerprints.LOADS_REMEMBERED


def test_an_unhashed_load_reads_its_fingerprints_only_when_a_check_asks(tmp_path, monkeypatch):
    """A load that hashes nothing leaves its views' fingerprints to be read from the chunk files when a
    resume's check first needs them (a load no check follows reads no window); a chunk file gone by then
    leaves that tensor to the exact comparison, which still tells equal from different."""
    from ckptfmt.storage.local import LocalStorage

    torch.manual_seed(0)
    url = ckptfmt.save({"a": torch.randn(256, 256), "b": torch.randn(100_000)}, f"{tmp_path}/run/a")
    reads: list[str] = []
    read_windows = LocalStorage.read_windows
    monkeypatch.setattr(LocalStorage, "read_windows",
                        lambda self, key, starts, length: reads.append(key) or read_windows(self, key, starts, length))
    live = ckptfmt.load(url, verify=False)
    assert reads == []
    assert verdicts(ckptfmt.record_resume(url, live)) == {"a": "equal", "b": "equal"} and len(reads) == 2
    live = ckptfmt.load(url, verify=False)
    for chunk in (tmp_path / "run" / "chunks").rglob("*"):
        if chunk.is_file() and chunk.stat().st_size == 100_000 * 4:
            chunk.unlink()  # b's chunk: its map still shows its bytes
    assert verdicts(ckptfmt.record_resume(url, live)) == {"a": "equal", "b": "equal"}
    live["a"][0, 0] += 1.0
    assert verdicts(ckptfmt.record_resume(url, live)) == {"a": "different", "b": "equal"}


def test_a_resume_recorded_by_restore_and_again_by_the_loop_is_one_record(tmp_path):
    """A loop that loads the state itself after ``restore()`` and records the objects it loaded, as
    restore's docstring says it may, makes one record of that resume (issue 46: each restart was counted
    twice), the loop's; ``restored_url`` names the copy restored."""
    url = str(tmp_path / "run")
    model, optimizer, scheduler = make()
    train(model, optimizer, scheduler, 2)
    with CheckpointManager(url) as manager:
        manager.save(2, state_of(model, optimizer, scheduler), force=True)
    fresh = make(seed=3)
    with CheckpointManager(url) as manager:
        state = manager.restore()
        assert manager.restored_url == f"{url}/step-000000002"
        fresh[0].load_state_dict(state["model"])
        ckptfmt.record_resume(manager.restored_url, {"model": fresh[0], "optimizer": fresh[1]})
    (pending,) = pending_resumes()
    assert [(p["part"], p["verdict"]) for p in pending["parts"]] == [("model", "equal"), ("optimizer", "missing")]
    # on record at once, before any save: one progress object, holding the loop's record alone
    (progress,) = read_progress(ckptfmt.Repository.open(url))
    assert progress.steps is None and progress.resumes == [pending]


def test_a_resumed_process_keeps_its_steps_where_it_saves_from_its_first_step(tmp_path):
    """Its resume's progress object takes the step timer's steps from the first one (a process killed before
    its first save is on record with them); the first save to another repository moves them there, the
    resume with them."""
    model, optimizer, scheduler = make()
    ckptfmt.save(state_of(model, optimizer, scheduler), f"{tmp_path}/a/step-5", step=5)
    ckptfmt.record_resume(f"{tmp_path}/a/step-5", {"model": model})
    timer = ckptfmt.StepTimer(system_interval=None, progress_interval=0.0)
    with timer.step(5):
        pass
    timer.progress.write_now()  # as the background write does, here at once
    (progress,) = read_progress(ckptfmt.Repository.open(f"{tmp_path}/a"))
    assert progress.steps is not None and len(progress.resumes) == 1
    ckptfmt.save({"w": torch.ones(2)}, f"{tmp_path}/b/step-6", step=6, timer=timer)
    with timer.step(6):
        pass
    timer.progress.write_now()
    (moved,) = read_progress(ckptfmt.Repository.open(f"{tmp_path}/b"))
    assert moved.steps is not None and moved.resumes is None  # the save to b stored the resume
    with ckptfmt.open(f"{tmp_path}/b/step-6") as reader:
        assert len(reader.metadata["timing"]["ranks"][0]["resumes"]) == 1
