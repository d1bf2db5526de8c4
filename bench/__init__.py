"""MinT's benchmarks: each script measures one comparison side by side and writes its figures
to bench/results/ (see README.md). `harness` is what they share; `synthetic` makes the adapters
in a mixture-of-experts model's shape that they and the packing tests use."""
