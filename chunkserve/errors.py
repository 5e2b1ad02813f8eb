"""The error types users see. The server (a later layer) maps them to HTTP codes."""


class InvalidRequestError(ValueError):
    """A request the engine refuses: bad prompt, bad sampling values, too long.

    The engine stays usable after raising it; the server answers 400 with the message.
    """


class ModelLoadError(ValueError):
    """A model path or format the loader cannot use; the message names what is missing
    or what is supported."""
