"""Developer tools, not shipped to Airflow: `local_airflow` (a real Airflow on this machine:
`make airflow`, the end-to-end tests) and `demo` (`make demo`)."""
