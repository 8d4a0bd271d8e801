"""Recurrent layers (cct/layers/recurrent.py): LSTMUnit, LSTM, RNN against step-by-step references,
float64 gradient checks, Caffe's parameter layout, state carry-over, expose_hidden, x_static, errors."""
from __future__ import annotations

import numpy as np
import pytest

from cct.blob import Blob
from cct.errors import LayerError
from cct.io.prototxt import parse_text
from cct.layers import create_layer
from cct.proto import caffe_pb2
from cct.testing import check_gradient, make_blob


def make_layer(text: str, name: str = "L"):
    lp = caffe_pb2.LayerParameter()
    parse_text(f'name: "{name}"\n' + text, lp)
    return create_layer(lp)


def rnd(*shape, seed=0, scale=1.0):
    return scale * np.random.default_rng(seed).standard_normal(shape)


def tops(n):
    return [Blob((), dtype=np.float64) for _ in range(n)]


def run(layer, bottom, top):
    layer.reshape(bottom, top)
    layer.forward(bottom, top)
    return top


def sig(x):
    return 1.0 / (1.0 + np.exp(-x))


CONT = np.array([[0, 0, 0], [1, 1, 0], [1, 0, 1], [1, 1, 1]], dtype=np.float64)  # (T=4, N=3)


def lstm_reference(x, cont, w_xc, b_c, w_hc, h0, c0, static=None, w_s=None):
    """The LSTM recurrence written out one step at a time (Caffe's unrolled net)."""
    T, N = cont.shape
    H = w_hc.shape[1]
    h, c = h0.copy(), c0.copy()
    out = np.zeros((T, N, H))
    for t in range(T):
        g = (cont[t][:, None] * h) @ w_hc.T + x[t].reshape(N, -1) @ w_xc.T + b_c
        if static is not None:
            g = g + static.reshape(N, -1) @ w_s.T
        i, f, o, gg = sig(g[:, :H]), sig(g[:, H:2 * H]), sig(g[:, 2 * H:3 * H]), np.tanh(g[:, 3 * H:])
        c = cont[t][:, None] * f * c + i * gg
        h = o * np.tanh(c)
        out[t] = h
    return out, h, c


def rnn_reference(x, cont, w_xh, b_h, w_hh, w_ho, b_o, h0):
    T, N = cont.shape
    h = h0.copy()
    out = np.zeros((T, N, w_ho.shape[0]))
    for t in range(T):
        h = np.tanh((cont[t][:, None] * h) @ w_hh.T + x[t].reshape(N, -1) @ w_xh.T + b_h)
        out[t] = np.tanh(h @ w_ho.T + b_o)
    return out, h


LSTM_TEXT = ('type: "LSTM" recurrent_param { num_output: 3 weight_filler { type: "gaussian" std: 0.5 } '
             'bias_filler { type: "gaussian" std: 0.3 } %s }')
RNN_TEXT = ('type: "RNN" recurrent_param { num_output: 3 weight_filler { type: "gaussian" std: 0.5 } '
            'bias_filler { type: "gaussian" std: 0.3 } %s }')


# ---------------------------------------------------------------------------------------- LSTMUnit
def test_lstm_unit_forward_and_gradient():
    layer = make_layer('type: "LSTMUnit"')
    c_prev, gates = rnd(1, 3, 2, seed=1), rnd(1, 3, 8, seed=2)
    cont = np.array([[1.0, 0.0, 1.0]])
    bottom = [make_blob(c_prev), make_blob(gates), make_blob(cont)]
    top = tops(2)
    layer.setup(bottom, top)
    run(layer, bottom, top)
    g = gates[0]
    i, f, o, gg = sig(g[:, :2]), sig(g[:, 2:4]) * cont[0][:, None], sig(g[:, 4:6]), np.tanh(g[:, 6:])
    c = f * c_prev[0] + i * gg
    np.testing.assert_allclose(top[0].data[0], c, rtol=1e-12)
    np.testing.assert_allclose(top[1].data[0], o * np.tanh(c), rtol=1e-12)
    check_gradient(layer, bottom, top, check_bottom=[0, 1], setup=False)
    # where cont = 0 no gradient reaches c_prev or the forget gate
    assert np.all(bottom[0].diff[0, 1] == 0) and np.all(bottom[1].diff[0, 1, 2:4] == 0)
    assert layer.allow_force_backward(0) and not layer.allow_force_backward(2)
    with pytest.raises(LayerError, match="sequence indicators"):
        layer.backward(top, [True, True, True], bottom)


