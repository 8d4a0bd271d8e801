"""Loading the BVLC Caffe reference cases in ../shared/reference and running them layer by layer.

``run_case_layerwise(name)`` builds each non-Input layer of the case's net.prototxt on its own,
feeds it Caffe's stored bottoms, parameters and top diffs, and returns what cct computed next to
what Caffe stored, so a test can compare array by array (immune to gradient-routing flips).
``run_model_case(name)`` runs a model case as one net; ``compare_model_case`` lists its arrays next to
Caffe's. Run as a script (``python tests/refcase.py CASE...``) it prints each case's largest error and
its conv layers' strategies as JSON: the tests run it in a fresh process with an empty cct cache.
"""
from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field

import numpy as np

import cct
from cct.blob import Blob
from cct.device.driver import Device, HostDevice, to_host
from cct.io.prototxt import parse_text
from cct.layers import create_layer
from cct.paths import shared_path
from cct.proto import caffe_pb2

REFERENCE_DIR = os.environ.get("CCT_REFERENCE_DIR", str(shared_path("reference")))


def reference_available() -> bool:
    return os.path.isdir(REFERENCE_DIR)


def case_dir(name: str) -> str:
    return os.path.join(REFERENCE_DIR, name)


def list_cases(kind: str | None = None) -> list[str]:
    with open(os.path.join(REFERENCE_DIR, "cases.json")) as f:
        cases = json.load(f)["cases"]
    return sorted(n for n, c in cases.items() if kind is None or c["kind"] == kind)


@dataclass
class Case:
    name: str
    meta: dict
    arrays: dict
    net: caffe_pb2.NetParameter
    dir: str = ""
    params: dict = field(default_factory=dict)  # layer name -> list of arrays


def load_meta(name: str) -> dict:
    """The case's meta.json (phase, blobs, weights file; no arrays read)."""
    with open(os.path.join(case_dir(name), "meta.json")) as f:
        return json.load(f)


def load_case(name: str) -> Case:
    d = case_dir(name)
    meta = load_meta(name)
    npz = np.load(os.path.join(d, "arrays.npz"))
    arrays = {k: npz[k] for k in npz.files}
    net = caffe_pb2.NetParameter()
    with open(os.path.join(d, "net.prototxt")) as f:
        parse_text(f.read(), net, source=os.path.join(d, "net.prototxt"))
    params: dict[str, list] = {}
    weights = caffe_pb2.NetParameter()
    with open(os.path.join(d, meta.get("weights_file", "weights.caffemodel")), "rb") as f:
        weights.ParseFromString(f.read())
    from cct.io.blobproto import blobproto_to_array

    for layer in weights.layer:
        if layer.blobs:
            params[layer.name] = [blobproto_to_array(b) for b in layer.blobs]
    return Case(name=name, meta=meta, arrays=arrays, net=net, dir=d, params=params)


def once_per_name(compute):
    """``get(name)``: ``compute(name)`` on the first call for a name, the same result after (a test module's
    fixture holds it, so the cases read and run once for the tests that only read them)."""
    results: dict = {}

    def get(name):
        if name not in results:
            results[name] = compute(name)
        return results[name]
    return get


