"""The engine's bookkeeping: requests, KV blocks and the prefix cache (kv/), the scheduler and its
policies (sched/), the step messages (messages.py) and every feature's stats (stats.py), the
KV-connector seam, the step-time model. Pure Python, no torch."""
