"""The infer-worker daemon and its engine: scheduler, block manager, model runner, models, sampler."""
