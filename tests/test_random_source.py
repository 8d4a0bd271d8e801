"""Who owns the host random generator (issue 29): a RandomSource per config, net and seeded solver.

The literals below were recorded with the process-global generator cct had before (main at f05cfba): a
seeded run must draw exactly what it drew then.
"""
import h5py
import numpy as np
import pytest
from google.protobuf import text_format

import caffe
import cct
from cct import config, rng
from cct.proto import caffe_pb2
from cct.random_source import RandomSource
from cct.solver import get_solver

NET = '''
name: "pin"
layer { name: "data" type: "DummyData" top: "data" top: "label"
  dummy_data_param { shape { dim: 4 dim: 6 } shape { dim: 4 }
    data_filler { type: "gaussian" std: 1 } data_filler { type: "constant" value: 1 } } }
layer { name: "ip1" type: "InnerProduct" bottom: "data" top: "ip1"
  inner_product_param { num_output: 5 weight_filler { type: "xavier" } bias_filler { type: "gaussian" std: 0.1 } } }
layer { name: "drop" type: "Dropout" bottom: "ip1" top: "ip1" dropout_param { dropout_ratio: 0.5 } }
layer { name: "ip2" type: "InnerProduct" bottom: "ip1" top: "ip2"
  inner_product_param { num_output: 3 weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip2" bottom: "label" top: "loss" }
'''

# seed -> (first 3 weights of ip1 after setup, the losses of iterations 1-4, first 3 weights of ip2 after them)
MAIN = {
    7: ([0.17691171169281006, 0.5617451667785645, 0.38987845182418823],
        [1.2470471858978271, 0.828605055809021, 1.0177563428878784, 0.8181023597717285],
        [-0.28420329093933105, -0.037334322929382324, 0.22250981628894806]),
    8: ([-0.2446981519460678, 0.6891134977340698, -0.2563816010951996],
        [1.3794127702713013, 1.1784281730651855, 0.7560059428215027, 0.8048659563064575],
        [0.35695716738700867, 0.4182474911212921, -0.10382537543773651]),
}


def solver_param(seed: int) -> caffe_pb2.SolverParameter:
    text = (f'base_lr: 0.1 lr_policy: "fixed" max_iter: 4 display: 0 test_iter: 1 test_interval: 100 '
            f'snapshot_after_train: false solver_mode: CPU random_seed: {seed}')
    p = text_format.Parse(text, caffe_pb2.SolverParameter())
    p.net_param.CopyFrom(text_format.Parse(NET, caffe_pb2.NetParameter()))
    return p


def first(blob, n=3) -> list[float]:
    return blob.data.ravel()[:n].tolist()


def step(solver) -> float:
    solver.step(1)
    return float(solver.net.blobs["loss"].data)


def test_a_source_draws_as_default_rng_and_reseeds_as_a_new_one():
    src = RandomSource(5)
    want = np.random.default_rng(5)
    np.testing.assert_array_equal(src.generator.normal(size=4), want.normal(size=4))
    src.generator.spawn(1)  # what a net does for its device-stream key
    src.seed(5)  # the seed sequence restarts too: the next net gets the key the first one got
    want = np.random.default_rng(5)
    assert src.generator.spawn(1)[0].random() == want.spawn(1)[0].random()
    np.testing.assert_array_equal(src.generator.normal(size=4), want.normal(size=4))
    saved = src.state()
    after = src.generator.random(3)
    src.generator.random(7)
    src.restore(saved)
    np.testing.assert_array_equal(src.generator.random(3), after)


@pytest.mark.parametrize("seed", sorted(MAIN))
def test_a_seeded_solver_draws_what_it_drew_with_the_global_generator(seed):
    s = get_solver(solver_param(seed))
    w0, losses, w_after = MAIN[seed]
    assert first(s.net.params["ip1"][0]) == w0
    assert [step(s) for _ in range(4)] == losses
    assert first(s.net.params["ip2"][0]) == w_after


