"""All-to-all-v with the splits on the device, in PyTorch's `all_to_all_vdev*` layouts: `op` is the
front (the checks and the functions; their custom ops are in `tridist.ops.torch_ops`), `staged` the
one method (one network round into per-source staging). `tridist.ops.moe` exports the ops."""
