"""The small net and solver settings that tests/test_fused_update.py (numpy) and tests/test_gpu_update.py
(CuPy) train: a convolution (lr_mult 1/2, decay_mult 1/0), two InnerProducts sharing a weight (lr_mult 0.5,
decay_mult 3), a frozen bias (lr_mult 0) and a bias with lr_mult 1.5, decay_mult 0.25."""
from __future__ import annotations

from cct.io.prototxt import parse_text
from cct.proto import caffe_pb2
from cct.solver import get_solver

NET = """
name: "mix"
layer { name: "data" type: "Input" top: "x" input_param { shape { dim: 2 dim: 3 dim: 5 dim: 5 } } }
layer { name: "conv" type: "Convolution" bottom: "x" top: "c"
  param { lr_mult: 1 decay_mult: 1 } param { lr_mult: 2 decay_mult: 0 }
  convolution_param { num_output: 4 kernel_size: 3 weight_filler { type: "gaussian" std: 0.3 }
                      bias_filler { type: "gaussian" std: 0.3 } } }
layer { name: "ip1" type: "InnerProduct" bottom: "c" top: "h1"
  param { name: "shared_w" lr_mult: 0.5 decay_mult: 3 } param { lr_mult: 0 decay_mult: 1 }
  inner_product_param { num_output: 6 weight_filler { type: "gaussian" std: 0.3 }
                        bias_filler { type: "gaussian" std: 0.3 } } }
layer { name: "ip2" type: "InnerProduct" bottom: "c" top: "h2"
  param { name: "shared_w" } param { lr_mult: 1.5 decay_mult: 0.25 }
  inner_product_param { num_output: 6 weight_filler { type: "gaussian" std: 0.3 }
                        bias_filler { type: "gaussian" std: 0.3 } } }
"""

#: each solver type's own settings
RULES = {
    "SGD": "momentum: 0.9",
    "Nesterov": "momentum: 0.9",
    "AdaGrad": "delta: 1e-6",
    "RMSProp": "rms_decay: 0.9 delta: 1e-6",
    "AdaDelta": "momentum: 0.95 delta: 1e-6",
    "Adam": "momentum: 0.9 momentum2: 0.999 delta: 1e-8",
}


def make_solver(kind: str, reg: str, iter_size: int, extra: str = "", mode: str = "CPU"):
    """A ``kind`` solver on :data:`NET` (step lr policy, weight decay 0.02, ``reg`` regularisation)."""
    text = (f'type: "{kind}" base_lr: 0.05 lr_policy: "step" gamma: 0.5 stepsize: 2 weight_decay: 0.02 '
            f'regularization_type: "{reg}" iter_size: {iter_size} display: 0 max_iter: 100 random_seed: 5 '
            f'solver_mode: {mode} {RULES[kind]} {extra}')
    p = parse_text(text, caffe_pb2.SolverParameter())
    parse_text(NET, p.net_param)
    return get_solver(p)
