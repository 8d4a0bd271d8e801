"""pycaffe's ``caffe.Classifier``: a Net that classifies images (resize, crop or oversample, preprocess)."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from cct.proto.caffe_pb2 import TEST

from . import io as caffe_io
from .pycaffe import Net

__all__ = ["Classifier"]


class Classifier(Net):
    """Image classification by scaling, center cropping or oversampling (pycaffe's Classifier).

    ``Classifier(model_file, pretrained_file, image_dims=None, mean=None, input_scale=None,
    raw_scale=None, channel_swap=None)`` builds the TEST net with the weights and configures a
    :class:`caffe.io.Transformer` for its first input (H x W x K images in, K x H x W out).
    ``image_dims`` is the size images are resized to before cropping (default: the net input size).
    """

    def __init__(self, model_file, pretrained_file, image_dims=None, mean=None, input_scale=None,
                 raw_scale=None, channel_swap=None):
        Net.__init__(self, model_file, TEST, weights=pretrained_file)
        in_ = self.inputs[0]
        self.transformer = caffe_io.image_transformer(in_, self.blobs[in_].data.shape, mean, input_scale,
                                                      raw_scale, channel_swap)

        self.crop_dims = np.array(self.blobs[in_].data.shape[2:])
        if image_dims is None or len(image_dims) == 0:
            image_dims = self.crop_dims
        self.image_dims = image_dims

    def predict(self, inputs: Sequence[np.ndarray], oversample: bool = True) -> np.ndarray:
        """Class probabilities (N x C) of N images (H x W x K arrays).

        ``oversample=True`` averages the predictions of the 10 crops (corners, center and their
        mirrors); ``False`` classifies the center crop only.
        """
        input_ = np.zeros((len(inputs), self.image_dims[0], self.image_dims[1], inputs[0].shape[2]),
                          dtype=np.float32)
        for ix, in_ in enumerate(inputs):
            input_[ix] = caffe_io.resize_image(in_, self.image_dims)

        if oversample:
            input_ = caffe_io.oversample(input_, self.crop_dims)
        else:
            center = np.array(self.image_dims) / 2.0
            crop = np.tile(center, (1, 2))[0] + np.concatenate([-self.crop_dims / 2.0, self.crop_dims / 2.0])
            crop = crop.astype(int)
            input_ = input_[:, crop[0]:crop[2], crop[1]:crop[3], :]

        caffe_in = np.zeros(np.array(input_.shape)[[0, 3, 1, 2]], dtype=np.float32)
        for ix, in_ in enumerate(input_):
            caffe_in[ix] = self.transformer.preprocess(self.inputs[0], in_)
        out = self.forward_all(**{self.inputs[0]: caffe_in})
        predictions = out[self.outputs[0]]

        if oversample:
            predictions = predictions.reshape((len(predictions) // 10, 10, -1))
            predictions = predictions.mean(1)
        return predictions
