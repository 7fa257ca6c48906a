"""Tests of epochal.launch and epochal.zygote: the launcher, its restarts and reruns, and the
process that imports torch once and forks the workers."""
