"""Database access: every SQL statement outbox issues (statements), and the migration runner."""
