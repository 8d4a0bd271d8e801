"""cct/proto/caffe_pb2.py is what protoc generates from proto/caffe.proto, the messages keep BVLC Caffe's
field numbers and defaults (wire/text compatibility), and every upstream prototxt parses."""
from __future__ import annotations

import glob
import importlib.util
import math
import os
import subprocess
import sys

import pytest
from google.protobuf import descriptor_pb2

from cct.io import parse_text, read_net_prototxt, read_solver_prototxt, read_text_file
from cct.paths import shared_path
from cct.proto import caffe_pb2

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MODELS = str(shared_path("caffe-models"))
HAVE_GRPC_TOOLS = importlib.util.find_spec("grpc_tools") is not None


def _gen_proto():
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    try:
        import gen_proto
    finally:
        sys.path.pop(0)
    return gen_proto


# ---------------------------------------------------------------------------------------------
# generated module is up to date
# ---------------------------------------------------------------------------------------------
@pytest.mark.skipif(not HAVE_GRPC_TOOLS, reason="grpc_tools not installed")
def test_committed_module_describes_the_proto_file():
    # Independent of the protoc version: the descriptor embedded in caffe_pb2 equals protoc's parse of
    # proto/caffe.proto.
    gen = _gen_proto()
    assert gen.descriptor_set() == gen.committed_descriptor()


@pytest.mark.skipif(not HAVE_GRPC_TOOLS, reason="grpc_tools not installed")
def test_committed_module_equals_fresh_generation():
    gen = _gen_proto()
    fresh = gen.generate()
    with open(gen.OUTPUT, "rb") as f:
        committed = f.read()

    def version_line(src: bytes) -> bytes:
        return next((l for l in src.splitlines() if l.startswith(b"# Protobuf Python Version")), b"")

    if version_line(fresh) != version_line(committed):
        pytest.skip(f"installed protoc writes {version_line(fresh)!r}, committed file has {version_line(committed)!r}")
    assert fresh == committed, "cct/proto/caffe_pb2.py is stale: run python tools/gen_proto.py"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "gen_proto.py"), "--check"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


@pytest.mark.skipif(not HAVE_GRPC_TOOLS, reason="grpc_tools not installed")
def test_descriptor_comparison_detects_a_change():
    gen = _gen_proto()
    fd = descriptor_pb2.FileDescriptorProto.FromString(caffe_pb2.DESCRIPTOR.serialized_pb)
    solver = next(m for m in fd.message_type if m.name == "SolverParameter")
    next(f for f in solver.field if f.name == "momentum2").default_value = "0.99"
    assert gen.normalize_descriptor(fd) != gen.committed_descriptor()


# ---------------------------------------------------------------------------------------------
# BVLC field numbers and defaults
# ---------------------------------------------------------------------------------------------
def number(message, field: str) -> int:
    return message.DESCRIPTOR.fields_by_name[field].number


LAYER_PARAMETER_NUMBERS = {
    "name": 1, "type": 2, "bottom": 3, "top": 4, "phase": 10, "loss_weight": 5, "param": 6, "blobs": 7,
    "propagate_down": 11, "include": 8, "exclude": 9, "transform_param": 100, "loss_param": 101,
    "accuracy_param": 102, "argmax_param": 103, "batch_norm_param": 139, "bias_param": 141, "clip_param": 148,
    "concat_param": 104, "contrastive_loss_param": 105, "convolution_param": 106, "crop_param": 144,
    "data_param": 107, "dropout_param": 108, "dummy_data_param": 109, "eltwise_param": 110, "elu_param": 140,
    "embed_param": 137, "exp_param": 111, "flatten_param": 135, "hdf5_data_param": 112,
    "hdf5_output_param": 113, "hinge_loss_param": 114, "image_data_param": 115, "infogain_loss_param": 116,
    "inner_product_param": 117, "input_param": 143, "log_param": 134, "lrn_param": 118,
    "memory_data_param": 119, "mvn_param": 120, "parameter_param": 145, "pooling_param": 121,
    "power_param": 122, "prelu_param": 131, "python_param": 130, "recurrent_param": 146,
    "reduction_param": 136, "relu_param": 123, "reshape_param": 133, "scale_param": 142,
    "sigmoid_param": 124, "softmax_param": 125, "spp_param": 132, "slice_param": 126, "swish_param": 147,
    "tanh_param": 127, "threshold_param": 128, "tile_param": 138, "window_data_param": 129,
}

