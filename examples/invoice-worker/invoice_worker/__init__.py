"""invoice-worker: the receiving half of outbox, as users copy it (README, "The receiving half")."""
