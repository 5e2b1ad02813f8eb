"""`chunkserve sim`: the engine's own scheduling on a virtual clock (docs/SIMULATOR.md).

profile.py (step-time profiles) -> timing.py (step timers) -> replica.py (the real EngineCore on
a VirtualClock; disagg.py and link.py: prefill and decode instances over a simulated wire) ->
fleet.py (replicas behind a router, one event loop) -> simulator.py (a run as a
bench result) -> search.py (rate search, sweeps); trace.py reads the requests."""
