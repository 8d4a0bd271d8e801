"""The net graph: NetState filtering, automatic splits, backward analysis, weight sharing."""
from .graph import filter_net, insert_splits, state_meets_rule
from .net import Net

__all__ = ["Net", "filter_net", "insert_splits", "state_meets_rule"]
