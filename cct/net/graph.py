"""Net preprocessing as Caffe does it before building: NetState rules and automatic Split layers."""
from __future__ import annotations

from ..errors import NetError
from ..proto import caffe_pb2


def state_meets_rule(state: caffe_pb2.NetState, rule: caffe_pb2.NetStateRule) -> bool:
    """Caffe's StateMeetsRule: phase, level range, required stages and forbidden stages."""
    if rule.HasField("phase") and rule.phase != state.phase:
        return False
    if rule.HasField("min_level") and state.level < rule.min_level:
        return False
    if rule.HasField("max_level") and state.level > rule.max_level:
        return False
    stages = set(state.stage)
    if any(s not in stages for s in rule.stage):
        return False
    if any(s in stages for s in rule.not_stage):
        return False
    return True


def filter_net(param: caffe_pb2.NetParameter, state: caffe_pb2.NetState) -> caffe_pb2.NetParameter:
    """Keep the layers whose include/exclude rules admit ``state`` (Caffe's FilterNet)."""
    out = caffe_pb2.NetParameter()
    out.CopyFrom(param)
    del out.layer[:]
    for layer in param.layer:
        if layer.include and layer.exclude:
            raise NetError(f"layer '{layer.name}': specify either include rules or exclude rules; not both")
        included = not layer.include
        if any(state_meets_rule(state, r) for r in layer.exclude):
            included = False
        if any(state_meets_rule(state, r) for r in layer.include):
            included = True
        if included:
            out.layer.add().CopyFrom(layer)
    return out


def split_layer_name(layer: str, blob: str, idx: int) -> str:
    return f"{blob}_{layer}_{idx}_split"


def split_blob_name(layer: str, blob: str, idx: int, k: int) -> str:
    return f"{blob}_{layer}_{idx}_split_{k}"


def insert_splits(param: caffe_pb2.NetParameter) -> caffe_pb2.NetParameter:
    """Insert Split layers where a top feeds several bottoms (or a bottom and a loss), as Caffe's InsertSplits."""
    last_top: dict[str, tuple[int, int]] = {}
    source_of: dict[tuple[int, int], tuple[int, int]] = {}
    consumers: dict[tuple[int, int], int] = {}
    loss_weight: dict[tuple[int, int], float] = {}
    names = [lp.name for lp in param.layer]
    for i, lp in enumerate(param.layer):
        for j, blob in enumerate(lp.bottom):
            if blob not in last_top:
                raise NetError(f"Unknown bottom blob '{blob}' (layer '{lp.name}', bottom index {j})")
            src = last_top[blob]
            source_of[(i, j)] = src
            consumers[src] = consumers.get(src, 0) + 1
        for j, blob in enumerate(lp.top):
            last_top[blob] = (i, j)
        for j in range(min(len(lp.loss_weight), len(lp.top))):
            src = last_top[lp.top[j]]
            loss_weight[src] = lp.loss_weight[j]
            if loss_weight[src]:
                consumers[src] = consumers.get(src, 0) + 1

    out = caffe_pb2.NetParameter()
    out.CopyFrom(param)
    del out.layer[:]
    split_idx: dict[tuple[int, int], int] = {}
    for i, lp in enumerate(param.layer):
        new = out.layer.add()
        new.CopyFrom(lp)
        for j, blob in enumerate(lp.bottom):
            src = source_of[(i, j)]
            if consumers.get(src, 0) > 1:
                k = split_idx.get(src, 0)
                new.bottom[j] = split_blob_name(names[src[0]], blob, src[1], k)
                split_idx[src] = k + 1
        for j, blob in enumerate(lp.top):
            count = consumers.get((i, j), 0)
            if count > 1:
                w = loss_weight.get((i, j), 0.0)
                split = out.layer.add()
                split.name = split_layer_name(lp.name, blob, j)
                split.type = "Split"
                split.bottom.append(blob)
                for k in range(count):
                    split.top.append(split_blob_name(lp.name, blob, j, k))
                    if w:
                        split.loss_weight.append(w if k == 0 else 0.0)
                if w:
                    del new.loss_weight[:]
                    split_idx[(i, j)] = split_idx.get((i, j), 0) + 1
    return out
