"""Process groups and sharding, the floor of the worker: this process's tensor-parallel shard, its share of the
experts, an EP group's lockstep and the one min-over-a-group every start agrees on, and weight broadcasts from a
trainer. Imports no other worker module."""
