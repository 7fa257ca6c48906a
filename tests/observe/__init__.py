"""Tests of epochal.observe: status.json, the learning curve, TensorBoard and Prometheus."""
