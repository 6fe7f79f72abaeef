"""The shared vocabulary every other package speaks, importing nothing of outbox's own: an
operation's model and statuses (model), durations as written and shown (durations), payloads as
stored and carried (payloads), the retry and failure policy (policy), text safe to show
(safe_text) and JSON pointers (json_pointer), which the http providers and the inbox's key read."""
