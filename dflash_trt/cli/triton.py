"""`dflash-trt triton`: a Triton Inference Server over a model repository (a bundle's triton/ folder, or one
written by `dflash_trt.serve.triton_repository.write_model_repository`) with the tritonserver that the
nvidia-pytriton wheel carries, set up as it needs (`dflash_trt.serve.triton_launch`)."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import click


@click.command(context_settings={"ignore_unknown_options": True})
@click.option("--model-repository", "repo", required=True, metavar="DIR",
              type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="The model repository (tritonserver's --model-repository): a bundle's triton/ folder.")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address HTTP, gRPC and metrics listen on (0.0.0.0: every interface).")
@click.option("--http-port", default=8000, show_default=True, type=click.IntRange(0, 65535),
              help="HTTP port (0: any free one).")
@click.option("--grpc-port", default=8001, show_default=True, type=click.IntRange(0, 65535),
              help="gRPC port (0: any free one).")
@click.option("--metrics-port", default=8002, show_default=True, type=click.IntRange(0, 65535),
              help="Prometheus metrics port (0: any free one).")
@click.argument("tritonserver_args", nargs=-1, type=click.UNPROCESSED, metavar="[TRITONSERVER_ARGS]...")
def triton(repo, host, http_port, grpc_port, metrics_port, tritonserver_args):
    """Serve a Triton model repository with nvidia-pytriton's tritonserver (`make install` installs it), its
    Python backend set up: the binary alone finds no backend. Other arguments go on to tritonserver (e.g.
    --exit-on-error=false --log-verbose=1; a flag given again overrides ours). Ctrl-C or SIGTERM stops it.
    In NVIDIA's Triton container the command is `tritonserver --model-repository DIR`."""
    from dflash_trt.cli.common import check_port
    from dflash_trt.interrupts import exit_stopped
    from dflash_trt.serve.triton_launch import TritonServer, work_dir

    # a port in use would be found by tritonserver only after the model loads, and the ready check would be answered
    # by the server that holds it: refused now, naming the option
    for flag, port in (("--http-port", http_port), ("--grpc-port", grpc_port), ("--metrics-port", metrics_port)):
        if port:
            check_port(host, port, flag)
    server = None
    try:
        server = TritonServer(repo, work_dir(), host=host, http_port=http_port, grpc_port=grpc_port,
                              metrics_port=metrics_port, extra_args=tuple(tritonserver_args), ready_timeout_s=None)
        models = ", ".join(f"POST {server.url}/v2/models/{m}/generate" for m in server.models()) or "no model READY"
        print(f"Triton ready on {server.url} ({models}), gRPC {server.grpc_url}, metrics {server.metrics_url}",
              file=sys.stderr, flush=True)
        code = server.proc.wait()
    except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM (the CLI's terminate_as_interrupt)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server's shutdown runs to its end
        if server is not None:
            server.stop()
        exit_stopped(exc, lambda how: f"triton {how}; tritonserver and its models stopped")
    if code != 0:
        from dflash_trt.errors import DFlashError

        raise DFlashError(f"tritonserver exited with status {code}: its log above says why")
