"""``cct infer``: the shipped example end to end, the printed plan, and one-line errors."""
from __future__ import annotations

import h5py
import numpy as np
import pytest
from scipy import ndimage

from cct.cli import main
from cct.infer.example import make_example
from cct.infer.znni_nets import znni_prototxt


@pytest.fixture(scope="module")
def example(tmp_path_factory):
    return make_example(str(tmp_path_factory.mktemp("example")))


def _infer(ex, out, *extra):
    return main(["infer", "--model", ex["model"], "--weights", ex["weights"], "--input", ex["volume"] + ":raw",
                 "--output", out, "--noprogress", *extra])


def test_example_finds_the_membranes(example, tmp_path, capsys):
    out = str(tmp_path / "m.h5")
    assert _infer(example, out + ":prob", "--mode", "same", "--padding", "mirror") == 0
    text = capsys.readouterr().out
    assert "dense inference plan" in text and "max-pooling fragments" in text and "voxels/s" in text
    with h5py.File(out) as f, h5py.File(example["volume"]) as v:
        prob, labels = f["prob"][0], v["labels"][...]
        assert prob.shape == labels.shape and f["prob"].attrs["cct_infer_padding"] == "mirror"
    membrane = np.zeros(labels.shape, dtype=bool)
    for axis in range(3):
        cut = [slice(None)] * 3
        cut[axis] = slice(0, -1)
        membrane[tuple(cut)] |= np.diff(labels, axis=axis) != 0
    interior = ndimage.distance_transform_edt(~membrane) >= 3
    assert (prob[membrane] > 0.5).mean() > 0.95 and (prob[interior] > 0.5).mean() < 0.05


def test_patch_and_method_flags_give_the_same_output(example, tmp_path, capsys):
    a, b = str(tmp_path / "a.npy"), str(tmp_path / "b.h5")
    assert _infer(example, a, "--patch", "20,21,30") == 0
    assert "--patch" in capsys.readouterr().out
    assert _infer(example, b, "--method", "shift", "--patch", "17,40,40") == 0
    assert "shifted runs of the plain net" in capsys.readouterr().out
    with h5py.File(b) as f:
        np.testing.assert_allclose(np.load(a), f["main"][...], rtol=1e-5, atol=1e-6)


def test_plan_only_prints_the_plan_under_the_budget(example, tmp_path, capsys):
    assert _infer(example, str(tmp_path / "x.h5"), "--plan_only", "--memory_budget", "4M") == 0
    text = capsys.readouterr().out
    assert "peak" in text and "budget 4.0 MiB" in text and "conv1" in text
    assert not (tmp_path / "x.h5").exists()


def test_bad_uses_give_one_line_errors(example, tmp_path, capsys):
    two_d = tmp_path / "n2d.prototxt"
    two_d.write_text(znni_prototxt("n726", fmaps=2, nd=2, kernels=[2, 2, 1, 1, 2, 1]))
    dense_fc = tmp_path / "fc.prototxt"
    dense_fc.write_text(znni_prototxt("n726", fmaps=2, nd=3, kernels=[2, 2, 1, 1, 2, 1]).replace(
        'layer { name: "prob" type: "Sigmoid" bottom: "conv6" top: "prob" }',
        'layer { name: "fc" type: "InnerProduct" bottom: "conv6" top: "fc" '
        'inner_product_param { num_output: 2 axis: 2 } }'))  # over space only: not a convolution
    cases = [
        (["--model", str(two_d), "--input", example["volume"] + ":raw"], "does not fit the net"),
        (["--model", str(dense_fc), "--input", example["volume"] + ":raw"], "layer 'fc' (type InnerProduct)"),
        (["--model", example["model"], "--input", example["volume"] + ":missing"], "no dataset 'missing'"),
        (["--model", example["model"], "--input", str(tmp_path / "none.h5")], "no such input file"),
        (["--model", example["model"], "--input", example["volume"] + ":raw", "--patch", "4,4,4"], "smallest patch"),
        (["--model", example["model"], "--input", example["volume"] + ":raw", "--mpf", "1,1"], "1 pooling layers"),
    ]
    for args, match in cases:
        code = main(["infer", *args, "--output", str(tmp_path / "o.h5"), "--noprogress"])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 1 and match in err[-1] and err[-1].startswith("cct infer: error:"), (args, err)
        assert not (tmp_path / "o.h5").exists()
