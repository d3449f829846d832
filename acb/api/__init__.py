"""What callers touch: engines, handles, generate_batch, the transformers-compatible manager."""
