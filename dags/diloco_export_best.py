"""The `diloco_export_best` example DAG: its definition ships in the installed package
(`diloco_airflow.dags.export_best`); this file only instantiates it in the DAG folder."""

from diloco_airflow.dags.export_best import diloco_export_best

diloco_export_best()
