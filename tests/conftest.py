import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

# Building nets in tests and in the CLI subprocesses they start must not stall on a one-time
# machine calibration: the lowering optimizer uses its nominal machine model instead.
os.environ.setdefault("CCT_CALIBRATE", "0")

# Tests must not depend on (or write into) the user's calibration cache in ~/.cache/cct: each test
# session gets an empty cache directory of its own.
if "CCT_CACHE_DIR" not in os.environ:
    import tempfile

    os.environ["CCT_CACHE_DIR"] = tempfile.mkdtemp(prefix="cct-test-cache-")
