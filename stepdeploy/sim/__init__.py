"""The embedded simulated cluster: N Debian nodes on one machine, each with its own network namespace,
overlay root, hostname, host key and sshd, joined by a private bridge. See docs/simcluster.md."""
