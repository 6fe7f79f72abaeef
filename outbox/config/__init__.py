"""Configuration: every setting declared once (settings, with the schema that reads and
documents them, and options for the built-in provider types), loaded from a TOML file and the
environment (loader), with secrets read where the file says they are (secrets); reference writes
docs/config-reference.md from the declarations.

The names a provider plug-in imports from here (docs/providers.md, "The interface") stay here.
"""

from outbox.config.schema import ConfigError
from outbox.config.secrets import read_secret
from outbox.config.settings import DEFAULT_MAX_RESPONSE_BYTES, ProviderSettings

__all__ = ["DEFAULT_MAX_RESPONSE_BYTES", "ConfigError", "ProviderSettings", "read_secret"]
