"""Hardening programs (chaos, soak) and their shared harness; tests/cluster/test_chaos.py runs chaos short."""
