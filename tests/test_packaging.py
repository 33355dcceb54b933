"""setup.py: a wheel builds without setuptools warnings and ships the default drafter as package data."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_wheel_builds_warning_free_with_the_drafter_assets(tmp_path):
    pytest.importorskip("setuptools")
    src = tmp_path / "src"
    src.mkdir()
    for name in ("setup.py", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    shutil.copytree(ROOT / "dflash_trt", src / "dflash_trt", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "-w", str(tmp_path / "dist"), "--no-deps",
                           "--no-build-isolation", "--no-cache-dir", "-v"],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    log = proc.stdout + proc.stderr
    warnings = [line.strip() for line in log.splitlines() if "Warning" in line]
    assert warnings == [], warnings
    [wheel] = (tmp_path / "dist").glob("dflash_trt-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "dflash_trt" / "assets").rglob("*") if p.is_file())
    assert "dflash_trt/assets/smollm2-135m-instruct-dflash-b16/model.safetensors" in shipped
    assert set(shipped) <= names, sorted(set(shipped) - names)
    assert "dflash_trt/ops/csrc/packed_linear.cpp" in names  # built on first use from the installed package
    assert "dflash_trt/ops/csrc/kv_inject.cu" in names  # the CUDA kernel, built with nvcc on first use
    assert "dflash_trt/cli/__init__.py" in names and not any(n.startswith("tests/") for n in names)
