"""The error every policy check raises."""


class PolicyError(ValueError):
    """A policy that is malformed or does not fit the model; the message says what to fix."""