SOLVER_PARAMETER_NUMBERS = {
    "net": 24, "net_param": 25, "train_net": 1, "test_net": 2, "train_net_param": 21, "test_net_param": 22,
    "train_state": 26, "test_state": 27, "test_iter": 3, "test_interval": 4, "test_compute_loss": 19,
    "test_initialization": 32, "base_lr": 5, "display": 6, "average_loss": 33, "max_iter": 7, "iter_size": 36,
    "lr_policy": 8, "gamma": 9, "power": 10, "momentum": 11, "weight_decay": 12, "regularization_type": 29,
    "stepsize": 13, "stepvalue": 34, "clip_gradients": 35, "snapshot": 14, "snapshot_prefix": 15,
    "snapshot_diff": 16, "snapshot_format": 37, "solver_mode": 17, "device_id": 18, "random_seed": 20,
    "type": 40, "delta": 31, "momentum2": 39, "rms_decay": 38, "debug_info": 23, "snapshot_after_train": 28,
    "solver_type": 30, "layer_wise_reduce": 41, "weights": 42,
}


@pytest.mark.parametrize("message, numbers", [
    (caffe_pb2.LayerParameter, LAYER_PARAMETER_NUMBERS),
    (caffe_pb2.SolverParameter, SOLVER_PARAMETER_NUMBERS),
    (caffe_pb2.NetParameter, {"name": 1, "input": 3, "input_shape": 8, "input_dim": 4, "force_backward": 5,
                              "state": 6, "debug_info": 7, "layer": 100, "layers": 2}),
    (caffe_pb2.BlobProto, {"shape": 7, "data": 5, "diff": 6, "double_data": 8, "double_diff": 9, "num": 1,
                           "channels": 2, "height": 3, "width": 4}),
    (caffe_pb2.SolverState, {"iter": 1, "learned_net": 2, "history": 3, "current_step": 4}),
    (caffe_pb2.Datum, {"channels": 1, "height": 2, "width": 3, "data": 4, "label": 5, "float_data": 6,
                       "encoded": 7}),
    (caffe_pb2.ParamSpec, {"name": 1, "share_mode": 2, "lr_mult": 3, "decay_mult": 4}),
    (caffe_pb2.ConvolutionParameter, {"num_output": 1, "bias_term": 2, "pad": 3, "kernel_size": 4, "group": 5,
                                      "stride": 6, "weight_filler": 7, "bias_filler": 8, "pad_h": 9,
                                      "pad_w": 10, "kernel_h": 11, "kernel_w": 12, "stride_h": 13,
                                      "stride_w": 14, "engine": 15, "axis": 16, "force_nd_im2col": 17,
                                      "dilation": 18}),
    (caffe_pb2.V1LayerParameter, {"layer": 1, "bottom": 2, "top": 3, "name": 4, "type": 5, "blobs": 6,
                                  "blobs_lr": 7, "weight_decay": 8, "include": 32, "exclude": 33,
                                  "loss_weight": 35, "param": 1001, "blob_share_mode": 1002,
                                  "convolution_param": 10, "data_param": 11, "transform_param": 36,
                                  "loss_param": 42, "pooling_param": 19, "inner_product_param": 17}),
    (caffe_pb2.V0LayerParameter, {"name": 1, "type": 2, "num_output": 3, "biasterm": 4, "pad": 7,
                                  "kernelsize": 8, "blobs": 50, "blobs_lr": 51, "weight_decay": 52,
                                  "hdf5_output_param": 1001}),
])
def test_field_numbers_match_bvlc(message, numbers):
    got = {name: number(message, name) for name in numbers}
    assert got == numbers