def max_rel_err(actual: np.ndarray, expected: np.ndarray) -> float:
    """max|a - e| / max|e| (the reference README's robust per-array check)."""
    actual = np.asarray(actual, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    assert actual.shape == expected.shape, f"shape {actual.shape} != reference {expected.shape}"
    scale = np.max(np.abs(expected)) if expected.size else 0.0
    diff = np.max(np.abs(actual - expected)) if expected.size else 0.0
    if scale == 0:
        return float(diff)
    return float(diff / scale)


def run_case_layerwise(name: str, phase: int | None = None, device: Device | None = None, built: list | None = None,
                       case: Case | None = None):
    """Run each layer of a case on Caffe's own inputs; return a list of (what, cct, caffe) triples.

    Runs with the case directory as working directory, as Caffe did (relative sources). ``device``
    is where the blobs live (default the host; a CupyDevice for the GPU path); results come back as numpy.
    ``built``: a list that receives the layers built. ``case``: the case already loaded (read only).
    """
    cwd = os.getcwd()
    os.chdir(case_dir(name))
    try:
        return _run_case_layerwise(case or load_case(name), device or HostDevice(),
                                   built if built is not None else [])
    finally:
        os.chdir(cwd)


def run_model_case(name: str, case: Case | None = None):
    """A model case's net with Caffe's weights after one forward and backward on Caffe's inputs:
    ``(case, net, loss)``. ``case``: the case already loaded (its arrays are only read)."""
    case = case or load_case(name)
    net = cct.Net(os.path.join(case.dir, "net.prototxt"), case.meta["phase"],
                  weights=os.path.join(case.dir, case.meta["weights_file"]))
    a = case.arrays
    for blob in net.input_blob_names:
        net.blobs[blob].data[...] = a[f"input/{blob}"]
    loss = net.forward()
    net.clear_param_diffs()
    net.backward()
    return case, net, loss


def compare_model_case(case: Case, net) -> list[tuple[str, np.ndarray, np.ndarray]]:
    """``(what, cct, caffe)`` for every blob's data and diff and every parameter diff Caffe stored (not the
    labels' and losses' diffs)."""
    a, out = case.arrays, []
    for blob in case.meta["blobs"]:
        if f"data/{blob}" in a:
            out.append((f"data/{blob}", _host_copy(net.blobs[blob].data), a[f"data/{blob}"]))
    for key in a:
        if key.startswith("diff/"):
            blob = key[5:]
            if blob not in case.meta["loss_blobs"] and blob != "label":
                out.append((key, _host_copy(net.blobs[blob].diff), a[key]))
        elif key.startswith("paramdiff/"):
            layer, idx = key[len("paramdiff/"):].rsplit("/", 1)
            out.append((key, _host_copy(net.layer_by_name(layer).blobs[int(idx)].diff), a[key]))
    return out


CONV_TYPES = ("Convolution", "Deconvolution")


def has_convolutions(name: str) -> bool:
    """Whether the case's net has a Convolution or Deconvolution layer (read from its prototxt only)."""
    net = caffe_pb2.NetParameter()
    path = os.path.join(case_dir(name), "net.prototxt")
    with open(path) as f:
        parse_text(f.read(), net, source=path)
    return any(lp.type in CONV_TYPES for lp in net.layer)


def conv_geometries(name: str) -> dict:
    """``{layer name: ConvGeometry}`` of the case's Convolution and Deconvolution layers."""
    cwd = os.getcwd()
    os.chdir(case_dir(name))
    try:
        net = cct.Net("net.prototxt", load_meta(name)["phase"])
    finally:
        os.chdir(cwd)
    return {layer.name: layer.geom for layer in net.layers if layer.type in CONV_TYPES}


def conv_strategies(layers) -> dict[str, str]:
    """``{layer name: name of the lowering it ran}`` of the conv layers among ``layers``."""
    return {layer.name: layer.lowering.name for layer in layers if layer.type in CONV_TYPES}


def run_case(name: str, case: Case | None = None) -> tuple[list[tuple[str, np.ndarray, np.ndarray]], dict[str, str]]:
    """Any case, unit (layer by layer) or model (one net): its ``(what, cct, caffe)`` triples and the
    strategies its conv layers ran. ``case``: the case already loaded (read only)."""
    if name in list_cases("model"):
        case, net, _ = run_model_case(name, case)
        return compare_model_case(case, net), conv_strategies(net.layers)
    built: list = []
    results = run_case_layerwise(name, built=built, case=case)
    return results, conv_strategies(layer for layer, _, _ in built)


def main(names: list[str]) -> None:
    """Print ``{case: {"max_rel_err": ..., "worst": what, "strategies": {...}}}`` as JSON."""
    report = {}
    for name in names:
        results, strategies = run_case(name)
        errs = {what: max_rel_err(ours, theirs) for what, ours, theirs in results}
        worst = max(errs, key=errs.get) if errs else None
        report[name] = {"max_rel_err": errs.get(worst, 0.0), "worst": worst, "compared": len(errs),
                        "strategies": strategies}
    print(json.dumps(report))


def _host_copy(arr) -> np.ndarray:
    return np.array(to_host(arr))


def _run_case_layerwise(case: Case, device: Device, built: list):
    a = case.arrays
    phase = caffe_pb2.TRAIN if case.meta["phase"] == "TRAIN" else caffe_pb2.TEST
    results = []
    layers = [lp for lp in case.net.layer if lp.type != "Input"]
    loss_blobs = case.meta.get("loss_blobs", {})
    # In-place layers (top == bottom) are only comparable at the end of a chain; the unit cases
    # with in-place layers feed from inputs, so run them in order on shared blobs.
    blobs: dict[str, Blob] = {}

    def blob(nm):
        if nm not in blobs:
            src = a.get(f"input/{nm}")
            if src is None:
                src = a[f"data/{nm}"]
            b = Blob(src.shape, name=nm, device=device)
            device.upload(src, out=b.data)
            blobs[nm] = b
        return blobs[nm]

    for lp in layers:
        lp = caffe_pb2.LayerParameter.FromString(lp.SerializeToString())
        if not lp.HasField("phase"):
            lp.phase = phase
        layer = create_layer(lp)
        bottom = [blob(n) for n in lp.bottom]
        top = []
        for i, n in enumerate(lp.top):
            if i < len(lp.bottom) and lp.bottom[i] == n:
                top.append(blobs[n])
            else:
                blobs[n] = Blob((), name=n, device=device)
                top.append(blobs[n])
        layer.setup(bottom, top)
        if lp.name in case.params:
            for pb, arr in zip(layer.blobs, case.params[lp.name]):
                assert pb.shape == arr.shape, f"{lp.name}: param shape {pb.shape} != {arr.shape}"
                device.upload(arr, out=pb.data)
        built.append((layer, bottom, top))
    for layer, bottom, top in built:
        layer.reshape(bottom, top)
        layer.forward(bottom, top)
    for nm, b in blobs.items():
        if f"data/{nm}" in a:
            results.append((f"data/{nm}", _host_copy(b.data), a[f"data/{nm}"]))
    for layer, _, _ in built:
        for i, pb in enumerate(layer.blobs):
            key = f"paramfwd/{layer.name}/{i}"
            if key in a:
                results.append((key, _host_copy(pb.data), a[key]))
    if case.meta.get("backward", "none") == "none":
        return results
    for nm, b in blobs.items():
        b.diff[...] = 0
        if f"topdiff/{nm}" in a:
            device.upload(a[f"topdiff/{nm}"], out=b.diff)
        elif nm in loss_blobs:
            b.diff[...] = loss_blobs[nm]
    for layer, _, _ in built:
        for pb in layer.blobs:
            pb.diff[...] = 0
    label_like = set()
    for layer, bottom, top in reversed(built):
        prop = [layer.allow_force_backward(i) for i in range(len(bottom))]
        for i, ok in enumerate(prop):
            if not ok:
                label_like.add(layer.param.bottom[i])
        layer.backward(top, prop, bottom)
    for nm, b in blobs.items():
        key = f"diff/{nm}"
        if key in a and nm not in label_like and nm not in loss_blobs:
            results.append((key, _host_copy(b.diff), a[key]))
    for layer, _, _ in built:
        for i, pb in enumerate(layer.blobs):
            key = f"paramdiff/{layer.name}/{i}"
            if key in a:
                results.append((key, _host_copy(pb.diff), a[key]))
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
