# The two commands: `make demo` runs the main job, `make test` runs the tests.
# Both create .venv from the committed, pinned requirements.lock when it is missing.
PYTHON ?= python3.11
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: venv test test-slow test-all lint format demo airflow image bench-quality bench-goodput-sim clean browser

venv: $(STAMP)

$(STAMP): requirements.lock pyproject.toml
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "error: $(PYTHON) not found (Python 3.11 is required)"; exit 1; }
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -r requirements.lock
	$(BIN)/pip install --quiet --no-deps -e .
	@touch $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

test: $(STAMP) lint
	$(BIN)/python -m pytest -q

# Debian's chromium for the browser test (tests/test_ui_browser.py; Playwright drives it with
# executable_path, it never downloads a browser). Without it that test skips with the reason.
browser:
	@command -v chromium >/dev/null 2>&1 || { echo "installing Debian's chromium (apt-get)"; \
	  $(if $(filter 0,$(shell id -u)),,sudo) apt-get install -y -q chromium >/dev/null \
	  || echo "warning: could not install chromium: the browser test will skip"; }

test-slow: $(STAMP) browser
	$(BIN)/python -m pytest -q -m slow || [ $$? -eq 5 ]

test-all: test test-slow

demo: $(STAMP)
	PYTHONPATH=.:plugins $(BIN)/python -m devtools.demo

# make airflow EXECUTOR=celery: PostgreSQL + Redis + CeleryExecutor + two workers (docs/AIRFLOW.md)
EXECUTOR ?= local
AIRFLOW_SETUP_local = local_airflow
AIRFLOW_SETUP_celery = celery_airflow
airflow: $(STAMP)
	@test -n "$(AIRFLOW_SETUP_$(EXECUTOR))" || { echo "EXECUTOR=$(EXECUTOR): local or celery" >&2; exit 2; }
	PYTHONPATH=.:plugins $(BIN)/python -m devtools.$(AIRFLOW_SETUP_$(EXECUTOR)) serve

# The Airflow image (Dockerfile, `default` target) built here with podman, FROM local stand-ins for
# the official base images (devtools/image/bases.sh: no registry is reachable from these machines).
# Users build with the defaults: `docker build -t diloco-airflow .`
IMAGE      ?= localhost/diloco-airflow:dev
CA_BUNDLE  := /etc/ssl/certs/ca-certificates.crt
image:
	bash devtools/image/bases.sh
	podman build --network host --pull=never --target default -v $(CA_BUNDLE):$(CA_BUNDLE):ro \
	  --build-arg AIRFLOW_IMAGE=localhost/diloco-base-airflow:3.3.2-python3.11 \
	  --build-arg PYTHON_IMAGE=localhost/diloco-base-python:3.11 -t $(IMAGE) .

bench-quality: $(STAMP)
	$(BIN)/diloco bench quality --quick --json runs/bench_quality.json

bench-goodput-sim: $(STAMP)
	$(BIN)/diloco bench goodput-sim --json runs/bench_goodput_sim.json

clean:
	rm -rf runs airflow_home .pytest_cache .ruff_cache
