"""The run directory's files: its layout, atomic writes, checkpoint manifests and keys, the
address file."""
