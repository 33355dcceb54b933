"""Errors raised by dflash-trt.

Every error names the problem and, where there is one, the fix. The CLI prints these without a
traceback; anything else that escapes is a bug.
"""


class DFlashError(Exception):
    """Base class of every error the package raises on bad input.

    Args:
        param: the request field the error is about, when a server request's field caused it (the `param` of
            OpenAI's error body); None when the message says it, or when no single field did.
        code: the `code` of OpenAI's error body, where the server gives one (the Responses endpoint's
            "invalid_value" for a value outside a field's enum), else None.
    """

    def __init__(self, *args, param: str | None = None, code: str | None = None):
        super().__init__(*args)
        self.param, self.code = param, code


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


class TrainingInterrupted(KeyboardInterrupt):
    """Ctrl-C or SIGTERM (a KeyboardInterrupt) stopped `trainer.train`; a KeyboardInterrupt still, so code that
    catches that keeps working. Nothing is saved at the interruption: the weights of the step in
    progress may be half-updated. The last complete checkpoint stays as it was.

    Attributes:
        step: optimizer steps done when interrupted; total_steps: the run's planned steps.
        checkpoint: the run's checkpoint file; checkpoint_step: its step, None when the run has
            not written one yet (a rerun then starts over).
        terminated: True when SIGTERM stopped it (`dflash_trt.interrupts.terminate_as_interrupt`), not Ctrl-C.
    """

    def __init__(self, step: int, total_steps: int, checkpoint, checkpoint_step: int | None, terminated: bool = False):
        self.step, self.total_steps, self.terminated = step, total_steps, terminated
        self.checkpoint, self.checkpoint_step = checkpoint, checkpoint_step
        where = (f"last checkpoint: step {checkpoint_step} ({checkpoint}); train again with resume=True to continue "
                 "from it" if checkpoint_step is not None
                 else f"no checkpoint written yet ({checkpoint}); train again without resume to start over")
        super().__init__(f"training interrupted at step {step}/{total_steps}; {where}")
