"""The six serving workloads of the benchmark, one module each; `context` holds what they share."""
