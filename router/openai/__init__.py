"""The router's OpenAI-compatible HTTP API: the server (api.py, into the router's `generate`),
each request field's verdict (fields.py), sampling, length limits, logprobs and structured output,
chat's tools and thinking (chat.py), errors (errors.py). Imports here are absolute
(`baton.router.openai.api`), so this package never stands in for the `openai` client library."""
