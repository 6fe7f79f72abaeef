"""What outbox shows of itself: the Prometheus metrics (metrics) and the bound on their action
labels (metric_labels), the structured logs (logs), the traces (tracing), and the masking of
secrets in whatever is shown (redaction)."""
