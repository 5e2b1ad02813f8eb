"""The scheduler: its step loop (scheduler.py), the policies it consults (chunk sizing,
admission, preemption), and the collaborators that own a request's state beyond its counters:
what the worker has been sent (sent.py), the KV the connector moves (remote_kv.py), the
grammars (grammars.py). The messages it exchanges are in core/messages.py."""
