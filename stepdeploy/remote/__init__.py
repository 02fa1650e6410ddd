"""Side effects on nodes: SSH connections and (later) the executors that launch and follow runs."""
