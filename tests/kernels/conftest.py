"""The kernel tests' shared helpers live in tests/kernel_checks.py: `from kernel_checks import DEVICE, ...`."""
