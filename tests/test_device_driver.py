"""cct.device.driver: the host device's copies, allocation, workspaces and placement answers, and a guard that
the idioms it replaced ("xp is np", isinstance(..., np.ndarray) as "on the host", asnumpy) stay out of the
layers and the scheduler. The GPU device's paths run in tests/test_gpu_*.py (skipped without a GPU)."""
import ast
import pathlib
import re
import threading

import numpy as np
import pytest

from cct import kernels
from cct.blob import Blob
from cct.device import driver
from cct.device.driver import (
    HostDevice,
    Workspaces,
    array_address,
    array_module,
    device_of,
    host_kernels_usable,
    module_device,
    to_host,
)
from cct.device.random import CounterRandom, philox4x32_10, round_keys
from cct.errors import CctError
from cct.lowering.direct_layout import Scratch

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_host_upload_and_download_copy_into_out():
    dev = HostDevice()
    host = np.arange(6, dtype=np.float64).reshape(2, 3)
    assert dev.upload(host) is host  # the host's memory already: no copy
    out = np.full((2, 3), -1.0, dtype=np.float32)
    assert dev.upload(host, out=out) is out
    np.testing.assert_array_equal(out, host.astype(np.float32))
    back = np.zeros((2, 3), dtype=np.float64)
    assert dev.download(out, out=back) is back
    np.testing.assert_array_equal(back, host)
    view = np.zeros((4, 3), dtype=np.float32)[1:3]  # into a row slice of a bigger array (a batch share)
    dev.download(host, out=view)
    np.testing.assert_array_equal(view, host.astype(np.float32))
    np.testing.assert_array_equal(dev.download([1.0, 2.0]), [1.0, 2.0])


def test_host_allocation():
    dev = HostDevice()
    z = dev.zeros((2, 5), np.float64)
    assert isinstance(z, np.ndarray) and z.dtype == np.float64 and z.shape == (2, 5) and not z.any()
    e = dev.empty(7, np.int32)
    assert e.shape == (7,) and e.dtype == np.int32


def test_workspace_is_allocated_once_per_owner_and_shape():
    dev = HostDevice()
    a = dev.workspace(("pool1", "argmax"), (2, 3), np.int32)
    a[...] = 7
    again = dev.workspace(("pool1", "argmax"), (2, 3), np.int32)
    assert again is a and (again == 7).all()  # the same buffer, contents kept: no allocation in the step
    other = dev.workspace(("pool2", "argmax"), (2, 3), np.int32)
    assert other is not a
    bigger = dev.workspace(("pool1", "argmax"), [4, 3], np.int32)  # a reshape: a new buffer
    assert bigger is not a and bigger.shape == (4, 3)
    assert dev.workspace(("pool1", "argmax"), (4, 3), np.int32) is bigger
    assert dev.workspace(("pool1", "argmax"), (4, 3), np.float32) is not bigger  # another dtype
    assert dev.workspace("flat", 5).shape == (5,)


def test_workspace_zeroed_when_created_only():
    dev = HostDevice()
    a = dev.workspace("xpad", (3, 4), np.float32, zeroed=True)
    assert not a.any()
    a[1] = 5.0  # a caller writes the same elements every step: the rest stays zero
    assert dev.workspace("xpad", (3, 4), np.float32, zeroed=True) is a and a[1].tolist() == [5.0] * 4


def test_workspaces_keep_the_newest_capacity_keys():
    pool, dev = Workspaces(capacity=2), HostDevice()
    a, created = pool.take(dev, "a", 3)
    assert created and a.shape == (3,) and a.dtype == np.float32
    b = pool.get(dev, "b", 3)
    assert pool.take(dev, "a", 3) == (a, False)  # "a" used last: "b" is the oldest now
    pool.get(dev, "c", 3)
    assert len(pool) == 2
    assert pool.get(dev, "a", 3) is a and pool.get(dev, "b", 3) is not b  # "b" was dropped and made anew


def test_workspaces_grow_hand_out_views_of_one_flat_buffer():
    pool, dev = Workspaces(), HostDevice()
    big, created = pool.take(dev, "role", (4, 5), np.float64, zeroed=True, grow=True)
    assert created and big.shape == (4, 5) and not big.any()
    big[...] = 1.0
    small, created = pool.take(dev, "role", (2, 3), np.float64, zeroed=True, grow=True)  # fits: the same memory
    assert not created and small.shape == (2, 3) and np.shares_memory(small, big) and (small == 1.0).all()
    bigger, created = pool.take(dev, "role", (5, 5), np.float64, zeroed=True, grow=True)  # more: a new buffer
    assert created and not np.shares_memory(bigger, big) and not bigger.any()
    assert pool.take(dev, "role", (2, 3), np.float32, grow=True)[1]  # another dtype: a new buffer


def test_scratch_is_per_thread_and_zeroed_once():
    scratch = Scratch(capacity=4)
    mine = scratch.zeros(("xpad", 1), (2, 2), np.float32)
    mine[0, 0] = 3.0
    assert scratch.zeros(("xpad", 1), (2, 2), np.float32) is mine and mine[0, 0] == 3.0
    theirs = []
    worker = threading.Thread(target=lambda: theirs.append(scratch.zeros(("xpad", 1), (2, 2), np.float32)))
    worker.start()
    worker.join()
    assert theirs[0] is not mine and not theirs[0].any() and len(scratch) == 2
    assert module_device(np) == HostDevice()


