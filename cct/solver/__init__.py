"""Training: Caffe's solvers (SGD, Nesterov, AdaGrad, RMSProp, AdaDelta, Adam), lr policies, snapshots.

``get_solver("solver.prototxt")`` builds the solver the file names; ``solver.solve()`` trains to
``max_iter`` (``cct train`` does this), ``solver.step(n)`` runs n iterations.
"""
from .lr_policy import POLICIES, learning_rate
from .rules import AdaDeltaSolver, AdaGradSolver, AdamSolver, NesterovSolver, RMSPropSolver, SGDSolver
from .signals import SignalHandler
from .solver import Solver, get_solver, read_solver_param, register_solver, solver_type_list

__all__ = [
    "POLICIES", "learning_rate", "SignalHandler", "AdaDeltaSolver", "AdaGradSolver", "AdamSolver",
    "NesterovSolver", "RMSPropSolver", "SGDSolver", "Solver", "get_solver", "read_solver_param",
    "register_solver", "solver_type_list",
]
