"""The method itself: the dual-stream mask, batches, the loss, the mask token, checkpoint I/O."""
