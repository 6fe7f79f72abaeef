from outbox.cli import main

main()
