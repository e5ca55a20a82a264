"""The few error classes the project raises; everything else is a bug."""


class IsolatorError(Exception):
    """Base of every error this project raises on purpose."""


class ConfigError(IsolatorError):
    """A setting or flag has a value we cannot run with."""


class DecodeError(IsolatorError):
    """A message or payload is not a valid event of a type we know."""


class BusError(IsolatorError):
    """The message bus is unreachable or refused an operation."""
