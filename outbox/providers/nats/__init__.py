"""The `nats` provider family, NATS JetStream: the provider (provider.py) and its connection
(link.py), its options declared (options.py) and read (config.py), and what each answer of
JetStream means (faults.py)."""
