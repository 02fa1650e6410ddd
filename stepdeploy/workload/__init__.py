"""Programs that run ON the nodes (shipped as files, started by torchrun). Each module here is
standalone: it imports only the standard library and torch, never the rest of stepdeploy."""
