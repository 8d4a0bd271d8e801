"""The device generator on CuPy (skipped without CuPy and a GPU): the same bits as on numpy, drawn
without the host, and a GPU net's Dropout and stochastic-pooling draws equal a CPU net's."""
import numpy as np
import pytest

import cct
from cct import scheduler
from cct.config import Config, using_config
from cct.device.driver import CupyDevice, HostDevice, cupy_available, to_host
from cct.device.random import philox4x32_10, round_keys
from cct.io.prototxt import parse_text
from cct.proto import caffe_pb2

pytestmark = pytest.mark.skipif(not cupy_available(), reason="needs CuPy and a GPU")

KEY, STREAM = (0xA4093822, 0x299F31D0), (3 << 32) + 17


def _cupy():
    import cupy

    return cupy


def test_philox_known_answer_on_the_gpu():
    cp = _cupy()
    counter = tuple(cp.asarray([c], dtype=cp.uint32) for c in (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344))
    got = philox4x32_10(cp, counter, round_keys(KEY))
    assert tuple(int(g[0]) for g in got) == (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)


def test_numpy_and_cupy_streams_give_identical_bits():
    cp = _cupy()
    host, dev = HostDevice().random_stream(KEY, STREAM), CupyDevice(0).random_stream(KEY, STREAM)
    for n in (1, 7, 4096, 100_003):  # odd sizes: every later draw starts mid-block
        np.testing.assert_array_equal(host.words(n), to_host(dev.words(n)))
    for dtype in (np.float32, np.float64):
        a, b = np.empty((33, 65), dtype), cp.empty((33, 65), dtype)
        host.uniform_(a)
        dev.uniform_(b)
        np.testing.assert_array_equal(a, to_host(b))
        host.bernoulli_(a, 0.55, 1 / 0.45)
        dev.bernoulli_(b, 0.55, 1 / 0.45)
        np.testing.assert_array_equal(a, to_host(b))
    assert isinstance(dev.position, cp.ndarray) and host.state() == dev.state()


def test_a_captured_draw_replays_and_advances_its_device_counter():
    """The draw holds no host read: captured once as a CUDA graph, each replay draws the next mask."""
    cp = _cupy()
    dev, host = CupyDevice(0).random_stream(KEY, STREAM), HostDevice().random_stream(KEY, STREAM)
    mask = cp.empty((64, 1000), cp.float32)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        dev.bernoulli_(mask, 0.5, 2.0)  # warm-up outside the capture (kernels compiled, pool primed)
        stream.synchronize()
        dev.set_state({**dev.state(), "position": 0})
        stream.begin_capture()
        dev.bernoulli_(mask, 0.5, 2.0)
        graph = stream.end_capture()
    want = np.empty((64, 1000), np.float32)
    seen = []
    for _ in range(3):
        graph.launch(stream)
        stream.synchronize()
        host.bernoulli_(want, 0.5, 2.0)
        np.testing.assert_array_equal(to_host(mask), want)
        seen.append(to_host(mask))
    assert not np.array_equal(seen[0], seen[1]) and dev.state()["position"] == 3 * 64 * 1000


NET = """
name: "drops"
layer { name: "x" type: "Input" top: "x" input_param { shape { dim: 4 dim: 3 dim: 6 dim: 6 } } }
layer { name: "pool" type: "Pooling" bottom: "x" top: "p" pooling_param { pool: STOCHASTIC kernel_size: 2 stride: 2 } }
layer { name: "drop" type: "Dropout" bottom: "p" top: "p" dropout_param { dropout_ratio: 0.4 } }
"""


def _run(config: Config | None, iterations: int = 3) -> list[np.ndarray]:
    cct.set_random_seed(23)
    param = parse_text(NET, caffe_pb2.NetParameter())
    if config is None:
        net = cct.Net(param, cct.TRAIN)
    else:
        with using_config(config):
            net = cct.Net(param, cct.TRAIN)
    xp = net.xp
    net.blobs["x"].data[...] = xp.asarray(np.random.default_rng(1).uniform(0.1, 1, (4, 3, 6, 6)), np.float32)
    out = []
    for _ in range(iterations):
        net.forward()
        out.append(to_host(net.blobs["p"].data).copy())
    return out


def test_gpu_net_draws_the_cpu_nets_masks():
    cpu = _run(None)
    cfg = Config(devices=scheduler.make_config("gpu:0", [1.0]))
    try:
        gpu = _run(cfg)
    finally:
        cfg.close()
    for a, b in zip(cpu, gpu):
        np.testing.assert_array_equal(a, b)
    assert not np.array_equal(cpu[0], cpu[1])
