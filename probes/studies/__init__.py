"""Studies built from the scorers and the metrics: task evaluation, the safety study,
the per-head probe study, the refusal-tuned model."""
