"""The OpenAI Python SDK's Azure client: openai_sdk_agent.py's two calls through `AzureOpenAI`.

An agent written for Azure OpenAI. `AzureOpenAI()` reads AZURE_OPENAI_ENDPOINT and AZURE_OPENAI_API_KEY (which
`harness run` sets to the episode's proxy URL and token) and sends its chat calls to Azure's deployment URLs,
`{endpoint}/openai/deployments/<model>/chat/completions?api-version=...`, with the key in an `api-key` header;
the proxy records them as any other chat call. The deployment name is the model the agent asks for.

    AZURE_OPENAI_ENDPOINT=http://127.0.0.1:8400 AZURE_OPENAI_API_KEY=sk-local \
        python examples/clients/azure_openai_agent.py < <(head -1 examples/clients/tasks.jsonl)
"""

from __future__ import annotations

from openai import AzureOpenAI
from openai_sdk_agent import main  # the same agent, next to this file

API_VERSION = "2024-10-21"  # the Azure API version the agent was written for

if __name__ == "__main__":
    main(AzureOpenAI(api_version=API_VERSION))
