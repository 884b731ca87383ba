"""The `diloco_maintenance` DAG: its definition ships in the installed package
(`diloco_airflow.dags.maintenance`); this file only instantiates it in the DAG folder."""

from diloco_airflow.dags.maintenance import diloco_maintenance

diloco_maintenance()
