"""Chunked / partitioned execution of the lowerings against the direct convolution.

Covers the paths the engine runs by default: ``Type1Lowering.forward_into``/``backward_into``
(workspace reuse, one im2col per chunk for both gradients, dW accumulated with ``+=``),
``BatchedLowering`` with explicit, cost-model (``"auto"``) and budget ``b_p``, ``p`` partitions in
parallel threads (explicit and ``"model"``), and the Convolution layer writing straight into its
blobs. References: the direct convolution of ``test_lowering_types`` (float64 loops over taps).
"""
import dataclasses

import numpy as np
import pytest
from naive import make_geom, ref_backward, ref_forward
from test_lowering_types import GEOMS

from cct import blas
from cct.io.prototxt import parse_text
from cct.layers.base import create_layer
from cct.lowering import cost_model as cm
from cct.lowering import get_strategy
from cct.lowering.optimizer import PerPassLowering
from cct.lowering.partition import BatchedLowering
from cct.lowering.type1 import Type1Lowering
from cct.proto import caffe_pb2
from cct.testing import make_blob

TOL = dict(rtol=2e-4, atol=2e-4)
SOME = GEOMS[::3] + GEOMS[-6:]


def _data(g, n, dtype, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, g.channels_in) + g.in_shape).astype(dtype)
    w = rng.standard_normal(g.weight_shape).astype(dtype)
    b = rng.standard_normal(g.channels_out).astype(dtype) if g.bias_term else None
    dy = rng.standard_normal((n, g.channels_out) + g.out_shape).astype(dtype)
    return x, w, b, dy


def _check_all(s, g, n, dtype=np.float32, seed=0):
    x, w, b, dy = _data(g, n, dtype, seed)
    y = np.full((n, g.channels_out) + g.out_shape, np.nan, dtype)
    s.forward_into(x, w, b, g, y)
    np.testing.assert_allclose(y, ref_forward(x.astype(np.float64), w, b, g), **TOL)
    rdx, rdw, rdb = ref_backward(dy.astype(np.float64), x.astype(np.float64), w.astype(np.float64), g)
    dw0 = np.random.default_rng(9).standard_normal(w.shape).astype(dtype)  # accumulate, not overwrite
    db0 = np.ones(g.channels_out, dtype)
    dw, db = dw0.copy(), db0.copy()
    dx = np.full(x.shape, np.nan, dtype)  # overwritten
    s.backward_into(dy, x, w, g, dw=dw, db=db if g.bias_term else None, dx=dx)
    np.testing.assert_allclose(dx, rdx, **TOL)
    np.testing.assert_allclose(dw - dw0, rdw, **TOL)
    if g.bias_term:
        np.testing.assert_allclose(db - db0, rdb, **TOL)
    # each gradient alone
    dw2 = np.zeros_like(w)
    s.backward_into(dy, x, w, g, dw=dw2)
    np.testing.assert_allclose(dw2, rdw, **TOL)
    dx2 = np.full(x.shape, np.nan, dtype)
    s.backward_into(dy, None, w, g, dx=dx2)
    np.testing.assert_allclose(dx2, rdx, **TOL)


@pytest.mark.parametrize("gi", range(len(SOME)))
def test_type1_into_matches_direct(gi):
    g = SOME[gi]
    s = Type1Lowering()
    for n in (1, 3):  # n == 1: GEMM straight into the image's block; n > 1: lifted through the buffer
        _check_all(s, g, n, seed=n)
    _check_all(s, g, 2, dtype=np.float64)  # the reused float32 buffers must not leak into float64


@pytest.mark.parametrize("gi", range(len(SOME)))
def test_fft_into_matches_direct(gi):
    """FFT's backward_into: one transform of dy feeds both gradients (alone, batched and partitioned)."""
    g = SOME[gi]
    _check_all(BatchedLowering(get_strategy("fft"), batch_partition=3, partitions=1), g, 3, seed=gi)
    _check_all(BatchedLowering(get_strategy("fft"), batch_partition=2, partitions=2, threads=2), g, 5, seed=gi)


