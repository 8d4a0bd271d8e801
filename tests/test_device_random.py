"""The counter-based device generator (cct/device/random.py) and the layers that draw from it.

Philox4x32-10 against Random123's published known answers and a plain-integer reference; the stream's
word layout, uniforms and Bernoulli masks; keys, streams and snapshots; Dropout and stochastic pooling
in nets (masks change per iteration, repeat per seed, survive a snapshot and resume).
"""
import math
import os

import numpy as np
import pytest

import cct
from cct import kernels, rng
from cct.blob import Blob
from cct.device.driver import HostDevice
from cct.device.random import NetRandom, key_from_host, philox4x32_10, round_keys
from cct.errors import CctError
from cct.io.prototxt import parse_text
from cct.layers import create_layer
from cct.proto import caffe_pb2
from cct.solver import snapshot
from cct.solver.solver import get_solver
from cct.testing import check_gradient, make_blob

M32 = 0xFFFFFFFF

# Random123's tests/kat_vectors, the three "philox4x32 10" lines: counter, key, expected output.
HOST = HostDevice()  # the streams of these tests live in host memory

PHILOX_KAT = [
    ((0x00000000, 0x00000000, 0x00000000, 0x00000000), (0x00000000, 0x00000000),
     (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF), (0xFFFFFFFF, 0xFFFFFFFF),
     (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


def naive_philox(counter, key):
    """Philox4x32-10 on Python ints, written from the paper's round function."""
    c, k = list(counter), list(key)
    for r in range(10):
        if r:
            k = [(k[0] + 0x9E3779B9) & M32, (k[1] + 0xBB67AE85) & M32]
        p0, p1 = 0xD2511F53 * c[0], 0xCD9E8D57 * c[2]
        c = [(p1 >> 32) ^ c[1] ^ k[0], p1 & M32, (p0 >> 32) ^ c[3] ^ k[1], p0 & M32]
    return tuple(c)


def naive_words(key, stream, start, n):
    """Words ``start .. start + n`` of a stream: lane j % 4 of the block with counter (j // 4, stream)."""
    out = []
    for j in range(start, start + n):
        b = j // 4
        out.append(naive_philox((b & M32, b >> 32, stream & M32, stream >> 32), key)[j % 4])
    return np.array(out, dtype=np.uint32)


# -- the bijection --------------------------------------------------------------------------------
@pytest.mark.parametrize("counter,key,want", PHILOX_KAT)
def test_philox_known_answers(counter, key, want):
    assert naive_philox(counter, key) == want
    got = philox4x32_10(np, tuple(np.array([c], dtype=np.uint32) for c in counter), round_keys(key))
    assert tuple(int(g[0]) for g in got) == want
    # host scalars (the stream words of a draw's first round) take the same arithmetic on the host
    assert tuple(int(g) for g in philox4x32_10(np, tuple(np.uint32(c) for c in counter), round_keys(key))) == want


def test_philox_vectorized_matches_naive_on_random_counters():
    g = np.random.default_rng(0)
    counters = g.integers(0, 2 ** 32, size=(4, 50), dtype=np.uint32)
    key = (int(g.integers(2 ** 32)), int(g.integers(2 ** 32)))
    got = np.stack(philox4x32_10(np, tuple(counters), round_keys(key)))
    want = np.array([naive_philox(tuple(int(v) for v in counters[:, i]), key) for i in range(50)]).T
    np.testing.assert_array_equal(got, want)


# -- the stream -----------------------------------------------------------------------------------
def test_words_follow_the_counter_layout_and_advance_the_position():
    key, stream = (0x12345678, 0x9ABCDEF0), (7 << 32) + 5
    gen = HOST.random_stream(key, stream)
    np.testing.assert_array_equal(gen.words(10), naive_words(key, stream, 0, 10))
    assert gen.position.dtype == np.uint64 and int(gen.position[0]) == 10
    np.testing.assert_array_equal(gen.words(7), naive_words(key, stream, 10, 7))  # starts mid-block
    assert int(gen.position[0]) == 17


def test_draws_concatenate_to_one_draw():
    a, b = HOST.random_stream((1, 2), 3), HOST.random_stream((1, 2), 3)
    parts = np.concatenate([a.words(n) for n in (5, 1, 13, 4, 9)])
    np.testing.assert_array_equal(parts, b.words(32))


def test_a_high_position_crosses_the_32_bit_block_boundary():
    gen = HOST.random_stream((9, 8), 1)
    start = 4 * (2 ** 32) - 6  # the draw runs from block 2^32 - 2 into block 2^32
    gen.set_state({**gen.state(), "position": start})
    np.testing.assert_array_equal(gen.words(12), naive_words((9, 8), 1, start, 12))


def test_streams_and_keys_give_different_words():
    base = HOST.random_stream((1, 2), 0).words(64)
    assert not np.array_equal(base, HOST.random_stream((1, 2), 1).words(64))
    assert not np.array_equal(base, HOST.random_stream((1, 3), 0).words(64))
    np.testing.assert_array_equal(base, HOST.random_stream((1, 2), 0).words(64))  # run to run: the same


def test_uniform_float32_is_the_top_24_bits():
    gen, twin = HOST.random_stream((5, 6), 2), HOST.random_stream((5, 6), 2)
    out = np.empty((3, 7), dtype=np.float32)
    gen.uniform_(out)
    want = (twin.words(21) >> 8).astype(np.float64) / 2 ** 24
    np.testing.assert_array_equal(out.reshape(-1), want.astype(np.float32))
    assert out.reshape(-1).astype(np.float64).tolist() == want.tolist()  # exact, no rounding


def test_uniform_float64_takes_53_bits_from_two_words():
    gen, twin = HOST.random_stream((5, 6), 2), HOST.random_stream((5, 6), 2)
    out = np.empty(6, dtype=np.float64)
    gen.uniform_(out)
    w = twin.words(12).astype(np.uint64).reshape(-1, 2)
    want = [(int(h >> 5) * 2 ** 26 + int(lo >> 6)) / 2 ** 53 for h, lo in w]
    assert out.tolist() == want
    assert int(gen.position[0]) == 12


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_uniform_statistics(dtype):
    u = np.empty(1_000_000, dtype=dtype)
    HOST.random_stream((42, 43), 0).uniform_(u)
    assert 0.0 <= u.min() and u.max() < 1.0
    assert abs(u.mean() - 0.5) < 2e-3  # standard error 2.9e-4
    assert abs(u.var() - 1 / 12) < 1e-3
    hist, _ = np.histogram(u, bins=16, range=(0, 1))
    assert np.all(np.abs(hist / u.size - 1 / 16) < 2e-3)


def test_bernoulli_is_a_float32_uniform_below_p():
    p = 0.7
    gen, twin = HOST.random_stream((3, 4), 9), HOST.random_stream((3, 4), 9)
    mask = np.empty((50, 40), dtype=np.float32)
    gen.bernoulli_(mask, p, 2.5)
    u = np.empty_like(mask)
    twin.uniform_(u)
    np.testing.assert_array_equal(mask, np.where(u < np.float32(p), np.float32(2.5), np.float32(0)))
    # a float64 array gets the same mask from the same words
    again = HOST.random_stream((3, 4), 9)
    m64 = np.empty((50, 40), dtype=np.float64)
    again.bernoulli_(m64, p, 2.5)
    np.testing.assert_array_equal(m64 != 0, mask != 0)
    assert set(np.unique(m64)) <= {0.0, 2.5}


def test_bernoulli_edge_probabilities_and_rate():
    m = np.empty(200_000, dtype=np.float32)
    HOST.random_stream((1, 1), 0).bernoulli_(m, 1.0, 1.0)
    assert m.min() == 1.0
    HOST.random_stream((1, 1), 0).bernoulli_(m, 0.0, 1.0)
    assert m.max() == 0.0
    HOST.random_stream((1, 1), 0).bernoulli_(m, 0.3, 1.0)
    assert abs(m.mean() - 0.3) < 5e-3


@pytest.mark.skipif(not kernels.numba_available(), reason="numba missing")
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("start", [0, 1, 2, 3, 4 * 2 ** 32 - 3])
def test_compiled_draws_equal_the_array_module_path(dtype, start):
    """On numpy arrays the draws run one compiled pass (cct.kernels.philox): the same bits, the same position."""
    for n in (1, 3, 6, 16389, 40001):  # 16389: past one kernel task (16384), odd ends
        fast, slow = HOST.random_stream((21, 22), 5), HOST.random_stream((21, 22), 5)
        for g in (fast, slow):
            g.set_state({**g.state(), "position": start})
        a, b = np.empty(n, dtype), np.empty(n, dtype)
        fast.bernoulli_(a, 0.45, 3.0)
        fast.uniform_(b)
        c, d = np.empty(n, dtype), np.empty(n, dtype)
        with kernels.forced_mode("numpy"):
            slow.bernoulli_(c, 0.45, 3.0)
            slow.uniform_(d)
        np.testing.assert_array_equal(a, c)
        np.testing.assert_array_equal(b, d)
        assert fast.state() == slow.state()


def test_state_round_trip_and_errors():
    gen = HOST.random_stream((11, 12), 4)
    gen.words(9)
    state = gen.state()
    assert state == {"key": [11, 12], "stream": 4, "position": 9}
    first = gen.words(20)
    gen.set_state(state)
    np.testing.assert_array_equal(gen.words(20), first)
    with pytest.raises(CctError, match="stream 5"):
        gen.set_state({**state, "stream": 5})
    with pytest.raises(CctError, match="malformed"):
        gen.set_state({"key": [1, 2]})
    with pytest.raises(CctError, match="outside"):
        gen.set_state({**state, "position": -1})
    with pytest.raises(CctError, match="C-contiguous"):
        gen.uniform_(np.empty((4, 4), dtype=np.float32)[:, ::2])
    with pytest.raises(CctError, match="float32 or float64"):
        gen.uniform_(np.empty(4, dtype=np.int32))


def test_key_from_host_is_seeded_and_leaves_the_host_stream_alone():
    a, b = np.random.default_rng(5), np.random.default_rng(5)
    ka = key_from_host(a)
    assert ka == key_from_host(b)
    assert a.random() == np.random.default_rng(5).random()  # no draw was taken from the host stream
    assert key_from_host(a) != ka  # the next net gets another key
    assert key_from_host(np.random.default_rng()) != key_from_host(np.random.default_rng())


def test_net_random_owns_one_stream_per_layer():
    nr = NetRandom(np.random.default_rng(1), HOST)
    assert nr.key is None and nr.state() == {}
    a, b = nr.stream(2, "drop1"), nr.stream(5, "drop2")
    assert a.key == b.key == nr.key and (a.stream, b.stream) == (2, 5)
    a.words(8)
    saved = nr.state()
    assert saved["drop1"]["position"] == 8 and saved["drop2"]["position"] == 0
    nr.rekey((7, 7))
    assert a.key == b.key == (7, 7) and int(a.position[0]) == 8
    assert nr.set_state(saved, keys=False) == []
    assert a.key == (7, 7)
    assert nr.set_state({**saved, "gone": saved["drop1"]}) == ["gone"]
    assert a.key == tuple(saved["drop1"]["key"])


# -- layers ---------------------------------------------------------------------------------------
def make_layer(text, phase=caffe_pb2.TRAIN):
    lp = caffe_pb2.LayerParameter()
    parse_text(text, lp)
    lp.name = lp.name or "l"
    lp.phase = phase
    return create_layer(lp)


@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_dropout_forward_backward_against_a_direct_reference(dtype, in_place):
    g = np.random.default_rng(0)
    x = g.standard_normal((4, 3, 5)).astype(dtype)
    dy = g.standard_normal(x.shape).astype(dtype)
    layer = make_layer('type: "Dropout" dropout_param { dropout_ratio: 0.35 }')
    b = make_blob(x)
    t = b if in_place else Blob((), dtype=dtype)
    rng.set_random_seed(4)
    layer.setup([b], [t])
    twin = HOST.random_stream(layer.random.key, layer.random.stream)
    twin.set_state(layer.random.state())
    mask = np.empty(x.shape, dtype=dtype)
    ratio = float(np.float32(0.35))  # dropout_ratio is a float field
    twin.bernoulli_(mask, 1 - ratio, 1 / (1 - ratio))
    layer.forward([b], [t])
    np.testing.assert_array_equal(t.data, x * mask)
    assert set(np.unique(mask)) == {0.0, dtype(1 / (1 - ratio))}
    t.diff[...] = dy
    layer.backward([t], [True], [b])
    np.testing.assert_array_equal(b.diff, dy * mask)


def test_dropout_mask_buffer_is_allocated_at_reshape_and_reused():
    layer = make_layer('type: "Dropout"')
    b, t = make_blob(np.ones((6, 5), np.float32)), Blob((), dtype=np.float32)
    rng.set_random_seed(1)
    layer.setup([b], [t])
    buf = layer.mask
    assert buf is not None and buf.shape == (6, 5)
    layer.forward([b], [t])
    first = t.data.copy()
    layer.reshape([b], [t])
    layer.forward([b], [t])
    assert layer.mask is buf and not np.array_equal(first, t.data)  # a new mask in the same buffer
    assert int(layer.random.position[0]) == 60


def test_dropout_backward_before_forward_is_a_clean_error():
    layer = make_layer('type: "Dropout"')
    b, t = make_blob(np.ones((2, 3), np.float64)), Blob((), dtype=np.float64)
    layer.setup([b], [t])
    with pytest.raises(CctError, match="backward called before forward"):
        layer.backward([t], [True], [b])


def test_dropout_gradient_with_a_fixed_mask():
    layer = make_layer('type: "Dropout" dropout_param { dropout_ratio: 0.4 }')
    x = np.random.default_rng(2).standard_normal((3, 4, 2))
    check_gradient(layer, [make_blob(x)], [Blob((), dtype=np.float64)])


def test_dropout_test_phase_has_no_stream():
    layer = make_layer('type: "Dropout"', caffe_pb2.TEST)
    b, t = make_blob(np.ones((2, 3), np.float32)), Blob((), dtype=np.float32)
    layer.setup([b], [t])
    assert layer.random is None and layer.mask is None and not layer.draws_random()


def test_stochastic_pooling_draws_one_uniform_per_output_from_its_stream():
    layer = make_layer('type: "Pooling" pooling_param { pool: STOCHASTIC kernel_size: 2 stride: 2 }')
    x = np.random.default_rng(3).uniform(0.1, 1.0, (2, 3, 4, 4)).astype(np.float32)
    b, t = make_blob(x), Blob((), dtype=np.float32)
    layer.setup([b], [t])
    state = layer.random.state()
    layer.forward([b], [t])
    assert int(layer.random.position[0]) == t.count
    first = t.data.copy()
    layer.random.set_state(state)
    layer.forward([b], [t])
    np.testing.assert_array_equal(t.data, first)  # the same draws, the same picks
    # each pick is the first window position whose running sum reaches u * sum (u from the stream)
    u = np.empty(t.shape, np.float32)
    twin = HOST.random_stream(layer.random.key, layer.random.stream)
    twin.set_state(state)
    twin.uniform_(u)
    win = x.reshape(2, 3, 2, 2, 2, 2).transpose(0, 1, 2, 4, 3, 5).reshape(2, 3, 2, 2, 4)
    cum = np.cumsum(win, axis=-1)
    pick = np.argmax(cum >= (u * cum[..., -1])[..., None], axis=-1)
    np.testing.assert_array_equal(first, np.take_along_axis(win, pick[..., None], -1)[..., 0])


# -- nets and solvers -----------------------------------------------------------------------------
NET = """
name: "drops"
layer { name: "x" type: "Input" top: "x" input_param { shape { dim: 4 dim: 6 } } }
layer { name: "d1" type: "Dropout" bottom: "x" top: "y1" dropout_param { dropout_ratio: 0.5 } }
layer { name: "d2" type: "Dropout" bottom: "x" top: "y2" dropout_param { dropout_ratio: 0.5 } }
"""


def net_masks(seed, iterations=3):
    cct.set_random_seed(seed)
    net = cct.Net(parse_text(NET, caffe_pb2.NetParameter()), cct.TRAIN)
    net.blobs["x"].data[...] = 1
    out = []
    for _ in range(iterations):
        net.forward()
        out.append((net.blobs["y1"].data.copy(), net.blobs["y2"].data.copy()))
    return net, out


def test_net_masks_differ_per_iteration_and_layer_and_repeat_per_seed():
    net, a = net_masks(7)
    _, b = net_masks(7)
    _, c = net_masks(8)
    for (a1, a2), (b1, b2) in zip(a, b):
        np.testing.assert_array_equal(a1, b1)
        np.testing.assert_array_equal(a2, b2)
    assert not np.array_equal(a[0][0], a[1][0])  # another mask each iteration
    assert not np.array_equal(a[0][0], a[0][1])  # each layer its own stream
    assert not np.array_equal(a[0][0], c[0][0])  # another seed, other masks
    assert net.layer_by_name("d1").random is net.random.streams["d1"]
    assert [net.random.streams[n].stream for n in ("d1", "d2")] == [net._layer_index[n] for n in ("d1", "d2")]


def test_a_net_without_random_layers_takes_no_key():
    cct.set_random_seed(3)
    net = cct.Net(parse_text(NET, caffe_pb2.NetParameter()), cct.TEST)
    assert net.random.key is None and net.random.streams == {}


LOSS_NET = """
name: "dropnet"
layer { name: "data" type: "DummyData" top: "data" top: "target"
        dummy_data_param { shape { dim: 8 dim: 10 } shape { dim: 8 dim: 3 }
                           data_filler { type: "gaussian" std: 1 } data_filler { type: "gaussian" std: 1 } } }
layer { name: "ip1" type: "InnerProduct" bottom: "data" top: "ip1"
        inner_product_param { num_output: 12 weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "drop" type: "Dropout" bottom: "ip1" top: "ip1" dropout_param { dropout_ratio: 0.4 } }
layer { name: "ip2" type: "InnerProduct" bottom: "ip1" top: "ip2"
        inner_product_param { num_output: 3 weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "loss" type: "EuclideanLoss" bottom: "ip2" bottom: "target" top: "loss" }
"""


def solver_param(prefix, max_iter, snapshot_every):
    sp = caffe_pb2.SolverParameter()
    parse_text(LOSS_NET, sp.net_param)
    sp.base_lr, sp.momentum, sp.lr_policy = 0.05, 0.9, "fixed"
    sp.max_iter, sp.snapshot, sp.display, sp.random_seed = max_iter, snapshot_every, 0, 17
    sp.snapshot_prefix = prefix
    sp.solver_mode = caffe_pb2.SolverParameter.CPU
    sp.snapshot_after_train = False
    return sp


def test_resume_draws_the_masks_of_an_uninterrupted_run(tmp_path):
    n = 6
    straight = get_solver(solver_param(str(tmp_path / "a" / "run"), 2 * n, 0))
    straight.solve()
    first = get_solver(solver_param(str(tmp_path / "b" / "run"), n, n))
    first.solve()
    state_file = str(tmp_path / "b" / f"run_iter_{n}.solverstate")
    saved = snapshot.read_cctstate(snapshot.cctstate_path(state_file))["random_streams"]["train_net"]
    assert saved["drop"]["position"] == n * 8 * 12
    resumed = get_solver(solver_param(str(tmp_path / "b" / "run"), 2 * n, 0))
    resumed.solve(state_file)
    for a, b in zip(straight.net.learnable_params, resumed.net.learnable_params):
        np.testing.assert_array_equal(a.data, b.data)
    # without the streams' state the resumed run redraws the first masks: other weights (the test can fail)
    cct_state = snapshot.cctstate_path(state_file)
    state = snapshot.read_cctstate(cct_state)
    del state["random_streams"]
    os.remove(cct_state)
    snapshot.write_cctstate(cct_state, state)
    fresh = get_solver(solver_param(str(tmp_path / "b" / "run"), 2 * n, 0))
    fresh.solve(state_file)
    assert not all(np.array_equal(a.data, b.data)
                   for a, b in zip(straight.net.learnable_params, fresh.net.learnable_params))


def test_dropout_scale_is_exact():
    # 1 / (1 - p) rounded once to the blob's dtype, as before
    layer = make_layer('type: "Dropout" dropout_param { dropout_ratio: 0.3 }')
    b, t = make_blob(np.ones((64, 64), np.float32)), Blob((), dtype=np.float32)
    layer.setup([b], [t])
    layer.forward([b], [t])
    assert set(np.unique(t.data)) == {0.0, np.float32(1 / (1 - float(np.float32(0.3))))}
    assert math.isclose((t.data != 0).mean(), 0.7, abs_tol=0.03)


def test_spp_stochastic_levels_share_the_layers_stream():
    text = """
    name: "spp"
    layer { name: "x" type: "Input" top: "x" input_param { shape { dim: 2 dim: 3 dim: 8 dim: 8 } } }
    layer { name: "spp" type: "SPP" bottom: "x" top: "y" spp_param { pyramid_height: 2 pool: STOCHASTIC } }
    """
    cct.set_random_seed(2)
    net = cct.Net(parse_text(text, caffe_pb2.NetParameter()), cct.TRAIN)
    net.blobs["x"].data[...] = np.random.default_rng(0).uniform(0.1, 1, (2, 3, 8, 8))
    spp = net.layer_by_name("spp")
    assert spp.random is net.random.streams["spp"] and all(pool.random is spp.random for pool, _ in spp.levels)
    net.forward()
    assert net.random.state()["spp"]["position"] == 2 * 3 * (1 + 4)  # one uniform per output of each level


def test_resume_with_a_stream_of_another_layer_is_a_clean_error(tmp_path):
    from cct.errors import SolverError

    first = get_solver(solver_param(str(tmp_path / "run"), 2, 2))
    first.solve()
    state_file = str(tmp_path / "run_iter_2.solverstate")
    cct_state = snapshot.cctstate_path(state_file)
    state = snapshot.read_cctstate(cct_state)
    state["random_streams"]["train_net"]["drop"]["stream"] = 99  # as if the layer had moved in the net
    os.remove(cct_state)
    snapshot.write_cctstate(cct_state, state)
    again = get_solver(solver_param(str(tmp_path / "run"), 4, 0))
    with pytest.raises(SolverError, match=r"run_iter_2.cctstate: train net: layer 'drop': .*stream 99"):
        again.restore(state_file)
