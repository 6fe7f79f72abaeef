"""The `amqp` provider family, RabbitMQ: the provider, publishing with confirms (provider.py),
its options declared (options.py) and read (config.py), and what the broker's answers and faults
mean (faults.py)."""