def test_random_stream_of_a_device_draws_philox_in_its_memory():
    dev = HostDevice()
    gen = dev.random_stream((7, 8), 3)
    assert isinstance(gen, CounterRandom) and gen.device is dev and isinstance(gen.position, np.ndarray)
    words = gen.words(6)
    lanes = philox4x32_10(np, (np.arange(2, dtype=np.uint32), np.uint32(0), np.uint32(3), np.uint32(0)),
                          round_keys((7, 8)))
    np.testing.assert_array_equal(words, np.stack(lanes, axis=1).reshape(-1)[:6])  # word j: lane j % 4 of j // 4
    assert int(gen.position[0]) == 6
    x = np.zeros(4, np.float32)
    assert dev.runs_host_kernels(x, contiguous=True) == host_kernels_usable(x, contiguous=True)
    assert not dev.runs_host_kernels(x[::2], contiguous=True)
    assert dev.locate(x) == dev


def test_device_of_host_arrays(tmp_path):
    arr = np.zeros((3, 4), np.float32)
    mm = np.memmap(tmp_path / "m.bin", dtype=np.float32, mode="w+", shape=(3, 4))
    for a in (arr, arr[1:, ::2], arr.T, mm, mm[1], np.float32(2.0), 3.0, [1, 2]):
        dev = device_of(a)
        assert isinstance(dev, HostDevice) and not dev.is_gpu and dev.name == "host" and dev.xp is np
        assert dev == HostDevice() and hash(dev) == hash(HostDevice())
    assert array_module(arr, mm) is np
    assert isinstance(to_host(mm), np.ndarray)
    np.testing.assert_array_equal(to_host([1.5, 2.5]), [1.5, 2.5])
    assert array_address(arr) == arr.ctypes.data
    assert array_address(arr[1]) == arr.ctypes.data + 4 * 4


def test_host_kernels_usable():
    a32, b32 = np.zeros((2, 3), np.float32), np.ones((2, 3), np.float32)
    with kernels.forced_mode("auto"):
        assert host_kernels_usable(a32, b32) == kernels.numba_available()
        assert not host_kernels_usable(a32, np.zeros(3, np.float64))  # mixed dtypes
        assert not host_kernels_usable(np.zeros(3, np.int32))
        assert not host_kernels_usable([1.0, 2.0])
        assert not host_kernels_usable()
        assert host_kernels_usable(a32.T) == kernels.numba_available()
        assert not host_kernels_usable(a32.T, contiguous=True)
    with kernels.forced_mode("numpy"):
        assert not host_kernels_usable(a32, b32)


def test_blobs_live_on_their_device():
    b = Blob((2, 3))
    assert b.device == HostDevice() and b.xp is np and isinstance(b.data, np.ndarray)
    dev = HostDevice()
    c = Blob((4,), dtype=np.float64, device=dev)
    assert c.device is dev and c.diff.dtype == np.float64 and device_of(c.diff) == dev


def test_without_cupy_there_is_no_gpu_device():
    try:
        import cupy  # noqa: F401
    except Exception:
        pass
    else:
        pytest.skip("CuPy is installed")
    assert driver.gpu_count() == 0 and not driver.cupy_available()
    with pytest.raises(CctError, match="CuPy is not installed"):
        driver.CupyDevice(0)


# -- the idioms the driver replaced stay out of the layers and the scheduler ----------------------------
IDIOMS = {
    r"\bxp\s+is\s+np\b": "'xp is np' (ask device_of(array).is_gpu or blob.device)",
    r"\bxp\s+is\s+not\s+np\b": "'xp is not np' (ask device_of(array).is_gpu or blob.device)",
    r"\bin_device_memory\(": "in_device_memory( (device_of(array).is_gpu)",
    r"\.asnumpy\(": "asnumpy (device.download / to_host)",
    r"isinstance\([^)]*np\.ndarray\)": "isinstance(..., np.ndarray) as 'on the host' (device_of / host_kernels_usable)",
}
#: isinstance(np.ndarray) checks that validate a user's input, not where an array lives
ALLOWED = {("cct/layers/input.py", "isinstance(data, np.ndarray)"),
           ("cct/layers/python_layer.py", "isinstance(shape[0], (tuple, list, np.ndarray))")}


def idioms_in(source: str, rel: str) -> list[str]:
    """'path:line: idiom' for each old device idiom in the code (not the docstrings) of ``source``."""
    docstrings = set()
    for node in ast.walk(ast.parse(source)):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) and isinstance(body[0].value,
                                                                                             ast.Constant):
            docstrings.update(range(body[0].lineno, body[0].end_lineno + 1))
    found = []
    for no, line in enumerate(source.splitlines(), 1):
        code = line.split("#", 1)[0]
        if no in docstrings:
            continue
        for pattern, what in IDIOMS.items():
            m = re.search(pattern, code)
            if m and not any(rel == f and text in code for f, text in ALLOWED):
                found.append(f"{rel}:{no}: {what}")
    return found


def test_layers_and_scheduler_use_the_driver():
    found = []
    for package in ("cct/layers", "cct/scheduler"):
        for path in sorted((ROOT / package).glob("*.py")):
            found += idioms_in(path.read_text(), path.relative_to(ROOT).as_posix())
    assert not found, "old device idioms:\n" + "\n".join(found)


def test_the_idiom_check_finds_each_idiom():
    src = ('"""xp is np in a docstring is fine."""\n'
           "def f(xp, a, cupy):\n"
           "    if xp is np:\n"
           "        return 1\n"
           "    b = xp is not np  # and a comment: xp is np\n"
           "    in_device_memory(a)\n"
           "    return cupy.asnumpy(a) if isinstance(a, np.ndarray) else b\n")
    found = idioms_in(src, "cct/layers/x.py")
    assert [f.split(":")[1] for f in found] == ["3", "5", "6", "7", "7"]
