"""Checkpoints: what a checkpoint holds (the Stateful adapters of each mode) and how it is
written, signed and read back (DCP plus each rank's own file)."""
