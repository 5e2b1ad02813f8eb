"""Prefill/decode disaggregation's configuration (SGLang's flags): a prefill instance computes
prompts and pushes their KV to a decode instance, which receives it and decodes."""

from __future__ import annotations

from dataclasses import dataclass

from chunkserve.config.fields import arg
from chunkserve.errors import InvalidRequestError

DISAGGREGATION_MODES = ("null", "prefill", "decode")
DISAGGREGATION_TRANSFER_BACKENDS = ("zmq",)


@dataclass(frozen=True)
class DisaggregationConfig:
    disaggregation_mode: str = arg(
        "null", "prefill/decode disaggregation (SGLang's flag): prefill = compute prompts and push their KV to a "
        "decode instance chunk by chunk; decode = receive the KV and decode; null = both here (monolithic). Both "
        "roles take requests from `chunkserve router --pd-disaggregation`", choices=DISAGGREGATION_MODES
    )
    disaggregation_transfer_backend: str = arg(
        "zmq", "how KV travels between the instances: zmq = pyzmq over TCP", choices=DISAGGREGATION_TRANSFER_BACKENDS
    )
    disaggregation_bootstrap_port: int = arg(
        8998, "a prefill instance's TCP port for decode instances' bootstrap and its KV transfers"
    )
    disaggregation_bootstrap_host: str = arg(
        "127.0.0.1", "the address a prefill instance's bootstrap port listens on (chunkserve serve sets it to "
        "--host)"
    )
    disaggregation_bootstrap_timeout: float = arg(
        300.0, "prefill: seconds a request waits for its decode instance to bootstrap (its blocks held) before it "
        "is failed and its blocks freed"
    )
    disaggregation_waiting_timeout: float = arg(
        300.0, "decode: seconds a request may wait for its KV (bootstrapping, pre-allocated or transferring) "
        "before it is aborted and its blocks freed"
    )
    disaggregation_heartbeat_interval: float = arg(
        1.0, "seconds between heartbeats on a decode instance's connection to each prefill instance"
    )
    disaggregation_heartbeat_max_failures: int = arg(
        3, "missed heartbeats after which a decode instance takes a prefill instance for dead and aborts the "
        "requests whose KV it was sending"
    )
    disaggregation_kv_lease_timeout: float = arg(
        30.0, "prefill: seconds a request's blocks stay held for a decode instance that stopped renewing its lease"
    )
    disaggregation_transfer_window: int = arg(
        64, "most KV blocks of one request in flight between the instances (credits the decode side grants as "
        "it copies blocks into its pool), so a long prompt's KV cannot pile up in socket buffers"
    )

    def __post_init__(self) -> None:
        if self.disaggregation_mode not in DISAGGREGATION_MODES:
            raise InvalidRequestError(f"disaggregation_mode must be one of {DISAGGREGATION_MODES}, "
                                      f"got {self.disaggregation_mode!r}")
        if self.disaggregation_transfer_backend not in DISAGGREGATION_TRANSFER_BACKENDS:
            raise InvalidRequestError(f"disaggregation_transfer_backend must be one of "
                                      f"{DISAGGREGATION_TRANSFER_BACKENDS}, got {self.disaggregation_transfer_backend!r}")
        if not 1 <= self.disaggregation_bootstrap_port <= 65535:
            raise InvalidRequestError(f"disaggregation_bootstrap_port must be in [1, 65535], "
                                      f"got {self.disaggregation_bootstrap_port}")
        for name in ("disaggregation_bootstrap_timeout", "disaggregation_waiting_timeout",
                     "disaggregation_heartbeat_interval", "disaggregation_kv_lease_timeout"):
            if not getattr(self, name) > 0:
                raise InvalidRequestError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("disaggregation_heartbeat_max_failures", "disaggregation_transfer_window"):
            if getattr(self, name) < 1:
                raise InvalidRequestError(f"{name} must be at least 1, got {getattr(self, name)}")
