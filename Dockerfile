# One image for the Airflow components (scheduler, triggerer, dag-processor, api-server, workers)
# with the project installed as a package; `--target island-tpu` builds the island image with
# jax[tpu]. The base images are build arguments (defaults: the official images).
#   docker build -t diloco-airflow .
#   docker build --target island-tpu -t diloco-island-tpu .
#   podman build --build-arg AIRFLOW_IMAGE=localhost/airflow-base ... (a base built locally)
ARG AIRFLOW_IMAGE=apache/airflow:3.3.2-python3.11
ARG PYTHON_IMAGE=python:3.11-slim

FROM ${AIRFLOW_IMAGE} AS airflow
USER airflow
WORKDIR /opt/diloco
COPY --chown=airflow:root requirements.lock pyproject.toml README.md ./
RUN pip install --no-cache-dir -r requirements.lock
# One package: `training` and the Airflow layer `diloco_airflow`. Airflow finds the page through
# the `airflow.plugins` entry point and the provider through `apache_airflow_provider`: the plugins
# folder stays empty and nothing goes on PYTHONPATH (as on Composer; tests/test_installed.py).
COPY --chown=airflow:root training ./training
COPY --chown=airflow:root plugins/diloco_airflow ./plugins/diloco_airflow
RUN pip install --no-cache-dir --no-deps .
# The DAG files are three lines each, calling the package's DAG bodies.
COPY --chown=airflow:root dags/*.py ${AIRFLOW_HOME}/dags/
ENV GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false

FROM ${PYTHON_IMAGE} AS island-tpu
ARG JAX_TPU="jax[tpu]==0.10.2"
WORKDIR /opt/diloco
COPY requirements.lock pyproject.toml README.md ./
RUN pip install --no-cache-dir -r requirements.lock \
    && pip install --no-cache-dir "${JAX_TPU}" \
       -f https://storage.googleapis.com/jax-releases/libtpu_releases.html
COPY training ./training
COPY plugins/diloco_airflow ./plugins/diloco_airflow
RUN pip install --no-cache-dir --no-deps .
ENTRYPOINT ["diloco"]

FROM airflow AS default
