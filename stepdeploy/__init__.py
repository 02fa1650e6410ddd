"""stepdeploy: bare GPU nodes in an Ansible inventory -> a validated, monitored Megatron training run."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("stepdeploy")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+unknown"
