"""What runs the model behind a worker: the Backend protocol, the embedded engine and vLLM."""
