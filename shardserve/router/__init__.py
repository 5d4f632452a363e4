"""The router: an OpenAI-compatible gateway that spreads requests over replicas, keeps streams
going when a replica dies (resuming them elsewhere), and sheds load it cannot serve."""
