"""shardserve: distributed LLM inference."""
from shardserve.request import RequestOutput, SamplingParams

__version__ = "0.1.0"


def __getattr__(name):
    # Importing LLM pulls in torch; keep `import shardserve` cheap for the CLI and the scheduler.
    if name == "LLM":
        from shardserve.llm import LLM

        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "RequestOutput", "SamplingParams", "__version__"]
