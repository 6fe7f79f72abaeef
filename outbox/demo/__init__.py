"""`outbox demo`: the whole product on loopback, against outbox's fakes (tour), and with
``--queue``, the outbox in front of a real NATS JetStream (jetstream)."""
