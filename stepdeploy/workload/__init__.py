"""Programs that run ON the nodes (shipped as files, started by launch_ranks.py or torchrun). Each module here is
standalone: it imports only the standard library and torch, never the rest of stepdeploy."""
