import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

# Building nets in tests and in the CLI subprocesses they start must not stall on a one-time
# machine calibration: the lowering optimizer uses its nominal machine model instead.
os.environ.setdefault("CCT_CALIBRATE", "0")
