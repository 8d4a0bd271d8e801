"""cct: Caffe con Troll, a fast Caffe-compatible CNN training framework."""
__version__ = "0.1.0"
