"""The worker's side of the control plane: the ZeroMQ client on its own thread, the rendezvous
with the coordinator, what a worker says while it waits, and how a worker process ends when the
run stops."""
