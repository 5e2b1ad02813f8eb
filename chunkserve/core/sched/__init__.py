"""The scheduler: its step loop (scheduler.py), the policies it consults (chunk sizing,
admission, preemption), the messages it exchanges with the worker (output.py), and the
collaborators that own a request's state beyond its counters: what the worker has been sent
(sent.py), the KV the connector moves (remote_kv.py), the grammars (grammars.py)."""
