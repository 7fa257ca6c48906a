"""The data plane's set-up: the network interface the process group uses and rank 0's
rendezvous store (served by a process of its own, its memory capped)."""