def test_key_defaults_match_bvlc():
    assert caffe_pb2.ConvolutionParameter().bias_term is True
    assert caffe_pb2.ConvolutionParameter().group == 1
    assert caffe_pb2.InnerProductParameter().bias_term is True
    s = caffe_pb2.SolverParameter()
    assert math.isclose(s.momentum2, 0.999, rel_tol=1e-7)
    assert math.isclose(s.delta, 1e-8, rel_tol=1e-7)
    assert math.isclose(s.rms_decay, 0.99, rel_tol=1e-7)
    assert s.snapshot_format == caffe_pb2.SolverParameter.BINARYPROTO
    assert s.solver_mode == caffe_pb2.SolverParameter.GPU
    assert (s.type, s.regularization_type, s.clip_gradients, s.random_seed) == ("SGD", "L2", -1, -1)
    assert (s.average_loss, s.iter_size, s.test_initialization, s.snapshot_after_train) == (1, 1, True, True)
    assert caffe_pb2.NetState().phase == caffe_pb2.TEST
    assert (caffe_pb2.TRAIN, caffe_pb2.TEST) == (0, 1)
    assert caffe_pb2.V1LayerParameter.CONVOLUTION == 4
    assert caffe_pb2.V1LayerParameter.DECONVOLUTION == 39
    assert caffe_pb2.V1LayerParameter.SOFTMAX_LOSS == 21
    p = caffe_pb2.ParamSpec()
    assert (p.lr_mult, p.decay_mult) == (1.0, 1.0)
    f = caffe_pb2.FillerParameter()
    assert (f.type, f.value, f.min, f.max, f.mean, f.std, f.sparse) == ("constant", 0, 0, 1, 0, 1, -1)
    lrn = caffe_pb2.LRNParameter()
    assert (lrn.local_size, lrn.alpha, lrn.beta, lrn.k) == (5, 1.0, 0.75, 1.0)
    assert caffe_pb2.PoolingParameter().pool == caffe_pb2.PoolingParameter.MAX
    assert caffe_pb2.PoolingParameter().stride == 1
    assert math.isclose(caffe_pb2.BatchNormParameter().moving_average_fraction, 0.999, rel_tol=1e-7)
    assert math.isclose(caffe_pb2.BatchNormParameter().eps, 1e-5, rel_tol=1e-6)
    assert caffe_pb2.LossParameter().normalization == caffe_pb2.LossParameter.VALID
    assert caffe_pb2.DataParameter().backend == caffe_pb2.DataParameter.LEVELDB
    assert caffe_pb2.TransformationParameter().scale == 1.0
    assert caffe_pb2.ConcatParameter().axis == 1 and caffe_pb2.SoftmaxParameter().axis == 1
    assert caffe_pb2.DropoutParameter().dropout_ratio == 0.5
    assert caffe_pb2.ReshapeParameter().num_axes == -1


def test_wire_encoding_of_a_blob():
    # packed floats under field 5 and a BlobShape under field 7, as Caffe writes them
    b = caffe_pb2.BlobProto()
    b.shape.dim.extend([2])
    b.data.extend([1.0, 2.0])
    assert b.SerializeToString() == b"\x2a\x08" + b"\x00\x00\x80\x3f\x00\x00\x00\x40" + b"\x3a\x03\x0a\x01\x02"


# ---------------------------------------------------------------------------------------------
# upstream prototxts
# ---------------------------------------------------------------------------------------------
UPSTREAM = sorted(glob.glob(os.path.join(MODELS, "**", "*.prototxt"), recursive=True))


def test_upstream_models_are_present():
    if not os.path.isdir(MODELS):
        pytest.skip("shared caffe-models not available")
    assert len(UPSTREAM) >= 20


@pytest.mark.parametrize("path", UPSTREAM, ids=[os.path.relpath(p, MODELS) for p in UPSTREAM])
def test_upstream_prototxt_parses(path):
    if "solver" in os.path.basename(path):
        solver = read_solver_prototxt(path)
        assert solver.HasField("base_lr") and solver.type
        assert solver.HasField("net") or solver.HasField("train_net") or solver.HasField("net_param")
        raw = read_text_file(path, caffe_pb2.SolverParameter())
        assert parse_text(str(raw), caffe_pb2.SolverParameter()) == raw
    else:
        net = read_net_prototxt(path)
        assert len(net.layer) > 0 and not net.layers and not net.input
        assert all(l.name and l.type for l in net.layer)
