"""A cluster on one host: the router plus supervised replicas (`shardserve cluster`), with
restarts, autoscaling, graceful drain and live resharding."""
