"""Monitors for a running training: collectors' parsers, delta judgements, failure classification, log
diagnosis and the Prometheus textfile. Everything here is pure (text in, values out) except
prometheus.write_textfile; the SSH loop that runs probe.remote_command() on every node lives elsewhere.

    probe.remote_command(spec) -> one shell command per node;  probe.parse(output, node, spec, now) -> NodeSample
    judge.judge_node(prev, cur) + training.judge_training(prev, cur) -> [Finding]   (deltas, never totals)
    classify.classify(run_status, findings) -> Classification (crash | hang | link | node-loss) or None
    diagnose.diagnose(log_text) -> [Diagnosis]  (cause + fix per known signature)
    prometheus.render(samples) -> text;  prometheus.write_textfile(path, text)
"""
