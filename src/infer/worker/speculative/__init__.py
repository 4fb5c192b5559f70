"""Speculative decoding: its configuration, the proposers of draft tokens (prompt lookup, a draft model) and the
verification of the drafts (the sampling rows of a verification chunk, acceptance). The engine core calls it; it
builds on the core's requests, scheduler and model runner."""
