"""What every long-running part of `outbox run` stands on, below the database, the dispatcher and
the configuration that use it: loops that outlive whatever their rounds raise (loops), the event
loop they run on (event_loop), and the pauses and simulated bugs the fault tests set (failpoints).
Not outbox/daemon/: the dispatcher, the readiness probe and the reconciler run these loops too,
and the daemon sits above them all."""
