"""The options of the queue provider types (docs/providers.md, "Queues"), declared as
outbox.config declares every key (outbox.settings_schema): one module per type, each an
``OPTIONS`` tuple that outbox.config puts into PROVIDER_OPTIONS.

Pure, like outbox.config: declarations only, no client library.
"""
