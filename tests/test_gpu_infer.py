"""Dense inference on a GPU (ZNNi VII; skipped without CuPy and a GPU): GPU-only, GPU + host RAM and CPU-GPU give
the CPU's output on a reduced ZNNi net, CuPy in gives CuPy out, and the CuPy pool's peak is the planner's prediction."""
from __future__ import annotations

import numpy as np
import pytest
from google.protobuf import text_format

import cct
from cct.device.driver import CupyDevice, cupy_available
from cct.infer.pipeline import DenseInference
from cct.infer.placement import gpu_config
from cct.infer.znni_nets import znni_prototxt
from cct.proto import caffe_pb2

pytestmark = pytest.mark.skipif(not cupy_available(), reason="needs CuPy and a GPU")

TXT = znni_prototxt("n337", fmaps=4, nd=3, kernels=[2, 2, 1, 1, 1, 1, 2])  # ZNNi's n337, reduced


def _nets():
    param = text_format.Parse(TXT, caffe_pb2.NetParameter())
    host = cct.Net(param, cct.TEST, dtype=np.float32)
    rng = np.random.default_rng(0)
    for blobs in host.params.values():
        for b in blobs:
            b.data[...] = rng.standard_normal(b.shape) * 0.5
    gpu = cct.Net(param, cct.TEST, dtype=np.float32, config=gpu_config(0))
    for a, b in zip(host.params.values(), gpu.params.values()):
        for pa, pb in zip(a, b):
            gpu.device.upload(pa.data, out=pb.data)
    return host, gpu


def peak_hook():
    """A real CuPy MemoryHook that records the pool's peak of used bytes while it is on (``.base``, ``.peak``)."""
    import cupy

    class PeakHook(cupy.cuda.memory_hook.MemoryHook):
        name = "PeakHook"

        def __init__(self):
            self.pool = cupy.get_default_memory_pool()
            self.base = self.peak = self.pool.used_bytes()

        def malloc_postprocess(self, **_kw):
            self.peak = max(self.peak, self.pool.used_bytes())

    return PeakHook()


@pytest.fixture(scope="module")
def case():
    host, gpu = _nets()
    vol = np.random.default_rng(1).standard_normal((40, 36, 44)).astype(np.float32)
    want = DenseInference(host, patch=(30, 30, 30))(vol).copy()
    return host, gpu, vol, want


def test_gpu_only_equals_the_cpu_and_cupy_in_gives_cupy_out(case):
    import cupy
    _host, gpu, vol, want = case
    di = DenseInference(gpu, patch=(30, 30, 30))
    got = di(vol)
    assert isinstance(got, np.ndarray) and di.target == "gpu"
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    dev = di(cupy.asarray(vol))
    assert isinstance(dev, cupy.ndarray)
    np.testing.assert_allclose(dev.get(), want, rtol=1e-4, atol=1e-4)


def test_the_pool_peak_is_the_planners_prediction(case):
    import cupy
    _host, gpu, vol, want = case
    cupy.get_default_memory_pool().free_all_blocks()
    di = DenseInference(gpu, device_budget=256 << 20)
    with peak_hook() as hook:
        got = di(vol)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    measured = hook.peak - hook.base
    assert abs(measured - di.plan.peak_bytes) <= 0.15 * di.plan.peak_bytes, (measured, di.plan.describe())


def test_gpu_plus_host_ram_splits_under_a_small_device_budget(case):
    import cupy
    host, _gpu, vol, want = case
    budget = 1200 << 10  # about half of what the layers need unsplit (2.4 MiB; the planner's, checked on the CPU)
    di = DenseInference(host, patch=(30, 30, 30), device=CupyDevice(0), host_ram=True, device_budget=budget)
    cupy.get_default_memory_pool().free_all_blocks()
    di.prepare(vol.shape)  # the shared slice buffer and the biases; the work buffers come with the first pass
    runners = di.runner.split_runners()
    held = di.runner.split_memory.flat.nbytes + sum(sr.bias_bytes() for sr in runners)
    with peak_hook() as hook:
        got = di(vol)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    assert any(sp.split for sp in di.plan.splits) and di.plan.device_peak_bytes <= budget
    assert held + hook.peak - hook.base <= di.plan.device_peak_bytes


def test_cpu_gpu_pipeline_equals_the_cpu(case):
    import cupy
    host, _gpu, vol, want = case
    for pipeline in (2, "auto"):
        di = DenseInference(host, patch=(30, 30, 30), device=CupyDevice(0), pipeline=pipeline)
        got = di(vol)
        assert di.target == "cpu-gpu" and di.plan.theta >= 1 and di.device_speedup > 0
        assert isinstance(di.device_net.blobs[di.geom.input_blob].data, cupy.ndarray)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
