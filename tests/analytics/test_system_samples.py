"""System samples (spec 9.4 ``system``): what a rank's process, host and GPU were doing while it
trained, sampled by its StepTimer without a collective and stored with its steps; absent fields
absent; the analytics ``system`` and ``tensor_stats`` tables."""

from __future__ import annotations

import builtins
import math
import time

import numpy as np
import pytest
import torch

import ckptfmt
from ckptfmt import analytics
from ckptfmt.errors import ManifestError
from ckptfmt.metadata.system import SystemSampler, decode_samples, encode_samples
from tests.support.helpers import cuda_name

#: What a CPU-only Linux machine with psutil gives.
HOST_FIELDS = {"cpu_user_s", "cpu_system_s", "rss_bytes", "ctx_involuntary", "peak_rss_bytes", "load_1m",
               "cpu_count", "host_cpus", "host_cpu_busy", "host_mem_available_bytes", "host_mem_total_bytes",
               "disk_read_bytes", "disk_write_bytes", "net_sent_bytes", "net_recv_bytes", "data_wait_s"}


def train(timer: ckptfmt.StepTimer, steps: range, data_s: float = 0.004, work_s: float = 0.004) -> float:
    """Steps with a data phase that sleeps and a busy compute phase; returns the data seconds measured."""
    waited = 0.0
    for step in steps:
        with timer.step(step):
            started = time.perf_counter()
            with timer.phase("data"):
                time.sleep(data_s)
            waited += time.perf_counter() - started
            end = time.perf_counter() + work_s
            with timer.phase("forward"):
                while time.perf_counter() < end:
                    pass
    return waited


def system_of(url: str, rank: int = 0):
    with ckptfmt.open(url) as reader:
        entry = next(e for e in reader.metadata["timing"]["ranks"] if e["rank"] == rank)
    return decode_samples(entry["system"], url)


def test_a_timer_samples_in_the_background_and_the_save_stores_what_it_has_not_stored(tmp_path):
    timer = ckptfmt.StepTimer(system_interval=0.02)
    try:
        began = time.time_ns()
        waited = train(timer, range(30))
        repo = tmp_path / "repo"
        ckptfmt.save({"w": torch.ones(2)}, f"{repo}/a", timer=timer)
        first = system_of(f"{repo}/a")
        assert first.count >= 3 and first.interval_s == 0.02
        # no CUDA in use: no cuda_* or gpu_* field, not even zeros
        assert {name for name in first.fields if not cuda_name(name)} == HOST_FIELDS
        assert (np.diff(first.time_ns) > 0).all() and first.time_ns[0] >= began
        for counter in ("cpu_user_s", "data_wait_s", "peak_rss_bytes", "ctx_involuntary"):
            assert (np.diff(first.fields[counter]) >= 0).all(), counter  # cumulative
        assert first.fields["data_wait_s"][-1] <= waited + 1e-6  # the data phases' time, never more
        assert 0 <= np.nanmin(first.fields["host_cpu_busy"]) and np.nanmax(first.fields["host_cpu_busy"]) <= 1
        assert (first.fields["rss_bytes"] > 0).all()
        train(timer, range(30, 60))
        ckptfmt.save({"w": torch.ones(2)}, f"{repo}/b", timer=timer)
        second = system_of(f"{repo}/b")
        assert second.time_ns[0] > first.time_ns[-1]  # each sample stored once, by the next checkpoint
        assert second.fields["data_wait_s"][-1] > first.fields["data_wait_s"][-1]
    finally:
        timer.close()


def test_a_failed_save_keeps_the_samples_for_the_next(tmp_path):
    timer = ckptfmt.StepTimer(system_interval="step")
    train(timer, range(5), data_s=0, work_s=0)
    with pytest.raises(RuntimeError, match="refused"):
        ckptfmt.save({"w": torch.ones(2)}, str(tmp_path / "repo" / "a"), timer=timer,
                     before_commit=lambda: (_ for _ in ()).throw(RuntimeError("refused")))
    ckptfmt.save({"w": torch.ones(2)}, str(tmp_path / "repo" / "b"), timer=timer)
    samples = system_of(str(tmp_path / "repo" / "b"))
    assert samples.count == 5 and samples.interval_s is None  # one per step, none lost
    assert timer.snapshot().get("system") is None


