"""Self-distillation of the mask vectors (``probe-mtp tune-masks``)."""
