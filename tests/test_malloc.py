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


def test_a_net_applies_it(monkeypatch):
    import cct.malloc as m
    from cct.net import Net
    from cct.proto import caffe_pb2

    monkeypatch.setattr(m, "_done", False)
    calls = []
    real = m.tune_malloc
    monkeypatch.setattr("cct.net.net.tune_malloc", lambda: calls.append(1) or real())
    p = caffe_pb2.NetParameter()
    layer = p.layer.add(name="in", type="Input", top=["x"])
    layer.input_param.shape.add().dim.extend([1, 2])
    Net(p, phase="TEST")
    assert calls == [1] and m._done
