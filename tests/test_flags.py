"""gflags syntax (cct.flags) and the ``cct`` command table: spellings, booleans, help, errors."""
from __future__ import annotations

import lmdb
import numpy as np
import pytest
from PIL import Image

from cct import cli
from cct.flags import FlagError, command_parser, to_gnu
from cct.proto import caffe_pb2


def _parser():
    p = command_parser("demo", "a demo command")
    p.add_argument("root")
    p.add_argument("db", nargs="?")
    p.add_bool("shuffle", "shuffle the list")
    p.add_bool("gray", "grayscale", default=True)
    p.add_argument("--quiet", "-q", action="store_true", help="quiet")
    p.add_flag("resize_height", type=int, default=0, help="height")
    p.add_flag("backend", default="lmdb", help="backend")
    return p


@pytest.mark.parametrize("argv", [
    ["--resize_height=64", "R"], ["-resize_height=64", "R"], ["--resize_height", "64", "R"],
    ["-resize_height", "64", "R"], ["R", "-resize_height", "64"],
])
def test_valued_flag_spellings(argv):
    a = _parser().parse_args(argv)
    assert a.resize_height == 64 and a.root == "R" and a.db is None


@pytest.mark.parametrize("argv,shuffle,gray", [
    (["--shuffle", "R"], True, True),
    (["-shuffle", "R"], True, True),
    (["--shuffle=true", "R"], True, True),
    (["--shuffle=false", "R"], False, True),
    (["-shuffle=0", "R"], False, True),
    (["--noshuffle", "R"], False, True),
    (["--shuffle", "--noshuffle", "R"], False, True),  # the last one wins, as in gflags
    (["--nogray", "R"], False, False),
    (["-nogray", "--gray=yes", "R"], False, True),
])
def test_boolean_flags_never_take_a_positional(argv, shuffle, gray):
    a = _parser().parse_args(argv)
    assert (a.shuffle, a.gray, a.root) == (shuffle, gray, "R")


def test_store_true_becomes_a_gflags_boolean():
    p = _parser()
    assert p.parse_args(["--quiet", "R", "D"]).quiet is True
    assert p.parse_args(["-q", "R"]).quiet is True
    assert p.parse_args(["-quiet=false", "R"]).quiet is False
    assert p.parse_args(["--noquiet", "R"]).quiet is False
    assert to_gnu(p, ["-q", "--", "-x"]) == ["--quiet=true", "--", "-x"]


def test_negative_values_and_unknown_flags():
    p = _parser()
    assert p.parse_args(["--resize_height", "-3", "R"]).resize_height == -3
    assert p.parse_args(["--backend", "--weird", "R"]).backend == "--weird"
    with pytest.raises(FlagError, match=r"unrecognized arguments: --bogus=1 \(see 'cct demo --help'\)"):
        p.parse_args(["R", "--bogus=1"])
    with pytest.raises(FlagError, match="not a boolean: 'maybe'"):
        p.parse_args(["--shuffle=maybe", "R"])
    with pytest.raises(FlagError, match="invalid int value"):
        p.parse_args(["--resize_height=x", "R"])
    with pytest.raises(FlagError, match="the following arguments are required: root"):
        p.parse_args(["--shuffle"])


def test_help_shows_defaults_and_names_the_command():
    text = _parser().format_help()
    assert text.startswith("usage: cct demo ")
    assert "[--shuffle]" in text and "--shuffle, --noshuffle" in text
    assert "grayscale (default: true)" in text
    assert "backend (default: lmdb)" in text
    assert "--quiet, -q, --noquiet" in text


@pytest.mark.parametrize("command", sorted(cli.COMMANDS))
def test_every_command_parser_says_cct_command(command):
    p = cli.build_parser(command)
    assert p.prog == f"cct {command}"
    assert p.format_usage().startswith(f"usage: cct {command}")


def test_top_level_command_list_is_aligned(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("  ") and line.split()[0] in cli.COMMANDS]
    assert [r.split()[0] for r in rows] == list(cli.COMMANDS)
    starts = {len(r) - len(r[2:].split(None, 1)[1]) for r in rows}
    assert len(starts) == 1, rows  # every summary starts in the same column


def test_create_imagenet_sh_call(tmp_path, capsys):
    """BVLC's examples/imagenet/create_imagenet.sh: ``--resize_height=.. --resize_width=.. --shuffle ROOT LIST DB``."""
    root = tmp_path / "train"
    root.mkdir()
    rng = np.random.default_rng(0)
    lines = []
    for i in range(3):
        Image.fromarray(rng.integers(0, 255, (7 + i, 9, 3), dtype=np.uint8)).save(root / f"n{i}.JPEG")
        lines.append(f"n{i}.JPEG {i}")
    (tmp_path / "train.txt").write_text("\n".join(lines) + "\n")
    db = tmp_path / "ilsvrc12_train_lmdb"
    rc = cli.main(["convert_imageset", "--resize_height=6", "--resize_width=5", "--shuffle",
                   f"{root}/", str(tmp_path / "train.txt"), str(db)])
    assert rc == 0, capsys.readouterr().err
    with lmdb.open(str(db), readonly=True, lock=False) as env, env.begin() as txn:
        records = list(txn.cursor())
    assert len(records) == 3
    labels = set()
    for _, value in records:
        d = caffe_pb2.Datum.FromString(value)
        assert (d.channels, d.height, d.width) == (3, 6, 5)
        labels.add(d.label)
    assert labels == {0, 1, 2}
    # --check_size (a boolean) must not swallow ROOT either
    rc = cli.main(["convert_imageset", "--check_size", "-resize_height", "6", "-resize_width", "5",
                   f"{root}/", str(tmp_path / "train.txt"), str(tmp_path / "db2")])
    assert rc == 0, capsys.readouterr().err
