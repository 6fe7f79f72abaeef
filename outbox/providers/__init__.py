"""Providers: the Provider protocol and its result types (base), the registry that builds the
configured ones (registry), their start before the first claim (lifecycle), the kits the families
share (kit, answers, building, shards, queue_kit) and the noop provider; then one package per
family, each holding its provider, options, wire format, answers, faults and lookup: http (with
webhook, its preset), stripe, and the queues nats, amqp, sqs and cloudtasks; none imports
another. JSON pointers, which the inbox reads too, are outbox.core.json_pointer."""
