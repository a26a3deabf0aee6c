"""What the machine was doing while a rank trained: resource use sampled on every rank, stored per
checkpoint beside the rank's training steps (spec 9.4, ``system``).

A ``SystemSampler`` belongs to a ``StepTimer``: from its first step it samples,
on a background thread at a fixed interval (1 s by default) or at the end of
every step, the rank's process (CPU time, resident and peak memory, disk bytes,
the time its training loop waited for data), its host (load, busy CPUs, memory
available, network bytes) and, where CUDA is in use, its device (memory
allocated, reserved and peak from torch.cuda; utilisation, SM clock,
temperature, power and throttle reasons from NVML through ``nvidia-ml-py`` when
it is installed). No collective: every rank samples itself, and the save
gathers the samples with the steps. A field this machine cannot give is absent,
never zero.

Counters are stored as read (cumulative: CPU seconds, bytes); analyses take
differences between samples. Samples are columns like the steps: a time
column and one float64 column per field, NaN where one sample lacked a field
the others have.
"""

from __future__ import annotations

import math
import os
import resource
import sys
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ckptfmt.errors import ManifestError
from ckptfmt.metadata.column_records import column_reader, record_count

_I64, _F64 = np.dtype("<i8"), np.dtype("<f8")
#: The default seconds between samples.
DEFAULT_INTERVAL_S = 1.0
#: Samples kept while no checkpoint stores them (a day at one a second): the oldest go first.
MAX_SAMPLES = 86_400


class SystemSampler:
    """Samples this process, its host and its CUDA device into columns (see the module's docstring).

    ``interval``: seconds between samples on a background thread, or None to sample only when
    ``sample`` is called (a StepTimer calls it at the end of every step). ``data_wait`` returns the
    seconds the training loop has spent in its ``data`` phase so far.
    """

    def __init__(self, interval: float | None = DEFAULT_INTERVAL_S, data_wait: Callable[[], float] | None = None):
        if interval is not None and not (isinstance(interval, (int, float)) and not isinstance(interval, bool)
                                         and interval > 0):
            raise ValueError(f"the sampling interval must be a positive number of seconds or None, not {interval!r}")
        self.interval = interval
        self.data_wait = data_wait
        self._probes = _probes()
        self._times: list[int] = []
        self._rows: list[dict[str, float]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start sampling in the background (a no-op when sampling per call, or when started)."""
        if self.interval is None or self._thread is not None:
            return
        self.sample()
        self._thread = threading.Thread(target=_run, args=(weakref.ref(self), self.interval, self._stop),
                                        name="ckptfmt-system-sampler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the background thread (samples taken stay until stored)."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def sample(self) -> None:
        """Take one sample now."""
        row: dict[str, float] = {}
        for probe in self._probes:
            try:
                probe(row)
            except Exception:  # a probe that fails once (a vanished device, a closed file) gives nothing
                continue
        if self.data_wait is not None:
            row["data_wait_s"] = self.data_wait()
        stamp = time.time_ns()
        with self._lock:
            self._times.append(stamp)
            self._rows.append(row)
            if len(self._times) > MAX_SAMPLES:
                del self._times[0], self._rows[0]

    def snapshot(self) -> dict | None:
        """The samples not yet stored, as the manifest records them (spec 9.4 ``system``), or None."""
        with self._lock:
            if not self._times:
                return None
            return encode_samples(list(self._times), list(self._rows), self.interval)

    def forget(self, rows: int) -> None:
        """Drop the first ``rows`` samples: a committed checkpoint holds them."""
        with self._lock:
            del self._times[:rows], self._rows[:rows]


def _run(owner: weakref.ref, interval: float, stop: threading.Event) -> None:
    """The sampling loop; it ends with its sampler (stopped, or garbage collected)."""
    while not stop.wait(interval):
        sampler = owner()
        if sampler is None:
            return
        sampler.sample()
        del sampler


# -- probes: each adds the fields it can read to a sample ---------------------------------------

def _probes() -> list[Callable[[dict[str, float]], None]]:
    probes: list[Callable[[dict[str, float]], None]] = [_process_cpu, _peak_rss, _host_load]
    try:
        import psutil
    except ImportError:
        psutil = None
    if psutil is not None:
        probes.append(_PsutilProbe(psutil))
    probes.append(_cuda_memory)
    nvml = _NvmlProbe.create()
    if nvml is not None:
        probes.append(nvml)
    return probes


def _process_cpu(row: dict[str, float]) -> None:
    times = os.times()
    row["cpu_user_s"], row["cpu_system_s"] = times.user, times.system


def _peak_rss(row: dict[str, float]) -> None:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    row["peak_rss_bytes"] = float(peak if sys.platform == "darwin" else peak * 1024)  # Linux counts KiB


def _host_load(row: dict[str, float]) -> None:
    row["load_1m"] = os.getloadavg()[0]
    affinity = getattr(os, "sched_getaffinity", None)
    row["cpu_count"] = float(len(affinity(0)) if affinity is not None else (os.cpu_count() or math.nan))
    row["host_cpus"] = float(os.cpu_count() or math.nan)


class _PsutilProbe:
    """Resident memory, involuntary context switches, disk bytes of this process; busy CPUs, memory and
    network of its host."""

    def __init__(self, psutil: Any):
        self.psutil = psutil
        self.process = psutil.Process()
        psutil.cpu_percent(interval=None)  # the first call starts the measurement

    def __call__(self, row: dict[str, float]) -> None:
        psutil = self.psutil
        with self.process.oneshot():
            row["rss_bytes"] = float(self.process.memory_info().rss)
            row["ctx_involuntary"] = float(self.process.num_ctx_switches().involuntary)
            io = getattr(self.process, "io_counters", None)
            if io is not None:
                counters = io()
                row["disk_read_bytes"] = float(counters.read_bytes)
                row["disk_write_bytes"] = float(counters.write_bytes)
        row["host_cpu_busy"] = psutil.cpu_percent(interval=None) / 100
        memory = psutil.virtual_memory()
        row["host_mem_available_bytes"], row["host_mem_total_bytes"] = float(memory.available), float(memory.total)
        network = psutil.net_io_counters()
        if network is not None:
            row["net_sent_bytes"], row["net_recv_bytes"] = float(network.bytes_sent), float(network.bytes_recv)


def _cuda_memory(row: dict[str, float]) -> None:
    """torch.cuda's memory figures for this rank's device, once CUDA is in use (never initialises it)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return
    device = torch.cuda.current_device()
    row["cuda_allocated_bytes"] = float(torch.cuda.memory_allocated(device))
    row["cuda_reserved_bytes"] = float(torch.cuda.memory_reserved(device))
    row["cuda_peak_bytes"] = float(torch.cuda.max_memory_allocated(device))


class _NvmlProbe:
    """NVML's view of this rank's GPU (found by UUID, whatever CUDA_VISIBLE_DEVICES renumbered)."""

    def __init__(self, nvml: Any):
        self.nvml = nvml
        self.handles: dict[int, Any] = {}

    @classmethod
    def create(cls) -> _NvmlProbe | None:
        try:
            import pynvml  # the nvidia-ml-py package
            pynvml.nvmlInit()
        except Exception:  # not installed, or no driver
            return None
        return cls(pynvml)

    def __call__(self, row: dict[str, float]) -> None:
        torch = sys.modules.get("torch")
        if torch is None or not torch.cuda.is_initialized():
            return
        device = torch.cuda.current_device()
        handle = self.handles.get(device)
        if handle is None:
            uuid = str(torch.cuda.get_device_properties(device).uuid)
            handle = self.handles[device] = self.nvml.nvmlDeviceGetHandleByUUID(f"GPU-{uuid}")
        nvml = self.nvml
        for field, read in (
            ("gpu_util", lambda: nvml.nvmlDeviceGetUtilizationRates(handle).gpu / 100),
            ("gpu_mem_util", lambda: nvml.nvmlDeviceGetUtilizationRates(handle).memory / 100),
            ("gpu_sm_clock_mhz", lambda: nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_SM)),
            ("gpu_temperature_c", lambda: nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU)),
            ("gpu_power_w", lambda: nvml.nvmlDeviceGetPowerUsage(handle) / 1000),
            ("gpu_throttle_reasons", lambda: nvml.nvmlDeviceGetCurrentClocksEventReasons(handle)),
        ):
            try:
                row[field] = float(read())
            except Exception:  # this GPU or driver does not report it: absent
                continue


