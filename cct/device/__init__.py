"""The device interface: what runs a training iteration on an accelerator without host round trips."""
