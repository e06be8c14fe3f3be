"""Environments: PettingZoo multi-agent envs as mpirl runs them, and the small multi-agent envs
and scripted policies that the tests, examples and benchmarks use. Nothing here crosses ranks."""
