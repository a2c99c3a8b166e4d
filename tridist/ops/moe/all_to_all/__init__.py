"""All-to-all-v with the splits on the device, in PyTorch's `all_to_all_vdev*` layouts: `op` is the
front (the checks, the functions and their custom ops), `staged` the one method (one network round
into per-source staging). `tridist.ops.moe` exports the ops."""
