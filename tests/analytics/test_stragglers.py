"""ckptfmt.analytics.stragglers and `ckptfmt stragglers`: who delayed the others, when, by how much.

Judged by precision and recall over (rank, step) pairs against injected delays:
on real gloo DDP runs of 2, 3 and 4 ranks (tests/support/ddp_runs.py: chosen ranks sleep
in chosen steps, in their data or forward phase; the others wait in backward's
all-reduce), on simulated synchronous runs of 2, 3 and 64 ranks with jitter
and clocks that disagree, and on simulated runs of 2 and 4 ranks on a busy host,
whose scheduler delays ranks at random (modelled on real runs on a loaded machine).
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import asdict

import numpy as np
import pyarrow as pa
import pytest

from ckptfmt.analytics import stragglers, tables
from ckptfmt.analytics.stragglers import step_delays
from tests.support.ddp_runs import MIN_DELAY_S, NOISY_MACHINE, RUNS, SLEEP_S, flagged


def precision_recall(found: set, injected: set) -> tuple[float, float]:
    hits = len(found & injected)
    return hits / max(len(found), 1), hits / max(len(injected), 1)




# -- real DDP runs ------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["two", "three", "four"])
def test_the_ranks_that_slept_are_found_and_never_those_that_waited(ddp_runs, name):
    run = RUNS[name]
    report = stragglers(ddp_runs[name], thresholds=NOISY_MACHINE)
    found, injected = flagged(report.to_json()), run.injected()
    assert report.steps == run.steps and report.ranks == run.world
    assert injected <= found, (injected - found, report.stragglers)  # every slept (rank, step)
    slept_steps = {step for _, step in injected}
    waited = {(rank, step) for rank, step in found - injected if step in slept_steps}
    assert not waited, report.stragglers  # the ranks that waited for a sleeper are never blamed
    # Beside that, a rank the OS descheduled for over MIN_DELAY_S once in a run is a real delay: allowed.
    precision, _ = precision_recall(found, injected)
    assert precision >= 0.8, (precision, report.stragglers)
    for sleep in run.sleeps:
        straggler = next(s for s in report.stragglers if s.rank == sleep.rank)
        episode = next(e for e in straggler.episodes if e.first_step <= sleep.first <= e.last_step)
        assert episode.phase == sleep.phase and episode.last_step >= sleep.last, straggler
        assert SLEEP_S * 0.8 < straggler.max_delay_s < SLEEP_S * 2, straggler
    assert all(s.kind == "transient" for s in report.stragglers)


def test_ratios_are_given_only_against_a_baseline_beyond_the_jitter(ddp_runs):
    """A sleep in a data phase of a fraction of a millisecond is thousands of times that phase: said as None."""
    report = stragglers(ddp_runs["four"], thresholds=NOISY_MACHINE)
    rank_1 = next(s for s in report.stragglers if s.rank == 1)
    assert rank_1.phase == "data" and rank_1.ratio is None
    assert all(e.ratio is None for e in rank_1.episodes)


def test_total_step_time_would_not_have_told(ddp_runs):
    """The reason for the method: the others wait for the straggler, so every rank's step is as long."""
    steps = tables(ddp_runs["four"])["steps"].to_pylist()
    step_5 = sorted(s["duration_s"] for s in steps if s["step"] == 5)
    assert step_5[0] > SLEEP_S * 0.8  # even the fastest rank's step took the sleep
    backward = {s["rank"]: s["phase_backward"] for s in steps if s["step"] == 5}
    assert min(backward, key=backward.get) == 1  # the straggler waits least


def test_the_steps_table_keeps_the_order_the_phases_were_recorded_in(ddp_runs):
    """Arrivals add the phases up in that order (the table once sorted them by name)."""
    names = [c for c in tables(ddp_runs["two"])["steps"].column_names if c.startswith("phase_")]
    assert names == ["phase_data", "phase_forward", "phase_backward", "phase_optimizer"]


