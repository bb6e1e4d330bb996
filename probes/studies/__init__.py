"""Studies built from the scorers and the metrics: task evaluation, the safety study,
the refusal-tuned model."""
