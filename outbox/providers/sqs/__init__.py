"""The `sqs` provider family, Amazon SQS: the provider, one SendMessage per operation
(provider.py), its options declared (options.py) and read (config.py), and what SQS's answers
and botocore's exceptions mean (answers.py)."""