def test_lstm_unit_shape_errors_name_layer():
    layer = make_layer('type: "LSTMUnit"', name="unit7")
    bottom = [make_blob(rnd(1, 3, 2)), make_blob(rnd(1, 3, 7)), make_blob(np.ones((1, 3)))]
    with pytest.raises(LayerError, match="unit7.*4 \\* 2"):
        layer.setup(bottom, tops(2))
    bottom = [make_blob(rnd(2, 3, 2)), make_blob(rnd(2, 3, 8)), make_blob(np.ones((2, 3)))]
    with pytest.raises(LayerError, match="unit7"):
        make_layer('type: "LSTMUnit"', name="unit7").setup(bottom, tops(2))


# -------------------------------------------------------------------------------------------- LSTM
def test_lstm_param_layout_forward_and_state_carry_over():
    layer = make_layer(LSTM_TEXT % "")
    x = rnd(4, 3, 2, 2, seed=3)  # (T, N, 2, 2): D = 4 from axis 2 on
    cont = CONT.copy()
    cont[0] = 1  # continue from the carried-over state at t = 0
    bottom = [make_blob(x), make_blob(cont)]
    top = tops(1)
    layer.setup(bottom, top)
    assert [b.shape for b in layer.blobs] == [(12, 4), (12,), (12, 3)]
    w_xc, b_c, w_hc = (b.data for b in layer.blobs)
    run(layer, bottom, top)
    zeros = np.zeros((3, 3))
    ref, h_T, c_T = lstm_reference(x, cont, w_xc, b_c, w_hc, zeros, zeros)
    assert top[0].shape == (4, 3, 3)
    np.testing.assert_allclose(top[0].data, ref, rtol=1e-10, atol=1e-12)
    # a second forward starts from the first one's final state
    run(layer, bottom, top)
    ref2, _, _ = lstm_reference(x, cont, w_xc, b_c, w_hc, h_T, c_T)
    np.testing.assert_allclose(top[0].data, ref2, rtol=1e-10, atol=1e-12)
    assert not np.allclose(ref2, ref)
    layer.reset()
    run(layer, bottom, top)
    np.testing.assert_allclose(top[0].data, ref, rtol=1e-10, atol=1e-12)


def test_lstm_gradient():
    layer = make_layer(LSTM_TEXT % "")
    bottom = [make_blob(rnd(4, 3, 2, seed=4)), make_blob(CONT)]
    check_gradient(layer, bottom, tops(1), check_bottom=[0], stepsize=1e-4, threshold=1e-6)
    assert not layer.allow_force_backward(1) and layer.allow_force_backward(0)


