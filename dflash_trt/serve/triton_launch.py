"""Starting a real Triton Inference Server over a model repository with the `tritonserver` binary and Python
backend that the `nvidia-pytriton` wheel carries (`make install` installs it with --no-deps): `dflash-trt
triton` and the tests' server.

The wheel holds tritonserver (2.51.0 in nvidia-pytriton 0.7.0) as a library of files, not a command on PATH:
run bare it finds no Python backend ("unable to find backend library for backend 'python'"). `TritonServer`
lays out what it needs (shared/ENVIRONMENT.md, "A real Triton Inference Server on CPU"):
- a backend folder: the wheel's `libtriton_python.so` and `triton_python_backend_utils.py`, and the
  Python-backend stub built for this interpreter's Python version (`backend_folder`);
- the stub's Python: the wheel's stub reads STRING tensors wrongly under numpy 2 (a buffer with stride 0: every
  byte reads as the first), so it runs in a small environment with numpy 1.26 that reaches this interpreter's
  packages through a .pth file (`stub_env`); the stub's embedded interpreter ignores PYTHONPATH (an isolated
  configuration), so that .pth also puts first the folder named by $DFLASH_TRT_SOURCE, which the server's
  environment sets to the one holding the `dflash_trt` this process imports: a run from another checkout (a
  git worktree) serves its own code, not the one installed in the venv (`server_env`);
- LD_LIBRARY_PATH: this interpreter's libpython before the wheel's libraries (else the system's libpython may
  load, and models fail with "'_thread.RLock' object has no attribute '_recursion_count'").
NVIDIA's Triton containers (nvcr.io/nvidia/tritonserver:YY.MM-py3) bring all of this with their own Python:
there `tritonserver --model-repository DIR` is the command, with dflash_trt importable by that Python.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from dflash_trt.errors import DFlashError

#: the wheel that carries tritonserver, as `make install` pins it (installed without its dependencies)
PYTRITON = "nvidia-pytriton==0.7.0"
#: the numpy the Python-backend stub of that build reads STRING tensors with correctly
STUB_NUMPY = "numpy<2"
#: NVIDIA's container, for real deployments (its Python must import dflash_trt)
CONTAINER = "nvcr.io/nvidia/tritonserver:YY.MM-py3"
#: the variable naming the folder that holds the `dflash_trt` the stub imports first (read by `stub_env`'s .pth)
SOURCE_VAR = "DFLASH_TRT_SOURCE"
#: flags for a CPU machine: no GPU metrics, no pinned or CUDA memory pools (tritonserver's own flags given later win)
CPU_FLAGS = ("--allow-gpu-metrics=false", "--pinned-memory-pool-byte-size=0", "--cuda-memory-pool-byte-size=0:0")


class TritonNotInstalled(DFlashError):
    """nvidia-pytriton (its tritonserver, or its stub for this Python version) is not installed."""


def pytriton_dir() -> Path | None:
    """The installed `pytriton` package folder (None when nvidia-pytriton is not installed). Found without
    importing it: installed with --no-deps, its own imports (gevent, ...) fail."""
    import importlib.util

    spec = importlib.util.find_spec("pytriton")
    return Path(spec.origin).parent if spec and spec.origin else None


def _install_hint() -> str:
    return (f"install it with `pip install --no-deps {PYTRITON}` (`make install` does), or serve the repository from "
            f"NVIDIA's Triton container ({CONTAINER}) with `tritonserver --model-repository DIR`, where the "
            "container's Python must import dflash_trt (pip install this package there)")


def tritonserver_files() -> tuple[Path, Path, Path]:
    """(the tritonserver binary, the Python backend's folder, the Python-backend stub for this Python version)
    inside the installed nvidia-pytriton.

    Raises:
        TritonNotInstalled: nvidia-pytriton is not installed, lacks the binary, or has no stub for this Python
            version; names what to install, or NVIDIA's container.
    """
    pt = pytriton_dir()
    server = pt / "tritonserver" if pt is not None else None
    if server is None or not (server / "bin" / "tritonserver").is_file():
        raise TritonNotInstalled(f"tritonserver not found: nvidia-pytriton, which carries it, is not installed; "
                                 f"{_install_hint()}")
    ver = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = server / "python_backend_stubs" / ver / "triton_python_backend_stub"
    if not stub.is_file():
        have = sorted(p.name for p in (server / "python_backend_stubs").glob("*") if p.is_dir())
        raise TritonNotInstalled(f"nvidia-pytriton has no Python-backend stub for Python {ver} (it has "
                                 f"{', '.join(have) or 'none'}): run dflash-trt with one of those, or serve the "
                                 f"repository from NVIDIA's Triton container ({CONTAINER}) with `tritonserver "
                                 "--model-repository DIR`")
    return server / "bin" / "tritonserver", server / "backends" / "python", stub


def work_dir() -> Path:
    """The folder in the dflash-trt cache (`dflash_trt.models.default.cache_dir`) where `dflash-trt triton` keeps
    the backend folder and the stub's environment of this interpreter: `triton/pyX.Y-HASH`, HASH of its
    site-packages (one per venv; reused by later runs)."""
    from dflash_trt.models.default import cache_dir

    purelib = sysconfig.get_paths()["purelib"]
    key = hashlib.sha256(purelib.encode()).hexdigest()[:12]
    return cache_dir() / "triton" / f"py{sys.version_info.major}.{sys.version_info.minor}-{key}"


def _place(src: Path, dst: Path) -> None:
    """Copy `src` to `dst` unless it holds the same bytes; by rename, so a server running from `dst` keeps its
    file (a copy over a loaded library would change it under that server)."""
    if dst.is_file() and dst.read_bytes() == src.read_bytes():
        return
    fd, tmp = tempfile.mkstemp(prefix=f".{dst.name}.", dir=dst.parent)
    os.close(fd)
    try:
        shutil.copy2(src, tmp)
        os.replace(tmp, dst)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def backend_folder(work: Path) -> Path:
    """`work/backends`, tritonserver's --backend-directory: `python/` holds the wheel's libtriton_python.so,
    triton_python_backend_utils.py and the stub for this Python version.

    Raises:
        TritonNotInstalled: as `tritonserver_files`. OSError: `work` cannot be written.
    """
    _, python_backend, stub = tritonserver_files()
    backends = work / "backends"
    (backends / "python").mkdir(parents=True, exist_ok=True)
    for src in (python_backend / "libtriton_python.so", python_backend / "triton_python_backend_utils.py", stub):
        _place(src, backends / "python" / src.name)
    return backends


def stub_env(root: Path) -> Path:
    """A venv at `root` (made once; reused) with numpy<2 whose .pth puts this interpreter's site-packages after its
    own, and $DFLASH_TRT_SOURCE (when set) first; returns its bin folder (put first on PATH, the stub runs its
    `python`). Made in a folder beside `root` and renamed into place: a run stopped halfway leaves no broken one.

    Raises:
        DFlashError: pip could not install numpy<2 (no index reachable): names the command and the fix.
    """
    if (root / "bin" / "python").exists():
        return root / "bin"
    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{root.name}.", dir=root.parent))
    try:
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp)], check=True)
        site = _site(tmp / "bin" / "python")
        pip = [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps",
               "--no-warn-conflicts", "--target", site, STUB_NUMPY]
        done = subprocess.run(pip, capture_output=True, text=True)
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["(no message)"])[-1]
            raise DFlashError(f"cannot make the Triton Python backend's environment in {root}: `pip install "
                              f"{STUB_NUMPY}` failed ({last}); let pip reach a package index with numpy 1.26, then "
                              "run again")
        purelib = sysconfig.get_paths()["purelib"]
        Path(site, "zz_dflash_main_env.pth").write_text(
            f"import os, site, sys; site.addsitedir({purelib!r}); p = os.environ.get({SOURCE_VAR!r}); "
            "p and sys.path.insert(0, p)\n")
        try:
            tmp.rename(root)
        except OSError:  # another run made it meanwhile
            if not (root / "bin" / "python").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return root / "bin"


def _site(python: Path) -> str:
    out = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         capture_output=True, text=True, check=True)
    return out.stdout.strip()


def server_env(env_bin: Path) -> dict[str, str]:
    """tritonserver's environment: this process's, with `env_bin` (the stub's environment) first on PATH,
    LD_LIBRARY_PATH this interpreter's libpython folder then the wheel's libraries, and $DFLASH_TRT_SOURCE the
    folder holding the `dflash_trt` this process imports."""
    import dflash_trt

    libs = pytriton_dir().parent / "nvidia_pytriton.libs"
    source = str(Path(dflash_trt.__file__).resolve().parent.parent)
    return dict(os.environ, PATH=f"{env_bin}:{os.environ.get('PATH', '')}",
                LD_LIBRARY_PATH=f"{sysconfig.get_config_var('LIBDIR')}:{libs}", **{SOURCE_VAR: source})


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """`n` distinct TCP ports free on `host` now (the system's picks; another process may take one before use)."""
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind((host, 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM it when the process that started it dies (Linux prctl
    PR_SET_PDEATHSIG), so a killed `dflash-trt triton` leaves no server behind."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class TritonServer:
    """`tritonserver` over the model repository `repo`, started and ready when the constructor returns; `stop()`
    ends it and its stub processes.

    Args:
        repo: the model repository (tritonserver's --model-repository).
        work: where the backend folder and the stub's environment are made (`work_dir()` for dflash-trt triton).
        host: the address HTTP, gRPC and metrics listen on (0.0.0.0: every interface).
        http_port, grpc_port, metrics_port: TCP ports; 0: a free one (`free_ports`).
        extra_args: more tritonserver flags, after ours (where a flag is given twice tritonserver takes the last).
        log: a file for tritonserver's output; None: this process's stdout and stderr.
        ready_timeout_s: seconds to wait for /v2/health/ready; None: as long as the server runs.
    Attributes:
        url (HTTP, "http://HOST:PORT"), grpc_url ("HOST:PORT"), metrics_url (".../metrics"), log, proc.
    Raises:
        TritonNotInstalled: nvidia-pytriton is not installed (names what to install).
        DFlashError: tritonserver exited before it was ready, or was not ready in time (then stopped); the
            message holds the end of its log when `log` is a file.
    """

    def __init__(self, repo: Path, work: Path, *, host: str = "127.0.0.1", http_port: int = 0, grpc_port: int = 0,
                 metrics_port: int = 0, extra_args: tuple[str, ...] = (), log: Path | None = None,
                 ready_timeout_s: float | None = 300):
        binary, _, _ = tritonserver_files()
        backends = backend_folder(work)
        env = server_env(stub_env(work / "stub-env"))
        picks = iter(free_ports(3, "127.0.0.1" if host == "0.0.0.0" or ":" in host else host))
        self.http, self.grpc, self.metrics = (port or next(picks) for port in (http_port, grpc_port, metrics_port))
        shown = f"[{host}]" if ":" in host else host
        self.url = f"http://{shown}:{self.http}"
        self.grpc_url = f"{shown}:{self.grpc}"
        self.metrics_url = f"http://{shown}:{self.metrics}/metrics"
        local = {"0.0.0.0": "127.0.0.1", "::": "[::1]"}.get(host, shown)
        self._probe = f"http://{local}:{self.http}"
        self.log = log
        cmd = [str(binary), "--model-repository", str(repo), "--backend-directory", str(backends),
               f"--http-address={host}", f"--grpc-address={host}", f"--metrics-address={host}",
               f"--http-port={self.http}", f"--grpc-port={self.grpc}", f"--metrics-port={self.metrics}",
               "--disable-auto-complete-config", "--exit-timeout-secs=5", *CPU_FLAGS, *extra_args]
        out = log.open("w") if log is not None else None
        try:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT if out else None, env=env,
                                         start_new_session=True, preexec_fn=_die_with_parent)
        finally:
            if out is not None:
                out.close()
        try:
            self._wait_ready(ready_timeout_s)
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self, timeout_s: float | None) -> None:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise DFlashError(f"tritonserver exited with status {self.proc.returncode} before it was ready"
                                  f"{self._log_tail()}")
            if self.ready():
                return
            if deadline is not None and time.monotonic() > deadline:
                raise DFlashError(f"tritonserver was not ready in {timeout_s:g} s{self._log_tail()}")
            time.sleep(0.5)

    def ready(self) -> bool:
        """Whether /v2/health/ready answers 200 (the server up, every model loaded)."""
        try:
            with urllib.request.urlopen(self._probe + "/v2/health/ready", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def models(self) -> list[str]:
        """The names of the repository's models that are READY (Triton's /v2/repository/index)."""
        import json

        req = urllib.request.Request(self._probe + "/v2/repository/index", data=b"{}", method="POST")
        with urllib.request.urlopen(req, timeout=10) as r:
            return [m["name"] for m in json.load(r) if m.get("state") == "READY"]

    def _log_tail(self) -> str:
        if self.log is None:
            return ": its log above says why"
        return f"; the end of its log ({self.log}):\n{self.log.read_text(errors='replace')[-3000:]}"

    def stop(self) -> None:
        """SIGTERM the server (it unloads its models, up to its 5 s exit timeout); SIGKILL its process group (the
        stubs) if it is not gone in 15 s, and what is left of that group anyway."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait(timeout=15)
