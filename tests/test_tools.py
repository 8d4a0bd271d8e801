"""Dataset tools: convert_imageset, compute_image_mean, convert_mnist, convert_cifar, make_digits."""
import numpy as np
import pytest
from PIL import Image

from cct.data.db import open_db, parse_datum
from cct.data.transformer import datum_to_array
from cct.io.blobproto import blobproto_to_array, read_binaryproto
from cct.tools import compute_image_mean, convert_cifar, convert_imageset, convert_mnist, make_digits


def read_all(path):
    with open_db(path) as db:
        return [(k.decode(), parse_datum(v)) for k, v in db.items()]


def test_convert_imageset_cli_flags(tmp_path):
    root = tmp_path / "r"
    root.mkdir()
    r = np.random.default_rng(0)
    names = []
    for i in range(4):
        Image.fromarray(r.integers(0, 256, (8 + i, 6, 3), dtype=np.uint8)).save(root / f"a{i}.png")
        names.append(f"a{i}.png {i}")
    (tmp_path / "list.txt").write_text("\n".join(names) + "\n")
    db = str(tmp_path / "db")
    rc = convert_imageset.main([f"{root}/", str(tmp_path / "list.txt"), db, "--resize_height=5",
                                "-resize_width=4", "--gray", "--shuffle", "--check_size", "--backend=lmdb"])
    assert rc == 0
    items = read_all(db)
    assert len(items) == 4
    assert sorted(d.label for _, d in items) == [0, 1, 2, 3]
    for i, (k, d) in enumerate(items):
        assert k.startswith(f"{i:08d}_a")
        assert (d.channels, d.height, d.width) == (1, 5, 4) and not d.encoded
    # --encoded with a different encode_type re-encodes
    db2 = str(tmp_path / "db2")
    assert convert_imageset.main([f"{root}/", str(tmp_path / "list.txt"), db2, "--encode_type=png",
                                  "--encoded=true"]) == 0
    k, d = read_all(db2)[0]
    assert d.encoded and d.data[:4] == b"\x89PNG"
    # errors: existing database, missing list file
    assert convert_imageset.main([f"{root}/", str(tmp_path / "list.txt"), db2]) == 1
    assert convert_imageset.main([f"{root}/", str(tmp_path / "nolist.txt"), str(tmp_path / "x")]) == 1


def test_compute_image_mean_cli(tmp_path, capsys):
    images = np.random.default_rng(1).integers(0, 256, (9, 2, 3, 4), dtype=np.uint8)
    db = str(tmp_path / "db")
    convert_mnist.write_images_db(db, images, np.zeros(9))
    out = str(tmp_path / "mean.binaryproto")
    assert compute_image_mean.main([db, out]) == 0
    proto = read_binaryproto(out)
    assert (proto.num, proto.channels, proto.height, proto.width) == (1, 2, 3, 4)
    np.testing.assert_allclose(blobproto_to_array(proto)[0], images.mean(axis=0), rtol=1e-6)
    assert compute_image_mean.main([str(tmp_path / "missing_db")]) == 1
    assert "missing_db" in capsys.readouterr().err


def _idx(path, magic, arr):
    header = magic.to_bytes(4, "big") + b"".join(int(d).to_bytes(4, "big") for d in arr.shape)
    path.write_bytes(header + arr.astype(np.uint8).tobytes())


def test_convert_mnist(tmp_path):
    r = np.random.default_rng(2)
    images = r.integers(0, 256, (12, 28, 28), dtype=np.uint8)
    labels = r.integers(0, 10, 12).astype(np.uint8)
    _idx(tmp_path / "img", 2051, images)
    _idx(tmp_path / "lab", 2049, labels)
    db = str(tmp_path / "mnist_train_lmdb")
    assert convert_mnist.main([str(tmp_path / "img"), str(tmp_path / "lab"), db, "--backend=lmdb"]) == 0
    items = read_all(db)
    assert [k for k, _ in items] == [f"{i:08d}" for i in range(12)]
    for i, (_, d) in enumerate(items):
        assert (d.channels, d.height, d.width, d.label) == (1, 28, 28, labels[i])
        np.testing.assert_array_equal(datum_to_array(d)[0], images[i])
    _idx(tmp_path / "bad", 1234, labels)
    assert convert_mnist.main([str(tmp_path / "img"), str(tmp_path / "bad"), str(tmp_path / "x")]) == 1


