"""WindowData (cct/layers/window_data.py): Caffe's window file, fg/bg split by overlap thresholds,
batch order and labels, warp/square/context_pad geometry, mirror, mean, cache_images, errors."""
from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from cct import rng
from cct.blob import Blob
from cct.errors import CctError, LayerError
from cct.io.prototxt import parse_text
from cct.layers import create_layer
from cct.layers.window_data import parse_window_file, window_geometry
from cct.proto import caffe_pb2


def write_image(path, h, w, seed=0):
    rgb = np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
    Image.fromarray(rgb).save(path)
    return rgb[:, :, ::-1]  # BGR, as the layer reads it


@pytest.fixture
def scene(tmp_path):
    """Two 20x24 PNGs; image 0 has one foreground window of class 3 (overlap 0.9) and an unused one
    (0.4); image 1 one background window (0.1). Windows are 6x6 so crop_size 6 needs no resizing."""
    imgs = [write_image(tmp_path / f"im{i}.png", 20, 24, seed=i) for i in range(2)]
    (tmp_path / "windows.txt").write_text(
        "# 0\nim0.png\n3 20 24\n2\n3 0.9 4 5 9 10\n2 0.4 0 0 5 5\n"
        "# 1\nim1.png\n3 20 24\n1\n7 0.1 10 8 15 13\n")
    return tmp_path, imgs


def make_layer(root, extra="", transform="crop_size: 6", batch=4, name="wd"):
    lp = caffe_pb2.LayerParameter()
    parse_text(f'name: "{name}" type: "WindowData" top: "data" top: "label" '
               f'window_data_param {{ source: "{root}/windows.txt" root_folder: "{root}/" batch_size: {batch} '
               f'fg_fraction: 0.5 {extra} }} transform_param {{ {transform} }}', lp)
    return create_layer(lp)


def forward(layer):
    top = [Blob(()), Blob(())]
    rng.set_random_seed(5)
    layer.setup([], top)
    layer.forward([], top)
    return top


def test_parse_window_file_splits_by_overlap(scene):
    root, _ = scene
    images, fg, bg = parse_window_file(str(root / "windows.txt"), "R/", 0.5, 0.5)
    assert images == {0: ("R/im0.png", [3, 20, 24]), 1: ("R/im1.png", [3, 20, 24])}
    np.testing.assert_allclose(fg, [[0, 3, np.float32(0.9), 4, 5, 9, 10]])
    np.testing.assert_array_equal(bg, [[0, 0, 0, 0, 0, 5, 5], [1, 0, 0, 10, 8, 15, 13]])
    _, fg, bg = parse_window_file(str(root / "windows.txt"), "", 0.95, 0.3)
    assert len(fg) == 0 and len(bg) == 1


def test_parse_window_file_errors_name_file_and_line(tmp_path):
    p = tmp_path / "w.txt"
    p.write_text("# 0\nim.png\n3 4 4\n1\n1 0.9 0 0 x 3\n")
    with pytest.raises(CctError, match=r"w.txt:5: expected a window corner, got 'x'"):
        parse_window_file(str(p), "", 0.5, 0.5)
    p.write_text("# 0\nim.png\n3 4 4\n1\n0 0.9 0 0 2 3\n")
    with pytest.raises(CctError, match=r"w.txt:5: foreground window.*class 0"):
        parse_window_file(str(p), "", 0.5, 0.5)
    p.write_text("# 0\nim.png\n3 4 4\n2\n0 0.1 0 0 2 3\n")
    with pytest.raises(CctError, match="ends early"):
        parse_window_file(str(p), "", 0.5, 0.5)
    p.write_text("")
    with pytest.raises(CctError, match="empty"):
        parse_window_file(str(p), "", 0.5, 0.5)


def test_window_geometry_matches_caffes_arithmetic():
    # warp: the box as is, warped to the crop
    assert window_geometry((3, 4, 9, 7), 20, 20, 8, 0, False, False) == ((3, 4, 9, 7), (8, 8), 0, 0)
    # context_pad 2 on crop 8: the 4x4 box grows by 8/4 around its centre (12, 12)
    assert window_geometry((10, 10, 13, 13), 20, 20, 8, 2, False, False) == ((8, 8, 16, 16), (8, 8), 0, 0)
    # near the corner: 2 pixels fall outside; the clipped 7x7 region is warped to round(7 * 8/9) = 6
    # and placed after round(2 * 8/9) = 2 pixels of zero padding (mirrored: the padding moves right)
    assert window_geometry((0, 0, 3, 3), 20, 20, 8, 2, False, False) == ((0, 0, 6, 6), (6, 6), 2, 2)
    assert window_geometry((0, 0, 3, 3), 20, 20, 8, 2, False, True) == ((0, 0, 6, 6), (6, 6), 2, 0)
    # square: the 4x2 box becomes 4x4 around its centre (12, 11), C rounding of 9.0 .. 13.0
    assert window_geometry((10, 10, 13, 11), 20, 20, 8, 0, True, False) == ((10, 9, 14, 13), (8, 8), 0, 0)


