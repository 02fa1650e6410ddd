"""Provisioning: run the Ansible roles through ansible-runner with live progress."""