def test_convert_cifar(tmp_path):
    r = np.random.default_rng(3)
    src = tmp_path / "cifar"
    src.mkdir()
    batches = {}
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        n = 3
        rec = np.concatenate([r.integers(0, 10, (n, 1)), r.integers(0, 256, (n, 3072))], axis=1).astype(np.uint8)
        (src / f"{name}.bin").write_bytes(rec.tobytes())
        batches[name] = rec
    out = tmp_path / "out"
    assert convert_cifar.main([str(src), str(out), "lmdb"]) == 0
    train = read_all(str(out / "cifar10_train_lmdb"))
    test = read_all(str(out / "cifar10_test_lmdb"))
    assert [k for k, _ in train[:4]] == ["00000", "00001", "00002", "10000"]
    assert [k for k, _ in test] == ["00000", "00001", "00002"]
    k, d = train[3]
    rec = batches["data_batch_2"][0]
    assert (d.channels, d.height, d.width, d.label) == (3, 32, 32, rec[0])
    assert d.data == rec[1:].tobytes()


def test_make_digits_counts_balance_determinism(tmp_path):
    assert make_digits.main([str(tmp_path / "a"), "--train", "200", "--test", "50", "--seed", "5"]) == 0
    train = read_all(str(tmp_path / "a" / "digits_train_lmdb"))
    test = read_all(str(tmp_path / "a" / "digits_test_lmdb"))
    assert len(train) == 200 and len(test) == 50
    assert [k for k, _ in train[:3]] == ["00000000", "00000001", "00000002"]
    d = train[0][1]
    assert (d.channels, d.height, d.width, d.encoded, len(d.data)) == (1, 28, 28, False, 784)
    counts = np.bincount([d.label for _, d in train], minlength=10)
    assert counts.min() >= 18 and counts.max() <= 22
    pixels = np.stack([datum_to_array(d)[0] for _, d in train])
    assert pixels.max() > 150 and (pixels < 30).mean() > 0.5  # bright strokes on a dark background
    # same seed -> same bytes; other seed -> different images
    make_digits.main([str(tmp_path / "b"), "--train", "200", "--test", "50", "--seed", "5"])
    make_digits.main([str(tmp_path / "c"), "--train", "200", "--test", "50", "--seed", "6"])
    assert read_all(str(tmp_path / "b" / "digits_train_lmdb")) == train
    assert read_all(str(tmp_path / "c" / "digits_train_lmdb")) != train
    # train and test are independent draws
    assert train[0][1].data != test[0][1].data
    assert make_digits.main([str(tmp_path / "a"), "--train", "10"]) == 1  # already exists


def test_make_digits_is_learnable_by_a_simple_classifier():
    """Nearest class-mean on blurred pixels beats chance by far, while not being trivially perfect."""
    x, y = make_digits.make_split(2000, np.random.SeedSequence(11))
    xt, yt = make_digits.make_split(500, np.random.SeedSequence(12))
    f = x.reshape(len(x), -1).astype(np.float32)
    ft = xt.reshape(len(xt), -1).astype(np.float32)
    means = np.stack([f[y == d].mean(axis=0) for d in range(10)])
    pred = np.argmin(((ft[:, None, :] - means[None]) ** 2).sum(-1), axis=1)
    acc = (pred == yt).mean()
    assert 0.4 < acc < 0.99, acc


@pytest.mark.parametrize("tool", [convert_imageset, compute_image_mean, convert_mnist, convert_cifar, make_digits])
def test_tools_have_help(tool, capsys):
    with pytest.raises(SystemExit) as e:
        tool.main(["--help"])
    assert e.value.code == 0
    assert "usage" in capsys.readouterr().out.lower()
