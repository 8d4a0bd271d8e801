"""README's "Caffe compatibility" section states exactly which BVLC Caffe layer types and tools cct has."""
from __future__ import annotations

import os
import re

import cct
from cct.cli import COMMANDS

README = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "README.md")

# Every layer type BVLC Caffe master registers (REGISTER_LAYER_CLASS / REGISTER_LAYER_CREATOR in
# src/caffe at commit 9b891540183ddc834a02b2bd81b31afae71b2153).
BVLC_LAYER_TYPES = frozenset("""
AbsVal Accuracy ArgMax BNLL BatchNorm BatchReindex Bias Clip Concat ContrastiveLoss Convolution Crop
Data Deconvolution Dropout DummyData ELU Eltwise Embed EuclideanLoss Exp Filter Flatten HDF5Data
HDF5Output HingeLoss Im2col ImageData InfogainLoss InnerProduct Input LRN LSTM LSTMUnit Log MVN
MemoryData MultinomialLogisticLoss PReLU Parameter Pooling Power Python RNN ReLU Reduction Reshape SPP
Scale Sigmoid SigmoidCrossEntropyLoss Silence Slice Softmax SoftmaxWithLoss Split Swish TanH Threshold
Tile WindowData
""".split())


def _names(text: str) -> set[str]:
    text = text.strip().rstrip(".")
    return set() if text == "none" else {n.strip() for n in text.split(",")}


def test_readme_lists_the_bvlc_layers_cct_has_and_lacks():
    with open(README, encoding="utf-8") as f:
        readme = f.read()
    m = re.search(r"\*\*Layers\*\*: (\d+) of BVLC's (\d+) layer types: (.*?)\.\s+Not yet: (.*?)\.\n",
                  readme, re.S)
    assert m, "README's Caffe compatibility section has no '**Layers**: N of BVLC's M layer types: ... Not yet: ...'"
    count, total = int(m.group(1)), int(m.group(2))
    listed, missing = _names(" ".join(m.group(3).split())), _names(" ".join(m.group(4).split()))
    registered = set(cct.layer_type_list())
    have, lack = BVLC_LAYER_TYPES & registered, BVLC_LAYER_TYPES - registered
    fix = "update the **Layers** bullet of README.md's 'Caffe compatibility' section"
    assert listed == have, f"{fix}: supported {sorted(have)}"
    assert missing == lack, f"{fix}: 'Not yet:' {', '.join(sorted(lack)) or 'none'}"
    assert (count, total) == (len(have), len(BVLC_LAYER_TYPES)), fix


# BVLC Caffe's command-line tools (tools/*.cpp; `caffe` has the train/test/time/device_query actions).
BVLC_TOOLS = frozenset("""
train test time device_query convert_imageset compute_image_mean extract_features
upgrade_net_proto_binary upgrade_net_proto_text upgrade_solver_proto_text
""".split())


def test_readme_lists_the_bvlc_tools_cct_has_and_lacks():
    with open(README, encoding="utf-8") as f:
        readme = f.read()
    m = re.search(r"\*\*Tools\*\* \(.*?\):\s+(.*?)\.\s+Not yet: (.*?)\.", readme, re.S)
    assert m, "README's Caffe compatibility section has no '**Tools** (...): ... Not yet: ...'"
    listed, missing = _names(" ".join(m.group(1).split())), _names(" ".join(m.group(2).split()))
    have, lack = BVLC_TOOLS & set(COMMANDS), BVLC_TOOLS - set(COMMANDS)
    fix = "update the **Tools** bullet of README.md's 'Caffe compatibility' section"
    assert listed == have, f"{fix}: supported {sorted(have)}"
    assert missing == lack, f"{fix}: 'Not yet:' {', '.join(sorted(lack)) or 'none'}"
