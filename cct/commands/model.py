"""What ``cct test`` and ``cct time`` share: the net a ``--model`` run builds from its flags."""
from __future__ import annotations

import argparse

from ..errors import CctError
from ..net import Net
from ..runsetup import engine_config, init_logging, load_weights, phase, run_config, stages


def model_net(args: argparse.Namespace, what: str, calibrate: bool, need_weights: bool) -> Net:
    """Check ``--model`` (and ``--weights`` when ``need_weights``) and ``--iterations``, start logging, and
    build the net of ``--model`` in ``--phase`` under the run's config, with ``--weights`` loaded when given.
    ``what`` names the command's job in the errors ("Need a model definition to <what>")."""
    if not args.model:
        raise CctError(f"Need a model definition to {what} (--model).")
    if need_weights and not args.weights:
        raise CctError(f"Need model weights to {what} (--weights).")
    if args.iterations < 1:
        raise CctError(f"--iterations must be >= 1, not {args.iterations}")
    init_logging(args.quiet)
    config = run_config(args, engine_config(args, calibrate=calibrate))
    net = Net(args.model, phase(args.phase), level=args.level, stages=stages(args.stage), config=config)
    if args.weights:
        load_weights(net, args.weights)
    return net
