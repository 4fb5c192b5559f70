"""A model's files into our model: the directory or GGUF file resolved, its config and tokenizer read, its
weights (safetensors, GGUF blocks, FP8, AWQ / GPTQ) loaded dense or kept quantized, refit and released. Imports
only distributed/ and models/ of the worker."""
