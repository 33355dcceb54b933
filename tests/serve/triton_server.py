"""A real Triton Inference Server for the tests: `dflash_trt.serve.triton_launch.TritonServer` (nvidia-pytriton's
`tritonserver` and Python backend, set up as `dflash-trt triton` sets them up) on 127.0.0.1, free ports, its
backend folder and stub environment in the test's `work` folder and its output in `work/tritonserver.log`
(../shared/ENVIRONMENT.md, "A real Triton Inference Server on CPU")."""

from __future__ import annotations

from pathlib import Path

from dflash_trt.serve import triton_launch


class TritonServer(triton_launch.TritonServer):
    """`tritonserver` over `repo` on 127.0.0.1 (HTTP, gRPC and metrics on free ports), its log in
    `work/tritonserver.log`; `stop()` ends it and its stub processes."""

    def __init__(self, repo: Path, work: Path, ready_timeout_s: float = 300):
        work.mkdir(parents=True, exist_ok=True)
        super().__init__(repo, work, log=work / "tritonserver.log", ready_timeout_s=ready_timeout_s)
