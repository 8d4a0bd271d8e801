"""``python -m cct``: the ``cct`` command line (see :mod:`cct.cli`)."""
import sys

from .cli import main

sys.exit(main())
