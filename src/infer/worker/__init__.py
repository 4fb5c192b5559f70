"""The infer-worker daemon and its engine, in layers (top to bottom; docs/architecture.md, "The worker's layers"):
service/ (the daemon), parallel/ (engines of several processes), engine/ (the engine core) with speculative/ and kv/
beside it, loading/ (a model's files into our model), models/, distributed/ (process groups and sharding). The
imports between them are checked by tests/test_import_cycles.py."""
