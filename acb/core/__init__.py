"""Engine bookkeeping in plain Python: requests, KV blocks, scheduling, the engine thread.

Imports neither torch nor asyncio, so all of it is unit-testable without a model.
"""
