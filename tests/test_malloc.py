"""cct.malloc: the glibc malloc settings are applied once per process, and can be switched off."""
import os
import platform
import subprocess
import sys

import pytest

glibc = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                           reason="glibc only")
CODE = "from cct.malloc import tune_malloc; print(tune_malloc(), tune_malloc())"


def _run(**env):
    e = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "CCT_MALLOC"))}
    e.update(env)
    return subprocess.run([sys.executable, "-c", CODE], env=e, capture_output=True, text=True, check=True).stdout


@glibc
def test_applied_once_per_process():
    assert _run().split() == ["True", "False"]


@glibc
def test_switched_off_by_cct_malloc_tune_or_user_malloc_env():
    assert _run(CCT_MALLOC_TUNE="0").split() == ["False", "False"]
    assert _run(MALLOC_MMAP_THRESHOLD_="1048576").split() == ["False", "False"]


@glibc
def test_a_net_applies_it():
    # a fresh process: building a net applies the settings, so a later call finds them applied
    code = ("from cct.net import Net\nfrom cct.proto import caffe_pb2\nfrom cct.malloc import tune_malloc\n"
            "p = caffe_pb2.NetParameter()\nlayer = p.layer.add(name='in', type='Input', top=['x'])\n"
            "layer.input_param.shape.add().dim.extend([1, 2])\nNet(p, phase='TEST')\nprint(tune_malloc())\n")
    e = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "CCT_MALLOC"))}
    out = subprocess.run([sys.executable, "-c", code], env=e, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False"]
    assert _run().split() == ["True", "False"]  # without a net, the first call applies them
