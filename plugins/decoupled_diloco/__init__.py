"""The provider's module as Airflow derives it from the distribution's name.

Airflow's example-DAG discovery (with the default `load_examples = True`) imports a module named
after each provider's distribution, `decoupled-diloco` -> `decoupled_diloco`, and adds its
`example_dags` folder if it has one. Without this module every task log and the scheduler
printed `Could not load provider module decoupled_diloco for example DAG discovery` with a
traceback (docs/AIRFLOW.md). The provider's code is `diloco_airflow`; the DAGs a deployment
runs are the `dags/diloco_*.py` files it copies into its DAGs folder, so there is no
`example_dags` folder here (the same DAGs twice would be two DAGs of one id).
"""

from diloco_airflow.get_provider_info import PACKAGE

__all__ = ["PACKAGE"]