def test_batch_bg_first_then_fg_with_labels_and_pixels(scene):
    root, imgs = scene
    top = forward(make_layer(root, transform="crop_size: 6 mean_value: 10 mean_value: 20 mean_value: 30",
                             extra="scale: 0.5"))
    assert top[0].shape == (4, 3, 6, 6) and top[1].shape == (4,)
    np.testing.assert_array_equal(top[1].data, [0, 0, 3, 3])
    mean = np.array([10, 20, 30], np.float32)[:, None, None]
    fg = (imgs[0][5:11, 4:10].transpose(2, 0, 1) - mean) * 0.5
    for i in (2, 3):
        np.testing.assert_allclose(top[0].data[i], fg, rtol=1e-6)
    bg_choices = [(imgs[0][0:6, 0:6].transpose(2, 0, 1) - mean) * 0.5,
                  (imgs[1][8:14, 10:16].transpose(2, 0, 1) - mean) * 0.5]
    for i in (0, 1):
        assert any(np.allclose(top[0].data[i], c) for c in bg_choices)


def test_mirror_flips_some_windows_and_cache_images_agrees(scene):
    root, imgs = scene
    layer = make_layer(root, transform="crop_size: 6 mirror: true", batch=16)
    top = forward(layer)
    fg = imgs[0][5:11, 4:10].transpose(2, 0, 1).astype(np.float32)
    flips = [bool(np.array_equal(top[0].data[i], fg[:, :, ::-1])) for i in range(8, 16)]
    plain = [bool(np.array_equal(top[0].data[i], fg)) for i in range(8, 16)]
    assert all(a != b for a, b in zip(flips, plain)) and any(flips) and any(plain)
    cached = forward(make_layer(root, extra="cache_images: true", transform="crop_size: 6 mirror: true", batch=16))
    np.testing.assert_array_equal(cached[0].data, top[0].data)
    layer.close()


def test_context_pad_leaves_zero_border_and_mean_file(scene, tmp_path):
    root, imgs = scene
    from cct.io.blobproto import array_to_blobproto

    mean = np.full((1, 3, 10, 10), 7.0, np.float32)
    (tmp_path / "mean.binaryproto").write_bytes(array_to_blobproto(mean).SerializeToString())
    (root / "windows.txt").write_text("# 0\nim0.png\n3 20 24\n2\n1 0.9 0 0 3 3\n1 0.1 0 0 3 3\n")
    top = forward(make_layer(root, extra="context_pad: 2",
                             transform=f'crop_size: 8 mean_file: "{tmp_path}/mean.binaryproto"'))
    # geometry (0, 0, 6, 6) -> 6x6 placed at (2, 2); the border stays 0 (not -mean)
    d = top[0].data[3]
    assert np.all(d[:, :2, :] == 0) and np.all(d[:, :, :2] == 0)
    assert np.any(d[:, 2:, 2:] != 0)
    assert np.all(d[:, 2:, 2:] >= -7.0) and np.all(d[:, 2:, 2:] <= 248.0)


def test_window_data_errors_name_layer(scene):
    root, _ = scene
    with pytest.raises(LayerError, match="wd.*crop_size must be positive"):
        forward(make_layer(root, transform=""))
    with pytest.raises(LayerError, match="wd.*transform_param.scale"):
        forward(make_layer(root, transform="crop_size: 6 scale: 0.5"))
    with pytest.raises(LayerError, match="wd.*crop_mode 'stretch'"):
        forward(make_layer(root, extra='crop_mode: "stretch"'))
    with pytest.raises(LayerError, match="wd.*0 foreground"):
        forward(make_layer(root, extra="fg_threshold: 0.95"))
    (root / "windows.txt").write_text("# 0\nim0.png\n3 20 24\n2\n3 0.9 4 5 30 10\n1 0.1 0 0 3 3\n")
    layer = make_layer(root, batch=2)
    with pytest.raises(LayerError, match="wd.*does not fit image"):
        forward(layer)


def test_same_seed_same_batches_and_read_state_resumes(scene):
    root, _ = scene
    text = "crop_size: 6 mirror: true"
    a, b = make_layer(root, transform=text, batch=8), make_layer(root, transform=text, batch=8)
    ta, tb = forward(a), forward(b)
    np.testing.assert_array_equal(ta[0].data, tb[0].data)
    state = a.get_read_state()
    a.forward([], ta)
    second = ta[0].data.copy()
    a.set_read_state(state)
    a.forward([], ta)
    np.testing.assert_array_equal(ta[0].data, second)
    a.close()
    b.close()
