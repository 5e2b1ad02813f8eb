"""`chunkserve router`: an HTTP load balancer in front of prefill and decode servers.

It does no compute and so imports nothing of the engine (nor torch): it starts in a moment and
can run on a machine without the model.
"""
