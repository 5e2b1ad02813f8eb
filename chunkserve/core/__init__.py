"""The engine's bookkeeping: requests, KV blocks and the prefix cache (kv/), the scheduler and its
policies (sched/), the KV-connector seam, the step-time model. Pure Python, no torch."""
