"""``import caffe``: a drop-in replacement for pycaffe, backed by cct."""
from . import io, proto  # noqa: F401  (``caffe.proto.caffe_pb2`` is an attribute, as in pycaffe)
from ._caffe import (
    Timer,
    __version__,
    has_nccl,
    init_log,
    layer_type_list,
    log,
    set_device,
    set_mode_cpu,
    set_mode_gpu,
    set_multiprocess,
    set_random_seed,
    set_solver_count,
    set_solver_rank,
    solver_count,
    solver_rank,
)
from .classifier import Classifier
from .detector import Detector
from .layer import Layer
from .net_spec import NetSpec, layers, params, to_proto
from .proto.caffe_pb2 import TEST, TRAIN
from .pycaffe import (
    AdaDeltaSolver,
    AdaGradSolver,
    AdamSolver,
    NesterovSolver,
    Net,
    RMSPropSolver,
    SGDSolver,
    get_solver,
)

__all__ = [
    "TRAIN", "TEST", "io", "proto", "Timer", "__version__", "has_nccl", "init_log", "layer_type_list", "log",
    "set_device", "set_mode_cpu", "set_mode_gpu", "set_multiprocess", "set_random_seed", "set_solver_count",
    "set_solver_rank", "solver_count", "solver_rank", "Classifier", "Detector", "Layer", "NetSpec", "layers",
    "params", "to_proto", "AdaDeltaSolver", "AdaGradSolver", "AdamSolver", "NesterovSolver", "Net",
    "RMSPropSolver", "SGDSolver", "get_solver",
]