def test_two_interleaved_seeded_solvers_each_run_as_alone():
    a = get_solver(solver_param(7))
    cct.set_random_seed(123)  # the process source: neither solver draws from it
    b = get_solver(solver_param(8))
    assert a.random_source is not b.random_source
    assert all(layer.random_source is a.random_source for net in [a.net, *a.test_nets] for layer in net.layers)
    assert first(a.net.params["ip1"][0]) == MAIN[7][0] and first(b.net.params["ip1"][0]) == MAIN[8][0]
    got = {7: [], 8: []}
    for _ in range(4):
        got[8].append(step(b))
        got[7].append(step(a))
    assert got == {7: MAIN[7][1], 8: MAIN[8][1]}
    assert first(a.net.params["ip2"][0]) == MAIN[7][2] and first(b.net.params["ip2"][0]) == MAIN[8][2]
    assert config.current().random.generator.random() == np.random.default_rng(123).random()


def test_an_unseeded_solver_draws_from_its_configs_source():
    """Caffe without random_seed: the process RNG, so cct.set_random_seed before it makes the run repeatable."""
    runs = []
    for _ in range(2):
        cct.set_random_seed(7)  # what random_seed: 7 seeds, so the same draws
        param = solver_param(7)
        param.ClearField("random_seed")
        s = get_solver(param)
        assert s.random_source is s.config.random is config.current().random
        runs.append((first(s.net.params["ip1"][0]), [step(s) for _ in range(4)]))
    assert runs[0] == runs[1] == (MAIN[7][0], MAIN[7][1])


def test_a_net_hands_its_source_to_its_layers_and_a_lone_layer_uses_the_current_configs(tmp_path):
    (tmp_path / "list.txt").write_text(str(tmp_path / "rows.h5") + "\n")
    with h5py.File(tmp_path / "rows.h5", "w") as f:
        f["data"] = np.arange(10, dtype=np.float32).reshape(10, 1)
        f["label"] = np.arange(10, dtype=np.float32)
    text = f'''
    layer {{ name: "h" type: "HDF5Data" top: "data" top: "label"
      hdf5_data_param {{ source: "{tmp_path / 'list.txt'}" batch_size: 4 shuffle: true }} }}
    layer {{ name: "ip" type: "InnerProduct" bottom: "data" top: "ip"
      inner_product_param {{ num_output: 2 weight_filler {{ type: "msra" }} }} }}'''
    param = text_format.Parse(text, caffe_pb2.NetParameter())

    def run(net) -> tuple[list[int], list[float]]:
        labels = []
        for _ in range(3):
            net.forward()
            labels += net.blobs["label"].data.astype(int).tolist()
        return labels, net.params["ip"][0].data.ravel().tolist()

    main = ([6, 3, 9, 7, 1, 0, 2, 4, 5, 8, 2, 5], [1.922973394393921, 1.732017159461975])  # main, seed 11
    cct.set_random_seed(11)
    net = cct.Net(param, cct.TRAIN)
    assert net.random_source is config.current().random
    assert run(net) == main
    assert config.current().random.generator.random() == 0.028689008371944547  # main's next draw

    own = RandomSource(11)
    cct.set_random_seed(0)
    before = config.current().random.state()
    net = cct.Net(param, cct.TRAIN, random=own)
    assert all(layer.random_source is own for layer in net.layers)
    assert run(net) == main
    assert config.current().random.state() == before  # the net drew from its own source only

    lone = cct.layers.create_layer(net.layers[1].param)
    assert lone.random_source is None and lone.host_random() is config.current().random


def test_set_random_seed_reseeds_the_current_configs_source():
    outer = config.current().random
    with config.using_config(config.Config()) as inner_cfg:
        caffe.set_random_seed(4)
        assert inner_cfg.random is not outer
        assert rng.get_rng() is inner_cfg.random.generator
        assert inner_cfg.random.generator.random() == np.random.default_rng(4).random()
    with config.using_config(engine={"mode": "caffe"}) as copy:  # a replace() copy shares its base's source
        assert copy.random is outer


def test_a_snapshot_saves_and_restores_the_solvers_source(tmp_path):
    param = solver_param(7)
    param.snapshot_prefix = str(tmp_path / "pin")
    a = get_solver(param)
    step(a)
    step(a)
    a.snapshot()
    rest = [step(a), step(a)]
    b = get_solver(solver_param(8))  # another seed: its own source, restored from a's snapshot
    b.restore(str(tmp_path / "pin_iter_2.solverstate"))
    assert [step(b), step(b)] == rest == MAIN[7][1][2:]
