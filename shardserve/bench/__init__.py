"""Load testing for OpenAI-compatible servers: client.py sends, stats.py summarizes, plots.py draws,
cli_args.py is `shardserve bench`."""
