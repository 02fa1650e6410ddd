# workload stand-in for golden files
