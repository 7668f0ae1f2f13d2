"""The wire formats the proxy translates into chat-completions calls: the OpenAI Responses API (`responses.py`) and
Anthropic Messages (`messages.py`), with what they share (`common.py`)."""
