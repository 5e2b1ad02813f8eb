"""The scheduler: its step loop (scheduler.py), the policies it consults (chunk sizing,
admission, preemption) and the messages it exchanges with the worker (output.py)."""
