"""The infer-worker daemon: its command line and options, WorkerCore (every decision of one rank on the wire, no
I/O, time passed in) with its lifecycle table and stream table, and the shells that do the I/O over zmq (the
DEALER to the coordinator, the direct-stream ROUTER, the KV sockets). The top of the worker: no other worker
module imports it."""
