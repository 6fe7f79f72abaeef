"""The `stripe` provider family: v1 create and change calls with the stored idempotency key
(provider.py), the actions outbox can send (actions.py), how the reconciler finds what an
operation did (lookup.py), and what a found object's state means for it (states.py)."""
