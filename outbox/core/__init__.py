"""The shared vocabulary every other package speaks, importing nothing of outbox's own: an
operation's model and statuses (model), durations as written and shown (durations), payloads as
stored and carried (payloads), the retry and failure policy (policy) and text safe to show
(safe_text)."""
