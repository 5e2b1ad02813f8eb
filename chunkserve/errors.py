"""The error types users see; the server maps each to an HTTP status."""


class InvalidRequestError(ValueError):
    """A request the engine refuses: bad prompt, bad sampling values, too long.

    The engine stays usable after raising it; the server answers 400 with the message and,
    where one field is at fault, its name as `param`.
    """

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class RequestFailedError(RuntimeError):
    """A step failed because of these requests' own data (a bad token id, a sampling row of
    NaN): the engine fails them alone and keeps serving the others."""

    def __init__(self, message: str, request_ids: list[str]) -> None:
        super().__init__(message)
        self.request_ids = list(request_ids)

    def __reduce__(self):  # the default pickles only the message
        return type(self), (str(self), self.request_ids)


class RequestAbortedError(RuntimeError):
    """The server aborted a request it had accepted (e.g. its client stopped reading its stream)."""


class KVTransferError(RuntimeError):
    """A disaggregated request's KV could not move between its prefill and decode instances
    (a timeout, a corrupted block, an instance gone): the request was aborted and may be
    retried (HTTP 503 with Retry-After; a stream ends with finish_reason "abort")."""


class ServerOverloadedError(RuntimeError):
    """Too many requests are waiting; the client should retry later (HTTP 503)."""


class EngineDeadError(RuntimeError):
    """The engine loop has stopped (shutting down or crashed); nothing more can be served."""


class ModelLoadError(ValueError):
    """A model path or format the loader cannot use; the message names what is missing
    or what is supported."""
