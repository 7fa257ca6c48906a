"""The coordinator's service: sockets, the clock, the journal and the disk, around the rules
of ``../rules``."""
