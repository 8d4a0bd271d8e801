#!/usr/bin/env bash
# Run BVLC Caffe's own pycaffe tests (python/caffe/test/*.py), unmodified, against cct's `caffe` shim.
#
#   tools/run_pycaffe_upstream.sh BVLC_CAFFE [unittest args...]
#
# BVLC_CAFFE is a BVLC/caffe source tree or a git directory of one (e.g. a bare mirror). The tests and
# the models/ and examples/ prototxts that test_draw.py walks are copied to a temporary directory
# outside this repository (nothing upstream is copied into the repo) and run there with
# `python -m unittest discover`; `import caffe` resolves to this repository's shim. test_draw needs
# pydot and graphviz's `dot`.
set -euo pipefail
if [ $# -lt 1 ]; then
    sed -n '2,10p' "$0"
    exit 2
fi
src=$1; shift
repo=$(cd "$(dirname "$0")/.." && pwd)
tmp=$(mktemp -d "${TMPDIR:-/tmp}/cct-pycaffe-upstream.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
paths=(python/caffe/test models examples)
if [ -d "$src/python/caffe/test" ]; then
    for p in "${paths[@]}"; do
        mkdir -p "$tmp/$(dirname "$p")"
        cp -R "$src/$p" "$tmp/$p"
    done
else
    git --git-dir="$src" archive HEAD "${paths[@]}" | tar -x -C "$tmp"
fi
command -v dot >/dev/null || echo "run_pycaffe_upstream: graphviz 'dot' not found: test_draw will fail" >&2
cd "$tmp/python"
PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" python -m unittest discover -s caffe/test -t caffe/test "$@"
