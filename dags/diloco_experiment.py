"""The `diloco_experiment` DAG: its definition ships in the installed package
(`diloco_airflow.dags.experiment`); this file only instantiates it in the DAG folder."""

from diloco_airflow.dags.experiment import diloco_experiment

diloco_experiment()
