"""The `diloco_scavenge` DAG: its definition ships in the installed package
(`diloco_airflow.dags.scavenge`); this file only instantiates it in the DAG folder."""

from diloco_airflow.dags.scavenge import diloco_scavenge

diloco_scavenge()
