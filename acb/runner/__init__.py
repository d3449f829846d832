"""Torch code that runs on the engine thread: KV cache, attention backends, model runner, sampler."""
