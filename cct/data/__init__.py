"""Data input: Caffe databases (LMDB/LevelDB), the DataTransformer, image decoding, prefetching, and the
data layers' loaders (:mod:`.db_loader`, :mod:`.image_list_loader`, :mod:`.hdf5_loader`; their sharding and
read-state bookkeeping in :mod:`.stream`, their decoding threads in :mod:`.decode_pool`)."""
from .db import DB, Cursor, DBWriter, backend_name, open_db, open_writer, parse_datum
from .prefetch import Prefetcher
from .transformer import (
    DataTransformer,
    array_to_datum,
    datum_to_array,
    decode_image,
    encode_image,
    image_to_datum,
    read_image,
    read_image_list,
    resize_bilinear,
)

__all__ = [
    "DB", "Cursor", "DBWriter", "backend_name", "open_db", "open_writer", "parse_datum", "Prefetcher",
    "DataTransformer", "array_to_datum", "datum_to_array", "decode_image", "encode_image", "image_to_datum",
    "read_image", "read_image_list", "resize_bilinear",
]
