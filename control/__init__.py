"""What the pipeline and the CLI use to drive a fleet: the workers' HTTP client, the fleet's
status as text, and starting and stopping services (MLflow, Prefect, moto, workers)."""
