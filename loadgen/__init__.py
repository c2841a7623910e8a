"""stepscope load generator: arrival processes, workloads, step-load capacity tests."""
