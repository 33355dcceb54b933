"""The `dflash-trt` command. Each subcommand lives in its own module and is imported lazily."""

from __future__ import annotations

import errno
import importlib
import sys

import click

# name -> "module:function" (the click command object)
SUBCOMMANDS = {
    "bench": "dflash_trt.cli.bench:bench",
    "build": "dflash_trt.cli.build:build",
    "check": "dflash_trt.cli.check:check",
    "generate": "dflash_trt.cli.generate:generate",
    "serve": "dflash_trt.cli.serve:serve",
    "init-drafter": "dflash_trt.cli.init_drafter:init_drafter",
    "train-drafter": "dflash_trt.cli.train_drafter:train_drafter",
    "triton": "dflash_trt.cli.triton:triton",
}


class LazyGroup(click.Group):
    def list_commands(self, ctx):
        return sorted(SUBCOMMANDS)

    def get_command(self, ctx, name):
        if name not in SUBCOMMANDS:
            return None
        module, attr = SUBCOMMANDS[name].split(":")
        return getattr(importlib.import_module(module), attr)

    def resolve_command(self, ctx, args):
        """click's, with the closest command named for a misspelt one ("No such command 'genrate'. Did you mean
        'generate'?"), as click names the closest option for a misspelt option."""
        try:
            return super().resolve_command(ctx, args)
        except click.UsageError as exc:
            import difflib

            close = difflib.get_close_matches(args[0], list(SUBCOMMANDS), n=1) if args else []
            if not close or "No such command" not in exc.message:
                raise
            raise click.UsageError(f"{exc.message.rstrip('.')}. Did you mean '{close[0]}'?", ctx) from None


def quiet_cuda_home_warning() -> None:
    """Drop torch's "No CUDA runtime is found, using CUDA_HOME=..." warning (torch.utils.cpp_extension logs it when
    imported, by our CPU kernels' build or by ModelOpt, wherever a CUDA build of torch runs without a GPU: PyPI's
    torch on a CPU machine). It says nothing a CPU run needs, and a run asked to use a GPU that is not there gets
    --device's own error. Other messages of that logger pass."""
    import logging

    logger = logging.getLogger("torch.utils.cpp_extension")
    if not any(getattr(f, "dflash_trt", False) for f in logger.filters):
        def no_cuda_runtime(record: logging.LogRecord) -> bool:
            return not str(record.msg).startswith("No CUDA runtime is found")
        no_cuda_runtime.dflash_trt = True
        logger.addFilter(no_cuda_runtime)


@click.group(cls=LazyGroup)
@click.version_option(package_name="dflash-trt")
@click.pass_context
def cli(ctx):
    """DFlash block-diffusion speculative decoding: generate, serve, triton, bench, check, build, init-drafter,
    train-drafter."""
    quiet_cuda_home_warning()
    if ctx.invoked_subcommand != "serve":  # serve stops on SIGTERM as on Ctrl-C already (uvicorn's handlers, its ranks')
        from dflash_trt.interrupts import terminate_as_interrupt

        ctx.with_resource(terminate_as_interrupt())  # SIGTERM (kill, timeout, Slurm) cleans up as Ctrl-C does


#: click >= 8.2 raises this for a group given no command (older click prints the help and exits 0 itself)
_NO_ARGS_IS_HELP = getattr(click.exceptions, "NoArgsIsHelpError", ())


def main() -> None:
    """Entry point: runs the CLI; a DFlashError is printed as `error: ...` (exit 1), a usage error as
    `error: ...` (exit 2), Ctrl-C / SIGTERM as one line (exit 130 / 143), a failed write of the output to stdout
    as one line (a closed pipe: none; exit 1, `stdout_error`), no traceback. `dflash-trt` alone prints the help (usage, commands) as click
    does for a group without a command: on stderr, exit 2, no `error:`."""
    from dflash_trt.errors import DFlashError

    if not isinstance(sys.stdout, MarkedStdout):
        sys.stdout = MarkedStdout(sys.stdout)
    try:
        cli.main(prog_name="dflash-trt", standalone_mode=False)
        sys.stdout.flush()  # now, not at exit: a failed write of the output is reported below, as one line
    except SystemExit:  # a command's own exit (its message given): stdout flushed quietly, never "Exception ignored"
        stdout_error(None)
        raise
    except click.exceptions.Abort as exc:  # Ctrl-C / SIGTERM in a command without its own message (generate, check, ...)
        from dflash_trt.interrupts import stopped_by

        how, code = stopped_by(exc)
        click.echo(how, err=True)
        sys.exit(code)
    except _NO_ARGS_IS_HELP as exc:  # no command given: the help itself is the message
        exc.show()
        sys.exit(exc.exit_code)
    except click.UsageError as exc:  # a bad option value, a missing or unknown option: one line, exit 2
        hint = f" (see '{exc.ctx.command_path} --help')" if exc.ctx is not None else ""
        click.echo(f"error: {exc.format_message()}{hint}", err=True)
        sys.exit(exc.exit_code)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except DFlashError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(1)
    except OSError as exc:  # a path that is missing, a file where a folder is expected, no permission
        broken = stdout_error(exc) if getattr(exc, "stdout", False) else None
        if broken is None:
            click.echo(f"error: {exc}", err=True)
        elif broken.errno != errno.EPIPE:  # a reader that went away (| head) is no error to report
            from dflash_trt.files import cannot_write

            click.echo(f"error: {cannot_write('the output to stdout', broken, 'send it to another disk')}", err=True)
        sys.exit(1)


class MarkedStdout:
    """`sys.stdout` as the CLI runs: the stream itself, whose write and flush errors carry `stdout = True` (so
    `main` tells a full disk under `> file`, or a closed pipe, from a failed write of another file)."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text):
        """The stream's write; an OSError is marked as stdout's."""
        try:
            return self.stream.write(text)
        except OSError as exc:
            exc.stdout = True
            raise

    def flush(self):
        """The stream's flush; an OSError is marked as stdout's."""
        try:
            return self.stream.flush()
        except OSError as exc:
            exc.stdout = True
            raise

    def __getattr__(self, name):
        return getattr(self.stream, name)


def stdout_error(exc: OSError | None) -> OSError | None:
    """The error of writing stdout: `exc` when it is one (`MarkedStdout`), else (None: no error yet) stdout's
    flush's error. Stdout's file descriptor then points at os.devnull, so the interpreter's flush at exit neither
    fails again nor prints "Exception ignored". None when stdout is fine."""
    broken = exc if getattr(exc, "stdout", False) else None
    if broken is None:
        try:
            sys.stdout.flush()
        except OSError as err:
            broken = err
    if broken is not None:
        _stdout_to_devnull()
    return broken


def _stdout_to_devnull() -> None:
    """Point stdout at os.devnull: its file descriptor (what the original stream's buffered bytes are flushed to
    when it is closed) where it has one, and `sys.stdout`."""
    import io
    import os

    try:
        fd = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(fd, sys.stdout.fileno())
        finally:
            os.close(fd)
    except (OSError, ValueError, AttributeError, io.UnsupportedOperation):  # no descriptor (a test's stream)
        pass
    sys.stdout = open(os.devnull, "w")
