"""Providers: the Provider protocol and result types (base), the built-in webhook and noop
providers, and the registry that builds the configured ones."""
