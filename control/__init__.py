"""What the pipeline and the CLI use to drive a fleet: the fleet's status as text, and the
services the control plane runs beside MinT (MLflow, Prefect, moto)."""
