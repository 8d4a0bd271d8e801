"""cct: Caffe con Troll, a fast Caffe-compatible CNN training framework.

The Python API in one screen::

    import cct
    net = cct.Net("models/lenet/lenet_train_test.prototxt", cct.TEST, weights="lenet.caffemodel")
    loss = net.forward()
    net.blobs["prob"].data
    net.params["conv1"][0].data          # weights by layer name (pycaffe's dict)

    solver = cct.get_solver("models/lenet/lenet_solver.prototxt")
    solver.step(100)                     # or cct.SGDSolver(...), cct.AdamSolver(...), ...
"""
# ruff: noqa: E402 (the OpenMP spin defaults must be set before any import can load a runtime)
from .blas.spin import set_openmp_spin_defaults

set_openmp_spin_defaults()  # before MKL's OpenMP runtime loads: it reads them once

from .blob import Blob
from .errors import CctError, LayerError, NetError, ProtoParseError, SolverError
from .layers import Layer, layer_type_list, register
from .log import init_log
from .net import Net
from .proto import caffe_pb2
from .rng import set_random_seed
from .scheduler import device_query, set_devices
from .solver import (
    AdaDeltaSolver,
    AdaGradSolver,
    AdamSolver,
    NesterovSolver,
    RMSPropSolver,
    SGDSolver,
    Solver,
    get_solver,
    solver_type_list,
)

__version__ = "0.1.0"

TRAIN = caffe_pb2.TRAIN
TEST = caffe_pb2.TEST

__all__ = [
    "Blob", "CctError", "LayerError", "NetError", "ProtoParseError", "SolverError", "Layer", "layer_type_list",
    "register", "init_log", "Net", "caffe_pb2", "set_random_seed", "TRAIN", "TEST", "__version__",
    "device_query", "set_devices", "Solver", "SGDSolver", "NesterovSolver", "AdaGradSolver", "RMSPropSolver",
    "AdaDeltaSolver", "AdamSolver", "get_solver", "solver_type_list",
]
