"""What the person on call does, by command or by the daemon's loop: the actions on operations
(operators: retry, cancel, resolve, quarantine...), reconciliation of in-doubt operations by
asking their providers (reconciler), pruning finished rows (prune), and the plain-text tables
the commands print (text_tables)."""
