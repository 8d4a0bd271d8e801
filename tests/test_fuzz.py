"""Property: mutated prototxts, caffemodels, HDF5 weights and data records (LMDB Datums, mean files, image
lists) give success or one of cct's errors, never a bare Python exception or a hang (hypothesis over the
seeds of cct.fuzz; the long run is tools/fuzz_inputs.py); bad records name the database, key or line, and
field."""
from __future__ import annotations

import io

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cct import fuzz
from cct.proto import caffe_pb2

SETTINGS = dict(deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck))
# The big ImageNet nets take seconds each to build under fuzzing: the long run has them, CI does not.
CORPUS = [(name, text) for name, text in fuzz.prototxt_corpus()
          if not any(big in name for big in ("alexnet", "caffenet", "googlenet", "rcnn", "flickr", "vgg"))]
WEIGHTS = fuzz.BaseWeights()  # the weights the caffemodel/hdf5 cases mutate, built once for this module


def _check(kind: str, seed: int) -> str:
    case = fuzz.make_case(kind, seed, CORPUS if kind == "prototxt" else None, WEIGHTS)
    outcome = fuzz.run_case(case, timeout=30)
    assert outcome == "ok" or outcome.startswith("cct:"), fuzz.describe(case, outcome)
    return outcome


@settings(max_examples=60, **SETTINGS)
@given(seed=st.integers(0, 2**31 - 1))
def test_mutated_prototxt(seed):
    _check("prototxt", seed)


@settings(max_examples=40, **SETTINGS)
@given(seed=st.integers(0, 2**31 - 1))
def test_mutated_caffemodel(seed):
    _check("caffemodel", seed)


@settings(max_examples=30, **SETTINGS)
@given(seed=st.integers(0, 2**31 - 1))
def test_mutated_hdf5(seed):
    _check("hdf5", seed)


def test_cases_are_deterministic_and_mutated():
    for kind in fuzz.KINDS:
        a, b = fuzz.make_case(kind, 7, CORPUS, WEIGHTS), fuzz.make_case(kind, 7, CORPUS)  # own weights: same
        assert a == b and a.mutation != "none"
    originals = dict(CORPUS)
    case = fuzz.make_case("prototxt", 7, CORPUS)
    assert case.data != originals[case.origin]


def test_alarm_interrupts_a_slow_case():
    import time

    t0 = time.perf_counter()
    with pytest.raises(fuzz.CaseTimeout):
        with fuzz.alarm(0.2):
            while True:
                time.sleep(0.01)
    assert time.perf_counter() - t0 < 3
    with fuzz.alarm(5):  # disarmed on exit: nothing fires later
        pass
    time.sleep(0.05)


# -- data records (cct/fuzz_data.py): LMDB Datum records, mean files, image lists ---------------------
@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")  # bomb headers are among the cases
@pytest.mark.parametrize("kind", fuzz.DATA_KINDS)
@settings(max_examples=20, **SETTINGS)
@given(seed=st.integers(0, 2**31 - 1))
def test_mutated_data_records(kind, seed):
    _check(kind, seed)


def _datum(**fields) -> bytes:
    values = dict(channels=3, height=6, width=6, data=bytes(108), label=1)
    values.update(fields)
    return caffe_pb2.Datum(**values).SerializeToString()


DATA_LAYER = ('layer { name: "data" type: "Data" top: "data" top: "label" data_param { source: "@DIR@/db" '
              'batch_size: 2 backend: LMDB } transform_param { %s } }')


@pytest.mark.parametrize("record,extra,message", [
    (_datum(channels=65536), "", r"record '00000001' in '.*/db' .*channels x height x width = 65536x6x6 needs "
                                 r"2359296 values but data holds 108 bytes"),
    (_datum(height=-1), "", r"record '00000001' in '.*/db' .*: height = -1 is not positive"),
    (_datum(width=2147483647), "", r"record '00000001' in '.*/db' .*3x6x2147483647 needs"),
    (_datum(data=bytes(100)), "", r"record '00000001' in '.*/db' .*data holds 100 bytes"),
    (_datum(data=b"", float_data=[0.5] * 107), "", r"record '00000001' in '.*/db' .*float_data holds 107 values"),
    (_datum(encoded=True, data=b"\x89PNG\r\n\x1a\n garbage"), "",
     r"record '00000001' in '.*/db': could not decode image in encoded Datum"),
    (_datum(channels=1, height=18, width=6), "", r"record '00000001' in '.*/db': image of shape \[1, 18, 6\]"),
    (_datum(), 'mean_file: "@DIR@/mean.binaryproto"',
     r"mean file '.*/mean.binaryproto' is 6x6x1 \(CxHxW\) but the data is 3x6x6"),
])
def test_bad_records_name_the_database_key_and_field(tmp_path, record, extra, message):
    from cct.config import Config
    from cct.errors import CctError
    from cct.fuzz_data import pack, run
    from cct.io.blobproto import array_to_blobproto

    files = {"db/00000000": _datum(), "db/00000001": record, "@layer": (DATA_LAYER % extra).encode(),
             # a (C, H, W) mean: Caffe's legacy view reads it as num 3, channels 6, height 6, width 1
             "mean.binaryproto": array_to_blobproto(np.zeros((3, 6, 6), np.float32)).SerializeToString()}
    with pytest.raises(CctError, match=message) as err:
        run(pack(files), str(tmp_path), Config(python_layers=False))
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("line,message", [
    ("missing.png 1", r"list.txt:2: could not open or find image file '.*/missing.png'"),
    ("0.png 2147483648", r"list.txt:2: label 2147483648 is outside the int range"),
    ("0.png one", r"list.txt:2: label 'one' is not an integer"),
    ("garbage.png 1", r"list.txt:2: could not decode image '.*/garbage.png'"),
])
def test_bad_image_lists_name_the_list_line_and_file(tmp_path, line, message):
    from PIL import Image

    from cct.config import Config
    from cct.errors import CctError
    from cct.fuzz_data import pack, run

    buf = io.BytesIO()
    Image.fromarray(np.zeros((6, 6, 3), np.uint8)).save(buf, format="PNG")
    files = {"img/0.png": buf.getvalue(), "img/garbage.png": b"not an image", "list.txt": f"0.png 0\n{line}\n".encode(),
             "@layer": b'layer { name: "data" type: "ImageData" top: "data" top: "label" image_data_param { '
                       b'source: "@DIR@/list.txt" root_folder: "@DIR@/img/" batch_size: 2 } }'}
    with pytest.raises(CctError, match=message):
        run(pack(files), str(tmp_path), Config(python_layers=False))