def test_the_cli_prints_the_report_as_json(ddp_runs):
    repo, min_delay = ddp_runs["four"], ["--min-delay", str(MIN_DELAY_S)]
    result = subprocess.run([sys.executable, "-m", "ckptfmt.cli", "stragglers", repo, "--json", *min_delay],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, result.stderr  # stragglers found
    report = json.loads(result.stdout)
    assert report == stragglers(repo, thresholds=NOISY_MACHINE).to_json()  # the JSON is to_json()
    assert {(s["rank"], s["host"]) for s in report["stragglers"]} >= {(1, report["stragglers"][0]["host"])}
    assert {"rank", "host", "steps", "delay_s", "ratio", "phase", "kind", "episodes"} <= set(report["stragglers"][0])
    text = subprocess.run([sys.executable, "-m", "ckptfmt.cli", "stragglers", repo, *min_delay],
                          capture_output=True, text=True, timeout=120)
    assert text.returncode == 1 and "rank" in text.stdout and "4-7" in text.stdout
    refused = subprocess.run([sys.executable, "-m", "ckptfmt.cli", "stragglers", repo, "--min-delay", "-1"],
                             capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "--min-delay" in refused.stderr and refused.stderr.count("\n") == 1


# -- simulated runs ---------------------------------------------------------------------------------
PHASES = ("data", "forward", "backward", "optimizer")


def synchronous_run(own: dict[str, np.ndarray], wait_in: str, rng, late_start: np.ndarray | None = None,
                    clocks: np.ndarray | None = None, hosts_of: int = 8, woken: np.ndarray | None = None) -> pa.Table:
    """The steps table of a synchronous run, from each rank's own seconds in each phase (steps x ranks, in
    order): in ``wait_in``, after its own part of it, every rank waits for the last to get there (plus a
    10 ms collective), and leaves it ``woken`` later (a busy host's scheduler). A rank starts its next step as
    it ends one, ``late_start`` later; its recorded times are on its own clock, ``clocks`` (seconds) ahead of
    the others'."""
    count, ranks = own[PHASES[0]].shape
    late_start = np.zeros((count, ranks)) if late_start is None else late_start
    woken = np.zeros((count, ranks)) if woken is None else woken
    spent = {name: values.copy() for name, values in own.items()}
    starts, now = np.zeros((count, ranks)), np.zeros(ranks)
    for step in range(count):
        starts[step] = now + late_start[step]
        arrival = starts[step] + sum(own[name][step] for name in PHASES[:PHASES.index(wait_in) + 1])
        spent[wait_in][step] += arrival.max() - arrival + 0.01 * rng.lognormal(0, 0.05, ranks) + woken[step]
        now = starts[step] + sum(spent[name][step] for name in PHASES)
    recorded = starts + (np.zeros(ranks) if clocks is None else clocks)
    step_grid, rank_grid = np.meshgrid(np.arange(count), np.arange(ranks), indexing="ij")
    epoch_us = 1_700_000_000 * 10**6
    return pa.table({
        "rank": rank_grid.ravel(), "host": [f"node{r // hosts_of}" for r in rank_grid.ravel()],
        "step": step_grid.ravel(),
        "start": pa.array(epoch_us + np.round(recorded.ravel() * 1e6).astype(np.int64)).cast(
            pa.timestamp("us", tz="UTC")),
        "duration_s": sum(spent[name] for name in PHASES).ravel(),
        **{f"phase_{name}": spent[name].ravel() for name in PHASES},
    })


def jittered_phases(rng, count: int, ranks: int) -> dict[str, np.ndarray]:
    """Each rank's own seconds per phase: 6% log-normal jitter, a tail on data loading, rare hiccups."""
    base = {"data": 0.05, "forward": 0.15, "backward": 0.25, "optimizer": 0.04}
    own = {p: base[p] * rng.lognormal(0.0, 0.06, size=(count, ranks)) for p in PHASES}
    own["data"] += rng.exponential(0.002, size=(count, ranks))
    own["forward"] += (rng.random((count, ranks)) < 0.002) * 0.006  # a preempted process now and then
    return own


def simulated(ranks: int = 64, steps: int = 200, seed: int = 0, transients: int = 30,
              seconds: tuple[float, float] = (0.04, 0.3), persistent_s: float = 0.06) -> tuple[pa.Table, set]:
    """A DDP-like run (the others wait in backward) with delays injected: ``transients`` episodes of 1-4
    steps on random ranks (never two in one step), a persistent straggler for the second half (rank 7, or
    the last), a whole host of 8 slow for 4 steps (given 24 ranks or more); its hosts' clocks disagree by
    tens of milliseconds. Returns the table and the injected (rank, step) pairs."""
    rng = np.random.default_rng(seed)
    own = jittered_phases(rng, steps, ranks)
    injected = set()

    def slow(rank_list, step_list, phase, delay):
        for r in rank_list:
            for s in step_list:
                own[phase][s, r] += delay
                injected.add((r, s))
    persistent_rank, half = min(7, ranks - 1), steps // 2
    slots = rng.choice(half // 6 if ranks < 8 else steps // 6, size=transients, replace=False)
    for slot in slots:  # with few ranks, none beside the persistent one: two slow at once hide each other
        slow([int(rng.integers(ranks))], range(6 * slot, 6 * slot + int(rng.integers(1, 5))),
             str(rng.choice(["data", "forward"])), float(rng.uniform(*seconds)))
    slow([persistent_rank], range(half, steps), "forward", persistent_s)
    if ranks >= 24:
        slow(range(16, 24), range(50, 54), "data", 0.1)
    clocks = np.repeat(rng.normal(0, 0.03, size=-(-ranks // 8)), 8)[:ranks]
    return synchronous_run(own, "backward", rng, clocks=clocks), injected


def empty_saves() -> pa.Table:
    return pa.table({"name": pa.array([], pa.string()), "rank": pa.array([], pa.int64()),
                     "host": pa.array([], pa.string()), "phase": pa.array([], pa.string()),
                     "duration_s": pa.array([], pa.float64()), "rank_total_s": pa.array([], pa.float64())})


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_simulated_64_rank_runs_with_jitter(seed):
    steps, injected = simulated(seed=seed)
    report = stragglers({"steps": steps, "saves": empty_saves()})
    precision, recall = precision_recall(flagged(report.to_json()), injected)
    assert precision >= 0.95 and recall >= 0.95, (seed, precision, recall)
    rank_7 = next(s for s in report.stragglers if s.rank == 7)
    assert rank_7.kind == "persistent" and rank_7.phase == "forward"
    second_half = [e for e in rank_7.episodes if e.last_step >= 100]
    assert second_half[0].first_step <= 102 and second_half[-1].last_step == 199
    assert sum(e.steps for e in second_half) >= 90  # 60 ms in a 150 ms phase with 6% jitter: a few missed
    node2 = next(h for h in report.hosts if h.host == "node2")
    assert sorted(node2.ranks) == list(range(16, 24)) and {50, 51, 52, 53} <= set(node2.steps)


def test_the_result_is_typed_and_its_json_keeps_the_keys_of_the_dict_it_was():
    """``stragglers()`` returned a dict before its result was typed: ``to_json()`` is that dict (``--json``),
    and indexing the result by its keys still works for a deprecation period, warning."""
    steps, _ = simulated(seed=0)
    report = stragglers({"steps": steps, "saves": empty_saves()})
    as_json = report.to_json()
    assert list(as_json) == ["steps", "ranks", "stragglers", "hosts", "slow_saves"]  # no explanations asked for
    assert list(as_json["stragglers"][0]) == ["rank", "host", "steps", "delay_s", "max_delay_s", "ratio", "phase",
                                              "kind", "episodes"]
    assert list(as_json["stragglers"][0]["episodes"][0]) == ["first_step", "last_step", "steps", "delay_s",
                                                             "ratio", "phase"]
    assert list(as_json["hosts"][0]) == ["host", "ranks", "of_ranks", "steps", "delay_s"]
    assert as_json["stragglers"] == [asdict(s) for s in report.stragglers] and json.loads(json.dumps(as_json))
    with pytest.warns(DeprecationWarning, match=r"stragglers\(\)\['stragglers'\] is deprecated: use \.stragglers") \
            as caught:
        old = report["stragglers"]
    assert old == as_json["stragglers"] and old[0]["rank"] == report.stragglers[0].rank
    assert caught[0].filename == __file__  # the warning points at the caller's line
    for key in ("steps", "ranks", "hosts", "slow_saves"):
        with pytest.warns(DeprecationWarning, match=f"use \\.{key}"):
            assert report[key] == as_json[key]
    with pytest.warns(DeprecationWarning), pytest.raises(KeyError):
        report["explanations"]  # as in the dict: there only with explain=True


@pytest.mark.parametrize("ranks", [2, 3])
@pytest.mark.parametrize("seed", [0, 1])
def test_simulated_runs_of_two_and_three_ranks(ranks, seed):
    """No majority of ranks on time to compare with: the rank that arrives last delayed the others. Against
    one other rank, both ranks' jitter counts: the delays injected are twice the 64-rank run's."""
    steps, injected = simulated(ranks, seed=seed, transients=12, seconds=(0.12, 0.3), persistent_s=0.12)
    report = stragglers({"steps": steps, "saves": empty_saves()})
    precision, recall = precision_recall(flagged(report.to_json()), injected)
    assert precision >= 0.95 and recall >= 0.95, (ranks, seed, precision, recall, report.stragglers)
    last = next(s for s in report.stragglers if s.rank == ranks - 1)
    persistent = next(e for e in last.episodes if e.last_step == 199)
    assert last.kind == "persistent" and persistent.first_step <= 100 and persistent.phase == "forward"
    assert 1.7 < persistent.ratio < 1.9  # forward took (0.15 + 0.12) / 0.15 times the other ranks'


@pytest.mark.parametrize("clock_s", [0.0, 1.0])
def test_a_rank_that_started_late_is_not_blamed_on_those_that_waited_for_it(clock_s):
    """FSDP-like (the others wait in forward): rank 1 starts some steps late (work between steps, outside the
    timer); rank 0, waiting for it in forward, gets to backward late by its own clock. A delay from before
    the step is not the step's, and nobody is blamed, whether or not the clocks agree."""
    rng = np.random.default_rng(5)
    own = jittered_phases(rng, 100, 2)
    late_start = np.zeros((100, 2))
    late_start[20:30, 1] = 0.2
    steps = synchronous_run(own, "forward", rng, late_start=late_start, clocks=np.array([0.0, clock_s]))
    report = stragglers({"steps": steps, "saves": empty_saves()})
    assert report.stragglers == []


def test_a_run_without_stragglers_reports_none():
    rng = np.random.default_rng(9)
    steps = synchronous_run(jittered_phases(rng, 100, 64), "backward", rng,
                            clocks=rng.normal(0, 0.03, size=64))
    report = stragglers({"steps": steps, "saves": empty_saves()})
    assert report.stragglers == [] and report.hosts == []


def test_slow_saves_name_the_rank_and_phase():
    rows = []
    for checkpoint in ("a", "b", "c"):
        for rank in range(8):
            for phase, seconds in (("join", 0.5 if rank != 3 else 0.01), ("write_chunks", 1.0), ("sync", 0.2)):
                if checkpoint == "b" and rank == 5 and phase == "write_chunks":
                    seconds = 3.0
                rows.append({"name": checkpoint, "rank": rank, "host": f"h{rank // 4}", "phase": phase,
                             "duration_s": seconds * (1 + 0.01 * ((rank * 7 + len(phase)) % 5))})
    totals = {}
    for row in rows:
        totals[row["name"], row["rank"]] = totals.get((row["name"], row["rank"]), 0.0) + row["duration_s"]
    saves = pa.Table.from_pylist([{**row, "rank_total_s": totals[row["name"], row["rank"]]} for row in rows])
    report = stragglers({"steps": simulated()[0].slice(0, 0), "saves": saves})
    assert [(s.rank, s.checkpoints, s.phases) for s in report.slow_saves] == [(5, ["b"], ["write_chunks"])]
    assert report.slow_saves[0].ratio > 2.5  # rank 3's short join is the others' wait: not reported


def test_slow_saves_of_two_ranks_carry_the_whole_delay_and_ratios_only_against_a_real_baseline():
    """Against the other rank, not a median over both (which would halve the delay); a phase that
    normally takes half a millisecond gives no ratio."""
    rows = []
    for checkpoint in ("a", "b", "c", "d"):
        for rank in range(2):
            for phase, seconds in (("write_chunks", 1.0), ("environment", 0.0005), ("sync", 0.2)):
                if (checkpoint, rank, phase) == ("b", 1, "write_chunks"):
                    seconds = 3.0
                if (checkpoint, rank, phase) == ("c", 0, "environment"):
                    seconds = 0.3
                rows.append({"name": checkpoint, "rank": rank, "host": "h", "phase": phase,
                             "duration_s": seconds * (1 + 0.01 * ((rank * 7 + len(checkpoint)) % 3)),
                             "rank_total_s": 1.5})
    report = stragglers({"steps": simulated(2, transients=0)[0].slice(0, 0), "saves": pa.Table.from_pylist(rows)})
    slow = {s.rank: s for s in report.slow_saves}
    assert sorted(slow) == [0, 1] and slow[1].checkpoints == ["b"] and slow[0].checkpoints == ["c"]
    assert 1.9 < slow[1].delay_s < 2.1 and 2.9 < slow[1].ratio < 3.1
    assert 0.29 < slow[0].delay_s < 0.31 and slow[0].ratio is None


# -- a busy host ------------------------------------------------------------------------------------
#: A rank's own seconds per phase (a small DDP model), before it waits for a CPU on a busy host.
BUSY_WORK = {"data": 0.0002, "forward": 0.01, "backward": 0.004, "optimizer": 0.0005}
#: Its waits for a CPU there, in every step where it computes most (gamma: shape, scale in seconds), and
#: now and then in backward and on leaving the all-reduce (log-normal: share of steps, median seconds, spread).
STEADY_WAITS = {"forward": (4, 0.008), "optimizer": (4, 0.001)}
OCCASIONAL_WAITS = {"backward": (0.3, 0.006, 0.8)}
WOKEN_LATE = (0.4, 0.0045, 0.7)


def cpu_waits(rng, shape: tuple[int, int], share: float, median_s: float, spread: float) -> np.ndarray:
    """Seconds a rank waits for a CPU: in ``share`` of the steps, log-normal around ``median_s``."""
    return (rng.random(shape) < share) * rng.lognormal(np.log(median_s), spread, shape)


def host_samples(steps: pa.Table, load: float) -> pa.Table:
    """Every rank's system samples over the run, a second apart, as ``tables()`` gives them: its host's 1-minute
    ``load`` on 2 CPUs."""
    starts = steps.column("start").cast(pa.int64()).to_numpy()
    hosts = dict(zip(steps.column("rank").to_pylist(), steps.column("host").to_pylist()))
    times = np.arange(starts.min(), starts.max() + 10**6, 10**6)
    rank_grid, time_grid = np.meshgrid(sorted(hosts), times, indexing="ij")
    return pa.table({"rank": rank_grid.ravel(), "host": [hosts[r] for r in rank_grid.ravel()],
                     "time": pa.array(time_grid.ravel()).cast(pa.timestamp("us", tz="UTC")),
                     "load_1m": np.full(time_grid.size, load),
                     "host_cpus": np.full(time_grid.size, 2.0)})


def busy_host_run(ranks: int, seed: int, steps: int = 120) -> tuple[dict[str, pa.Table], set]:
    """The tables of a DDP-like run (the others wait in backward) on a 2-core host at a load of 5, after 23
    real gloo runs of 2 and 4 ranks there (per phase their jitter and the tail past it): the OS makes a rank
    wait for a CPU in every forward pass (32 ms on average, up to about 90) and optimizer step, now and then
    in backward, and on leaving the all-reduce (a few milliseconds, the tail to tens). 4 episodes of 1-4 steps
    on random ranks sleep 0.3-0.6 s in data or forward. Returns the tables and the slept (rank, step) pairs."""
    rng = np.random.default_rng(seed)
    shape = (steps, ranks)
    own = {name: work * rng.lognormal(0, 0.1, shape) for name, work in BUSY_WORK.items()}
    for name, (gamma_shape, scale_s) in STEADY_WAITS.items():
        own[name] += rng.gamma(gamma_shape, scale_s, shape)
    for name, waits in OCCASIONAL_WAITS.items():
        own[name] += cpu_waits(rng, shape, *waits)
    injected = set()
    for slot in rng.choice(steps // 8, size=4, replace=False):
        rank, length = int(rng.integers(ranks)), int(rng.integers(1, 5))
        phase, seconds = str(rng.choice(["data", "forward"])), float(rng.uniform(0.3, 0.6))
        own[phase][8 * slot:8 * slot + length, rank] += seconds
        injected |= {(rank, step) for step in range(8 * slot, 8 * slot + length)}
    table = synchronous_run(own, "backward", rng, woken=cpu_waits(rng, shape, *WOKEN_LATE))
    return {"steps": table, "saves": empty_saves(), "system": host_samples(table, load=5.0)}, injected


@pytest.mark.parametrize("ranks", [2, 4])
def test_a_busy_hosts_scheduler_noise_is_no_straggler(ranks):
    """Descheduled for tens of milliseconds, in any phase, on random ranks: a real delay, but noise, whose
    tail the median of its changes underestimates. The system samples say the host was busy: over 12 runs
    every slept (rank, step) is found, and few others (without the samples, precision 0.94 with 2 ranks
    and 0.85 with 4; with them, 1.0 and 0.98)."""
    found, injected = set(), set()
    for seed in range(12):
        built, slept = busy_host_run(ranks, seed)
        found |= {(seed, *pair) for pair in flagged(stragglers(built).to_json())}
        injected |= {(seed, *pair) for pair in slept}
    precision, recall = precision_recall(found, injected)
    assert precision >= 0.95 and recall == 1.0, (precision, recall, sorted(found - injected))


def test_a_host_with_cpus_to_spare_is_judged_as_one_without_samples():
    built, _ = busy_host_run(4, seed=0)
    unsampled = {"steps": built["steps"], "saves": built["saves"]}
    spare = {**unsampled, "system": host_samples(built["steps"], load=1.5)}
    assert stragglers(spare) == stragglers(unsampled) != stragglers(built)


def test_each_step_is_judged_by_the_load_its_rank_sampled_nearest_it():
    """A host busy from the middle of the run on: the steps a second or more before are judged as without
    samples, those a second or more after as on a host busy throughout (this run's judgement differs in both)."""
    built, _ = busy_host_run(4, seed=3)
    steps, samples = built["steps"], built["system"]
    times = samples.column("time").cast(pa.int64()).to_numpy()
    middle = np.median(times)
    loads = pa.array(np.where(times < middle, 1.5, 5.0))
    half = samples.set_column(samples.column_names.index("load_1m"), "load_1m", loads)
    starts, numbers = steps.column("start").cast(pa.int64()).to_numpy(), steps.column("step").to_numpy()
    before, after = numbers[starts >= middle - 10**6].min(), numbers[starts <= middle + 10**6].max() + 1
    judged, unsampled, busy = (step_delays(steps, system=system).delay_s for system in (half, None, samples))
    assert (unsampled[:before] != busy[:before]).any() and (unsampled[after:] != busy[after:]).any()
    assert np.array_equal(judged[:before], unsampled[:before]) and np.array_equal(judged[after:], busy[after:])


def test_a_run_without_phases_on_a_busy_host_reports_no_straggler():
    built, _ = busy_host_run(2, seed=0)
    steps = built["steps"].select(["rank", "host", "step", "start", "duration_s"])
    report = stragglers({**built, "steps": steps})
    assert report.steps == 120 and report.stragglers == []