def test_sampling_can_be_turned_off_and_a_bad_interval_is_refused(tmp_path):
    timer = ckptfmt.StepTimer(system_interval=None)
    train(timer, range(3), data_s=0, work_s=0)
    url = str(tmp_path / "repo" / "a")
    ckptfmt.save({"w": torch.ones(2)}, url, timer=timer)
    with ckptfmt.open(url) as reader:
        assert "system" not in reader.metadata["timing"]["ranks"][0]
    for bad in (0, -1, "often", True):
        with pytest.raises(ValueError, match="system_interval|interval"):
            ckptfmt.StepTimer(system_interval=bad)


def test_without_psutil_the_fields_it_gives_are_absent(monkeypatch):
    real_import = builtins.__import__

    def no_psutil(name, *args, **kwargs):
        if name == "psutil":
            raise ImportError("no psutil here")
        return real_import(name, *args, **kwargs)
    monkeypatch.setattr(builtins, "__import__", no_psutil)
    sampler = SystemSampler(None)
    sampler.sample()
    fields = decode_samples(sampler.snapshot(), "test").fields
    assert {name for name in fields if not cuda_name(name)} == {"cpu_user_s", "cpu_system_s", "peak_rss_bytes",
                                                               "load_1m", "cpu_count", "host_cpus"}


def test_a_field_missing_from_one_sample_is_nan_there_and_a_probe_that_fails_gives_nothing():
    record = encode_samples([1, 2], [{"a": 1.0}, {"a": 2.0, "b": 5.0}], 1.0)
    decoded = decode_samples(record, "test")
    assert decoded.fields["a"].tolist() == [1.0, 2.0] and math.isnan(decoded.fields["b"][0])

    sampler = SystemSampler(None)
    sampler._probes.append(lambda row: 1 / 0)
    sampler.sample()
    assert decode_samples(sampler.snapshot(), "test").count == 1


@pytest.mark.parametrize("change, message", [
    (lambda r: r.update(count=-1), "count is not a non-negative int"),
    (lambda r: r.update(time_ns=b"x"), "time_ns is not 2 int64 values"),
    (lambda r: r["fields"].update(a=b"\0" * 8), "fields.a is not 2 float64 values"),
    (lambda r: r.update(fields=[1]), "fields is not a map of names"),
    (lambda r: r.update(interval_s=-2), "interval_s is not a positive number"),
    (lambda r: r.clear(), "count is not a non-negative int"),
])
def test_hostile_sample_records_are_refused_naming_what(change, message):
    record = encode_samples([1, 2], [{"a": 1.0}, {"a": 2.0}], 1.0)
    change(record)
    with pytest.raises(ManifestError, match=f"where: {message}"):
        decode_samples(record, "where")


def test_the_sampler_thread_ends_with_its_timer():
    timer = ckptfmt.StepTimer(system_interval=0.01)
    train(timer, range(2), data_s=0, work_s=0)
    thread = timer._sampler._thread
    assert thread is not None and thread.is_alive()
    del timer
    thread.join(timeout=10)
    assert not thread.is_alive()


def test_the_system_and_tensor_statistics_tables(tmp_path):
    timer = ckptfmt.StepTimer(system_interval="step")
    repo = tmp_path / "repo"
    for checkpoint in range(2):
        train(timer, range(checkpoint * 4, checkpoint * 4 + 4), data_s=0.001, work_s=0)
        state = {"w": torch.full((10,), float(checkpoint + 1)), "tied": None, "i": torch.arange(3)}
        state["tied"] = state["w"]
        ckptfmt.save(state, f"{repo}/c{checkpoint}", step=checkpoint, timer=timer)
    built = analytics.tables(str(repo))
    system = built["system"]
    assert system.num_rows == 8 and set(HOST_FIELDS) <= set(system.column_names)
    assert system.column("interval_s").null_count == 8  # sampled per step
    assert system.column("checkpoint").to_pylist() == ["c0"] * 4 + ["c1"] * 4
    waits = system.column("data_wait_s").to_pylist()
    assert waits == sorted(waits) and waits[-1] > 0
    stats = built["tensor_stats"].to_pylist()
    assert [(row["name"], row["key"]) for row in stats] == [("c0", "w"), ("c0", "i"), ("c1", "w"), ("c1", "i")]
    assert stats[2]["l2"] == pytest.approx(2 * math.sqrt(10)) and stats[2]["zeros"] == 0
    assert stats[1]["min"] == 0 and stats[1]["zeros"] == 1 and stats[1]["mean"] is None
