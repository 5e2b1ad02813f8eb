"""The engine's bookkeeping: requests, KV blocks and the scheduler. Pure Python, no torch."""
