"""The `cloudtasks` provider family, Google Cloud Tasks: the provider, one HTTP task per
operation (provider.py), the client library's every import (client.py), its options declared
(options.py) and read (config.py), and what each answer of CreateTask leads to (answers.py)."""
