"""Operating the run: Prefect deployments and workers, failures, alerts, reports and inspection."""
