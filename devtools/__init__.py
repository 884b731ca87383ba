"""Developer tools, not shipped to Airflow: `local_airflow` (a real Airflow on this machine:
`make airflow`, the end-to-end tests), `demo` (`make demo`), and the device check
(`device_check.sh`, with `device_wheels.sh` for the wheels it carries; docs/BENCHMARKS.md, "On an
accelerator")."""