@pytest.mark.parametrize("bp,p", [(1, 1), (2, 1), (3, 2), (1, 2), ("auto", 1), ("auto", "model"), ("budget", 2)])
@pytest.mark.parametrize("gi", [0, 4, len(GEOMS) - 5, len(GEOMS) - 1])
def test_batched_chunks_and_partitions_match_direct(gi, bp, p):
    g = GEOMS[gi]
    s = BatchedLowering(get_strategy("type1"), batch_partition=bp, partitions=p, threads=2)
    _check_all(s, g, 7)
    # the whole-array interface goes through the same chunks
    x, w, b, dy = _data(g, 7, np.float32, 3)
    np.testing.assert_allclose(s.forward(x, w, b, g), ref_forward(x, w, b, g), **TOL)
    rdx, rdw, rdb = ref_backward(dy, x, w, g)
    np.testing.assert_allclose(s.backward_data(dy, w, g), rdx, **TOL)
    dw, db = s.backward_weights(dy, x, g)
    np.testing.assert_allclose(dw, rdw, **TOL)
    if g.bias_term:
        np.testing.assert_allclose(db, rdb, **TOL)


@pytest.mark.parametrize("inner", ["type2", "type3", "perpass"])
def test_batched_fallback_for_lowerings_without_into(inner):
    g = make_geom(4, 6, 2, (7, 7), (5, 5), (2, 2), (1, 1), (1, 1))
    strat = (PerPassLowering(get_strategy("type2"), get_strategy("type1"), get_strategy("type3"))
             if inner == "perpass" else get_strategy(inner))
    _check_all(BatchedLowering(strat, batch_partition=2, partitions=2, threads=2), g, 5)
    # bias gradient without the weight gradient
    x, w, b, dy = _data(g, 5, np.float32)
    db = np.zeros(6, np.float32)
    BatchedLowering(strat, batch_partition=2).backward_into(dy, None, w, g, db=db)
    np.testing.assert_allclose(db, ref_backward(dy, x, w, g)[2], **TOL)


def test_auto_batch_partition_follows_the_cost_model():
    g = make_geom(32, 32, 1, (16, 16), (5, 5), (2, 2), (1, 1), (1, 1))
    flat = cm.Machine(grid_dims=[1, 100000], gemm_bign=[[100.0] * 2] * 2, gemm_bigk=[[100.0] * 2] * 2,
                      big_curve=[], gemm_overhead_s=0.0, cache_bytes=1 << 60)
    assert BatchedLowering(get_strategy("type1"), machine=flat).plan(g, 64)["b_p"] == 64
    cachey = dataclasses.replace(flat, lowering_curves={
        "type1": {"lower": [(1e4, 0.2), (1e6, 0.2), (4e6, 1.0)], "unlower": [(1e4, 0.2), (1e6, 0.2), (4e6, 1.0)]}})
    s = BatchedLowering(get_strategy("type1"), machine=cachey)
    plan = s.plan(g, 64)
    assert plan["b_p"] < 64 and plan["b_p"] == cm.best_batch_partition("type1", g, 64, cachey)[0]
    assert [r for part in plan["ranges"] for r in part][-1][1] == 64
    assert s.plan(g, 64) is plan  # cached per shape
    # "budget": CcT's largest chunk that fits, whatever the model says
    assert BatchedLowering(get_strategy("type1"), batch_partition="budget", machine=cachey).plan(g, 64)["b_p"] == 64


def test_model_partitions_use_per_thread_machines():
    g = make_geom(32, 32, 1, (16, 16), (5, 5), (2, 2), (1, 1), (1, 1))
    fast = cm.Machine(grid_dims=[1, 100000], gemm_bign=[[100.0] * 2] * 2, gemm_bigk=[[100.0] * 2] * 2,
                      big_curve=[], gemm_overhead_s=0.0)
    # the same machine for 1 and 2 threads: two 1-thread partitions do half the work each -> p = 2
    s = BatchedLowering(get_strategy("type1"), partitions="model", threads=2, machine=fast)
    assert s.plan(g, 16)["p"] == 2
    assert BatchedLowering(get_strategy("type1"), partitions="model", threads=1, machine=fast).plan(g, 16)["p"] == 1
    with pytest.raises(ValueError):
        BatchedLowering(get_strategy("type1"), partitions="fastest")


