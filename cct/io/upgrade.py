"""Upgrade of legacy Caffe definitions (placeholder until the full upgrader lands)."""
from __future__ import annotations

from ..proto import caffe_pb2


def upgrade_net(net: caffe_pb2.NetParameter, source: str = "<net>") -> caffe_pb2.NetParameter:
    return net


def upgrade_solver(solver: caffe_pb2.SolverParameter, source: str = "<solver>") -> caffe_pb2.SolverParameter:
    return solver
