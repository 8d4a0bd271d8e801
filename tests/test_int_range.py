"""Unsigned/64-bit proto fields above INT_MAX (Caffe reads them into a signed int): a clean error naming
the file, the layer and the field, before any layer is built (issue 33, item 5)."""
from __future__ import annotations

import pytest
from google.protobuf.descriptor import FieldDescriptor

import cct
from cct.errors import LayerError
from cct.io.int_range import KEPT_UNSIGNED, values_above_int_max
from cct.membudget import INT_MAX
from cct.proto import caffe_pb2

HEAD = 'name: "n" layer { name: "data" type: "Input" top: "x" input_param { shape { dim: 1 dim: 2 dim: 8 dim: 8 } } }\n'


@pytest.mark.parametrize("layer,field", [
    ('layer { name: "pool" type: "Pooling" bottom: "x" top: "y" pooling_param { pool: MAX kernel_size: 2 '
     'stride: 4294967295 } }', "pooling_param.stride = 4294967295"),
    ('layer { name: "ip" type: "InnerProduct" bottom: "x" top: "y" inner_product_param { num_output: 2147483648 } }',
     "inner_product_param.num_output = 2147483648"),
    ('layer { name: "conv" type: "Convolution" bottom: "x" top: "y" convolution_param { num_output: 2 '
     'kernel_size: 3 pad: 1 pad: 4294967295 } }', "convolution_param.pad[1] = 4294967295"),
    ('layer { name: "sl" type: "Slice" bottom: "x" top: "a" top: "b" slice_param { slice_point: 3000000000 } }',
     "slice_param.slice_point[0] = 3000000000"),
    ('layer { name: "r" type: "Reshape" bottom: "x" top: "y" reshape_param { shape { dim: 0 dim: 4294967298 } } }',
     "reshape_param.shape.dim[1] = 4294967298"),
])
def test_value_above_int_max_names_file_layer_and_field(tmp_path, layer, field):
    path = tmp_path / "net.prototxt"
    path.write_text(HEAD + layer)
    with pytest.raises(LayerError) as err:
        cct.Net(str(path), cct.TEST)
    message = str(err.value)
    name = layer.split('"')[1]
    assert f"layer '{name}'" in message and str(path) in message and field in message
    assert "INT_MAX (2147483647)" in message and "\n" not in message


def test_the_command_line_reports_it_in_one_line(tmp_path, capsys):
    from cct.cli import main

    path = tmp_path / "net.prototxt"
    path.write_text(HEAD + 'layer { name: "pool" type: "Pooling" bottom: "x" top: "y" pooling_param { pool: MAX '
                           'kernel_size: 2 stride_h: 4294967295 stride_w: 1 } }')
    assert main(["time", "--model", str(path), "--iterations", "1"]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "pooling_param.stride_h = 4294967295" in err and "layer 'pool'" in err


def _wide_fields(descriptor, seen=None):
    """Every (message descriptor, field) of an unsigned or 64-bit integer field under LayerParameter."""
    seen = set() if seen is None else seen
    if descriptor.full_name in seen:
        return
    seen.add(descriptor.full_name)
    for f in descriptor.fields:
        if f.type == FieldDescriptor.TYPE_MESSAGE:
            yield from _wide_fields(f.message_type, seen)
        elif f.type in (FieldDescriptor.TYPE_UINT32, FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_INT64):
            yield descriptor, f


WIDE = list(_wide_fields(caffe_pb2.LayerParameter.DESCRIPTOR))


@pytest.mark.parametrize("descriptor,field", WIDE, ids=[f"{d.name}.{f.name}" for d, f in WIDE])
def test_every_wide_field_is_checked_at_int_max_plus_one(descriptor, field):
    from google.protobuf import message_factory

    cls = message_factory.GetMessageClass(descriptor)
    for value, flagged in ((INT_MAX, False), (INT_MAX + 1, (descriptor.name, field.name) not in KEPT_UNSIGNED)):
        msg = cls()
        if field.is_repeated:
            getattr(msg, field.name).extend([1, value])
            want = [(f"{field.name}[1]", value)]
        else:
            setattr(msg, field.name, value)
            want = [(field.name, value)]
        assert list(values_above_int_max(msg)) == (want if flagged else [])
    assert len(WIDE) > 50  # kernel/stride/pad/num_output/batch sizes/dims ... all seen
