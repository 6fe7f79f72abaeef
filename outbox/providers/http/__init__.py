"""The `http` provider family: any HTTP API that takes an idempotency key, described by
configuration (provider.py), and its preset `webhook` (webhook.py). What it sends and how it
reads the answers (spec.py), the reading of its options (config.py), what every HTTP provider
shares on the wire (wire.py), and its lookups for the reconciler (lookup.py)."""
