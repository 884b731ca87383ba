# One image for the Airflow components (scheduler, triggerer, dag-processor, api-server, workers)
# with the project installed; `--target island-tpu` builds the island image with jax[tpu].
#   docker build -t diloco-airflow .
#   docker build --target island-tpu -t diloco-island-tpu .
ARG AIRFLOW_IMAGE=apache/airflow:3.3.2-python3.11

FROM ${AIRFLOW_IMAGE} AS airflow
USER airflow
WORKDIR /opt/diloco
COPY --chown=airflow:root requirements.lock pyproject.toml ./
RUN pip install --no-cache-dir -r requirements.lock
COPY --chown=airflow:root training ./training
RUN pip install --no-cache-dir --no-deps .
# DAGs stay thin; plugins/ is on sys.path in every component (the triggerer imports the triggers)
COPY --chown=airflow:root dags/ ${AIRFLOW_HOME}/dags/
COPY --chown=airflow:root plugins/ ${AIRFLOW_HOME}/plugins/
ENV PYTHONPATH=${AIRFLOW_HOME}/plugins \
    GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false

FROM python:3.11-slim AS island-tpu
ARG JAX_TPU="jax[tpu]==0.10.2"
WORKDIR /opt/diloco
COPY requirements.lock pyproject.toml ./
RUN pip install --no-cache-dir -r requirements.lock \
    && pip install --no-cache-dir "${JAX_TPU}" \
       -f https://storage.googleapis.com/jax-releases/libtpu_releases.html
COPY training ./training
RUN pip install --no-cache-dir --no-deps .
ENTRYPOINT ["diloco"]

FROM airflow AS default
