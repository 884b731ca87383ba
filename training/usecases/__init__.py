"""The use cases that span roles: each one the single path that a `diloco` command and its
Airflow task share (`create.create_or_join`: `diloco init` and the experiment DAG's `init`
task). They import the roles below them; the cli and the plugin call them."""