# -- the stored form (spec 9.4, system) -----------------------------------------------------------

@dataclass
class SystemColumns:
    """One rank's stored samples, decoded: ``count`` rows each."""

    count: int
    time_ns: np.ndarray  # int64, wall clock
    interval_s: float | None
    fields: dict[str, np.ndarray]  # float64, NaN where a sample lacked the field


def encode_samples(times: list[int], rows: list[dict[str, float]], interval: float | None) -> dict:
    """Samples as the manifest stores them: a count, the times and one bin of float64 per field."""
    names = sorted({name for row in rows for name in row})
    return {
        "count": len(times),
        "time_ns": np.array(times, dtype=_I64).tobytes(),
        "interval_s": interval,
        "fields": {name: np.array([row.get(name, math.nan) for row in rows], dtype=_F64).tobytes()
                   for name in names},
    }


def decode_samples(record: Any, where: str) -> SystemColumns:
    """A stored ``system`` record as arrays, or a ManifestError naming ``where`` and what is wrong."""
    count = record_count(record, where)
    column = column_reader(count, where)
    interval = record.get("interval_s")
    if interval is not None and (type(interval) not in (int, float) or not interval > 0):
        raise ManifestError(f"{where}: interval_s is not a positive number or nil")
    fields = record.get("fields", {})
    if not isinstance(fields, dict) or not all(type(name) is str for name in fields):
        raise ManifestError(f"{where}: fields is not a map of names")
    return SystemColumns(count, column(record.get("time_ns"), "time_ns", _I64),
                         None if interval is None else float(interval),
                         {name: column(value, f"fields.{name}", _F64) for name, value in fields.items()})
