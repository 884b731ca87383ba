"""The project's DAGs as decorated functions, shipped in the package.

A DAG file in Airflow's DAG folder (the repo's `dags/*.py`, three lines each) imports one and
calls it: Airflow records that file as the DAG's location, so the DAG folder holds only those
thin files and the code upgrades with `pip install`. Calling a function here registers the DAG
in whatever module calls it; importing this package registers nothing.
"""
