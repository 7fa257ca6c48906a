"""Training under the coordinator: :func:`train` / :func:`fit`, mixed precision and clipping,
initial parameters from rank 0, layer placement, the data sharding sampler and the results a run
returns."""
