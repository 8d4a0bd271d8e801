"""pycaffe's ``caffe.Detector``: classify windows (crops, optionally with context) of images (R-CNN style)."""
from __future__ import annotations

import os

import numpy as np

from cct.proto.caffe_pb2 import TEST

from . import io as caffe_io
from .pycaffe import Net

__all__ = ["Detector"]


class Detector(Net):
    """Windowed detection: every window is cropped (with ``context_pad`` pixels of context if given),
    warped to the net input and classified (pycaffe's Detector).

    ``Detector(model_file, pretrained_file, mean=None, input_scale=None, raw_scale=None,
    channel_swap=None, context_pad=None)``.
    """

    def __init__(self, model_file, pretrained_file, mean=None, input_scale=None, raw_scale=None,
                 channel_swap=None, context_pad=None):
        Net.__init__(self, model_file, TEST, weights=pretrained_file)
        in_ = self.inputs[0]
        self.transformer = caffe_io.image_transformer(in_, self.blobs[in_].data.shape, mean, input_scale,
                                                      raw_scale, channel_swap)
        self.configure_crop(context_pad)

    def detect_windows(self, images_windows):
        """Classify windows of images.

        ``images_windows``: iterable of (image filename, windows), a window being
        (ymin, xmin, ymax, xmax). Returns a list of {'window', 'prediction', 'filename'} dicts.
        """
        images_windows = list(images_windows)
        window_inputs = []
        for image_fname, windows in images_windows:
            image = caffe_io.load_image(image_fname).astype(np.float32)
            for window in windows:
                window_inputs.append(self.crop(image, window))

        in_ = self.inputs[0]
        caffe_in = np.zeros((len(window_inputs), window_inputs[0].shape[2]) + tuple(self.blobs[in_].data.shape[2:]),
                            dtype=np.float32)
        for ix, window_in in enumerate(window_inputs):
            caffe_in[ix] = self.transformer.preprocess(in_, window_in)
        out = self.forward_all(**{in_: caffe_in})
        predictions = out[self.outputs[0]]

        detections = []
        ix = 0
        for image_fname, windows in images_windows:
            for window in windows:
                detections.append({"window": window, "prediction": predictions[ix], "filename": image_fname})
                ix += 1
        return detections

    def detect_selective_search(self, image_fnames):
        """Detect over Selective Search proposals (needs the external ``selective_search_ijcv_with_python``)."""
        try:
            import selective_search_ijcv_with_python as selective_search
        except ImportError as e:
            raise ImportError("Detector.detect_selective_search needs the selective_search_ijcv_with_python "
                              "package (https://github.com/sergeyk/selective_search_ijcv_with_python) "
                              "on sys.path") from e
        image_fnames = [os.path.abspath(f) for f in image_fnames]
        windows_list = selective_search.get_windows(image_fnames, cmd="selective_search_rcnn")
        return self.detect_windows(zip(image_fnames, windows_list))

    def crop(self, im: np.ndarray, window) -> np.ndarray:
        """The window (ymin, xmin, ymax, xmax) of ``im``, with context padding when configured
        (the padded box is clipped to the image and the rest filled with the mean)."""
        crop = im[window[0]:window[2], window[1]:window[3]]
        if self.context_pad:
            box = np.array(window, dtype=float)
            crop_size = self.blobs[self.inputs[0]].width  # assumes square
            scale = crop_size / (1. * crop_size - self.context_pad * 2)
            half_h = (box[2] - box[0] + 1) / 2.
            half_w = (box[3] - box[1] + 1) / 2.
            center = (box[0] + half_h, box[1] + half_w)
            scaled_dims = scale * np.array((-half_h, -half_w, half_h, half_w))
            box = np.round(np.tile(center, 2) + scaled_dims)
            full_h = box[2] - box[0] + 1
            full_w = box[3] - box[1] + 1
            scale_h = crop_size / full_h
            scale_w = crop_size / full_w
            pad_y = int(round(max(0, -box[0]) * scale_h))  # amount out of bounds
            pad_x = int(round(max(0, -box[1]) * scale_w))

            im_h, im_w = im.shape[:2]
            box = np.clip(box, 0., [im_h, im_w, im_h, im_w])
            clip_h = box[2] - box[0] + 1
            clip_w = box[3] - box[1] + 1
            assert clip_h > 0 and clip_w > 0
            crop_h = int(round(clip_h * scale_h))
            crop_w = int(round(clip_w * scale_w))
            if pad_y + crop_h > crop_size:
                crop_h = crop_size - pad_y
            if pad_x + crop_w > crop_size:
                crop_w = crop_size - pad_x

            box = box.astype(int)
            context_crop = im[box[0]:box[2], box[1]:box[3]]
            context_crop = caffe_io.resize_image(context_crop, (crop_h, crop_w))
            crop = np.ones(self.crop_dims, dtype=np.float32) * self.crop_mean
            crop[pad_y:(pad_y + crop_h), pad_x:(pad_x + crop_w)] = context_crop
        return crop

    def configure_crop(self, context_pad) -> None:
        """Set the crop dimensions (H x W x K) and, with ``context_pad``, the mean used to pad crops
        (the Transformer's mean taken back to image space)."""
        in_ = self.inputs[0]
        tpose = self.transformer.transpose[in_]
        inv_tpose = [tpose[t] for t in tpose]
        self.crop_dims = np.array(self.blobs[in_].data.shape[1:])[inv_tpose]
        self.context_pad = context_pad
        if self.context_pad:
            transpose = self.transformer.transpose.get(in_)
            channel_order = self.transformer.channel_swap.get(in_)
            raw_scale = self.transformer.raw_scale.get(in_)
            mean = self.transformer.mean.get(in_)
            if mean is not None:
                inv_transpose = [transpose[t] for t in transpose]
                crop_mean = np.array(mean, dtype=np.float32).transpose(inv_transpose)
                if channel_order is not None:
                    channel_order_inverse = [list(channel_order).index(i) for i in range(crop_mean.shape[2])]
                    crop_mean = crop_mean[:, :, channel_order_inverse]
                if raw_scale is not None:
                    crop_mean /= raw_scale
                self.crop_mean = crop_mean
            else:
                self.crop_mean = np.zeros(self.crop_dims, dtype=np.float32)
