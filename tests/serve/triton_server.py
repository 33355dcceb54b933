"""A real Triton Inference Server for the tests: the `tritonserver` binary and Python backend that the
`nvidia-pytriton` wheel carries (installed with --no-deps by `make install`), started on free ports
(../shared/ENVIRONMENT.md, "A real Triton Inference Server on CPU").

The Python-backend stub of that build reads STRING tensors wrongly under numpy 2 (a buffer with
stride 0: every byte reads as the first), so the stub runs in a small environment with numpy 1.26
that reaches this venv's packages through a .pth file (`stub_env`); Triton containers bring their
own Python, where this does not arise. The stub's embedded interpreter ignores PYTHONPATH (an isolated
configuration), so that .pth also puts first the checkout whose `dflash_trt` the tests import: a test run
from another checkout (a git worktree) serves its own code, not the one installed in the venv.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import httpx


def pytriton_dir() -> Path | None:
    """The installed `pytriton` package folder (None when nvidia-pytriton is not installed)."""
    import importlib.util

    spec = importlib.util.find_spec("pytriton")
    return Path(spec.origin).parent if spec and spec.origin else None


def stub_env(root: Path) -> Path:
    """A venv at `root` with numpy<2 whose .pth adds this interpreter's site-packages after its own, and
    the folder holding the `dflash_trt` this process imports before them; returns its bin folder (put
    first on PATH, the stub runs its `python`)."""
    import dflash_trt

    source = str(Path(dflash_trt.__file__).resolve().parent.parent)
    if not (root / "bin" / "python").exists():
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
        py = root / "bin" / "python"
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps",
                        "--no-warn-conflicts", "--target", _site(py), "numpy<2"], check=True)
        Path(_site(py), "zz_dflash_main_env.pth").write_text(
            f"import site, sys; site.addsitedir({sysconfig.get_paths()['purelib']!r}); sys.path.insert(0, {source!r})\n")
    return root / "bin"


def _site(python: Path) -> str:
    out = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         capture_output=True, text=True, check=True)
    return out.stdout.strip()


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


class TritonServer:
    """`tritonserver` over `repo` on 127.0.0.1 (HTTP, gRPC and metrics on free ports); `stop()` ends it
    and its stub processes."""

    def __init__(self, repo: Path, work: Path, ready_timeout_s: float = 300):
        pt = pytriton_dir()
        assert pt is not None, "nvidia-pytriton is not installed: make install (or pip install --no-deps nvidia-pytriton==0.7.0)"
        server = pt / "tritonserver"
        backends = work / "backends"
        (backends / "python").mkdir(parents=True, exist_ok=True)
        for f in ("libtriton_python.so", "triton_python_backend_utils.py"):
            shutil.copy(server / "backends" / "python" / f, backends / "python" / f)
        ver = f"{sys.version_info.major}.{sys.version_info.minor}"
        shutil.copy(server / "python_backend_stubs" / ver / "triton_python_backend_stub", backends / "python")
        env_bin = stub_env(work / "stub-env")
        libs = pt.parent / "nvidia_pytriton.libs"
        env = dict(os.environ, PATH=f"{env_bin}:{os.environ.get('PATH', '')}",
                   LD_LIBRARY_PATH=f"{sysconfig.get_config_var('LIBDIR')}:{libs}")
        self.http, grpc, metrics = free_ports(3)
        self.url = f"http://127.0.0.1:{self.http}"
        self.grpc_url = f"127.0.0.1:{grpc}"
        self.metrics_url = f"http://127.0.0.1:{metrics}/metrics"
        self.log = work / "tritonserver.log"
        cmd = [str(server / "bin" / "tritonserver"), "--model-repository", str(repo), "--backend-directory",
               str(backends), "--http-address=127.0.0.1", "--grpc-address=127.0.0.1", "--metrics-address=127.0.0.1",
               f"--http-port={self.http}", f"--grpc-port={grpc}", f"--metrics-port={metrics}",
               "--disable-auto-complete-config", "--exit-timeout-secs=5", "--allow-gpu-metrics=false",
               "--pinned-memory-pool-byte-size=0", "--cuda-memory-pool-byte-size=0:0"]
        self.proc = subprocess.Popen(cmd, stdout=self.log.open("w"), stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        deadline = time.time() + ready_timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"tritonserver exited ({self.proc.returncode}):\n{self.log.read_text()[-3000:]}")
            try:
                if httpx.get(self.url + "/v2/health/ready", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.time() > deadline:
                self.stop()
                raise RuntimeError(f"tritonserver not ready in {ready_timeout_s} s:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.5)

    def stop(self) -> None:
        """SIGTERM the server; SIGKILL its process group (the stubs) if it is not gone in 15 s."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=15)
