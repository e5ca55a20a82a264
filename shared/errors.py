"""The few error classes the project raises; everything else is a bug."""


class IsolatorError(Exception):
    """Base of every error this project raises on purpose."""


class NotYet(IsolatorError):
    """An expected "not yet" (a container still starting, say): the work is retried later, and it is no failure.

    Raise it only where a later look is arranged already (the verifier's passes revisit every pod without a
    verdict): one that outlasts its deliveries is acknowledged as handed over to that look, never dead-lettered.
    """


class ConfigError(IsolatorError):
    """A setting or flag has a value we cannot run with."""


class DecodeError(IsolatorError):
    """A message or payload is not a valid event of a type we know."""


class BusError(IsolatorError):
    """The message bus is unreachable or refused an operation."""


class FencedError(BusError):
    """A conditional write lost to a newer writer: compare-and-set on a KV revision or a stream subject sequence."""


class LeaseLostError(IsolatorError):
    """This replica no longer holds the lease its work needs (it ran out or another replica took it)."""
