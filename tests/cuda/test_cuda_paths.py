"""The CUDA paths: saving GPU tensors (staging on a side stream into pinned buffers), loading onto
a GPU, CUDA's generator in the RNG states and the step signatures, a GPU loss kept exactly,
the environment and system samples naming the GPU, resume records of GPU state, and a
DTensor on a CUDA mesh through NCCL and the DCP layer.

CI has no GPU, so these are skipped there; a lent GPU machine runs them
(``python -m pytest tests/cuda``, docs/development.md says how).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import ckptfmt
from ckptfmt.metadata.step_timer import decode_steps
from tests.support.helpers import assert_tensor_exact
from tests.support.tensor_values import assert_stats_close

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def gpu_state() -> dict:
    torch.manual_seed(0)
    big = torch.randn(2048, 2048, device="cuda")  # 16 MiB: several chunks, statistics in blocks
    return {
        "f32": big,
        "bf16": torch.randn(300, 77, device="cuda").bfloat16(),
        "f16": torch.randn(5, 3, device="cuda").half(),
        "i64": torch.randint(-2**40, 2**40, (1000,), device="cuda"),
        "strided": big[:, ::3],  # a non-contiguous view
        "scalar": torch.tensor(3.25, device="cuda"),
        "mask": torch.rand(64, device="cuda") > 0.5,
        "cpu_too": torch.arange(10),
        "step": 4,
    }


def test_gpu_tensors_round_trip_bit_exact_with_the_hashes_and_statistics_of_the_same_bytes_on_cpu(tmp_path):
    state = gpu_state()
    on_cpu = {key: value.cpu() if isinstance(value, torch.Tensor) else value for key, value in state.items()}
    gpu_url = ckptfmt.save(state, f"{tmp_path}/gpu/a", step=4)
    cpu_url = ckptfmt.save(on_cpu, f"{tmp_path}/cpu/a", step=4)
    assert ckptfmt.verify(gpu_url).ok
    with ckptfmt.open(gpu_url) as gpu, ckptfmt.open(cpu_url) as cpu:
        for key in ("f32", "bf16", "f16", "i64", "strided", "scalar", "mask"):
            saved, reference = gpu.tensor_info(key), cpu.tensor_info(key)
            assert saved.shards == reference.shards, key  # the same chunks: content addressed, whatever device
            assert_stats_close(reference.stats, saved.stats, key)  # reduced on the GPU: to float64's rounding
    loaded = ckptfmt.load(gpu_url)
    for key, value in on_cpu.items():
        if isinstance(value, torch.Tensor):
            assert loaded[key].device.type == "cpu"
            assert_tensor_exact(loaded[key], value, key)
    onto_gpu = ckptfmt.load(gpu_url, map_location="cuda")
    for key in ("f32", "bf16", "strided", "mask"):
        assert onto_gpu[key].is_cuda and torch.equal(onto_gpu[key], state[key]), key
    with ckptfmt.open(gpu_url, map_location="cuda:0") as reader:
        assert torch.equal(reader.get_tensor("i64"), state["i64"])


def test_async_save_keeps_the_values_at_the_call_while_the_gpu_goes_on_writing(tmp_path):
    weights = torch.randn(4096, 1024, device="cuda")
    for round_ in range(3):  # the staging buffers are pinned once and reused
        expected = weights.cpu()
        future = ckptfmt.async_save({"w": weights}, f"{tmp_path}/repo/r{round_}", step=round_)
        for _ in range(20):  # kernels queued right after the call, on the default stream
            weights.mul_(1.5).add_(1.0)
        url = future.result(timeout=120)
        assert_tensor_exact(ckptfmt.load(url)["w"], expected, f"round {round_}")


def test_cuda_rng_is_saved_and_restored(tmp_path):
    torch.cuda.manual_seed_all(7)
    torch.rand(10, device="cuda")
    url = ckptfmt.save({"x": 1}, f"{tmp_path}/repo/rng")
    expected = torch.rand(5, device="cuda")
    torch.rand(1000, device="cuda")
    ckptfmt.restore_rng(url)
    assert torch.equal(torch.rand(5, device="cuda"), expected)


def test_step_signatures_digest_cudas_generator_and_keep_a_gpu_loss_exactly():
    torch.cuda.init()
    timer = ckptfmt.StepTimer(system_interval=None)
    losses = []
    for step in range(4):
        with timer.step(step):
            if step == 2:
                torch.rand(3, device="cuda")  # only step 2 moves CUDA's generator
            loss = (torch.randn(8, device="cuda", generator=torch.Generator("cuda").manual_seed(step)) * 0.1).sum()
            losses.append(loss)
            timer.metrics(loss=loss)
    records = decode_steps(timer.snapshot(), "here")
    digests = records.rng["cuda:0"]
    changed = [bytes(digests[i]) != bytes(digests[i + 1]) for i in range(3)]
    assert changed == [False, False, True]  # step 3 starts after step 2's draw
    for stored, loss in zip(records.metrics["loss"], losses):
        assert np.float32(stored).tobytes() == loss.cpu().numpy().tobytes()


def test_the_environment_and_the_system_samples_name_the_gpu(tmp_path):
    import time

    from ckptfmt.metadata.system import decode_samples

    timer = ckptfmt.StepTimer(system_interval=0.02)
    try:
        held = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
        for step in range(10):
            with timer.step(step):
                held.add_(1)
                time.sleep(0.01)
        url = ckptfmt.save({"w": torch.ones(2, device="cuda")}, f"{tmp_path}/repo/a", timer=timer)
    finally:
        timer.close()
    with ckptfmt.open(url) as reader:
        environment = reader.metadata["environment"]
        (entry,) = reader.metadata["timing"]["ranks"]
    gpus = environment["gpus"]
    assert gpus[0]["name"] == torch.cuda.get_device_name(0)
    assert gpus[0]["memory_bytes"] == torch.cuda.get_device_properties(0).total_memory
    assert environment["torch"]["cuda"] == torch.version.cuda and environment["torch"]["nccl"]
    samples = decode_samples(entry["system"], url)
    assert samples.count >= 3
    assert samples.fields["cuda_allocated_bytes"].max() >= 64 << 20
    try:
        import pynvml  # noqa: F401  (nvidia-ml-py: the GPU's own counters, where it is installed)
    except ImportError:
        return
    assert "gpu_util" in samples.fields and "gpu_temperature_c" in samples.fields


def test_a_save_from_a_process_that_never_used_cuda_leaves_cuda_uninitialised(tmp_path):
    """Reading the GPUs' properties initialises CUDA: a save must not do that to a CPU process (its
    forked data loader workers could not use CUDA), so such a process records no GPUs."""
    import subprocess
    import sys

    script = ("import sys, torch, ckptfmt\n"
              "url = ckptfmt.save({'w': torch.ones(3)}, sys.argv[1], timer=ckptfmt.StepTimer(system_interval=None))\n"
              "assert not torch.cuda.is_initialized()\n"
              "assert ckptfmt.open(url).metadata['environment']['gpus'] == []\n")
    subprocess.run([sys.executable, "-c", script, f"{tmp_path}/repo/a"], check=True, timeout=120)


def test_a_resume_of_gpu_state_is_on_record_part_by_part(tmp_path):
    def make(seed):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 4)).cuda()
        return model, torch.optim.AdamW(model.parameters(), lr=0.01)

    model, optimizer = make(0)
    for _ in range(3):
        model(torch.randn(16, 256, device="cuda")).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    url = ckptfmt.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, f"{tmp_path}/run/s3",
                       step=3)
    model2, optimizer2 = make(1)
    weights = model2.state_dict()
    addresses = {key: value.data_ptr() for key, value in weights.items()}
    ckptfmt.load(url, into={"model": weights}, strict=False)  # in place, on the GPU
    assert {key: value.data_ptr() for key, value in weights.items()} == addresses
    assert all(value.is_cuda for value in weights.values())
    record = ckptfmt.record_resume(url, {"model": model2, "optimizer": optimizer2})
    assert {part.part: part.verdict for part in record.parts} == {"model": "equal", "optimizer": "missing"}
    optimizer2.load_state_dict(ckptfmt.load(url, map_location="cuda")["optimizer"])
    record = ckptfmt.record_resume(url, {"model": model2, "optimizer": optimizer2})
    assert {part.part: part.verdict for part in record.parts} == {"model": "equal", "optimizer": "equal"}
    with torch.no_grad():  # 100 rows of a 512 KiB tensor: a region its fingerprint's 16 windows sample
        model2[0].weight[100:200] += 1e-3
    record = ckptfmt.record_resume(url, {"model": model2})
    assert record.parts[0].verdict == "different" and record.parts[0].different == 1


def test_a_dtensor_on_a_cuda_mesh_saves_and_loads_through_nccl_and_the_dcp_layer(tmp_path):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=torch.device("cuda", 0))
    try:
        mesh = init_device_mesh("cuda", (1,))
        torch.manual_seed(3)
        full = torch.randn(64, 48, device="cuda")
        state = {"dt": distribute_tensor(full, mesh, [Shard(0)]), "plain": full[:3].clone(), "step": 9}
        url = ckptfmt.save(state, f"{tmp_path}/repo/a", step=9)
        into = {"dt": distribute_tensor(torch.zeros_like(full), mesh, [Shard(0)]),
                "plain": torch.zeros(3, 48, device="cuda"), "step": 0}
        ckptfmt.load(url, into=into)
        assert torch.equal(into["dt"].full_tensor(), full) and torch.equal(into["plain"], full[:3])
        assert into["step"] == 9

        dcp.save(state, storage_writer=ckptfmt.dcp.StorageWriter(f"{tmp_path}/repo/dcp"))
        back = {"dt": distribute_tensor(torch.zeros_like(full), mesh, [Shard(0)]),
                "plain": torch.zeros(3, 48, device="cuda"), "step": 0}
        dcp.load(back, storage_reader=ckptfmt.dcp.StorageReader(f"{tmp_path}/repo/dcp"))
        assert torch.equal(back["dt"].full_tensor(), full) and torch.equal(back["plain"], full[:3])
        assert ckptfmt.verify(f"{tmp_path}/repo").ok
    finally:
        dist.destroy_process_group()
