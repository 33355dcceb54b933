"""Errors raised by dflash-trt.

Every error names the problem and, where there is one, the fix. The CLI prints these without a
traceback; anything else that escapes is a bug.
"""


class DFlashError(Exception):
    """Base class of every error the package raises on bad input."""


class CheckpointError(DFlashError):
    """A checkpoint folder is missing, unreadable, or its keys/shapes do not match the config."""


class ConfigError(DFlashError):
    """A model or drafter config is missing a field or has a value this runtime cannot serve."""


class IncompatibleModelsError(DFlashError):
    """The drafter does not fit the target (vocab, hidden size, target layer ids, fc width...)."""


class PromptTooLongError(DFlashError):
    """A prompt (plus at least one generated token) does not fit in the model's context."""


class InvalidRequestError(DFlashError):
    """Sampling parameters or a request field are out of range (e.g. top_p <= 0, max_tokens < 1)."""


class BundleError(DFlashError):
    """A build bundle is missing, altered (sha256 mismatch), or from a newer manifest schema."""


class BuildError(DFlashError):
    """`dflash-trt build` failed; nothing was written to the output folder."""
