"""The KV cache beyond one engine's pool: the prefix cache's changes on their way to the coordinator, the tiers in
host memory and on disk (offload, host_store, offload_store), the pool's blocks as bytes (port) and their transfers
between workers (transfer, sans-I/O; the sockets are worker/service/kv_links.py's). Builds on the engine core's
block manager and pool; imports no zmq."""