def test_lstm_static_input_and_exposed_hidden():
    layer = make_layer(LSTM_TEXT % "expose_hidden: true")
    x, xs = rnd(4, 3, 2, seed=5), rnd(3, 5, seed=6)
    h0, c0 = rnd(1, 3, 3, seed=7), rnd(1, 3, 3, seed=8)
    bottom = [make_blob(x), make_blob(CONT), make_blob(xs), make_blob(h0), make_blob(c0)]
    top = tops(3)
    layer.setup(bottom, top)
    assert [b.shape for b in layer.blobs] == [(12, 2), (12,), (12, 5), (12, 3)]
    assert [t.shape for t in top] == [(4, 3, 3), (1, 3, 3), (1, 3, 3)]
    w_xc, b_c, w_s, w_hc = (b.data for b in layer.blobs)
    run(layer, bottom, top)
    ref, h_T, c_T = lstm_reference(x, CONT, w_xc, b_c, w_hc, h0[0], c0[0], xs, w_s)
    np.testing.assert_allclose(top[0].data, ref, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(top[1].data[0], h_T, rtol=1e-10)
    np.testing.assert_allclose(top[2].data[0], c_T, rtol=1e-10)
    # exposed hidden: the state comes from the bottoms every time, not from the last forward
    run(layer, bottom, top)
    np.testing.assert_allclose(top[0].data, ref, rtol=1e-10, atol=1e-12)
    # gradients of x, x_static and every parameter (the final states carry no gradient, as in Caffe)
    w = [rnd(4, 3, 3, seed=9), None, None]
    check_gradient(layer, bottom, top, check_bottom=[0, 2], stepsize=1e-4, threshold=1e-6,
                   top_weights=w, setup=False)
    layer.backward(top, [True, False, True, True, True], bottom)
    assert np.all(bottom[3].diff == 0) and np.all(bottom[4].diff == 0)


def test_lstm_errors():
    with pytest.raises(LayerError, match="lstm1.*num_output must be positive"):
        make_layer('type: "LSTM"', name="lstm1").setup([make_blob(rnd(2, 1, 2)), make_blob(np.ones((2, 1)))],
                                                     tops(1))
    layer = make_layer(LSTM_TEXT % "", name="lstm2")
    with pytest.raises(LayerError, match="lstm2.*cont"):
        layer.setup([make_blob(rnd(4, 3, 2)), make_blob(np.ones((3, 4)))], tops(1))
    layer = make_layer(LSTM_TEXT % "", name="lstm3")
    bottom, top = [make_blob(rnd(4, 3, 2)), make_blob(CONT)], tops(1)
    layer.setup(bottom, top)
    with pytest.raises(LayerError, match="lstm3.*timesteps changed"):
        layer.reshape([make_blob(rnd(5, 3, 2)), make_blob(np.ones((5, 3)))], top)
    with pytest.raises(LayerError, match="lstm3.*sequence indicators"):
        layer.backward(top, [True, True], bottom)
    layer = make_layer(LSTM_TEXT % "expose_hidden: true", name="lstm4")
    with pytest.raises(LayerError, match="lstm4.*at least 4 bottom"):
        layer.setup(bottom, tops(3))
    layer = make_layer(LSTM_TEXT % "expose_hidden: true", name="lstm5")
    with pytest.raises(LayerError, match="lstm5.*h_0"):
        layer.setup(bottom + [make_blob(rnd(1, 3, 4)), make_blob(rnd(1, 3, 3))], tops(3))
    # weights of the wrong layout (e.g. from another net) are refused with the expected shape
    lp = caffe_pb2.LayerParameter()
    parse_text('name: "lstm6" ' + LSTM_TEXT % "", lp)
    for shape in [(12, 2), (12,), (12, 4)]:
        lp.blobs.add().shape.dim.extend(shape)
        lp.blobs[-1].data.extend([0.0] * int(np.prod(shape)))
    with pytest.raises(LayerError, match="lstm6.*parameter 2 has shape \\[12, 4\\]; expected \\[12, 3\\]"):
        create_layer(lp).setup(bottom, tops(1))


# --------------------------------------------------------------------------------------------- RNN
def test_rnn_param_layout_forward_and_gradient():
    layer = make_layer(RNN_TEXT % "")
    x = rnd(4, 3, 2, seed=10)
    bottom = [make_blob(x), make_blob(CONT)]
    top = tops(1)
    layer.setup(bottom, top)
    assert [b.shape for b in layer.blobs] == [(3, 2), (3,), (3, 3), (3, 3), (3,)]
    run(layer, bottom, top)
    ref, _ = rnn_reference(x, CONT, *(b.data for b in layer.blobs), np.zeros((3, 3)))
    np.testing.assert_allclose(top[0].data, ref, rtol=1e-10, atol=1e-12)
    check_gradient(layer, bottom, top, check_bottom=[0], stepsize=1e-4, threshold=1e-6, setup=False)


def test_rnn_static_exposed_hidden_gradient():
    layer = make_layer(RNN_TEXT % "expose_hidden: true")
    x, xs, h0 = rnd(4, 3, 2, seed=11), rnd(3, 2, 2, seed=12), rnd(1, 3, 3, seed=13)
    bottom = [make_blob(x), make_blob(CONT), make_blob(xs), make_blob(h0)]
    top = tops(2)
    layer.setup(bottom, top)
    assert [b.shape for b in layer.blobs] == [(3, 2), (3,), (3, 4), (3, 3), (3, 3), (3,)]
    run(layer, bottom, top)
    w_xh, b_h, w_s, w_hh, w_ho, b_o = (b.data for b in layer.blobs)
    xw = x.reshape(4, 3, 2)
    b_eff = b_h + xs.reshape(3, 4) @ w_s.T  # the static term is a per-stream bias
    ref = np.zeros((4, 3, 3))
    h = h0[0]
    for t in range(4):
        h = np.tanh((CONT[t][:, None] * h) @ w_hh.T + xw[t] @ w_xh.T + b_eff)
        ref[t] = np.tanh(h @ w_ho.T + b_o)
    np.testing.assert_allclose(top[0].data, ref, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(top[1].data[0], h, rtol=1e-10)
    check_gradient(layer, bottom, top, check_bottom=[0, 2], stepsize=1e-4, threshold=1e-6,
                   top_weights=[rnd(4, 3, 3, seed=14), None], setup=False)


def test_lstm_in_a_net_loads_its_own_weights(tmp_path):
    """A net with an LSTM round-trips its weights through a caffemodel (param order and shapes)."""
    from cct.net import Net

    text = """
    name: "n" force_backward: true
    layer { name: "in" type: "Input" top: "x" top: "cont"
            input_param { shape { dim: 3 dim: 2 dim: 4 } shape { dim: 3 dim: 2 } } }
    layer { name: "lstm" type: "LSTM" bottom: "x" bottom: "cont" top: "h"
            recurrent_param { num_output: 5 weight_filler { type: "uniform" min: -0.1 max: 0.1 } } }
    """
    path = tmp_path / "n.prototxt"
    path.write_text(text)
    net = Net(str(path), caffe_pb2.TRAIN)
    net.blobs["x"].data[...] = rnd(3, 2, 4)
    net.blobs["cont"].data[...] = [[0, 0], [1, 1], [1, 0]]
    net.forward()
    h = net.blobs["h"].data.copy()
    net.save(str(tmp_path / "w.caffemodel"))
    net2 = Net(str(path), caffe_pb2.TRAIN, weights=str(tmp_path / "w.caffemodel"))
    net2.blobs["x"].data[...] = net.blobs["x"].data
    net2.blobs["cont"].data[...] = net.blobs["cont"].data
    net2.forward()
    np.testing.assert_array_equal(net2.blobs["h"].data, h)


@pytest.mark.parametrize("case,out", [("lstm_t3_n2", "h"), ("rnn_t3_n2", "o")])
def test_caffe_trained_weights_load_into_a_net(case, out):
    """Caffe's own .caffemodel of a recurrent net loads by layer name (parameter order and shapes)."""
    import os

    from refcase import case_dir, load_case, max_rel_err, reference_available

    from cct.net import Net

    if not reference_available():
        pytest.skip("../shared/reference not present")
    d = case_dir(case)
    ref = load_case(case).arrays
    net = Net(os.path.join(d, "net.prototxt"), caffe_pb2.TRAIN, weights=os.path.join(d, "weights.caffemodel"))
    for name in ("x", "cont"):
        net.blobs[name].data[...] = ref[f"input/{name}"]
    net.forward()
    assert max_rel_err(net.blobs[out].data, ref[f"data/{out}"]) <= 1e-4
