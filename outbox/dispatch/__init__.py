"""The dispatcher's parts, each with one job; ``dispatcher.Dispatcher`` puts them together.

- ``claims``: the claim scheduler (free slots, claim loops, the fairness cursor, wake-ups).
- ``pipeline``: one operation's way from claim to send (check, send, classify, decide).
- ``recorder``: writing each outcome, fenced by the lease; it alone handles record errors.
- ``leases``: keeping leases (heartbeat) and cutting off calls that outlive their time.
- ``maintenance``: rescue of dead workers' rows, ordering-key repair, staging scheduled rows.
- ``rules``: per provider, the key window and the call limit, computed in this one place.
- ``limits``: per-provider isolation, each claim's cap from the provider's circuit breaker
  (``breaker``), max_in_flight and the shared rate limit; ``pauses``: an action paused for its
  credentials, and the reconciler's lookups kept within the rate limit.
- ``flight``, ``meters``, ``shared``: what the parts pass between them.

The claim protocol they implement is docs/design.md's, "Claim protocol".
"""
