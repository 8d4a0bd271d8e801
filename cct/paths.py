"""Where the repository and the shared material (papers, upstream Caffe nets, reference outputs) live.

The shared folder sits beside the repository (``<repo>/../shared``); ``$CCT_SHARED_DIR`` overrides it.
Tests, benchmarks and docs derive every path to it from :func:`shared_dir`, never from an absolute path.
"""
from __future__ import annotations

from pathlib import Path

from . import env


def repo_root() -> Path:
    """The repository root (the directory that holds the ``cct`` package)."""
    return Path(__file__).resolve().parents[1]


def shared_dir() -> Path:
    """The shared folder: ``$CCT_SHARED_DIR`` if set, else ``<repo>/../shared`` (may not exist)."""
    if env.is_set("CCT_SHARED_DIR"):
        return Path(env.text("CCT_SHARED_DIR")).expanduser()
    return repo_root().parent / "shared"


def shared_path(*parts: str) -> Path:
    """A path inside :func:`shared_dir` (``shared_path("reference", "README.md")``)."""
    return shared_dir().joinpath(*parts)


__all__ = ["repo_root", "shared_dir", "shared_path"]
