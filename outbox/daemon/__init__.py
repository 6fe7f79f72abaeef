"""`outbox run`: the process that serves the dispatcher (service: start, the health and metrics
endpoint, signals, shutdown), its checks before the first claim (startup), the gauges it
refreshes (gauges), the LISTEN connection that wakes the claim (wakeup) and its word to systemd
(sdnotify). The loops it runs are outbox/runtime/'s, the dispatcher outbox/dispatch/'s."""
