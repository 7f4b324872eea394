"""Errors the engine reports to users: each carries a message that says what to do."""


class EngineError(Exception):
    """Base class: the message is meant for the user, not a traceback reader."""


class PrepareError(EngineError):
    """A model could not be fetched, verified or converted."""


class TokenizerMismatchError(PrepareError):
    """The draft model does not share the target's tokenizer."""


class ContextLimitError(EngineError):
    """The prompt (plus what must be generated) does not fit the model's context."""
