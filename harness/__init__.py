"""harness: record unmodified LLM agents through a proxy, judge them, and train the policy with RL."""

__version__ = "0.1.0"