def test_workspace_is_reused_and_big_buffers_are_not_kept(monkeypatch):
    g = make_geom(3, 4, 1, (8, 8), (3, 3), (1, 1), (1, 1), (1, 1))
    s = Type1Lowering()
    x, w, b, _ = _data(g, 4, np.float32)
    y = np.empty((4, 4) + g.out_shape, np.float32)
    s.forward_into(x, w, b, g, y)
    col = s._tls.bufs["col"]
    s.forward_into(x[:2], w, b, g, y[:2])  # a smaller chunk reuses the same memory
    assert s._tls.bufs["col"] is col
    monkeypatch.setattr("cct.lowering.type1.WORKSPACE_CACHE_BYTES", 16)
    s2 = Type1Lowering()
    s2.forward_into(x, w, b, g, y)
    assert "col" not in getattr(s2._tls, "bufs", {})
    np.testing.assert_allclose(y, ref_forward(x, w, b, g), **TOL)


def test_conv_layer_writes_into_blobs_and_accumulates_param_diffs():
    param = parse_text(
        'name: "conv" type: "Convolution" convolution_param { num_output: 6 kernel_size: 3 pad: 1 stride: 2 group: 2 '
        'weight_filler { type: "gaussian" std: 0.5 } bias_filler { type: "gaussian" std: 0.5 } }',
        caffe_pb2.LayerParameter())
    layer = create_layer(param)
    rng = np.random.default_rng(1)
    bottom = [make_blob(rng.standard_normal((5, 4, 7, 7)).astype(np.float32))]
    top = [make_blob(np.zeros(1, np.float32))]
    layer.setup(bottom, top)
    layer.lowering = BatchedLowering(get_strategy("type1"), batch_partition=2, partitions=2, threads=2)
    layer.forward(bottom, top)
    g = layer.geom
    w, b = layer.blobs[0].data, layer.blobs[1].data
    np.testing.assert_allclose(top[0].data, ref_forward(bottom[0].data, w, b, g), **TOL)
    top[0].diff[...] = rng.standard_normal(top[0].shape)
    layer.blobs[0].diff[...] = 1.0
    layer.blobs[1].diff[...] = 2.0
    layer.backward(top, [True], bottom)
    rdx, rdw, rdb = ref_backward(top[0].diff, bottom[0].data, w, g)
    np.testing.assert_allclose(bottom[0].diff, rdx, **TOL)
    np.testing.assert_allclose(layer.blobs[0].diff - 1.0, rdw, **TOL)
    np.testing.assert_allclose(layer.blobs[1].diff - 2.0, rdb, **TOL)
    # propagate_down False leaves the bottom diff alone; frozen params get nothing
    bottom[0].diff[...] = 7.0
    layer.param_propagate_down = [False, False]
    layer.backward(top, [False], bottom)
    assert np.all(bottom[0].diff == 7.0)
    np.testing.assert_allclose(layer.blobs[0].diff - 1.0, rdw, **TOL)


def test_blas_threads_fast_path_restores():
    n = blas.get_num_threads()
    with blas.blas_threads(1):
        assert blas.get_num_threads() == 1 or blas.get_backend() == "mkl"
    assert blas.get_num_threads() == n


