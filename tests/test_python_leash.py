"""Python layers on a leash: a switch refuses them before any import (API, env, CLI flag), and their
modules come from sys.path only (not the prototxt's directory), as in Caffe."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import cct
from cct.config import Config, using_config
from cct.errors import LayerError

ROOT = Path(__file__).resolve().parents[1]

MODULE = """
import pathlib
pathlib.Path({marker!r}).write_text("imported")   # the side effect an untrusted prototxt could trigger
from cct.layers.python_layer import PythonLayer

class Twice(PythonLayer):
    def reshape(self, bottom, top):
        top[0].reshape(*bottom[0].shape)
    def forward(self, bottom, top):
        top[0].data[...] = 2 * bottom[0].data
    def backward(self, top, propagate_down, bottom):
        bottom[0].diff[...] = 2 * top[0].diff
"""

NET = """
name: "leash"
layer {{ name: "in" type: "Input" top: "x" input_param {{ shape {{ dim: 2 dim: 3 }} }} }}
layer {{ name: "py" type: "Python" bottom: "x" top: "y" python_param {{ module: "{module}" layer: "Twice" }} }}
"""


@pytest.fixture
def beside(tmp_path):
    """A module and a prototxt in the same directory (not on sys.path); the marker shows an import."""
    module = f"cct_leash_{tmp_path.name.replace('-', '_')}"
    marker = tmp_path / "imported.marker"
    (tmp_path / f"{module}.py").write_text(MODULE.format(marker=str(marker)))
    net = tmp_path / "net.prototxt"
    net.write_text(NET.format(module=module))
    yield net, module, marker
    sys.modules.pop(module, None)


def test_config_switch_refuses_before_import(beside, monkeypatch):
    net, module, marker = beside
    monkeypatch.syspath_prepend(str(net.parent))
    with pytest.raises(LayerError, match=r"layer 'py' \(type Python\): Python layers are disabled.*"
                                         + module + r"\.Twice"):
        cct.Net(str(net), cct.TEST, config=Config(python_layers=False))
    with using_config(python_layers=False), pytest.raises(LayerError, match="disabled"):
        cct.Net(str(net), cct.TEST)
    assert not marker.exists() and module not in sys.modules
    # allowed (the default): imported from sys.path and run
    n = cct.Net(str(net), cct.TEST, config=Config(python_layers=True))
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    n.blobs["x"].data[...] = x
    n.forward()
    np.testing.assert_array_equal(n.blobs["y"].data, 2 * x)
    assert marker.read_text() == "imported"


@pytest.mark.parametrize("value,allowed", [("0", False), ("false", False), ("OFF", False), ("no", False),
                                           ("1", True), ("", True), ("yes", True)])
def test_env_switch(monkeypatch, value, allowed):
    monkeypatch.setenv("CCT_PYTHON_LAYERS", value)
    assert Config().python_layers is allowed


def test_prototxt_directory_is_not_searched(beside):
    net, module, marker = beside
    with pytest.raises(LayerError, match=rf"cannot import python_param.module '{module}'.*sys.path only.*PYTHONPATH"):
        cct.Net(str(net), cct.TEST)
    assert not marker.exists()


def _cct(*args: str, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    full = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(cwd)]), **env)
    return subprocess.run([sys.executable, "-m", "cct", *args], cwd=cwd, env=full, capture_output=True, text=True,
                          timeout=120)


def test_cli_flag_and_env_refuse_python_layers(beside):
    net, module, marker = beside
    for extra, env in ((["--no_python_layers"], {}), ([], {"CCT_PYTHON_LAYERS": "0"})):
        r = _cct("time", f"--model={net}", "--iterations=1", *extra, cwd=net.parent, **env)
        assert r.returncode == 1, r.stderr
        assert "Traceback" not in r.stderr
        assert "layer 'py' (type Python): Python layers are disabled" in r.stderr
        assert not marker.exists()
    r = _cct("time", f"--model={net}", "--iterations=1", cwd=net.parent)  # on PYTHONPATH, allowed: runs
    assert r.returncode == 0, r.stderr[-2000:]
    assert marker.exists()
