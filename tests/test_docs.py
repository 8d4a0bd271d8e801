"""docs/commands.md is generated from the parsers and must not drift; the guide's links and commands exist."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from cct import cli
from cct.tools import reference

DOCS = Path(__file__).resolve().parents[1] / "docs"


def test_command_reference_is_up_to_date():
    path = reference.default_path()
    assert path == DOCS / "commands.md" and path.is_file()
    made_with = re.search(r"\(Python (\d+\.\d+)\)", path.read_text(encoding="utf-8"))
    assert made_with, "docs/commands.md has no generator header"
    if made_with.group(1) != reference.python_version():
        pytest.skip(f"reference generated with Python {made_with.group(1)}; argparse lays out help differently "
                    f"on {reference.python_version()}")
    diff = reference.check(path)
    assert not diff, ("docs/commands.md is out of date; run: python -m cct.tools.reference\n" + "\n".join(diff[:60]))


def test_reference_check_mode_detects_drift(tmp_path, capsys):
    out = tmp_path / "commands.md"
    assert reference.main(["--out", str(out)]) == 0
    assert reference.main(["--out", str(out), "--check"]) == 0
    out.write_text(out.read_text().replace("(default: lmdb)", "(default: leveldb)", 1))
    assert reference.main(["--out", str(out), "--check"]) == 1
    assert "out of date" in capsys.readouterr().err
    text = reference.render()
    for name in cli.COMMANDS:
        assert f"\n## cct {name}\n\n```text\nusage: cct {name}" in text


def test_guide_links_resolve_and_its_commands_exist():
    guide = (DOCS / "guide.md").read_text(encoding="utf-8")
    for name in re.findall(r"`cct ([a-z_]+)", guide):
        assert name in cli.COMMANDS, name
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", guide):
        if not target.startswith("http"):
            assert (DOCS / target).is_file(), target


def test_readme_curves_picture_is_there_and_made_from_the_log():
    readme = (DOCS.parent / "README.md").read_text(encoding="utf-8")
    for target in re.findall(r"\]\((docs/[^)#]+)\)", readme):
        assert (DOCS.parent / target).is_file(), target
    assert "![LeNet training curves" in readme
    png = (DOCS / "lenet_curves.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    from cct.tools.parse_log import parse_log

    train, test = parse_log(str(DOCS / "lenet.log"))
    assert test[-1]["NumIters"] == 10000.0 and test[-1]["accuracy"] > 0.99