def test_limit_openblas_spin_keeps_gemms_right():
    import subprocess
    import sys

    code = (
        "import numpy as np, threading\n"
        "from cct import blas\n"
        "a = np.random.default_rng(0).standard_normal((300, 300)).astype(np.float32)\n"
        "ref = a.astype(np.float64) @ a\n"
        "n = blas.get_num_threads()\n"
        "t = threading.Thread(target=lambda: None, name='cct-x'); t.start(); t.join()\n"
        "ok = blas.limit_openblas_spin()\n"
        "again = blas.limit_openblas_spin()\n"
        "assert not again\n"
        "assert blas.get_num_threads() == n\n"
        "assert np.allclose(a @ a, ref, rtol=1e-3, atol=1e-3)\n"
        "with blas.blas_threads(1):\n"
        "    assert np.allclose(a @ a, ref, rtol=1e-3, atol=1e-3)\n"
        "print('applied' if ok else 'skipped')\n"
    )
    env = {k: v for k, v in __import__("os").environ.items() if k != "OPENBLAS_THREAD_TIMEOUT"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() in ("applied", "skipped")
    env["CCT_BLAS_THREAD_TIMEOUT"] = "off"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "skipped", out.stderr


@pytest.mark.parametrize("trans_a,alpha", [(True, 1.0), (False, 0.5)])
def test_accumulating_gemm_in_row_blocks(monkeypatch, trans_a, alpha):
    """``beta = 1`` into a big output (the InnerProduct weight gradient) runs in cache-sized row blocks."""
    monkeypatch.setattr(blas.product, "ACC_BLOCK_BYTES", 4 * 40 * 3)  # 3 rows of 40 per block, last block short
    rng = np.random.default_rng(2)
    a = rng.standard_normal((6, 17) if trans_a else (17, 6)).astype(np.float32)
    b = rng.standard_normal((6, 40)).astype(np.float32)
    c0 = rng.standard_normal((17, 40)).astype(np.float32)
    out = c0.copy()
    blas.gemm(a, b, out=out, trans_a=trans_a, alpha=alpha, beta=1.0)
    opa = a.T if trans_a else a
    np.testing.assert_allclose(out, c0 + alpha * (opa.astype(np.float64) @ b), rtol=1e-5, atol=1e-5)


def test_partition_reduction_is_priced_once_a_call():
    """The weight-gradient sums BatchedLowering adds after its chunks: per partition a zeroed private
    gradient summed into dw; type 1 (transposed accumulation) also one transposing add with one partition."""
    from cct.lowering import ConvGeometry, get_strategy
    from cct.lowering.chunking import reduction_ops

    g = ConvGeometry(16, 32, 1, (9, 9), (3, 3), (1, 1), (1, 1), (1, 1), (9, 9), True)
    w = 32 * 16 * 9
    assert reduction_ops(get_strategy("type1"), g, 1) == [("zero", w), ("add", 0), ("add", w)]
    assert reduction_ops(get_strategy("type1"), g, 2) == [("zero", 2 * w), ("add", w), ("add", w)]
    assert reduction_ops(get_strategy("direct"), g, 1) == []
    assert reduction_ops(get_strategy("direct"), g, 2) == [("zero", 2 * w), ("add", 2 * w)]


@pytest.mark.parametrize("partitions", [1, "model"])
def test_a_conv_layer_settles_its_chunking_at_setup_and_passes_only_execute(partitions):
    """Issue 29: nothing plans in forward/backward. A hand-built wrapper with ``b_p="auto"`` (priced by the cost
    model) is settled when it is set and on every reshape; the passes then never consult the cost model."""
    param = parse_text('name: "conv" type: "Convolution" convolution_param { num_output: 4 kernel_size: 3 '
                       'weight_filler { type: "gaussian" std: 0.5 } }', caffe_pb2.LayerParameter())
    layer = create_layer(param)
    rng = np.random.default_rng(2)
    bottom = [make_blob(rng.standard_normal((6, 3, 9, 9)).astype(np.float32))]
    top = [make_blob(np.zeros(1, np.float32))]
    layer.setup(bottom, top)
    priced = []

    def machine_for(threads):
        priced.append(threads)
        return cm.nominal_machine()

    lowering = BatchedLowering(get_strategy("type1"), batch_partition="auto", partitions=partitions, threads=2,
                               machine_for=machine_for)
    layer.lowering = lowering
    assert priced, "setting the lowering on a set-up layer prices its chunking there"
    settled = len(priced)

    def run():
        layer.forward(bottom, top)
        top[0].diff[...] = 1.0
        layer.backward(top, [True], bottom)
        return top[0].data.copy(), bottom[0].diff.copy()

    y, dx = run()
    run()
    assert len(priced) == settled, "a pass priced the chunking"
    np.testing.assert_allclose(y, ref_forward(bottom[0].data, layer.blobs[0].data, layer.blobs[1].data, layer.geom),
                               **TOL)
    bottom[0].reshape((3, 3, 9, 9))  # a new shape: planned again by reshape, not by the pass after it
    bottom[0].data[...] = rng.standard_normal(bottom[0].shape)
    layer.reshape(bottom, top)
    assert len(priced) > settled
    settled = len(priced)
    run()
    assert len(priced) == settled
