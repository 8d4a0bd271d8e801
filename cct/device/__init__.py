"""The device interface: what a training step needs to run on a GPU without the host (random streams, ...)."""
