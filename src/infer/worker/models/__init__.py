"""Model implementations, built from a transformers config."""
