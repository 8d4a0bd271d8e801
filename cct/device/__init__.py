"""The device interface: what cct needs from a GPU beyond CuPy's arrays (a capture-capable cuBLAS, CUDA graphs
of a training step, the device-side random generator, checks and update kernels)."""
